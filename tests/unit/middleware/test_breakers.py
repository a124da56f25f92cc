"""``Breakers``: the circuit-breaker middleware against a real Control on a recording consumer, a fake hub
and a fake clock; health checks run by hand instead of in threads."""
from __future__ import annotations

import logging
from typing import Any

import pytest

from kombu_events import (
    CircuitBreaker,
    ConfigurationError,
    Degraded,
    Exponential,
    Healthy,
    Unhealthy,
    signals,
)
from kombu_events.core.breaker import CLOSED, HALF_OPEN, OPEN
from kombu_events.core.config import Settings
from kombu_events.core.decision import (
    ARCHIVE,
    DEFERRED,
    FAILED,
    LOST,
    OK,
    REDELIVERED,
    RETRY,
    UNDECODABLE,
    Outcome,
)
from kombu_events.core.delivery import Delivery, read_delivery
from kombu_events.core.handlers import Handler
from kombu_events.core.health import HealthCheck
from kombu_events.core.settlement import ACK, Republish, plan
from kombu_events.core.topology import build_topology
from kombu_events.middleware.breakers import Breakers
from kombu_events.middleware.control import Control

LOGGER = "kombu_events.middleware.breakers"
POLICY = CircuitBreaker(max_failures=3, window_s=10, reset_s=30, max_reset_s=600)


def charge(payload): ...
def audit(payload): ...
def ship(payload): ...


def handler(fn: Any, policy: CircuitBreaker | None = POLICY) -> Handler:
    return Handler(fn=fn, name=fn.__name__, queue=f"svc.{fn.__name__}", binding_keys=("orders.#",), max_retries=5,
                   backoff=Exponential(), circuit_breaker=policy)


class Consuming:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def pause_queue(self, queue):
        self.calls.append(("pause", queue))

    def resume_queue(self, queue, prefetch):
        self.calls.append(("resume", queue, prefetch))

    def call_soon_threadsafe(self, fn):
        fn()


class Entry:
    def __init__(self, seconds, fn, repeat):
        self.seconds, self.fn, self.repeat, self.cancelled = seconds, fn, repeat, False

    def cancel(self):
        self.cancelled = True


class Hub:
    def __init__(self) -> None:
        self.timers: list[Entry] = []

    def call_later(self, seconds, fn):
        self.timers.append(Entry(seconds, fn, False))
        return self.timers[-1]

    def call_repeatedly(self, seconds, fn):
        self.timers.append(Entry(seconds, fn, True))
        return self.timers[-1]

    def live(self, repeat: bool = False) -> list[Entry]:
        return [t for t in self.timers if not t.cancelled and t.repeat == repeat]


class World:
    """A Breakers middleware started on a Control, with a clock, a hub and health-check threads run by hand."""

    def __init__(self, handlers=(charge, audit), checks=(), *, max_delay_ms: float = 3_600_000) -> None:
        self.now = 1000.0
        self.threads: list[tuple[Any, str]] = []
        handlers = [h if isinstance(h, Handler) else handler(h) for h in handlers]
        self.breakers = Breakers(handlers, checks, prefetch_count=100, max_delay_ms=max_delay_ms,
                                 clock=lambda: self.now, spawn=lambda body, name: self.threads.append((body, name)))
        self.consuming = Consuming()
        self.hub = Hub()
        self.control = Control("svc", tuple(h.queue for h in handlers), self.consuming)
        self.control.attach(object(), self.hub)
        self.breakers.started(self.control)

    def circuit(self, fn=charge):
        return self.breakers.circuits[f"svc.{fn.__name__}"]

    def deliver(self, fn=charge, message_id: str = "m") -> tuple[Delivery, Outcome | None]:
        delivery = Delivery(f"svc.{fn.__name__}", "orders.1.created", b"{}", {"message_id": message_id})
        return delivery, self.breakers.before_dispatch(delivery)

    def settle(self, delivery: Delivery, kind: str, reason: str = "") -> None:
        self.breakers.settled(delivery, Outcome(kind, reason), ACK)

    def run(self, fn=charge, kind: str = FAILED, reason: str = "ValueError: db down") -> Outcome | None:
        """Deliver a message and, if it is let through, settle it with ``kind``."""
        delivery, refused = self.deliver(fn)
        if refused is None:
            self.settle(delivery, kind, reason)
        return refused

    def trip(self, fn=charge) -> None:
        for _ in range(POLICY.max_failures):
            self.run(fn)
        assert self.circuit(fn).breaker.state == OPEN

    def fire(self) -> None:
        """Advance the clock to the first live one-shot timer and fire it."""
        entry = self.hub.live()[0]
        entry.cancelled = True
        self.now += entry.seconds
        entry.fn()

    def finish_threads(self) -> None:
        threads, self.threads = self.threads, []
        for body, _name in threads:
            body()


