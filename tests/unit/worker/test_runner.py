"""worker/runner.py: what runs in the pool -- decode, call the handler; decision.classify: how it ended."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kombu_events import registry
from kombu_events.core import decision
from kombu_events.core.backoff import Exponential
from kombu_events.core.codec import JSON
from kombu_events.core.event import Event
from kombu_events.core.handlers import Handler
from kombu_events.errors import Archive, Retry, poisonous
from kombu_events.registry import Route
from kombu_events.worker import runner

QUEUE = "billing.audit"
ACCEPT = frozenset({JSON})


def _handler(fn=lambda payload: None, **kwargs) -> Handler:
    options = {"name": "audit", "queue": QUEUE, "binding_keys": ("orders.#",), "max_retries": 5,
               "backoff": Exponential()}
    options.update(kwargs)
    return Handler(fn=fn, **options)


def _raised(exc: BaseException) -> BaseException:
    """``exc`` with a real traceback."""
    try:
        raise exc
    except BaseException as caught:
        return caught


def _poisoned() -> BaseException:
    try:
        with poisonous():
            int("not a number")
    except BaseException as caught:
        return caught
    raise AssertionError("poisonous() did not raise")


class Transient(Exception):
    pass


def classify(exc: BaseException, handler: Handler, traceback_limit: int, final: bool = True) -> decision.Outcome:
    return decision.classify(exc, retry_for=handler.retry_for, dont_retry=handler.dont_retry,
                             traceback_limit=traceback_limit, final=final)


@pytest.mark.parametrize(
    "exc, handler_options, kind, reason",
    [
        (Retry(2.5), {}, decision.RETRY, "retry in 2.5 s"),
        (Retry(), {}, decision.RETRY, "retry"),
        (Retry(1, reason="rate limited"), {}, decision.RETRY, "rate limited"),
        (Archive("order cancelled"), {}, decision.ARCHIVE, "order cancelled"),
        (_poisoned(), {}, decision.ARCHIVE, "poisonous section failed: ValueError: invalid literal"),
        (KeyError("id"), {"dont_retry": (KeyError,)}, decision.ARCHIVE, "dont_retry: builtins.KeyError: 'id'"),
        (KeyError("id"), {"dont_retry": (LookupError,), "retry_for": (KeyError,)}, decision.ARCHIVE, "dont_retry:"),
        (ValueError("x"), {"retry_for": (Transient,)}, decision.ARCHIVE, "not in retry_for: builtins.ValueError: x"),
        (Transient("later"), {"retry_for": (Transient,)}, decision.FAILED, f"{__name__}.Transient: later"),
        (ValueError("boom"), {}, decision.FAILED, "builtins.ValueError: boom"),
        (Retry(1), {"dont_retry": (Exception,)}, decision.RETRY, "retry in 1 s"),
        (Archive("x"), {"retry_for": (Archive,)}, decision.ARCHIVE, "x"),
    ],
)
def test_classify(exc, handler_options, kind, reason):
    outcome = classify(_raised(exc), _handler(**handler_options), 2000)
    assert outcome.kind == kind
    assert outcome.reason.startswith(reason)
    assert outcome.exception == f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    assert outcome.traceback.startswith("Traceback (most recent call last)")
    assert type(exc).__name__ in outcome.traceback.splitlines()[-1]


@pytest.mark.parametrize("exc, delay_ms", [(Retry(2.5), 2500), (Retry(0), 0), (Retry(), None)])
def test_classify_retry_delay_is_in_milliseconds(exc, delay_ms):
    assert classify(_raised(exc), _handler(), 100).delay_ms == delay_ms


def _deep(depth: int) -> None:
    if depth:
        _deep(depth - 1)
    raise ValueError("the-last-words")


@pytest.mark.parametrize("limit", [1, 50, 200])
def test_traceback_is_bounded_and_keeps_its_tail(limit):
    try:
        _deep(10)
    except ValueError as caught:
        exc = caught
    full = classify(exc, _handler(), 60_000).traceback
    assert len(full) > 200
    bounded = classify(exc, _handler(), limit).traceback
    assert len(bounded) == limit
    assert full.endswith(bounded)


def test_traceback_limit_zero_means_none():
    assert classify(_raised(ValueError("x")), _handler(), 0).traceback == ""


@pytest.fixture
def register():
    """Put a handler in the pool-side registry (the autouse fixture empties it afterwards)."""

    def put(handler: Handler, accept=ACCEPT, traceback_limit: int = 2000) -> Handler:
        registry._routes[handler.queue] = Route(handler, accept, traceback_limit)
        return handler

    return put


def test_run_ok_passes_the_decoded_payload(register):
    calls = []
    register(_handler(calls.append))
    outcome = runner.run(QUEUE, b'{"order_id": 7}', JSON, "utf-8")
    assert outcome.kind == decision.OK and outcome.duration_ms >= 0
    assert calls == [{"order_id": 7}]


def test_run_bind_gets_an_event(register):
    calls = []
    register(_handler(calls.append, bind=True))
    headers = {"x-request-id": "r1"}
    properties = {"message_id": "m-1", "correlation_id": "c-1", "content_type": JSON, "timestamp": 1700000000}
    body = json.dumps({"order_id": 7}).encode()
    outcome = runner.run(QUEUE, body, JSON, "utf-8", ("orders.7.created", 3, headers, properties))
    assert outcome.kind == decision.OK
    (event,) = calls
    assert isinstance(event, Event)
    assert event == Event({"order_id": 7}, "orders.7.created", QUEUE, 3, headers, properties, body)
    assert (event.message_id, event.correlation_id, event.content_type, event.timestamp) == (
        "m-1", "c-1", JSON, 1700000000)


def test_run_raw_gets_the_body_bytes_even_if_they_are_not_json(register):
    calls = []
    register(_handler(calls.append, raw=True))
    assert runner.run(QUEUE, b"\x00\xffbinary", "application/octet-stream", None).kind == decision.OK
    assert calls == [b"\x00\xffbinary"]


@pytest.mark.parametrize(
    "body, content_type, reason",
    [(b"not json", JSON, "not valid JSON"), (b"{}", "text/plain", "'text/plain' is not accepted")],
)
def test_run_undecodable_never_calls_the_handler(register, body, content_type, reason):
    calls = []
    register(_handler(calls.append))
    outcome = runner.run(QUEUE, body, content_type, None)
    assert outcome.kind == decision.UNDECODABLE
    assert reason in outcome.reason
    assert outcome.exception.startswith("DecodeError: ")
    assert calls == []


def test_run_classifies_handler_exceptions(register):
    def fails(payload):
        raise Retry(5)

    register(_handler(fails), traceback_limit=30)
    outcome = runner.run(QUEUE, b"{}", JSON, None)
    assert (outcome.kind, outcome.delay_ms) == (decision.RETRY, 5000)
    assert len(outcome.traceback) == 30


def test_run_unknown_queue_is_lost():
    outcome = runner.run("billing.nobody", b"{}", JSON, None)
    assert outcome.kind == decision.LOST
    assert "'billing.nobody'" in outcome.reason


def test_run_finds_routes_of_registered_services_and_keeps_them(mocker):
    calls = []
    handler = _handler(calls.append)
    route = Route(handler, ACCEPT, 10)
    service = SimpleNamespace(routes=mocker.Mock(return_value=[route]))
    registry.register(service)
    assert runner.run(QUEUE, b"[1]", JSON, None).kind == decision.OK
    assert runner.run(QUEUE, b"[2]", JSON, None).kind == decision.OK
    assert calls == [[1], [2]]
    assert registry.route(QUEUE) is route
    service.routes.assert_called_once_with()


def test_outcomes_are_picklable_for_the_prefork_pipe(register):
    import pickle

    register(_handler(lambda payload: 1 / 0))
    outcome = runner.run(QUEUE, b"{}", JSON, None)
    assert pickle.loads(pickle.dumps(outcome)) == outcome
    assert outcome.kind == decision.FAILED



@pytest.mark.parametrize("exc, kind", [(RuntimeError("transient"), decision.FAILED), (Retry(delay=1), decision.RETRY)])
def test_a_failure_that_will_be_retried_carries_no_traceback(exc, kind):
    outcome = classify(_raised(exc), _handler(), traceback_limit=2000, final=False)
    assert outcome.kind == kind and outcome.traceback == ""
    assert classify(_raised(exc), _handler(), traceback_limit=2000, final=True).traceback


def test_a_failure_archived_at_once_has_its_traceback_even_when_not_final():
    outcome = classify(_raised(Archive("bad")), _handler(), traceback_limit=2000, final=False)
    assert outcome.kind == decision.ARCHIVE and "Archive" in outcome.traceback


def test_a_handler_that_changes_its_event_headers_leaves_the_delivery_alone(register):
    """Under solo and threads the pool gets the delivery's own dicts: retries are built from them."""
    def meddle(event):
        event.headers["x-added"] = 1
        event.properties["message_id"] = "changed"

    register(_handler(meddle, bind=True))
    headers, properties = {"x-request-id": "r1"}, {"message_id": "m-1"}
    assert runner.run(QUEUE, b"{}", JSON, None, ("orders.1", 1, headers, properties)).kind == decision.OK
    assert (headers, properties) == ({"x-request-id": "r1"}, {"message_id": "m-1"})


