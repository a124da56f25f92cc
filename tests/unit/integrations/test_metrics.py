"""integrations/metrics.py: PrometheusMetrics counts what the hooks see, on a registry of its own, a fake control."""
from __future__ import annotations

import logging

import celery
import pytest
from amqp.exceptions import NotFound
from prometheus_client import CollectorRegistry

from kombu_events import Archive, Constant, Events, signals
from kombu_events.core.decision import (
    ARCHIVE,
    DEFERRED,
    FAILED,
    LOST,
    OK,
    RETRY,
    UNDECODABLE,
    Outcome,
)
from kombu_events.core.delivery import Delivery
from kombu_events.core.settlement import ACK, Hold, Republish
from kombu_events.errors import BrokerUnavailableError, UnroutableError
from kombu_events.integrations.metrics import (
    PrometheusMetrics,
    exception_type,
    handler_ran,
    publish_status,
)
from kombu_events.testing.stub import StubEvents


@pytest.fixture
def events():
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, service="billing", delay_levels=4)

    @events.handler("orders.#")
    def audit(payload):
        if payload.get("fail"):
            raise ValueError("audit store down")
        if payload.get("poison"):
            raise Archive("bad order")

    return events


@pytest.fixture
def metrics(events):
    metrics = PrometheusMetrics(CollectorRegistry())
    metrics.watched = []
    metrics._watch_archive = metrics.watched.append  # the archive is counted in a thread, on a connection: not here
    return metrics


LABELS = {"service": "billing", "queue": "billing.audit", "handler": "audit"}


def value(metrics, name, **labels):
    if "action" in labels:  # kombu_events_messages: the deprecated outcome label carries the same value
        labels["outcome"] = labels["action"]
    found = metrics.registry.get_sample_value(name, {**LABELS, **labels})
    return 0.0 if found is None else found


def delivery(received=1.0):
    return Delivery("billing.audit", "orders.7.created", b"{}", received=received)


def republish(action):
    return Republish(action, "x", "k", {})


class FakeChannel:
    def __init__(self, depths, log):
        self.depths, self.log, self.closed = depths, log, False

    def queue_declare(self, queue, passive):
        assert passive, "depth readings never create a queue"
        self.log.append(queue)
        if queue not in self.depths:  # the broker closes the channel; py-amqp reopens it at once
            raise NotFound("no queue", (50, 10), None)
        return queue, self.depths[queue], 0

    def close(self):
        self.closed = True


class FakeConnection:
    def __init__(self, depths):
        self.depths, self.declared, self.channels = depths, [], []

    def channel(self):
        self.channels.append(FakeChannel(self.depths, self.declared))
        return self.channels[-1]


class FakeControl:
    service = "billing"
    queues = ("billing.audit",)

    def __init__(self, connection=None):
        self.connection = connection
        self.timers = []

    def call_after(self, seconds, fn):
        self.timers.append(("after", seconds, fn))

    def call_every(self, seconds, fn):
        self.timers.append(("every", seconds, fn))


def test_every_outcome_is_counted_exactly_with_service_queue_and_handler_labels(metrics):
    steps = [ACK] * 3 + [republish("retry")] * 2 + [republish("requeue"), republish("archive"), Hold("no confirm")]
    for step in steps:
        metrics.settled(delivery(), Outcome(OK), step)
    counts = {a: value(metrics, "kombu_events_messages_total", action=a)
              for a in ("ack", "retry", "requeue", "archive", "held")}
    assert counts == {"ack": 3, "retry": 2, "requeue": 1, "archive": 1, "held": 1}


def test_messages_are_labelled_by_action_and_by_the_deprecated_outcome_with_the_same_value(metrics):
    metrics.settled(delivery(), Outcome(FAILED, "x", "builtins.ValueError: x"), republish("retry"))
    [family] = [f for f in metrics.registry.collect() if f.name == "kombu_events_messages"]
    labelled = {(s.labels["action"], s.labels["outcome"]): s.value for s in family.samples if s.value}
    assert labelled == {("retry", "retry"): 1}, "action is the step's action; outcome (deprecated) repeats it"


def test_the_handler_time_is_observed_only_when_the_handler_ran(metrics):
    metrics.settled(delivery(), Outcome(OK, duration_ms=20), ACK)
    metrics.settled(delivery(), Outcome(FAILED, "x", "builtins.ValueError: x", duration_ms=3000), republish("retry"))
    metrics.settled(delivery(), Outcome(UNDECODABLE, "not JSON", "DecodeError: not JSON"), republish("archive"))
    metrics.settled(delivery(), Outcome(DEFERRED, "circuit open", delay_ms=5000), republish("requeue"))
    assert value(metrics, "kombu_events_handler_duration_seconds_count") == 2
    assert value(metrics, "kombu_events_handler_duration_seconds_sum") == pytest.approx(3.02)
    assert value(metrics, "kombu_events_handler_duration_seconds_bucket", le="0.025") == 1
    assert value(metrics, "kombu_events_handler_duration_seconds_bucket", le="5.0") == 2


