"""``Control``: pause, resume and timers, driven against a recording consumer and a fake hub."""
from __future__ import annotations

import threading
import time

import pytest

from kombu_events import Middleware
from kombu_events.middleware.base import Hooks
from kombu_events.middleware.control import Control


class Consuming:
    """Records what reaches the consumer; queued callables run only when the test turns the loop."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.queued: list = []

    def pause_queue(self, queue):
        self.calls.append(("pause", queue))

    def resume_queue(self, queue, prefetch):
        self.calls.append(("resume", queue, prefetch))

    def call_soon_threadsafe(self, fn):
        self.calls.append(("soon",))
        self.queued.append(fn)

    def turn(self):
        """One turn of the event loop: run what was queued (and what that queues)."""
        while self.queued:
            self.queued.pop(0)()
        return [c for c in self.calls if c != ("soon",)]


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
    assert control._consuming.turn() == [("pause", "svc.a")]


def test_pause_and_resume_reach_the_consumer_only_on_the_next_turn_of_the_loop(control):
    """Asked for inside a broker callback, the cancel must not run inside it (it would drain frames)."""
    control.pause("svc.a", "circuit open")
    assert control.is_paused("svc.a"), "the wanted state changes at once"
    assert control._consuming.calls == [("soon",)], "the effect waits for the loop"
    assert control._consuming.turn() == [("pause", "svc.a")]


def test_a_request_superseded_before_the_loop_turns_is_skipped(control):
    control.pause("svc.a")
    control.resume("svc.a")
    assert control._consuming.turn() == [("resume", "svc.a", None)], "the pause never reaches the consumer"
    control.pause("svc.b")
    control.resume("svc.b", prefetch=1)
    control.pause("svc.b")
    assert control._consuming.turn()[1:] == [("pause", "svc.b")]
    assert control.paused == {"svc.b": ""}


def test_pause_from_many_threads_at_once_is_one_pause(control):
    threads = [threading.Thread(target=control.pause, args=("svc.a", f"t{n}")) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert control._consuming.turn() == [("pause", "svc.a")]


def test_resume_only_touches_a_paused_queue_unless_a_prefetch_is_asked(control):
    control.resume("svc.a")
    assert control._consuming.calls == []
    control.pause("svc.a")
    control._consuming.turn()
    control.resume("svc.a", prefetch=1)
    control.resume("svc.b", prefetch=100)
    assert control._consuming.turn() == [("pause", "svc.a"), ("resume", "svc.a", 1), ("resume", "svc.b", 100)]
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


def test_a_timer_asked_for_from_another_thread_is_set_on_the_loop(control):
    hub = Hub()
    control.attach("connection", hub)  # on this thread: the loop's
    timers = []
    worker = threading.Thread(target=lambda: timers.append(control.call_after(5, lambda: None)))
    worker.start()
    worker.join()
    assert hub.timers == [], "the hub's timer heap is touched only on the loop"
    control._consuming.turn()
    assert [(e.seconds, e.repeat) for e in hub.timers] == [(5, False)]
    timers[0].cancel()
    assert hub.timers[0].cancelled


def test_a_timer_cancelled_before_the_loop_sets_it_never_fires(control):
    hub = Hub()
    control.attach("connection", hub)
    worker = threading.Thread(target=lambda: control.call_every(1, lambda: None).cancel())
    worker.start()
    worker.join()
    control._consuming.turn()
    assert hub.timers == []


def test_a_failing_timer_is_logged_not_raised(control, caplog):
    control.attach(None, Hub())
    control.call_after(1, lambda: 1 / 0)
    control._hub.timers[0].fn()
    assert "run on the event loop, failed" in caplog.text and "ZeroDivisionError" in caplog.text


@pytest.mark.parametrize("seconds", [-1, float("nan"), True, "5"])
def test_a_bad_timer_delay_is_refused(control, seconds):
    with pytest.raises(ValueError, match="seconds"):
        control.call_after(seconds, lambda: None)


def test_without_an_event_loop_timers_run_on_a_thread_through_the_consumer(control):
    fired = threading.Event()
    control.attach(None, None)
    control.call_after(0.01, fired.set)
    deadline = time.monotonic() + 5
    while not fired.is_set() and time.monotonic() < deadline:
        control._consuming.turn()
        time.sleep(0.005)
    assert fired.is_set()
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
