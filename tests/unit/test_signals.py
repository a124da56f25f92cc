"""signals.py and the pool side of middleware: what runner.run tells receivers and handling() contexts."""
from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Callable

import pytest

from kombu_events import registry, signals
from kombu_events.core import decision
from kombu_events.core.backoff import Exponential
from kombu_events.core.codec import JSON
from kombu_events.core.event import Event
from kombu_events.core.handlers import Handler
from kombu_events.errors import Archive, Retry
from kombu_events.middleware.base import Hooks, Middleware
from kombu_events.registry import Route
from kombu_events.worker import runner

QUEUE = "billing.audit"
KEY = "orders.7.created"
HEADERS = {"x-request-id": "r-1", "kombu-events-attempts": 2}
PROPERTIES = {"message_id": "m-1", "content_type": JSON, "application_headers": HEADERS}
BODY = json.dumps({"order_id": 7}).encode()
META = (KEY, 3, HEADERS, PROPERTIES)
POOL_SIGNALS = (signals.handler_started, signals.handler_succeeded, signals.handler_failed)


def _register(fn: Callable[[Any], Any], *middleware: Middleware, **options: Any) -> Handler:
    handler = Handler(fn=fn, name="audit", queue=QUEUE, binding_keys=("orders.#",), max_retries=5,
                      backoff=Exponential(), **options)
    registry._routes[QUEUE] = Route(handler, frozenset({JSON}), 2000, Hooks(middleware))
    return handler


def _run(final: bool = True) -> decision.Outcome:
    return runner.run(QUEUE, BODY, JSON, "utf-8", META, final)


@pytest.fixture
def receive():
    """``receive(signal, sender=None)`` connects a recorder and returns its list of (sender, arguments)."""
    connected = []

    def connect(signal, sender=None, receiver=None):
        calls: list[tuple[Any, dict[str, Any]]] = []

        def record(sender, signal, **arguments):
            calls.append((sender, arguments))

        receiver = receiver or record
        signal.connect(receiver, sender=sender, weak=False)
        connected.append((signal, receiver, sender))
        return calls

    yield connect
    for signal, receiver, sender in connected:
        signal.disconnect(receiver, sender=sender)
    assert not any(signal.receivers for signal in POOL_SIGNALS)


def _fails(exc: BaseException) -> Callable[[Any], None]:
    def handler(payload):
        raise exc
    return handler


def test_a_handler_that_returns_sends_started_then_succeeded(receive):
    started, succeeded, failed = (receive(signal) for signal in POOL_SIGNALS)
    calls = []
    handler = _register(calls.append)
    outcome = _run()
    assert outcome.kind == decision.OK and calls == [{"order_id": 7}]
    event = Event({"order_id": 7}, KEY, QUEUE, 3, HEADERS, PROPERTIES, BODY)
    assert started == [(handler.fn, {"event": event})]
    ((sender, arguments),) = succeeded
    assert sender is handler.fn and set(arguments) == {"event", "duration_ms"}
    assert arguments["event"] == event and arguments["duration_ms"] == outcome.duration_ms
    assert failed == []


@pytest.mark.parametrize("exc, kind", [(ValueError("boom"), decision.FAILED), (Retry(5), decision.RETRY)])
def test_a_handler_that_raises_sends_started_then_failed(receive, exc, kind):
    started, succeeded, failed = (receive(signal) for signal in POOL_SIGNALS)
    handler = _register(_fails(exc))
    outcome = _run()
    assert outcome.kind == kind
    assert len(started) == 1 and succeeded == []
    ((sender, arguments),) = failed
    assert sender is handler.fn
    assert set(arguments) == {"event", "exception", "traceback", "duration_ms", "outcome", "action"}
    assert arguments["exception"] is exc
    assert isinstance(arguments["traceback"], TracebackType)
    assert arguments["traceback"].tb_next.tb_frame.f_code.co_name == "handler"
    assert arguments["duration_ms"] == outcome.duration_ms
    assert arguments["outcome"] == outcome and arguments["action"] == "archive"  # final: no retry left


@pytest.mark.parametrize("exc, final, action", [
    (ValueError("boom"), False, "retry"),
    (Retry(5), False, "retry"),
    (ValueError("boom"), True, "archive"),
    (Archive("no"), False, "archive"),
    (KeyError("k"), False, "archive"),  # dont_retry
])
def test_handler_failed_tells_what_the_worker_will_most_likely_do(receive, exc, final, action):
    failed = receive(signals.handler_failed)
    _register(_fails(exc), dont_retry=(KeyError,))
    outcome = _run(final=final)
    ((_sender, arguments),) = failed
    assert arguments["action"] == action and arguments["outcome"] == outcome