def test_exceptions_are_counted_by_type(metrics):
    failed = Outcome(FAILED, "x", "builtins.ValueError: audit store down: retry later", duration_ms=1)
    metrics.settled(delivery(), failed, republish("retry"))
    metrics.settled(delivery(), failed, republish("archive"))
    metrics.settled(delivery(), Outcome(LOST, "pool process lost", "billiard.exceptions.WorkerLostError: gone"),
                    republish("retry"))
    metrics.settled(delivery(), Outcome(UNDECODABLE, "bad", "DecodeError: bad"), republish("archive"))
    assert value(metrics, "kombu_events_handler_exceptions_total", exception_type="builtins.ValueError") == 2
    assert value(metrics, "kombu_events_handler_exceptions_total",
                 exception_type="billiard.exceptions.WorkerLostError") == 1
    assert value(metrics, "kombu_events_handler_exceptions_total", exception_type="DecodeError") == 0


@pytest.mark.parametrize(("outcome", "ran", "kind"), [
    (Outcome(OK, duration_ms=1), True, None),
    (Outcome(FAILED, "x", "builtins.KeyError: 'a'"), True, "builtins.KeyError"),
    (Outcome(RETRY, "later", "kombu_events.errors.Retry: later"), True, "kombu_events.errors.Retry"),
    (Outcome(ARCHIVE, "bad", "kombu_events.errors.Archive: bad"), True, "kombu_events.errors.Archive"),
    (Outcome(ARCHIVE, "refused by a middleware"), False, None),
    (Outcome(UNDECODABLE, "bad", "DecodeError: bad"), False, None),
    (Outcome(LOST, "lost", "billiard.exceptions.WorkerLostError: x"), False, "billiard.exceptions.WorkerLostError"),
    (Outcome(DEFERRED, "paused"), False, None),
])
def test_handler_ran_and_exception_type(outcome, ran, kind):
    assert handler_ran(outcome) is ran
    assert exception_type(outcome) == kind


def test_in_flight_goes_up_on_receive_and_down_on_settle(metrics):
    for _ in range(3):
        metrics.received(delivery())
    assert value(metrics, "kombu_events_in_flight") == 3
    metrics.settled(delivery(), Outcome(OK), ACK)
    assert value(metrics, "kombu_events_in_flight") == 2


def test_a_restart_zeroes_in_flight_and_ignores_what_the_old_connection_settles(metrics):
    metrics.received(delivery(received=1.0))
    metrics.received(delivery(received=2.0))
    metrics.started(FakeControl())  # a reconnect: the old channel's messages come back from the broker
    assert value(metrics, "kombu_events_in_flight") == 0
    metrics.received(delivery(received=float("inf")))  # after the restart
    metrics.settled(delivery(received=2.0), Outcome(OK), Hold("no channel"))
    assert value(metrics, "kombu_events_in_flight") == 1
    assert value(metrics, "kombu_events_messages_total", action="held") == 1, "still counted as an action"


@pytest.mark.parametrize(("error", "status"), [
    (None, "ok"),
    (UnroutableError("no queue", exchange="events", routing_key="k"), "unroutable"),
    (BrokerUnavailableError("down"), "failed"),
])
def test_publishes_are_counted_by_exchange_and_status(metrics, error, status):
    metrics.after_publish("events", "orders.7.created", {}, error)
    metrics.after_publish("events", "orders.7.created", {}, error)
    assert metrics.registry.get_sample_value("kombu_events_published_total",
                                             {"exchange": "events", "status": status}) == 2
    assert publish_status(error) == status


