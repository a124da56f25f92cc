"""core/topology.py: every exchange, queue, argument and binding of a service, with no I/O."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from kombu import Exchange, Queue, binding

from kombu_events.core.backoff import Exponential
from kombu_events.core.config import Settings
from kombu_events.core.handlers import Handler
from kombu_events.core.topology import (
    ARCHIVE_SEGMENT_BYTES,
    NO_DELIVERY_LIMIT,
    Topology,
    archive_segment_bytes,
    build_topology,
)
from kombu_events.errors import DelayTooLongError

CLASSIC = {"x-queue-type": "classic"}
STREAM = {"x-queue-type": "stream"}
GIB = 1024**3

DAY_MS = 24 * 3600 * 1000


def _handler(queue: str, *keys: str) -> Handler:
    return Handler(fn=lambda payload: None, name=queue.rsplit(".", 1)[-1], queue=queue,
                   binding_keys=keys, max_retries=5, backoff=Exponential())


HANDLERS = (
    _handler("billing.on_order_created", "orders.*.created"),
    _handler("billing.audit", "orders.#", "refunds.#"),
)


def _settings(**kwargs) -> Settings:
    # publish_delay_levels=0: the service's own entities; the shared delayed-publishing ladder is tested below.
    values = {"service": "billing", "delay_levels": 3, "delay_unit_ms": 1000,
              "archive_ttl_ms": DAY_MS, "archive_max_length": 500, "publish_delay_levels": 0}
    values.update(kwargs)
    return Settings(**values)


def _bindings(queue) -> set[tuple[str, str, str]]:
    return {(b.exchange.name, b.exchange.type, b.routing_key) for b in queue.bindings}


def test_every_exchange_of_a_two_handler_service():
    topology = build_topology(_settings(), HANDLERS)
    assert [(e.name, e.type, e.durable) for e in topology.exchanges] == [
        ("events", "topic", True),
        ("billing.delay.2", "topic", True),
        ("billing.delay.1", "topic", True),
        ("billing.delay.0", "topic", True),
        ("billing.delivery", "topic", True),
        ("billing.archive", "fanout", True),
    ]


def test_every_queue_with_every_argument():
    topology = build_topology(_settings(), HANDLERS)
    assert {q.name: (q.durable, dict(q.queue_arguments)) for q in topology.queues} == {
        "billing.on_order_created": (True, {
            "x-queue-type": "classic",
            "x-dead-letter-exchange": "billing.delay.0",
            "x-dead-letter-routing-key": "0.0.1.billing.on_order_created",
        }),
        "billing.audit": (True, {
            "x-queue-type": "classic",
            "x-dead-letter-exchange": "billing.delay.0",
            "x-dead-letter-routing-key": "0.0.1.billing.audit",
        }),
        "billing.delay.2": (True, {**CLASSIC, "x-message-ttl": 4000, "x-dead-letter-exchange": "billing.delay.1"}),
        "billing.delay.1": (True, {**CLASSIC, "x-message-ttl": 2000, "x-dead-letter-exchange": "billing.delay.0"}),
        "billing.delay.0": (True, {**CLASSIC, "x-message-ttl": 1000, "x-dead-letter-exchange": "billing.delivery"}),
        # a stream whatever queue_type; archive_max_length bounds nothing any more
        "billing.archive": (True, {**STREAM, "x-max-age": "86400s", "x-max-length-bytes": GIB,
                                   "x-stream-max-segment-size-bytes": ARCHIVE_SEGMENT_BYTES}),
    }
    assert [q.name for q in topology.queues][:2] == ["billing.on_order_created", "billing.audit"]
    assert [q.name for q in topology.handler_queues] == ["billing.on_order_created", "billing.audit"]


def test_every_queue_binding():
    topology = build_topology(_settings(), HANDLERS)
    assert {q.name: _bindings(q) for q in topology.queues} == {
        "billing.on_order_created": {
            ("events", "topic", "orders.*.created"),
            ("billing.delivery", "topic", "*.*.*.billing.on_order_created"),
        },
        "billing.audit": {
            ("events", "topic", "orders.#"),
            ("events", "topic", "refunds.#"),
            ("billing.delivery", "topic", "*.*.*.billing.audit"),
        },
        "billing.delay.2": {("billing.delay.2", "topic", "1.*.*.#")},
        "billing.delay.1": {("billing.delay.1", "topic", "*.1.*.#")},
        "billing.delay.0": {("billing.delay.0", "topic", "*.*.1.#")},
        "billing.archive": {("billing.archive", "fanout", "")},
    }


def test_every_exchange_to_exchange_binding():
    topology = build_topology(_settings(), HANDLERS)
    assert [(eb.destination.name, eb.source.name, eb.routing_key) for eb in topology.exchange_bindings] == [
        ("billing.delay.1", "billing.delay.2", "0.*.*.#"),
        ("billing.delay.0", "billing.delay.1", "*.0.*.#"),
        ("billing.delivery", "billing.delay.0", "*.*.0.#"),
    ]
    declared = {e.name for e in topology.exchanges}
    for eb in topology.exchange_bindings:
        assert {eb.source.name, eb.destination.name} <= declared


def test_named_entry_points():
    topology = build_topology(_settings(), HANDLERS)
    assert topology.entry_exchange(0) == "billing.delivery"
    assert topology.entry_exchange(1) == "billing.delay.0"
    assert topology.entry_exchange(5) == "billing.delay.2"  # highest set bit of 0b101
    assert topology.entry_exchange(2) == "billing.delay.1"
    assert topology.archive_exchange == "billing.archive"


def test_other_exchange_and_ttl_unit():
    topology = build_topology(_settings(exchange="domain", delay_unit_ms=250, delay_levels=2), HANDLERS[:1])
    assert topology.exchanges[0].name == "domain"
    assert {b.exchange.name for b in topology.queues[0].bindings} == {"domain", "billing.delivery"}
    assert [q.queue_arguments["x-message-ttl"] for q in topology.queues[1:3]] == [500, 250]


SEGMENT = "x-stream-max-segment-size-bytes"


@pytest.mark.parametrize(
    "ttl, max_bytes, expected",
    [
        (0, 0, {**STREAM, SEGMENT: ARCHIVE_SEGMENT_BYTES}),
        (0, 5, {**STREAM, "x-max-length-bytes": 5, SEGMENT: 2**20}),
        (5, 0, {**STREAM, "x-max-age": "1s", SEGMENT: ARCHIVE_SEGMENT_BYTES}),  # whole seconds, rounded up
        (1000, 0, {**STREAM, "x-max-age": "1s", SEGMENT: ARCHIVE_SEGMENT_BYTES}),
        (1001, 6, {**STREAM, "x-max-age": "2s", "x-max-length-bytes": 6, SEGMENT: 2**20}),
        (DAY_MS, 8 * 2**20, {**STREAM, "x-max-age": "86400s", "x-max-length-bytes": 8 * 2**20, SEGMENT: 2 * 2**20}),
    ],
)
@pytest.mark.parametrize("length", [0, 500])
def test_archive_arguments_are_omitted_when_zero(ttl, max_bytes, expected, length):
    topology = build_topology(_settings(archive_ttl_ms=ttl, archive_max_bytes=max_bytes, archive_max_length=length),
                              HANDLERS)
    archive = topology.queues[-1]
    assert archive.name == "billing.archive"
    assert dict(archive.queue_arguments or {}) == expected


@pytest.mark.parametrize("max_bytes, segment", [
    (0, ARCHIVE_SEGMENT_BYTES),  # no bound: the largest segment
    (1, 2**20),  # never below 1 MiB
    (4 * 2**20 - 1, 2**20),
    (8 * 2**20, 2 * 2**20),  # a quarter: retention drops a quarter at a time
    (4 * ARCHIVE_SEGMENT_BYTES, ARCHIVE_SEGMENT_BYTES),
    (GIB, ARCHIVE_SEGMENT_BYTES),  # never above 100 MB
    (2**53, ARCHIVE_SEGMENT_BYTES),
])
def test_archive_segment_bytes(max_bytes, segment):
    assert archive_segment_bytes(max_bytes) == segment


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=30), st.integers(min_value=1, max_value=32),
       st.integers(min_value=0, max_value=32))
def test_entity_counts(handler_count, levels, publish_levels):
    handlers = [_handler(f"svc.h{i}", f"k{i}.#") for i in range(handler_count)]
    topology = build_topology(Settings(service="svc", delay_levels=levels, publish_delay_levels=publish_levels,
                                       delay_unit_ms=1, publish_delay_unit_ms=1), handlers)  # 32 levels fit
    shared = publish_levels + 1 if publish_levels else 0  # its levels and the unrouted queue
    assert len(topology.queues) == levels + handler_count + 1 + shared
    assert len(topology.exchanges) == levels + 3 + (publish_levels + 2 if publish_levels else 0)
    assert len(topology.exchange_bindings) == levels + publish_levels
    assert [q.name for q in topology.handler_queues] == [h.queue for h in handlers]
    assert len({q.name for q in topology.queues}) == len(topology.queues), "queue names are unique"
    assert all(q.durable for q in topology.queues) and all(e.durable for e in topology.exchanges)


QUORUM = {"x-queue-type": "quorum", "x-quorum-initial-group-size": 3, "x-delivery-limit": NO_DELIVERY_LIMIT}
QUORUM_DEAD_LETTERING = {**QUORUM, "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}


def test_quorum_mode():
    classic = {q.name: dict(q.queue_arguments or {}) for q in build_topology(_settings(), HANDLERS).queues}
    quorum = build_topology(_settings(queue_type="quorum"), HANDLERS)
    for queue in quorum.queues:
        args = dict(queue.queue_arguments)
        if queue.name == "billing.archive":
            # the archive is a stream whatever queue_type: no quorum argument
            assert args == classic[queue.name]
            assert args["x-queue-type"] == "stream"
        else:
            assert args == {**classic[queue.name], **QUORUM_DEAD_LETTERING}


def test_every_quorum_queue_asks_for_the_configured_number_of_replicas():
    queues = build_topology(_settings(queue_type="quorum", quorum_initial_group_size=5), HANDLERS).queues
    assert {q.queue_arguments["x-quorum-initial-group-size"] for q in queues if q.name != "billing.archive"} == {5}
    assert "x-quorum-initial-group-size" not in queues[-1].queue_arguments  # the archive: a stream


def test_classic_mode_names_its_type_and_sets_no_quorum_arguments():
    for queue in build_topology(_settings(), HANDLERS).queues:
        expected = "stream" if queue.name == "billing.archive" else "classic"
        assert queue.queue_arguments["x-queue-type"] == expected  # not the vhost's default type
        assert not set(queue.queue_arguments) & (set(QUORUM_DEAD_LETTERING) - {"x-queue-type"})


def test_describe_lists_every_entity():
    topology = build_topology(_settings(), HANDLERS)
    lines = topology.describe()
    assert "exchange events type=topic durable=True" in lines
    assert "exchange billing.archive type=fanout durable=True" in lines
    assert ("queue billing.audit durable=True x-dead-letter-exchange=billing.delay.0 "
            "x-dead-letter-routing-key=0.0.1.billing.audit x-queue-type=classic") in lines
    assert ("queue billing.delay.0 durable=True x-dead-letter-exchange=billing.delivery x-message-ttl=1000 "
            "x-queue-type=classic") in lines
    assert ("queue billing.archive durable=True x-max-age=86400s x-max-length-bytes=1073741824 x-queue-type=stream "
            f"x-stream-max-segment-size-bytes={ARCHIVE_SEGMENT_BYTES}") in lines
    assert "  bind queue billing.audit <- exchange events key='refunds.#'" in lines
    assert "  bind queue billing.archive <- exchange billing.archive key=''" in lines
    assert "bind exchange billing.delivery <- exchange billing.delay.0 key='*.*.0.#'" in lines
    for exchange in topology.exchanges:
        assert f"exchange {exchange.name} type={exchange.type} durable=True" in lines
    text = "\n".join(lines)
    for queue in topology.queues:
        assert f"queue {queue.name} durable=True" in text
        for key, value in queue.queue_arguments.items():
            assert f"{key}={value}" in text
        for b in queue.bindings:
            assert f"  bind queue {queue.name} <- exchange {b.exchange.name} key={b.routing_key!r}" in lines
    for eb in topology.exchange_bindings:
        assert f"bind exchange {eb.destination.name} <- exchange {eb.source.name} key={eb.routing_key!r}" in lines
    bindings = sum(len(q.bindings) for q in topology.queues)
    assert len(lines) == len(topology.exchanges) + len(topology.queues) + bindings + len(topology.exchange_bindings)


def test_describe_is_the_same_whatever_the_order_of_kombus_binding_sets():
    events = Exchange("events", "topic")
    keys = [f"k{n}.#" for n in range(20)]
    base = build_topology(_settings(), HANDLERS)
    plans = [Topology(base.settings, base.exchanges, (Queue("q", bindings=[binding(events, routing_key=k)
                                                                           for k in order]),), ()).describe()
             for order in (keys, keys[::-1])]
    assert plans[0] == plans[1]
    assert [line for line in plans[0] if line.startswith("  bind ")] == [
        f"  bind queue q <- exchange events key={k!r}" for k in sorted(keys)]


def test_describe_has_no_trailing_space():
    lines = build_topology(_settings(archive_ttl_ms=0, archive_max_bytes=0, archive_max_length=0), []).describe()
    assert ("queue billing.archive durable=True x-queue-type=stream "
            f"x-stream-max-segment-size-bytes={ARCHIVE_SEGMENT_BYTES}") in lines
    assert all(line == line.rstrip() for line in lines)


def test_the_exchanges_delayed_publishing_ladder_is_shared_and_every_binding_key_is_bound_at_its_end():
    topology = build_topology(_settings(publish_delay_levels=2, publish_delay_unit_ms=500), HANDLERS)
    service = build_topology(_settings(), HANDLERS)
    extra_exchanges = [(e.name, e.type, dict(e.arguments or {})) for e in topology.exchanges[len(service.exchanges):]]
    assert extra_exchanges == [
        ("events.deferred.1", "topic", {}),
        ("events.deferred.0", "topic", {}),
        ("events.deferred", "topic", {"alternate-exchange": "events.unrouted"}),
        ("events.unrouted", "fanout", {}),
    ]
    extra_queues = {q.name: (dict(q.queue_arguments or {}), _bindings(q)) for q in topology.queues
                    if q.name.startswith("events.")}
    assert extra_queues == {
        "events.deferred.1": ({**CLASSIC, "x-message-ttl": 1000, "x-dead-letter-exchange": "events.deferred.0"},
                              {("events.deferred.1", "topic", "1.*.#")}),
        "events.deferred.0": ({**CLASSIC, "x-message-ttl": 500, "x-dead-letter-exchange": "events.deferred"},
                              {("events.deferred.0", "topic", "*.1.#")}),
        "events.unrouted": ({**CLASSIC}, {("events.unrouted", "fanout", "")}),
    }
    audit = {q.name: q for q in topology.queues}["billing.audit"]
    assert _bindings(audit) - _bindings({q.name: q for q in service.queues}["billing.audit"]) == {
        ("events.deferred", "topic", "*.*.orders.#"), ("events.deferred", "topic", "*.*.refunds.#")}
    assert [(eb.destination.name, eb.source.name, eb.routing_key) for eb in topology.exchange_bindings][-2:] == [
        ("events.deferred.0", "events.deferred.1", "0.*.#"), ("events.deferred", "events.deferred.0", "*.0.#")]
    assert [q.name for q in topology.handler_queues] == ["billing.on_order_created", "billing.audit"]
    assert [topology.role(q.name) for q in topology.queues] == [
        "handler", "handler", "delay", "delay", "delay", "archive", "deferred", "deferred", "unrouted"]


@pytest.mark.parametrize("delay_ms, expected", [
    (0, ("events", "orders.1.created", 0)),
    (1, ("events.deferred.0", "0.1.orders.1.created", 500)),
    (500, ("events.deferred.0", "0.1.orders.1.created", 500)),
    (501, ("events.deferred.1", "1.0.orders.1.created", 1000)),
    (1500, ("events.deferred.1", "1.1.orders.1.created", 1500)),
])
def test_publish_address_rounds_up_to_whole_units_and_enters_at_the_highest_bit(delay_ms, expected):
    topology = build_topology(_settings(publish_delay_levels=2, publish_delay_unit_ms=500), HANDLERS)
    assert tuple(topology.publish_address("orders.1.created", delay_ms)) == expected


@pytest.mark.parametrize("levels, delay_ms", [(2, 1501), (2, float("inf")), (2, -1), (0, 1)])
def test_a_delay_beyond_the_exchanges_ladder_is_refused_naming_its_reach(levels, delay_ms):
    topology = build_topology(_settings(publish_delay_levels=levels, publish_delay_unit_ms=500), HANDLERS)
    with pytest.raises(DelayTooLongError, match=r"'orders.1.created'.*publish_delay_levels"):
        topology.publish_address("orders.1.created", delay_ms)


def test_a_handler_s_own_queue_arguments_single_active_consumer_and_expiry():
    handler = Handler(fn=lambda payload: None, name="ordered", queue="billing.ordered", binding_keys=("a.#",),
                      max_retries=5, backoff=Exponential(), prefetch=1, single_active_consumer=True,
                      expires_ms=60_000)
    queue = {q.name: q for q in build_topology(_settings(), (*HANDLERS, handler)).queues}["billing.ordered"]
    assert queue.queue_arguments["x-single-active-consumer"] is True
    assert queue.queue_arguments["x-expires"] == 60_000
    plain = {q.name: q for q in build_topology(_settings(), HANDLERS).queues}["billing.audit"]
    assert "x-single-active-consumer" not in plain.queue_arguments and "x-expires" not in plain.queue_arguments


def test_a_schedule_s_token_queue_is_consumed_and_its_state_queue_keeps_the_newest_message():
    from kombu_events.core.schedule import Schedule

    schedule = Schedule("hourly", 3_600_000, 0, "latest", 86_400_000, "billing.schedule.hourly",
                        "billing.schedule.hourly.state")
    token = Handler(fn=lambda event: None, name="schedule.hourly", queue=schedule.queue, binding_keys=(),
                    max_retries=10_000, backoff=Exponential(), bind=True, prefetch=1, single_active_consumer=True,
                    expires_ms=schedule.retire_after_ms)
    topology = build_topology(_settings(), (*HANDLERS, token), (schedule,))
    queues = {q.name: q for q in topology.queues}
    assert _bindings(queues[schedule.queue]) == {("billing.delivery", "topic", "*.*.*.billing.schedule.hourly")}
    assert queues[schedule.state_queue].queue_arguments == {
        **CLASSIC, "x-max-length": 1, "x-overflow": "drop-head", "x-expires": 86_400_000}
    assert not queues[schedule.state_queue].bindings, "written through the default exchange only"
    assert topology.role(schedule.queue) == "schedule" and topology.role(schedule.state_queue) == "state"
    assert [q.name for q in topology.handler_queues] == [*(h.queue for h in HANDLERS), schedule.queue]
    quorum = {q.name: q for q in build_topology(_settings(queue_type="quorum"), (token,), (schedule,)).queues}
    assert quorum[schedule.state_queue].queue_arguments["x-overflow"] == "drop-head"