def test_a_message_that_does_not_decode_starts_no_handler(receive):
    received = [receive(signal) for signal in POOL_SIGNALS]
    _register(lambda payload: None)
    assert runner.run(QUEUE, b"not json", JSON, None, META).kind == decision.UNDECODABLE
    assert received == [[], [], []]


def test_receivers_of_another_sender_are_not_called(receive):
    received = [receive(signal, sender=print) for signal in POOL_SIGNALS]
    handler = _register(lambda payload: None)
    mine = receive(signals.handler_succeeded, sender=handler.fn)
    assert _run().kind == decision.OK
    assert received == [[], [], []]
    assert [sender for sender, _ in mine] == [handler.fn]


def _raises(sender, signal, **arguments):
    raise RuntimeError(f"receiver of {signal.name} broke")


@pytest.mark.parametrize("fn, kind", [(lambda payload: None, decision.OK), (_fails(KeyError("id")), decision.FAILED)],
                         ids=["ok", "failed"])
def test_a_receiver_that_raises_changes_nothing(receive, fn, kind, caplog):
    for signal in POOL_SIGNALS:
        receive(signal, receiver=_raises)
    _register(fn)
    expected = _run()
    assert expected.kind == kind
    assert "receiver of handler_started broke" in caplog.text
    caplog.clear()
    for signal in POOL_SIGNALS:
        signal.disconnect(_raises)
    assert _run()._replace(duration_ms=0, traceback="") == expected._replace(duration_ms=0, traceback="")


class Seeing(Middleware):
    """A pool-side middleware recording the Event and when its context enters and exits."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    @contextmanager
    def handling(self, event):
        self.log.append(("enter", event))
        try:
            yield
        finally:
            self.log.append("exit")


def test_handling_sees_the_event_of_a_handler_that_takes_the_payload(receive):
    log: list[Any] = []
    handler = _register(lambda payload: log.append(("handler", payload)), Seeing(log))
    assert handler.bind is False
    receive(signals.handler_started, receiver=lambda sender, signal, **a: log.append("started"))
    receive(signals.handler_succeeded, receiver=lambda sender, signal, **a: log.append("succeeded"))
    assert _run().kind == decision.OK
    event = Event({"order_id": 7}, KEY, QUEUE, 3, HEADERS, PROPERTIES, BODY)
    assert log == ["started", ("enter", event), ("handler", {"order_id": 7}), "exit", "succeeded"]
    (_, seen), *_ = log[1:]
    assert (seen.queue, seen.routing_key, seen.attempt, seen.headers) == (QUEUE, KEY, 3, HEADERS)


def test_handling_sees_the_event_of_a_bound_handler_too():
    log: list[Any] = []
    _register(lambda event: log.append(("handler", event)), Seeing(log), bind=True)
    assert _run().kind == decision.OK
    (_, seen), (_, given), _exit = log
    assert given is seen


def test_a_handlers_failure_inside_handling_is_classified_as_usual():
    log: list[Any] = []
    _register(_fails(Retry(2)), Seeing(log))
    outcome = _run()
    assert (outcome.kind, outcome.delay_ms) == (decision.RETRY, 2000)
    assert log[-1] == "exit"


def _sleeps(payload):
    time.sleep(0.02)


@pytest.mark.parametrize("fn", [_sleeps, lambda payload: (_sleeps(payload), 1 / 0)], ids=["returns", "raises"])
def test_duration_is_the_handlers_run_time(receive, fn):
    ended = receive(signals.handler_succeeded), receive(signals.handler_failed)
    _register(fn)
    outcome = _run()
    assert 20 <= outcome.duration_ms < 1000
    ((_, arguments),) = ended[0] + ended[1]
    assert arguments["duration_ms"] == outcome.duration_ms


def test_duration_leaves_out_the_middlewares_time():
    class Slow(Middleware):
        @contextmanager
        def handling(self, event):
            time.sleep(0.05)
            yield

    _register(lambda payload: None, Slow())
    assert _run().duration_ms < 50


@pytest.mark.parametrize("name", [n for n in signals.__all__ if n != "TypedSignal"])
def test_a_receiver_that_raises_never_raises_out_of_send(name, caplog):
    """The main-process signals are sent from the event loop (settling, confirms, breaker timers): Celery's
    dispatcher must keep a receiver's exception to itself, logged, for every one of them."""
    signal = getattr(signals, name)
    signal.connect(_raises, weak=False, dispatch_uid="test_raises")
    try:
        with caplog.at_level(logging.ERROR):
            # Only ours: a metrics middleware of an earlier test may still be connected (weakly) until collected.
            [(receiver, exc)] = [(r, e) for r, e in signal.send(sender=None) if r is _raises]
    finally:
        signal.disconnect(dispatch_uid="test_raises")
    assert receiver is _raises and isinstance(exc, RuntimeError)
    assert f"receiver of {name} broke" in caplog.text