def test_a_pool_side_admit_refusal_settles_the_message_without_decoding_or_calling_the_handler():
    from kombu_events import Middleware
    from kombu_events.middleware.base import Hooks

    calls = []

    class Gate(Middleware):
        def admit(self, queue):
            return decision.Outcome(decision.DEFERRED, f"{queue} is closed", delay_ms=500) if calls else None

    registry._routes[QUEUE] = Route(_handler(calls.append), ACCEPT, 100, Hooks([Gate()]))
    try:
        assert runner.run(QUEUE, b'{"n": 1}', JSON, "utf-8").kind == decision.OK
        refused = runner.run(QUEUE, b"not even json", JSON, "utf-8")
    finally:
        registry._routes.pop(QUEUE)
    assert calls == [{"n": 1}]
    assert refused == decision.Outcome(decision.DEFERRED, f"{QUEUE} is closed", delay_ms=500)


def test_with_only_a_handler_failed_receiver_no_event_is_built_for_a_success_but_a_failure_gets_one(register, mocker):
    from kombu_events import signals

    built = mocker.spy(runner, "Event")
    failures = []

    def on_failed(sender, event, exception, **kwargs):
        failures.append((event.payload, event.routing_key, event.attempt, event.headers, repr(exception)))

    def handler(payload):
        if payload["fail"]:
            raise ValueError("boom")

    register(_handler(handler))
    signals.handler_failed.connect(on_failed, weak=False, dispatch_uid="test-lazy-event")
    try:
        meta = ("orders.1", 2, {"h": 1}, {"message_id": "m"})
        assert runner.run(QUEUE, b'{"fail": false}', JSON, "utf-8", meta).kind == decision.OK
        assert built.call_count == 0, "a success with no receiver that needs it builds no Event"
        assert runner.run(QUEUE, b'{"fail": true}', JSON, "utf-8", meta).kind == decision.FAILED
    finally:
        signals.handler_failed.disconnect(dispatch_uid="test-lazy-event")
    assert built.call_count == 1
    assert failures == [({"fail": True}, "orders.1", 2, {"h": 1}, "ValueError('boom')")]


def _async_under_a_sync_decorator():
    """A sync wrapper around a coroutine function: registration cannot see through it."""
    async def body(payload):
        raise AssertionError("never runs")

    def wrapper(payload):
        return body(payload)
    return wrapper


def _generator_under_a_sync_decorator():
    def body(payload):
        yield payload

    def wrapper(payload):
        return body(payload)
    return wrapper


def test_a_handler_that_returns_a_generator_is_archived_not_acked(recwarn):
    route = Route(_handler(_generator_under_a_sync_decorator()), ACCEPT, 2000)
    outcome = runner._run(route, QUEUE, b"{}", JSON, None, None, True)
    assert outcome.kind == decision.ARCHIVE and "instead of running" in outcome.reason


def test_the_coroutine_a_sync_wrapper_returns_is_awaited(recwarn):
    route = Route(_handler(_async_under_a_sync_decorator()), ACCEPT, 2000)
    outcome = runner._run(route, QUEUE, b"{}", JSON, None, None, True)
    assert (outcome.kind, outcome.exception) == (decision.FAILED, "builtins.AssertionError: never runs"), \
        "its body ran (and raised)"
    assert not [w for w in recwarn if "never awaited" in str(w.message)]
