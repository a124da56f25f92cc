"""middleware/base.py: Hooks calls the middleware that override a hook, in order; a failing one is
logged and skipped.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

import celery
import pytest

from kombu_events import Events
from kombu_events.core.decision import DEFERRED, OK, Decision, Outcome
from kombu_events.core.delivery import Delivery
from kombu_events.core.event import Event
from kombu_events.core.settlement import ACK
from kombu_events.errors import ConfigurationError
from kombu_events.middleware.base import Hooks, Middleware

HOOKS = ("on_received", "on_before_dispatch", "on_settled", "on_before_publish", "on_after_publish", "on_after_store",
         "on_handling")
DELIVERY = Delivery("billing.audit", "orders.7.created", b"{}")
EVENT = Event({}, "orders.7.created", "billing.audit", 1)
DEFER = Outcome(DEFERRED, "circuit open", delay_ms=5000)
LOGGER = "kombu_events.middleware.base"


class Recorder(Middleware):
    """Records every main-process hook call as (name, hook)."""

    def __init__(self, name: str, calls: list[tuple[str, str]], fail: bool = False) -> None:
        self.name, self.calls, self.fail = name, calls, fail

    def _record(self, hook: str) -> None:
        self.calls.append((self.name, hook))
        if self.fail:
            raise RuntimeError(f"{self.name} broke in {hook}")

    def received(self, delivery):
        self._record("received")

    def before_dispatch(self, delivery):
        self._record("before_dispatch")

    def settled(self, delivery, outcome, step):
        self._record("settled")

    def before_publish(self, exchange, routing_key, properties):
        self._record("before_publish")

    def after_publish(self, exchange, routing_key, properties, error):
        self._record("after_publish")

    def after_store(self, exchange, routing_key, properties):
        self._record("after_store")


CALLS = {
    "received": lambda hooks: hooks.received(DELIVERY),
    "before_dispatch": lambda hooks: hooks.before_dispatch(DELIVERY),
    "settled": lambda hooks: hooks.settled(DELIVERY, Outcome(OK), ACK),
    "before_publish": lambda hooks: hooks.before_publish("events", "orders.7.created", {"application_headers": {}}),
    "after_publish": lambda hooks: hooks.after_publish("events", "orders.7.created", {}, None),
    "after_store": lambda hooks: hooks.after_store("events", "orders.7.created", {}),
}


def test_a_plain_middleware_costs_nothing():
    hooks = Hooks([Middleware(), Middleware()])
    assert len(hooks.middleware) == 2
    assert all(getattr(hooks, hook) == () for hook in HOOKS)
    assert hooks.before_dispatch(DELIVERY) is None
    assert hooks.around(EVENT, lambda: "result") == "result"


def test_only_the_hooks_a_middleware_overrides_are_grouped():
    class Received(Middleware):
        def received(self, delivery):
            pass

    class Inherits(Received):
        def handling(self, event):
            return super().handling(event)

    received, inherits = Received(), Inherits()
    hooks = Hooks([received, Middleware(), inherits])
    assert hooks.on_received == (received, inherits)
    assert hooks.on_handling == (inherits,)
    assert hooks.on_settled == hooks.on_before_dispatch == hooks.on_before_publish == hooks.on_after_publish == ()


@pytest.mark.parametrize("hook", CALLS)
def test_hooks_run_in_registration_order(hook):
    calls: list[tuple[str, str]] = []
    CALLS[hook](Hooks([Recorder("a", calls), Middleware(), Recorder("b", calls), Recorder("c", calls)]))
    assert calls == [("a", hook), ("b", hook), ("c", hook)]


@pytest.mark.parametrize("hook", CALLS)
def test_a_hook_that_raises_is_logged_and_the_next_one_runs(hook, caplog):
    calls: list[tuple[str, str]] = []
    hooks = Hooks([Recorder("a", calls, fail=True), Recorder("b", calls)])
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        CALLS[hook](hooks)
    assert calls == [("a", hook), ("b", hook)]
    (record,) = caplog.records
    assert f"Recorder.{hook}" in record.getMessage() and "; skipped" in record.getMessage()
    assert record.exc_info[1].args == (f"a broke in {hook}",)


ABOUT = {
    "received": "for message 'm-7' of billing.audit",
    "before_dispatch": "for message 'm-7' of billing.audit",
    "settled": "for message 'm-7' of billing.audit",
    "before_publish": "for event 'orders.7.created' to exchange 'events' (message id 'm-7')",
    "after_publish": "for event 'orders.7.created' to exchange 'events' (message id 'm-7')",
    "after_store": "for event 'orders.7.created' to exchange 'events' (message id 'm-7')",
}


@pytest.mark.parametrize("hook", ABOUT)
def test_a_failing_hook_is_logged_with_the_message_it_was_called_about(hook, caplog):
    delivery = DELIVERY._replace(properties={"message_id": "m-7"})
    properties = {"message_id": "m-7", "application_headers": {}}
    hooks = Hooks([Recorder("a", [], fail=True)])
    calls = {"received": lambda: hooks.received(delivery), "before_dispatch": lambda: hooks.before_dispatch(delivery),
             "settled": lambda: hooks.settled(delivery, Outcome(OK), ACK),
             "before_publish": lambda: hooks.before_publish("events", "orders.7.created", properties),
             "after_publish": lambda: hooks.after_publish("events", "orders.7.created", properties, None),
             "after_store": lambda: hooks.after_store("events", "orders.7.created", properties)}
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        calls[hook]()
    (record,) = caplog.records
    assert ABOUT[hook] in record.getMessage()


class Lifecycle(Middleware):
    """started, stopped and admit that raise."""

    def started(self, control):
        raise RuntimeError("started broke")

    def stopped(self, control):
        raise RuntimeError("stopped broke")

    def admit(self, queue):
        raise RuntimeError("admit broke")


class Service:
    service, queues = "billing", ("billing.audit",)


@pytest.mark.parametrize("hook, call, about", [
    ("started", lambda hooks: hooks.started(Service()), "for service billing"),
    ("stopped", lambda hooks: hooks.stopped(Service()), "for service billing"),
    ("admit", lambda hooks: hooks.admit("billing.audit"), "for a message of billing.audit"),
])
def test_lifecycle_and_pool_hooks_that_raise_are_logged_with_their_service_or_queue(hook, call, about, caplog):
    calls: list[tuple[str, str]] = []

    class After(Middleware):
        def started(self, control):
            calls.append(("after", "started"))

        def stopped(self, control):
            calls.append(("after", "stopped"))

        def admit(self, queue):
            calls.append(("after", "admit"))

    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert call(Hooks([Lifecycle(), After()])) is None
    assert calls == [("after", hook)]
    (record,) = caplog.records
    assert f"Lifecycle.{hook} failed {about}; skipped" in record.getMessage()
    assert record.exc_info[1].args == (f"{hook} broke",)


class Returns(Middleware):
    def __init__(self, value: Any, calls: list[Any]) -> None:
        self.value, self.calls = value, calls

    def before_dispatch(self, delivery):
        self.calls.append(self.value)
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


def test_before_dispatch_returns_the_first_outcome():
    calls: list[Any] = []
    other = Outcome(DEFERRED, "rate limited", delay_ms=100)
    hooks = Hooks([Returns(None, calls), Returns(DEFER, calls), Returns(other, calls)])
    assert hooks.before_dispatch(DELIVERY) is DEFER
    assert calls == [None, DEFER]


@pytest.mark.parametrize("returned", ["defer", Decision("requeue", 100), ("deferred", "x"), 0, False])
def test_before_dispatch_ignores_and_logs_what_is_not_an_outcome(returned, caplog):
    calls: list[Any] = []
    hooks = Hooks([Returns(returned, calls), Returns(DEFER, calls)])
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert hooks.before_dispatch(DELIVERY) is DEFER
    (record,) = caplog.records
    assert repr(returned) in record.getMessage() and "not an Outcome or None for message" in record.getMessage()


def test_before_dispatch_that_raises_dispatches(caplog):
    calls: list[Any] = []
    hooks = Hooks([Returns(RuntimeError("breaker state unknown"), calls), Returns(None, calls)])
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert hooks.before_dispatch(DELIVERY) is None
    assert len(calls) == 2 and len(caplog.records) == 1


# -- around: the pool-side handling() contexts --------------------------------------------------------

class Context:
    """A context manager recording into ``log``; may fail entering or exiting, or swallow the exception."""

    def __init__(self, name: str, log: list[Any], *, enter_fails=False, exit_fails=False, swallow=False) -> None:
        self.name, self.log = name, log
        self.enter_fails, self.exit_fails, self.swallow = enter_fails, exit_fails, swallow

    def __enter__(self):
        self.log.append(("enter", self.name))
        if self.enter_fails:
            raise RuntimeError(f"{self.name} cannot enter")
        return self

    def __exit__(self, *exc_info):
        self.log.append(("exit", self.name, exc_info))
        if self.exit_fails:
            raise RuntimeError(f"{self.name} cannot exit")
        return self.swallow


class Handling(Middleware):
    def __init__(self, make) -> None:
        self.make = make
        self.events: list[Event] = []

    def handling(self, event):
        self.events.append(event)
        return self.make()


def _hooks(log: list[Any], **options: dict[str, bool]) -> Hooks:
    """Hooks over contexts a, b, c; ``options`` per context name."""
    return Hooks([Handling(lambda name=name: Context(name, log, **options.get(name, {}))) for name in "abc"])


def _call(log: list[Any], result: Any = "done"):
    def call():
        log.append("handler")
        return result
    return call


def _fail(log: list[Any], exc: BaseException):
    def call():
        log.append("handler")
        raise exc
    return call


def test_contexts_enter_in_order_and_exit_in_reverse():
    log: list[Any] = []
    hooks = _hooks(log)
    assert hooks.around(EVENT, _call(log, 42)) == 42
    assert log == [("enter", "a"), ("enter", "b"), ("enter", "c"), "handler",
                   ("exit", "c", (None, None, None)), ("exit", "b", (None, None, None)),
                   ("exit", "a", (None, None, None))]
    assert all(m.events == [EVENT] for m in hooks.on_handling)


@pytest.mark.parametrize("swallow", [False, True])
def test_the_handlers_exception_reaches_every_exit_and_is_raised(swallow):
    log: list[Any] = []
    error = ValueError("boom")
    with pytest.raises(ValueError) as caught:
        _hooks(log, b={"swallow": swallow}).around(EVENT, _fail(log, error))
    assert caught.value is error
    exits = [entry for entry in log if entry[0] == "exit"]
    assert [name for _, name, _ in exits] == ["c", "b", "a"]
    for _, _, (kind, value, traceback) in exits:
        assert (kind, value) == (ValueError, error)
        assert _innermost(traceback).tb_frame.f_code.co_name == "call"  # where the handler raised


def _innermost(traceback):
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback


def test_a_contextmanager_that_swallows_cannot_lose_the_exception():
    seen: list[BaseException] = []

    @contextmanager
    def swallowing():
        try:
            yield
        except Exception as exc:  # a middleware that 'handles' errors: returns True from __exit__
            seen.append(exc)

    with pytest.raises(KeyError):
        Hooks([Handling(swallowing)]).around(EVENT, _fail([], KeyError("id")))
    assert [type(exc) for exc in seen] == [KeyError]


def test_a_base_exception_from_the_handler_still_exits_every_context():
    log: list[Any] = []
    with pytest.raises(SystemExit):
        _hooks(log).around(EVENT, _fail(log, SystemExit(3)))
    assert [entry[:2] for entry in log if entry[0] == "exit"] == [("exit", "c"), ("exit", "b"), ("exit", "a")]


def test_a_context_that_fails_to_enter_is_skipped(caplog):
    log: list[Any] = []
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert _hooks(log, b={"enter_fails": True}).around(EVENT, _call(log)) == "done"
    assert [entry[:2] if isinstance(entry, tuple) else entry for entry in log] == [
        ("enter", "a"), ("enter", "b"), ("enter", "c"), "handler", ("exit", "c"), ("exit", "a")]
    (record,) = caplog.records
    assert "failed entering handling() for message None of billing.audit; skipped" in record.getMessage()


@pytest.mark.parametrize("handling", [
    lambda event: (_ for _ in ()).throw(RuntimeError("handling() itself raised")),
    lambda event: None,  # not a context manager
], ids=["raises", "returns None"])
def test_a_handling_hook_that_gives_no_context_is_skipped(handling, caplog):
    broken = Middleware()
    broken.handling = handling  # an instance attribute is not an override: subclass instead
    assert Hooks([broken]).on_handling == ()

    class Broken(Middleware):
        pass

    Broken.handling = lambda self, event: handling(event)
    log: list[Any] = []
    hooks = Hooks([Broken(), Handling(lambda: Context("a", log))])
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert hooks.around(EVENT, _call(log)) == "done"
    assert [entry[:2] if isinstance(entry, tuple) else entry for entry in log] == [
        ("enter", "a"), "handler", ("exit", "a")]
    assert len(caplog.records) == 1


@pytest.mark.parametrize("fails", [False, True])
def test_a_context_that_fails_to_exit_is_logged_and_the_others_exit(fails, caplog):
    log: list[Any] = []
    hooks = _hooks(log, b={"exit_fails": True})
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        if fails:
            with pytest.raises(ValueError, match="boom"):
                hooks.around(EVENT, _fail(log, ValueError("boom")))
        else:
            assert hooks.around(EVENT, _call(log)) == "done"
    assert [entry[:2] for entry in log if entry[0] == "exit"] == [("exit", "c"), ("exit", "b"), ("exit", "a")]
    (record,) = caplog.records
    assert "failed on exit; ignored" in record.getMessage()


# -- registration --------------------------------------------------------------------------------

@pytest.mark.parametrize("middleware", [[object()], [Middleware], [Middleware(), "metrics"], [None]])
def test_events_refuses_what_is_not_a_middleware_instance(middleware):
    with pytest.raises(ConfigurationError, match="middleware must be Middleware instances"):
        Events(celery.Celery("t", set_as_current=False), "svc", middleware=middleware)


def test_events_groups_its_middleware():
    calls: list[tuple[str, str]] = []
    recorder = Recorder("a", calls)
    events = Events(celery.Celery("t", set_as_current=False), "svc", middleware=(m for m in [recorder]))
    assert events.hooks.middleware == (recorder,)
    assert events.hooks.on_received == (recorder,)


def test_add_appends_a_middleware_that_every_route_of_the_service_then_calls():
    calls: list[tuple[str, str]] = []
    events = Events(celery.Celery("proj", broker="memory://", set_as_current=False), service="billing",
                    middleware=[Recorder("first", calls)])
    events.handler("orders.#")(lambda payload: None)
    [route] = events.routes()
    events.hooks.add(Recorder("added", calls))
    route.hooks.settled(DELIVERY, Outcome(OK), ACK)
    assert calls == [("first", "settled"), ("added", "settled")]
    with pytest.raises(ConfigurationError, match="must be Middleware instances"):
        events.hooks.add(object())  # type: ignore[arg-type]
    assert len(events.hooks.middleware) == 2


def test_add_middleware_before_the_hooks_are_resolved_adds_it_once_for_consuming_and_publishing():
    calls: list[tuple[str, str]] = []
    events = Events(celery.Celery("proj", broker="memory://", set_as_current=False), service="billing")
    events.handler("orders.#")(lambda payload: None)
    added = Recorder("added", calls)
    events.add_middleware(added)
    assert events.hooks.middleware.count(added) == 1
    events.hooks.settled(DELIVERY, Outcome(OK), ACK)
    events.hooks.after_publish("events", "k", {}, None)
    assert calls == [("added", "settled"), ("added", "after_publish")]
