"""``Control``: pause, resume and timers, driven against a recording consumer and a fake hub."""
from __future__ import annotations

import threading

import pytest

from kombu_events import Middleware
from kombu_events.control import Control
from kombu_events.middleware import Hooks


class Consuming:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def pause_queue(self, queue):
        self.calls.append(("pause", queue))

    def resume_queue(self, queue, prefetch):
        self.calls.append(("resume", queue, prefetch))

    def call_soon_threadsafe(self, fn):
        self.calls.append(("soon",))
        fn()


class Hub:
    def __init__(self) -> None:
        self.timers: list[tuple] = []

    def call_later(self, seconds, fn):
        entry = Entry(seconds, fn, repeat=False)
        self.timers.append(entry)
        return entry

    def call_repeatedly(self, seconds, fn):
        entry = Entry(seconds, fn, repeat=True)
        self.timers.append(entry)
        return entry


class Entry:
    def __init__(self, seconds, fn, repeat):
        self.seconds, self.fn, self.repeat, self.cancelled = seconds, fn, repeat, False

    def cancel(self):
        self.cancelled = True


@pytest.fixture
def control():
    return Control("svc", ("svc.a", "svc.b"), Consuming())


def test_pause_is_idempotent_and_remembers_why(control):
    control.pause("svc.a", "circuit open")
    control.pause("svc.a", "again")
    assert control.paused == {"svc.a": "circuit open"}
    assert control.is_paused("svc.a") and not control.is_paused("svc.b")
    assert control._consuming.calls == [("pause", "svc.a")]


def test_resume_only_touches_a_paused_queue_unless_a_prefetch_is_asked(control):
    control.resume("svc.a")
    assert control._consuming.calls == []
    control.pause("svc.a")
    control.resume("svc.a", prefetch=1)
    control.resume("svc.b", prefetch=100)
    assert control._consuming.calls == [("pause", "svc.a"), ("resume", "svc.a", 1), ("resume", "svc.b", 100)]
    assert control.paused == {}


@pytest.mark.parametrize("call", [lambda c: c.pause("other"), lambda c: c.resume("svc.c")])
def test_a_queue_of_another_service_is_refused_with_the_valid_ones(control, call):
    with pytest.raises(ValueError, match=r"its queues: svc\.a, svc\.b"):
        call(control)


@pytest.mark.parametrize("prefetch", [0, -1, 65536, 1.5, True, "1"])
def test_a_bad_prefetch_is_refused(control, prefetch):
    control.pause("svc.a")
    with pytest.raises(ValueError, match="prefetch"):
        control.resume("svc.a", prefetch=prefetch)
    assert control.is_paused("svc.a"), "a refused resume leaves the queue paused"


def test_timers_go_to_the_hub_and_are_cancelled_when_the_step_stops(control):
    hub = Hub()
    control.attach("connection", hub)
    assert control.connection == "connection"
    fired = []
    once = control.call_after(5, lambda: fired.append("once"))
    control.call_every(15, lambda: fired.append("every"))
    assert [(e.seconds, e.repeat) for e in hub.timers] == [(5, False), (15, True)]
    hub.timers[0].fn()
    assert fired == ["once"]
    control.detach()
    assert all(e.cancelled for e in hub.timers) and once.cancelled
    assert control.connection is None


def test_a_failing_timer_is_logged_not_raised(control, caplog):
    control.attach(None, Hub())
    control.call_after(1, lambda: 1 / 0)
    control._hub.timers[0].fn()
    assert "timer" in caplog.text and "ZeroDivisionError" in caplog.text


@pytest.mark.parametrize("seconds", [-1, float("nan"), True, "5"])
def test_a_bad_timer_delay_is_refused(control, seconds):
    with pytest.raises(ValueError, match="seconds"):
        control.call_after(seconds, lambda: None)


def test_without_an_event_loop_timers_run_on_a_thread_through_the_consumer(control):
    fired = threading.Event()
    control.attach(None, None)
    control.call_after(0.01, fired.set)
    assert fired.wait(5)
    assert ("soon",) in control._consuming.calls
    control.detach()


def test_started_and_stopped_reach_only_middleware_that_override_them(control):
    seen = []

    class Watcher(Middleware):
        def started(self, control):
            seen.append(("started", control.service))

        def stopped(self, control):
            seen.append(("stopped", control.service))

    class Broken(Middleware):
        def started(self, control):
            raise RuntimeError("broken")

    hooks = Hooks([Broken(), Middleware(), Watcher()])
    assert len(hooks.on_started) == 2 and len(hooks.on_stopped) == 1
    hooks.started(control)
    hooks.stopped(control)
    assert seen == [("started", "svc"), ("stopped", "svc")]