@pytest.fixture
def world():
    return World()


@pytest.fixture
def changes():
    seen: list[dict[str, Any]] = []

    def receiver(sender, **kwargs):
        seen.append({"sender": sender, **{k: kwargs[k] for k in ("queue", "state", "previous", "reason")}})

    signals.circuit_changed.connect(receiver, weak=False, dispatch_uid="test_breakers")
    yield seen
    signals.circuit_changed.disconnect(dispatch_uid="test_breakers")


# -- closed: what counts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [FAILED, LOST])
def test_failures_that_would_be_retried_trip_the_circuit_and_pause_only_its_queue(world, changes, kind):
    for _ in range(3):
        world.run(kind=kind)
    assert world.circuit().breaker.state == OPEN
    assert world.consuming.calls == [("pause", "svc.charge")]
    assert world.control.paused == {"svc.charge": "circuit open: 3 failures within 10 s"}
    assert changes == [{"sender": charge, "queue": "svc.charge", "state": OPEN, "previous": CLOSED,
                        "reason": "3 failures within 10 s"}]
    assert world.run(audit) is None, "another handler's circuit is untouched"


@pytest.mark.parametrize("kind", [OK, ARCHIVE, UNDECODABLE, RETRY, DEFERRED, REDELIVERED])
def test_archive_poison_dont_retry_undecodable_retry_and_redeliveries_do_not_count(world, kind):
    for _ in range(10):
        world.run(kind=kind)
    assert world.circuit().breaker.state == CLOSED
    assert world.consuming.calls == []


def test_failures_outside_the_window_do_not_add_up(world):
    for _ in range(2):
        world.run()
    world.now += 10.5
    world.run()
    world.run()
    assert world.circuit().breaker.state == CLOSED
    world.run()
    assert world.circuit().breaker.state == OPEN


def test_a_handler_without_a_breaker_and_an_unstarted_middleware_are_left_alone():
    breakers = Breakers([handler(charge, None)], prefetch_count=100, max_delay_ms=1000)
    assert breakers.circuits == {}
    started_later = Breakers([handler(charge)], prefetch_count=100, max_delay_ms=1000)
    delivery = Delivery("svc.charge", "k")
    for _ in range(10):
        assert started_later.before_dispatch(delivery) is None
        started_later.settled(delivery, Outcome(FAILED), ACK)
    assert started_later.circuits["svc.charge"].breaker.state == CLOSED, "no Control (e.g. the test stub): off"


# -- open: messages wait, and what still arrives is deferred ------------------------------------------------

def test_a_trip_sets_one_timer_for_the_reset_time(world):
    world.trip()
    [timer] = world.hub.live()
    assert timer.seconds == 30


def test_what_arrives_while_open_is_deferred_until_about_the_reset_time_without_running(world):
    world.trip()
    world.now += 12
    _delivery, outcome = world.deliver()
    assert outcome == Outcome(DEFERRED, "circuit open: 3 failures within 10 s", delay_ms=18_000)