def test_started_reads_depths_at_once_and_every_15_s_on_the_event_loop(metrics):
    depths = {"billing.audit": 4, "billing.delay.0": 1, "billing.delay.3": 9, "billing.archive": 12}
    connection = FakeConnection(depths)
    control = FakeControl(connection)
    metrics.started(control)
    assert [(kind, seconds) for kind, seconds, _ in control.timers] == [("after", 0), ("every", 15.0)]
    assert connection.declared == [], "no broker round trip before the timer fires"
    control.timers[0][2]()
    assert connection.declared == ["billing.audit", "billing.delay.0", "billing.delay.1", "billing.delay.2",
                                   "billing.delay.3"], "the archive is a stream: never peeked on the event loop"
    assert [e.service for e in metrics.watched] == ["billing"], "it is counted by a watch of its own"
    assert len(connection.channels) == 3, "one channel, replaced after each missing queue (delay.1, delay.2)"
    assert all(c.closed for c in connection.channels), "each channel closed, a missing queue's one too"
    assert value(metrics, "kombu_events_queue_depth") == 4
    ladder = {lv: metrics.registry.get_sample_value("kombu_events_ladder_depth", {"service": "billing", "level": lv})
              for lv in "0123"}
    assert ladder == {"0": 1, "1": None, "2": None, "3": 9}
    assert metrics.registry.get_sample_value("kombu_events_archive_depth", {"service": "billing"}) is None
    metrics.archive_depths["billing"] = 12  # what the watch sets
    assert metrics.registry.get_sample_value("kombu_events_archive_depth", {"service": "billing"}) == 12


def test_each_partition_of_an_ordered_handler_has_its_own_depth_gauge(events, metrics):
    @events.handler("shipments.#", ordered_by="key", partitions=3)
    def ship(payload):
        pass

    depths = {"billing.audit": 0, "billing.ship.p0": 5, "billing.ship.p1": 0, "billing.ship.p2": 7}
    connection = FakeConnection(depths)
    control = FakeControl(connection)
    control.queues = tuple(h.queue for h in events.handlers)  # what the worker consumes: each partition
    assert control.queues == ("billing.audit", "billing.ship.p0", "billing.ship.p1", "billing.ship.p2")
    metrics.started(control)
    control.timers[0][2]()
    assert {q for q in connection.declared if q.startswith("billing.ship")} == {
        "billing.ship.p0", "billing.ship.p1", "billing.ship.p2"}
    got = {q: metrics.registry.get_sample_value("kombu_events_queue_depth",
                                                {"service": "billing", "queue": q, "handler": "ship"})
           for q in ("billing.ship.p0", "billing.ship.p1", "billing.ship.p2")}
    assert got == {"billing.ship.p0": 5, "billing.ship.p1": 0, "billing.ship.p2": 7}


def test_no_depth_reading_while_the_step_has_no_connection(metrics):
    control = FakeControl(connection=None)
    metrics.started(control)
    control.timers[0][2]()
    assert metrics.registry.get_sample_value("kombu_events_archive_depth", {"service": "billing"}) is None


class LostConnection(FakeConnection):
    def channel(self):
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_depth_reading_that_fails_is_logged_with_its_service_and_the_gauges_keep_their_values(metrics, caplog):
    connection = FakeConnection({"billing.audit": 4})
    control = FakeControl(connection)
    metrics.started(control)
    refresh = control.timers[1][2]
    refresh()
    control.connection = LostConnection({})
    with caplog.at_level(logging.ERROR, logger="kombu_events.integrations.metrics"):
        refresh()  # the timer on the event loop: must not raise
    (record,) = caplog.records
    assert record.getMessage() == ("kombu-events: reading the queue depths of service billing failed; "
                                   "trying again in 15 s")
    assert isinstance(record.exc_info[1], ConnectionResetError)
    assert value(metrics, "kombu_events_queue_depth") == 4


def test_the_circuit_state_gauge_follows_circuit_changed(metrics, events):
    metrics.received(delivery())
    states = {s: value(metrics, "kombu_events_circuit_state", state=s) for s in ("closed", "open", "half_open")}
    assert states == {"closed": 1, "open": 0, "half_open": 0}, "a handler without a breaker is closed"
    handler = events.handlers[0].fn
    signals.circuit_changed.send(sender=handler, queue="billing.audit", state="open", previous="closed",
                                 reason="5 failures in 10 s")
    states = {s: value(metrics, "kombu_events_circuit_state", state=s) for s in ("closed", "open", "half_open")}
    assert states == {"closed": 0, "open": 1, "half_open": 0}
    signals.circuit_changed.send(sender=handler, queue="billing.audit", state="half_open", previous="open",
                                 reason="probe")
    assert value(metrics, "kombu_events_circuit_state", state="half_open") == 1
    assert value(metrics, "kombu_events_circuit_state", state="open") == 0


def test_a_queue_no_service_knows_is_still_counted(metrics):
    metrics.settled(Delivery("elsewhere.q", "k", b""), Outcome(OK), ACK)
    assert metrics.registry.get_sample_value(
        "kombu_events_messages_total",
        {"service": "", "queue": "elsewhere.q", "handler": "", "action": "ack", "outcome": "ack"}) == 1


