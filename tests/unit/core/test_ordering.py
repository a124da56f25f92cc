"""Ordered handlers, the pure part: the options, the partitions a handler becomes, and their topology."""
from __future__ import annotations

import pytest
from celery import Celery

from kombu_events import ConfigurationError, Events
from kombu_events.core import names
from kombu_events.core.ordering import Ordering, check_key, check_ordering


def ordered(partitions: int = 4, ordered_by: str = "key", **options):
    events = Events(Celery("t", broker="memory://"), service="shop")

    @events.handler("orders.#", "refunds.*", ordered_by=ordered_by, partitions=partitions, hold_failures=False,
                    **options)
    def ship(payload):
        pass

    return events


def test_an_ordered_handler_becomes_its_partitions_one_event_in_flight_one_active_consumer_each():
    handlers = ordered(partitions=12).handlers
    assert [h.queue for h in handlers] == [f"shop.ship.p{i:02d}" for i in range(12)]
    assert {(h.name, h.prefetch, h.single_active_consumer, h.partition_of) for h in handlers} == {
        ("ship", 1, True, "shop.ship")}
    assert [h.partition for h in handlers] == list(range(12))


def test_the_partitions_are_fed_by_a_consistent_hash_exchange_bound_with_the_handlers_keys():
    topology = ordered(partitions=3).topology()
    (hashed,) = [e for e in topology.exchanges if e.type == "x-consistent-hash"]
    assert hashed.name == "shop.ship.partitions" and hashed.arguments == {"hash-header": "kombu-events-key"}
    assert {(b.destination.name, b.source.name, b.routing_key) for b in topology.exchange_bindings
            if b.destination is hashed} >= {("shop.ship.partitions", "events", "orders.#"),
                                             ("shop.ship.partitions", "events", "refunds.*")}
    for queue in topology.handler_queues:
        sources = {(b.exchange.name, b.routing_key) for b in queue.bindings}
        assert ("shop.ship.partitions", "1") in sources, "weight 1 on the hash exchange"
        assert not any(name == "events" for name, _ in sources), "never bound to the events exchange itself"
        assert any(name == "shop.delivery" and key.endswith(queue.name) for name, key in sources), "retries return"
        assert queue.queue_arguments["x-single-active-consumer"] is True


@pytest.mark.parametrize("by, arguments", [
    ("key", {"hash-header": "kombu-events-key"}), ("header:tenant", {"hash-header": "tenant"}),
    ("correlation_id", {"hash-property": "correlation_id"}), ("message_id", {"hash-property": "message_id"}),
    ("routing_key", {})])
def test_what_orders_the_events_is_what_the_exchange_hashes(by, arguments):
    assert Ordering(by, 4).exchange_arguments() == arguments


@pytest.mark.parametrize("ordered_by, partitions, hold, message", [
    ("body", 4, False, "ordered_by must be one of"), ("header:", 4, False, "ordered_by must be one of"),
    ("key", 0, False, r"partitions must be an integer within 1 \.\. 1024"),
    ("key", 1025, False, "partitions must be"), ("key", True, False, "partitions must be"),
    ("key", None, False, "partitions must be"), (None, 4, False, "partitions= needs ordered_by="),
    ("key", 4, "yes", "hold_failures must be True or False")])
def test_an_ordering_that_cannot_work_is_refused_with_what_is_valid(ordered_by, partitions, hold, message):
    with pytest.raises(ConfigurationError, match=message):
        check_ordering(ordered_by, partitions, hold)


def test_no_ordering_without_ordered_by_and_a_key_must_be_a_string():
    assert check_ordering(None, None, True) is None
    assert check_key("order-17") == "order-17"
    for bad in ("", 17, None):
        with pytest.raises(ConfigurationError, match="key must be a non-empty string"):
            check_key(bad)


def test_partition_queues_sort_in_order():
    assert [names.partition_queue("q", i, 100) for i in (0, 9, 99)] == ["q.p00", "q.p09", "q.p99"]
    assert names.partition_queue("q", 0, 1) == "q.p0"


def test_a_broker_without_the_plugin_is_a_clear_error_on_a_connection_of_its_own():
    from amqp.exceptions import InvalidCommand

    from kombu_events import PluginMissingError
    from kombu_events.broker.declare import declare

    class Channel:
        def exchange_declare(self, exchange, type, *args, **kwargs):
            raise InvalidCommand(f"COMMAND_INVALID - unknown exchange type '{type}'")

    class Probe:
        released = False

        def channel(self):
            return Channel()

        def release(self):
            Probe.released = True

    class Worker:
        def clone(self):
            return Probe()

        def channel(self):
            raise AssertionError("nothing is declared on the worker's own connection")

    with pytest.raises(PluginMissingError, match="rabbitmq-plugins enable rabbitmq_consistent_hash_exchange"):
        declare(ordered().topology(), Worker())
    assert Probe.released


def test_a_failing_event_may_not_hold_its_partition_past_half_the_consumer_timeout():
    from kombu_events import Constant, Exponential

    events = Events(Celery("t", broker="memory://"), service="shop")
    events.handler("a.#", ordered_by="key", partitions=2, max_retries=14, backoff=Constant(every_ms=60_000))(print)
    assert len(events.handlers) == 2, "14 minutes held at most: accepted"
    events.handler("b.#", name="b", ordered_by="key", partitions=2, max_retries=16,
                   backoff=Constant(every_ms=60_000))(print)
    with pytest.raises(ConfigurationError, match=r"up to 960 s \(16 retries with its backoff\), more than 15 minutes"):
        events.handlers
    events = Events(Celery("t", broker="memory://"), service="shop")
    events.handler("c.#", ordered_by="key", partitions=2, max_retries=30, hold_failures=False,
                   backoff=Exponential(max_delay_ms=3_600_000))(print)
    assert len(events.handlers) == 2, "through the ladder: no partition held"