def test_the_deferral_never_asks_the_ladder_for_more_than_it_holds():
    world = World(max_delay_ms=7000)
    world.trip()
    _delivery, outcome = world.deliver()
    assert outcome.delay_ms == 7000


def test_a_deferred_message_goes_back_to_its_queue_with_no_attempt_spent_and_no_redelivery_counted(world):
    settings = Settings(service="svc", delay_levels=3)  # the ladder holds 7 s; the reset time is 30 s
    world = World(max_delay_ms=settings.max_delay_ms)
    world.trip()
    delivery = Delivery("svc.charge", "orders.1.created", b"{}", {"message_id": "m"}, attempt=3, redeliveries=1)
    outcome = world.breakers.before_dispatch(delivery)
    topology = build_topology(settings, [handler(charge)])
    step = plan(delivery, outcome, max_retries=3, backoff=Exponential(), topology=topology)
    assert isinstance(step, Republish) and step.action == "requeue", "deferred, never archived"
    assert step.delay_ms == 7000
    back = read_delivery("svc.charge", b"{}", step.properties, {"routing_key": "orders.1.created"})
    assert (back.attempt, back.redeliveries, back.message_id) == (3, 1, "m")


def test_failures_of_messages_already_in_the_pool_when_it_tripped_are_not_counted_again(world, changes):
    in_flight = [world.deliver()[0] for _ in range(5)]
    world.trip()
    for delivery in in_flight:
        world.settle(delivery, FAILED)
    assert world.circuit().breaker.reopens_at == 1000 + 30
    assert [c["state"] for c in changes] == [OPEN]
    assert world.consuming.calls == [("pause", "svc.charge")]


# -- half-open: one probe ------------------------------------------------------------------------------------

def test_after_the_reset_time_it_half_opens_and_consumes_one_message_at_a_time(world, changes):
    world.trip()
    world.fire()
    assert world.circuit().breaker.state == HALF_OPEN
    assert world.consuming.calls[-1] == ("resume", "svc.charge", 1)
    assert changes[-1] == {"sender": charge, "queue": "svc.charge", "state": HALF_OPEN, "previous": OPEN,
                           "reason": "3 failures within 10 s"}
    _probe, let_through = world.deliver(message_id="probe")
    assert let_through is None
    _other, deferred = world.deliver(message_id="beyond")
    assert deferred.kind == DEFERRED and deferred.delay_ms == 30_000


def test_closing_restores_a_handler_s_own_prefetch():
    own = Handler(fn=charge, name="charge", queue="svc.charge", binding_keys=("orders.#",), max_retries=5,
                  backoff=Exponential(), circuit_breaker=POLICY, prefetch=3)
    world = World(handlers=(own, audit))
    world.trip()
    world.fire()
    probe, _ = world.deliver()
    world.settle(probe, OK)
    assert world.consuming.calls[-1] == ("resume", "svc.charge", 3)


def test_a_successful_probe_closes_the_circuit_and_restores_the_prefetch(world, changes):
    world.trip()
    world.fire()
    probe, _ = world.deliver()
    world.settle(probe, OK)
    assert world.circuit().breaker.state == CLOSED
    assert world.consuming.calls[-1] == ("resume", "svc.charge", 100)
    assert [c["state"] for c in changes] == [OPEN, HALF_OPEN, CLOSED]
    assert changes[-1]["reason"] == "the probe succeeded"
    assert world.control.paused == {}
    assert world.run() is None and world.run(kind=OK) is None


def test_a_failed_probe_opens_it_again_for_twice_as_long(world, changes):
    world.trip()
    world.fire()
    probe, _ = world.deliver()
    world.settle(probe, FAILED, "ValueError: still down")
    breaker = world.circuit().breaker
    assert breaker.state == OPEN and breaker.reason == "the probe failed: ValueError: still down"
    assert world.consuming.calls[-1] == ("pause", "svc.charge")
    [timer] = world.hub.live()
    assert timer.seconds == 60
    assert [(c["previous"], c["state"]) for c in changes] == [(CLOSED, OPEN), (OPEN, HALF_OPEN), (HALF_OPEN, OPEN)]