def test_through_the_stub_every_message_of_the_pipeline_is_counted(events):
    """The worker's own read/run/plan code (the test kit's stub) with the middleware registered as a user would."""
    metrics = PrometheusMetrics(CollectorRegistry())
    events.hooks.add(metrics)
    with StubEvents(events) as stub:
        events.publish_many([("orders.1.created", {})] * 10)
        events.publish("orders.2.created", {"poison": True})
        stub.join()
    assert value(metrics, "kombu_events_messages_total", action="ack") == 10
    assert value(metrics, "kombu_events_messages_total", action="archive") == 1
    assert value(metrics, "kombu_events_handler_exceptions_total",
                 exception_type="kombu_events.errors.Archive") == 1
    assert value(metrics, "kombu_events_handler_duration_seconds_count") == 11
    assert value(metrics, "kombu_events_in_flight") == 0
    assert metrics.registry.get_sample_value("kombu_events_published_total",
                                             {"exchange": "events", "status": "ok"}) == 11


def test_a_failing_handler_retries_then_archives_through_the_stub():
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, service="billing", max_retries=2, delay_levels=4)

    @events.handler("orders.#", backoff=Constant(every_ms=1000))
    def audit(payload):
        raise ValueError("down")

    metrics = PrometheusMetrics(CollectorRegistry())
    events.hooks.add(metrics)
    with StubEvents(events) as stub:
        events.publish_many([("orders.1.created", {})] * 3)
        stub.advance(10, fail_fast=False)  # an exception nobody declared is still retried, then archived
    assert value(metrics, "kombu_events_messages_total", action="retry") == 6
    assert value(metrics, "kombu_events_messages_total", action="archive") == 3
    assert value(metrics, "kombu_events_handler_exceptions_total", exception_type="builtins.ValueError") == 9


def test_a_handler_slower_than_the_last_bucket_is_counted_in_inf_only(metrics):
    metrics.settled(delivery(), Outcome(OK, duration_ms=301_000), ACK)
    assert value(metrics, "kombu_events_handler_duration_seconds_bucket", le="300.0") == 0
    assert value(metrics, "kombu_events_handler_duration_seconds_bucket", le="+Inf") == 1
    assert value(metrics, "kombu_events_handler_duration_seconds_count") == 1


def test_a_state_the_gauge_does_not_know_is_shown_beside_the_three(metrics, events):
    metrics.received(delivery())
    signals.circuit_changed.send(sender=events.handlers[0].fn, queue="billing.audit", state="forced_open",
                                 previous="closed", reason="operator")
    states = {s: value(metrics, "kombu_events_circuit_state", state=s)
              for s in ("closed", "open", "half_open", "forced_open")}
    assert states == {"closed": 0, "open": 0, "half_open": 0, "forced_open": 1}


def test_two_metrics_on_one_registry_are_refused_as_duplicates():
    registry = CollectorRegistry()
    PrometheusMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PrometheusMetrics(registry)


def test_messages_settled_without_running_the_handler_are_counted_by_reason(metrics):
    from kombu_events.core.decision import INVALID, SKIPPED

    metrics.settled(delivery(), Outcome(INVALID, "does not fit", "kombu_events.errors.InvalidPayload: x"),
                    republish("archive"))
    metrics.settled(delivery(), Outcome(INVALID, "does not fit", "kombu_events.errors.InvalidPayload: x"),
                    republish("archive"))
    metrics.settled(delivery(), Outcome(UNDECODABLE, "bad", "DecodeError: bad"), republish("archive"))
    metrics.settled(delivery(), Outcome(SKIPPED, "not of type 'x'"), ACK)
    metrics.settled(delivery(), Outcome(OK, duration_ms=1), ACK)
    unhandled = {reason: value(metrics, "kombu_events_unhandled_total", reason=reason)
                 for reason in ("invalid", "undecodable", "other_type")}
    assert unhandled == {"invalid": 2, "undecodable": 1, "other_type": 1}
    assert value(metrics, "kombu_events_handler_exceptions_total",
                 exception_type="kombu_events.errors.InvalidPayload") == 0  # the handler did not raise it
    assert value(metrics, "kombu_events_handler_duration_seconds_count") == 1


def test_each_readers_position_and_lag_are_gauges_of_its_service_and_name(metrics):
    assert metrics.registry.get_sample_value("kombu_events_reader_lag", {"service": "billing",
                                                                        "reader": "projector"}) is None
    metrics.readers[("billing", "projector")] = (120, 7)  # what the watch sets
    labels = {"service": "billing", "reader": "projector"}
    assert metrics.registry.get_sample_value("kombu_events_reader_position", labels) == 120
    assert metrics.registry.get_sample_value("kombu_events_reader_lag", labels) == 7