@pytest.mark.parametrize("kind", [ARCHIVE, RETRY, UNDECODABLE])
def test_a_probe_that_says_nothing_about_the_dependency_lets_the_next_message_probe(world, kind):
    world.trip()
    world.fire()
    probe, _ = world.deliver()
    world.settle(probe, kind)
    assert world.circuit().breaker.state == HALF_OPEN
    assert world.deliver()[1] is None, "the next message is the probe"
    assert world.deliver()[1].kind == DEFERRED


def test_in_half_open_only_the_probes_result_counts(world):
    late = world.deliver()[0]
    world.trip()
    world.fire()
    probe, _ = world.deliver()
    world.settle(late, FAILED)  # ran before the trip, settles now
    assert world.circuit().breaker.state == HALF_OPEN
    world.settle(probe, OK)
    assert world.circuit().breaker.state == CLOSED


# -- logs ------------------------------------------------------------------------------------------------------

def test_one_log_line_per_transition_a_trip_at_warning(world, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    world.trip()
    world.fire()
    probe, _ = world.deliver()
    world.settle(probe, OK)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert [level for level, _ in lines] == ["WARNING", "INFO", "INFO"]
    assert lines[0][1] == ("kombu-events: circuit of handler charge (queue svc.charge) opened: 3 failures "
                           "within 10 s (last failure: ValueError: db down); queue paused, half-opens in 30 s "
                           "(trip 1 in a row)")
    assert "half-open" in lines[1][1] and "closed" in lines[2][1]


def test_three_trips_within_five_minutes_log_at_error_and_back_to_warning_thirty_minutes_later(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    world = World()
    levels = []
    for _ in range(4):
        world.trip()
        levels.append(caplog.records[-1].levelname)
        world.fire()
        world.settle(world.deliver()[0], OK)
        world.now += 60
    world.now += 1800
    world.trip()
    levels.append(caplog.records[-1].levelname)
    assert levels == ["WARNING", "WARNING", "ERROR", "ERROR", "WARNING"]


# -- health checks ----------------------------------------------------------------------------------------------

def checked_world(*results: Any, handlers=(charge, audit), serves=(charge,), **options: Any) -> World:
    """A World whose one health check returns ``results`` in turn (an exception is raised)."""
    answers = iter(results)

    def db():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return World(handlers, [HealthCheck(db, serves, interval_s=5, timeout_s=2, **options)])


def test_health_checks_run_every_interval_in_a_thread_of_their_own():
    world = checked_world(Healthy())
    [every] = world.hub.live(repeat=True)
    assert every.seconds == 5
    every.fn()
    assert [name for _body, name in world.threads] == ["kombu-events-health-checked_world.<locals>.db"]
    every.fn()
    assert len(world.threads) == 1, "one run at a time"
    world.finish_threads()
    assert world.breakers.runs[0].last == Healthy() and not world.breakers.runs[0].running


def test_two_unhealthy_within_the_window_trip_a_closed_circuit(changes, caplog):
    world = checked_world(Unhealthy("refused"), Unhealthy("refused"))
    world.run()  # an earlier failure is not what tripped it: the log line does not name it
    for _ in range(2):
        world.hub.live(repeat=True)[0].fn()
        world.finish_threads()
    assert world.circuit().breaker.state == OPEN
    [line] = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "opened: health check checked_world.<locals>.db: unhealthy: refused; queue paused" in line
    assert changes[-1]["reason"] == "health check checked_world.<locals>.db: unhealthy: refused"
    assert world.consuming.calls == [("pause", "svc.charge")]


def test_ten_degraded_within_the_window_trip_it_and_nine_do_not():
    world = checked_world(*[Degraded("slow")] * 10)
    for n in range(10):
        assert world.circuit().breaker.state == CLOSED, n
        world.hub.live(repeat=True)[0].fn()
        world.finish_threads()
        world.now += 0.5
    assert world.circuit().breaker.state == OPEN


def test_before_the_probe_the_checks_run_and_unhealthy_keeps_the_circuit_open_for_longer(changes, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    world = checked_world(Unhealthy("refused"), Healthy())
    world.trip()
    world.fire()
    assert world.circuit().breaker.state == OPEN, "not before the checks say so"
    assert world.consuming.calls == [("pause", "svc.charge")]
    world.finish_threads()
    assert world.circuit().breaker.state == OPEN
    [timer] = world.hub.live()
    assert timer.seconds == 60, "the reset time grows as for a trip"
    assert "stays open: health check checked_world.<locals>.db: unhealthy: refused" in caplog.text
    world.fire()
    world.finish_threads()
    assert world.circuit().breaker.state == HALF_OPEN
    assert world.consuming.calls[-1] == ("resume", "svc.charge", 1)
    assert [c["state"] for c in changes] == [OPEN, HALF_OPEN], "staying open is not a transition"


def test_a_check_that_raises_is_unhealthy_with_the_exception_in_the_reason():
    world = checked_world(ConnectionRefusedError("db:5432"))
    world.trip()
    world.fire()
    world.finish_threads()
    assert world.circuit().breaker.reason == ("health check checked_world.<locals>.db: unhealthy: health check "
                                              "checked_world.<locals>.db raised builtins.ConnectionRefusedError: "
                                              "db:5432")


def test_a_check_that_hangs_past_its_timeout_is_unhealthy():
    world = checked_world(Healthy())
    world.trip()
    world.fire()  # the reset time: the check starts (and never returns)
    assert len(world.threads) == 1
    world.fire()  # its timeout
    assert world.circuit().breaker.state == OPEN
    assert "still running after 2 s" in world.circuit().breaker.reason
    assert world.hub.live()[0].seconds == 60


def test_degraded_before_the_probe_lets_it_half_open():
    world = checked_world(Degraded("slow"))
    world.trip()
    world.fire()
    world.finish_threads()
    assert world.circuit().breaker.state == HALF_OPEN


def test_one_check_serves_several_handlers():
    world = checked_world(Unhealthy(), Unhealthy(), serves=(charge, audit))
    for _ in range(2):
        world.hub.live(repeat=True)[0].fn()
        world.finish_threads()
    assert world.circuit(charge).breaker.state == world.circuit(audit).breaker.state == OPEN
    assert world.consuming.calls == [("pause", "svc.charge"), ("pause", "svc.audit")]


def test_unhealthy_aborts_a_half_open_probe():
    world = checked_world(Healthy(), Unhealthy("down again"))
    world.trip()
    world.fire()
    world.finish_threads()
    probe, _ = world.deliver()
    world.hub.live(repeat=True)[0].fn()
    world.finish_threads()
    assert world.circuit().breaker.state == OPEN
    world.settle(probe, OK)  # the aborted probe's late result
    assert world.circuit().breaker.state == OPEN


def test_between_probes_periodic_results_do_not_push_the_reset_time_back():
    world = checked_world(Unhealthy(), Unhealthy(), Unhealthy())
    world.trip()
    world.hub.live(repeat=True)[0].fn()
    world.finish_threads()
    assert world.circuit().breaker.reopens_at == 1000 + 30


def test_a_check_of_a_handler_without_a_breaker_is_a_configuration_error():
    with pytest.raises(ConfigurationError, match="not a handler with a circuit breaker"):
        World([handler(charge, None)], [HealthCheck(lambda: Healthy(), (charge,))])


# -- reconnects ------------------------------------------------------------------------------------------------

def test_after_a_reconnect_an_open_circuit_waits_out_its_reset_time_and_a_half_open_one_probes_again(world):
    world.trip()  # at 1000: half-opens at 1030
    world.now = 1010
    world.trip(audit)  # half-opens at 1040
    world.now = 1030
    world.hub.live()[0].fn()
    assert world.circuit(charge).breaker.state == HALF_OPEN
    world.deliver(charge)  # the probe, lost with the connection
    world.control.detach()
    world.breakers.stopped(world.control)
    world.hub = Hub()
    world.now = 1035
    world.control.attach(object(), world.hub)
    world.breakers.started(world.control)
    assert world.consuming.calls[-1] == ("resume", "svc.charge", 1), "the lost probe is taken again"
    assert world.deliver(charge)[1] is None
    [timer] = world.hub.live()
    assert timer.seconds == pytest.approx(5)
    assert world.control.is_paused("svc.audit")


# -- the pool side: messages handed to the pool before the circuit opened --------------------------------


def test_the_pool_defers_what_it_got_before_the_trip_until_the_circuit_half_opens():
    world = World()
    assert world.breakers.admit("svc.charge") is None, "closed: let through"
    world.trip()
    refused = world.breakers.admit("svc.charge")
    assert refused is not None and refused.kind == DEFERRED
    assert refused.delay_ms == pytest.approx(30_000), "back about when the circuit half-opens"
    assert world.breakers.admit("svc.audit") is None, "another handler's circuit is closed"
    assert world.breakers.admit("svc.unknown") is None
    world.now += 10
    assert world.breakers.admit("svc.charge").delay_ms == pytest.approx(20_000)
    world.fire()
    assert world.circuit().breaker.state == HALF_OPEN
    assert world.breakers.admit("svc.charge") is None, "half-open: the probe must reach its handler"


def test_the_pool_reads_the_state_through_memory_shared_before_a_fork():
    import multiprocessing

    world = World()
    ctx = multiprocessing.get_context("fork")
    child_saw = ctx.Queue()

    def in_child():
        import time as _time

        deadline = _time.monotonic() + 10
        while world.circuit().gate[0] == 0 and _time.monotonic() < deadline:
            _time.sleep(0.005)
        child_saw.put(world.circuit().gate[0])

    child = ctx.Process(target=in_child)
    child.start()
    world.trip()  # in the parent, after the fork
    assert child_saw.get(timeout=15) == 1.0
    child.join(5)


def test_a_pool_deferral_is_no_failure_and_spends_no_attempt():
    world = World()
    world.trip()
    delivery = read_delivery("svc.charge", b"{}", {"message_id": "m"}, {"routing_key": "orders.1.created"})
    refused = world.breakers.admit("svc.charge")
    world.breakers.settled(delivery, refused, ACK)
    topology = build_topology(Settings(service="svc", publish_delay_levels=0), [handler(charge)])
    step = plan(delivery, refused, max_retries=5, backoff=Exponential(), topology=topology)
    assert isinstance(step, Republish) and step.action == "requeue"
    assert step.properties["application_headers"]["kombu-events-attempts"] == 0


# -- what fails on the event loop is logged with its circuit and goes no further ----------------------------

class Broken(Consuming):
    """A consumer whose channel closed under it: resuming a queue raises."""

    def resume_queue(self, queue, prefetch):
        super().resume_queue(queue, prefetch)
        raise RuntimeError("channel closed")


def _broken_world() -> World:
    world = World()
    world.consuming = Broken()
    world.control = Control("svc", world.control.queues, world.consuming)
    world.control.attach(object(), world.hub)
    world.breakers.started(world.control)
    return world


def test_a_queue_that_cannot_be_resumed_is_logged_with_its_circuit_and_no_hook_or_timer_raises(caplog):
    world = _broken_world()
    world.trip()
    with caplog.at_level(logging.ERROR):
        world.fire()  # the reset time: half-open, resume raises
        assert world.circuit().breaker.state == HALF_OPEN
        delivery, refused = world.deliver()
        assert refused is None, "the probe is let through"
        world.breakers.settled(delivery, Outcome(OK), ACK)  # closes it: resume raises again, from the hook
    assert world.circuit().breaker.state == CLOSED
    assert world.consuming.calls[-2:] == [("resume", "svc.charge", 1), ("resume", "svc.charge", 100)]
    records = [r for r in caplog.records if r.levelno >= logging.ERROR]
    failed = "pausing or resuming its queue failed"
    assert [(r.name, r.getMessage()) for r in records] == [
        (LOGGER, f"kombu-events: circuit of handler charge (queue svc.charge, half_open): {failed}"),
        (LOGGER, f"kombu-events: circuit of handler charge (queue svc.charge, closed): {failed}")]
    assert all(r.exc_info[1].args == ("channel closed",) for r in records)


def test_after_a_reconnect_a_circuit_that_cannot_be_resumed_does_not_keep_the_others_from_re_arming(caplog):
    world = World()
    world.trip(charge)
    world.trip(audit)
    world.fire()  # charge half-opens
    world.control.detach()
    world.breakers.stopped(world.control)
    world.consuming, world.hub = Broken(), Hub()
    world.control = Control("svc", world.control.queues, world.consuming)
    world.control.attach(object(), world.hub)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        world.breakers.started(world.control)
    assert "circuit of handler charge (queue svc.charge, half_open): re-arming it after the step started failed" \
        in caplog.text
    assert [t.seconds for t in world.hub.live()] == [0.0], "audit's reset timer (due now) is set all the same"


def test_a_reset_timer_that_fails_is_logged_with_its_circuit(world, monkeypatch, caplog):
    world.trip()
    monkeypatch.setattr(world.circuit().breaker, "due", lambda now: 1 / 0)
    with caplog.at_level(logging.ERROR):
        world.fire()
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.name == LOGGER
    assert record.getMessage() == ("kombu-events: circuit of handler charge (queue svc.charge, open): its reset "
                                   "timer failed")


def test_a_health_check_thread_that_cannot_start_is_logged_and_the_next_request_starts_one(caplog):
    world = checked_world(Healthy())
    [run] = world.breakers.runs
    spawned: list[Any] = []

    def spawn(body, name):
        if not spawned:
            spawned.append(None)
            raise RuntimeError("can't start new thread")
        world.threads.append((body, name))

    run._spawn = spawn
    with caplog.at_level(logging.ERROR, logger="kombu_events.middleware.health"):
        run.request()
    assert not run.running and world.threads == []
    assert "health check checked_world.<locals>.db could not be started" in caplog.text
    run.request()
    assert run.running and len(world.threads) == 1


def test_a_result_that_cannot_reach_the_event_loop_is_logged_and_the_next_run_may_start(caplog):
    world = checked_world(Healthy())
    [run] = world.breakers.runs

    def closed(fn):
        raise TypeError("'NoneType' object is not subscriptable")  # the loop's wake-up pipe was closed

    world.consuming.call_soon_threadsafe = closed  # type: ignore[method-assign]
    run.request()
    with caplog.at_level(logging.ERROR, logger="kombu_events.middleware.health"):
        world.finish_threads()  # the thread's body: must not raise
    assert not run.running and run.last is None
    assert "its result Healthy() could not be posted to the event loop" in caplog.text


def test_a_result_the_breakers_fail_to_act_on_is_logged_with_its_check(caplog):
    world = checked_world(Unhealthy("refused"))
    [run] = world.breakers.runs
    run.report = lambda run, health: 1 / 0
    run.request()
    with caplog.at_level(logging.ERROR, logger="kombu_events.middleware.health"):
        world.finish_threads()
    assert run.last == Unhealthy("refused") and not run.running
    assert "health check checked_world.<locals>.db: acting on its result Unhealthy('refused') failed" in caplog.text
