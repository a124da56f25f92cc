"""The ladder's topology, routed by a pure model of RabbitMQ topic exchanges and dead-lettering.

Proves, without a broker, that a message published to the top level with
``routing_key(delay, queue)`` waits in exactly the levels of ``levels_for(delay)``
and comes back to exactly ``queue``, never to a sibling queue of the service.
"""
from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings, strategies as st
from kombu import Exchange, Queue, binding

from kombu_events.core import ladder, names
from kombu_events.core.backoff import Exponential
from kombu_events.core.config import Settings
from kombu_events.core.handlers import Handler
from kombu_events.core.topology import ExchangeBinding, Topology, build_topology
from kombu_events.errors import ConfigurationError, TopologyConflictError
from kombu_events.testing.broker_model import BrokerModel, Landing, Lost

SERVICE = "svc"
UNIT_MS = 250
#: Handler queues whose names are prefixes, suffixes and look-alikes of each other.
QUEUES = (
    "svc.a", "svc.a.b", "svc.a.b.c", "svc.b.a", "svc.ab", "svc.b", "x.svc.a", "svc", "a",
    "1.svc.a", "0.1.svc.a", "0", "svc-a", "svc.delay", "other.a",
)


def topic_matches(pattern: str, key: str) -> bool:
    """RabbitMQ topic matching: ``*`` is exactly one word, ``#`` zero or more words."""
    p, k = pattern.split("."), key.split(".")

    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(p):
            return j == len(k)
        if p[i] == "#":
            return match(i + 1, j) or (j < len(k) and match(i, j + 1))
        return j < len(k) and p[i] in ("*", k[j]) and match(i + 1, j + 1)

    return match(0, 0)


@pytest.mark.parametrize(
    "pattern, key, expected",
    [
        ("a.b", "a.b", True), ("a.b", "a.c", False), ("*.b", "a.b", True), ("*.b", "b", False),
        ("*.b", "x.a.b", False), ("a.*", "a", False), ("a.#", "a", True), ("a.#", "a.b.c", True),
        ("#.c", "a.b.c", True), ("#", "a.b", True), ("#.#", "a", True), ("a.#.c", "a.c", True),
        ("a.#.c", "a.x.y.c", True), ("a.#.c", "a.x.y", False),
        ("*.*.svc.a", "0.1.svc.a", True), ("*.*.svc.a", "0.1.svc.a.b", False),
        ("*.*.svc.a.b", "0.1.svc.a", False), ("*.1.#", "0.1.svc.a", True), ("*.1.#", "1.0.svc.a", False),
    ],
)
def test_topic_matcher_model(pattern, key, expected):
    assert topic_matches(pattern, key) is expected


class FakeBroker:
    """Routes like RabbitMQ over a Topology: queue bindings, exchange bindings, TTL + dead-lettering."""

    def __init__(self, topology: Topology) -> None:
        self.types = {e.name: e.type for e in topology.exchanges}
        self.bindings = [(b.exchange.name, b.routing_key, q.name) for q in topology.queues for b in q.bindings]
        self.links = [(eb.source.name, eb.routing_key, eb.destination.name) for eb in topology.exchange_bindings]
        self.args = {q.name: dict(q.queue_arguments or {}) for q in topology.queues}

    def _matches(self, exchange: str, pattern: str, key: str) -> bool:
        assert exchange in self.types, f"binding to undeclared exchange {exchange!r}"
        return self.types[exchange] == "fanout" or topic_matches(pattern, key)

    def route(self, exchange: str, key: str, seen: frozenset = frozenset()) -> list[str]:
        """Queues a publish reaches (a list: a queue reached twice would show up twice)."""
        assert exchange not in seen, f"exchange-binding cycle through {exchange!r}"
        queues = [q for e, p, q in self.bindings if e == exchange and self._matches(e, p, key)]
        for source, pattern, destination in self.links:
            if source == exchange and self._matches(source, pattern, key):
                queues += self.route(destination, key, seen | {exchange})
        return queues

    def travel(self, exchange: str, key: str) -> tuple[list[str], int, str]:
        """Follow one message until a queue holds it for a consumer: (waited in, ms waited, final queue)."""
        waited_in, waited_ms = [], 0
        for _hop in range(100):
            reached = self.route(exchange, key)
            assert len(reached) == 1, f"{key!r} published to {exchange!r} reached {reached}"
            queue = reached[0]
            args = self.args[queue]
            if "x-message-ttl" not in args or "x-dead-letter-exchange" not in args:
                return waited_in, waited_ms, queue
            waited_in.append(queue)
            waited_ms += args["x-message-ttl"]
            exchange = args["x-dead-letter-exchange"]
            key = args.get("x-dead-letter-routing-key", key)  # unset: the message keeps its key
        raise AssertionError("the message never settles in a queue")


def _handler(queue: str, *keys: str) -> Handler:
    return Handler(fn=lambda payload: None, name=queue, queue=queue, binding_keys=keys or (queue,),
                   max_retries=5, backoff=Exponential())


@functools.cache
def broker(levels: int) -> FakeBroker:
    settings_ = Settings(service=SERVICE, delay_levels=levels, delay_unit_ms=UNIT_MS)
    return FakeBroker(build_topology(settings_, [_handler(q) for q in QUEUES]))


@functools.cache
def topology_of(levels: int):
    return build_topology(Settings(service=SERVICE, delay_levels=levels), [])


levels_and_delay = st.integers(min_value=1, max_value=20).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(min_value=0, max_value=(1 << n) - 1))
)


@settings(max_examples=300, deadline=None)
@given(levels_and_delay, st.sampled_from(QUEUES))
def test_delayed_message_waits_in_exactly_its_levels_and_returns_to_its_queue(levels_delay, queue):
    levels, delay = levels_delay
    key = ladder.routing_key(delay_units=delay, levels=levels, queue=queue)
    expected = [names.delay_name(SERVICE, lv) for lv in ladder.levels_for(delay_units=delay, levels=levels)]
    top = names.delay_name(SERVICE, levels - 1)
    # Entering at the highest set bit (what the consumer does) and at the top give the same route.
    for entry in (topology_of(levels).entry_exchange(delay), top):
        waited_in, waited_ms, final = broker(levels).travel(entry, key)
        assert waited_in == expected
        assert waited_ms == delay * UNIT_MS
        assert final == queue


@pytest.mark.parametrize("levels", [1, 2, 5, 16])
@pytest.mark.parametrize("queue", QUEUES)
def test_delivery_exchange_reaches_only_the_target_queue(levels, queue):
    delivery = names.delivery_exchange(SERVICE)
    for delay in {0, 1, ladder.max_delay_units(levels=levels)}:
        key = ladder.routing_key(delay_units=delay, levels=levels, queue=queue)
        assert broker(levels).route(delivery, key) == [queue]


@pytest.mark.parametrize("unknown", ["svc.zzz", "svc.a.b.c.d", "svc.", "b"])
def test_delivery_exchange_drops_keys_for_queues_the_service_does_not_have(unknown):
    key = ladder.routing_key(delay_units=1, levels=3, queue=unknown)
    assert broker(3).route(names.delivery_exchange(SERVICE), key) == []


@pytest.mark.parametrize("levels", [1, 3, 16])
@pytest.mark.parametrize("queue", QUEUES)
def test_rejected_message_waits_one_unit_and_returns_to_its_own_queue(levels, queue):
    fake = broker(levels)
    args = fake.args[queue]
    waited_in, waited_ms, final = fake.travel(args["x-dead-letter-exchange"], args["x-dead-letter-routing-key"])
    assert waited_in == [names.delay_name(SERVICE, 0)]
    assert waited_ms == UNIT_MS
    assert final == queue


def test_events_exchange_routes_by_binding_keys_only():
    topology = build_topology(
        Settings(service="billing", delay_levels=3),
        [_handler("billing.created", "orders.*.created"), _handler("billing.audit", "orders.#")],
    )
    fake = FakeBroker(topology)
    assert sorted(fake.route("events", "orders.42.created")) == ["billing.audit", "billing.created"]
    assert fake.route("events", "orders.42.shipped") == ["billing.audit"]
    assert fake.route("events", "invoices.1.paid") == []
    assert fake.route("billing.archive", "anything.at.all") == ["billing.archive"]


# -- the library's broker model (what the test stub routes with) agrees with the one above -------------


@functools.cache
def model(levels: int) -> BrokerModel:
    settings_ = Settings(service=SERVICE, delay_levels=levels, delay_unit_ms=UNIT_MS)
    return BrokerModel([build_topology(settings_, [_handler(q) for q in QUEUES])])


@settings(max_examples=100, deadline=None)
@given(levels_and_delay, st.sampled_from(QUEUES))
def test_the_broker_model_routes_the_ladder_as_the_fake_broker_does(levels_delay, queue):
    levels, delay = levels_delay
    key = ladder.routing_key(delay_units=delay, levels=levels, queue=queue)
    entry = topology_of(levels).entry_exchange(delay)
    waited_in, waited_ms, final = broker(levels).travel(entry, key)
    routed = model(levels).follow(entry, key)
    assert routed.lost == ()
    assert routed.landings == (Landing(final, key, waited_ms, tuple(waited_in)),)
    assert routed.entered == ((waited_in or [final])[0],)


@pytest.mark.parametrize("levels", [1, 3])
@pytest.mark.parametrize("queue", QUEUES)
def test_the_broker_model_follows_a_queues_dead_letter_routing_key(levels, queue):
    args = broker(levels).args[queue]
    routed = model(levels).follow(args["x-dead-letter-exchange"], args["x-dead-letter-routing-key"])
    assert routed.landings == (Landing(queue, args["x-dead-letter-routing-key"], UNIT_MS,
                                       (names.delay_name(SERVICE, 0),)),)


def test_a_copy_for_a_queue_the_service_does_not_have_is_lost_after_its_wait():
    key = ladder.routing_key(delay_units=5, levels=3, queue="svc.zzz")
    routed = model(3).follow(names.delay_name(SERVICE, 2), key)
    assert routed.entered == ("svc.delay.2",) and routed.landings == ()
    assert routed.lost == (Lost("svc.delay.0", "svc.delivery", key, 5 * UNIT_MS, "no queue is bound for it"),)


def test_a_publish_no_binding_takes_enters_no_queue():
    assert model(3).follow(names.delivery_exchange(SERVICE), "0.0.0.svc.zzz") == ((), (), ())
    assert model(3).follow("no.such.exchange", "a") == ((), (), ())
    assert not model(3).has_exchange("no.such.exchange") and model(3).has_exchange("")


def test_a_delayed_event_is_due_at_every_bound_queue_and_else_waits_in_the_unrouted_queue():
    topology = build_topology(
        Settings(service="billing", delay_levels=3, publish_delay_levels=2, publish_delay_unit_ms=500),
        [_handler("billing.created", "orders.*.created"), _handler("billing.audit", "orders.#")])
    model_ = BrokerModel([topology])
    routed = model_.follow("events.deferred.1", "1.1.orders.7.created")
    assert routed.entered == ("events.deferred.1",)
    assert sorted((landing.queue, landing.after_ms, landing.waited_in) for landing in routed.landings) == [
        ("billing.audit", 1500, ("events.deferred.1", "events.deferred.0")),
        ("billing.created", 1500, ("events.deferred.1", "events.deferred.0"))]
    [unrouted] = model_.follow("events.deferred.0", "0.1.invoices.1").landings
    assert (unrouted.queue, unrouted.after_ms) == ("events.unrouted", 500)  # the due exchange's alternate exchange
    assert model_.consumed == {"billing.created", "billing.audit"}


def _custom(*queues: Queue, exchanges=(), links=()) -> Topology:
    return Topology(Settings(service=SERVICE), tuple(exchanges), queues, tuple(links))


def test_direct_fanout_and_the_default_exchange_one_copy_per_queue_and_exchange_cycles_end():
    direct, fanout = Exchange("d", "direct"), Exchange("f", "fanout")
    topology = _custom(Queue("q1", bindings=[binding(direct, routing_key="k"), binding(fanout)]),
                       Queue("q2", bindings=[binding(direct, routing_key="other")]),
                       exchanges=[direct, fanout],
                       links=[ExchangeBinding(fanout, direct, "k"), ExchangeBinding(direct, fanout, "")])
    model_ = BrokerModel([topology])
    assert model_.route("d", "k") == ("q1",)  # reached directly and through the fanout: one copy
    assert model_.route("d", "k.x") == ()
    assert model_.route("f", "whatever") == ("q1",)
    assert model_.route("", "q2") == ("q2",) and model_.route("", "nope") == ()


def test_a_dead_letter_cycle_drops_the_message():
    a, b = Exchange("a", "fanout"), Exchange("b", "fanout")
    topology = _custom(Queue("qa", bindings=[binding(a)], queue_arguments={"x-message-ttl": 1,
                                                                           "x-dead-letter-exchange": "b"}),
                       Queue("qb", bindings=[binding(b)], queue_arguments={"x-message-ttl": 2,
                                                                           "x-dead-letter-exchange": "a"}),
                       exchanges=[a, b])
    routed = BrokerModel([topology], consumed=()).follow("a", "k")
    assert routed.landings == ()
    assert routed.lost == (Lost("qa", "b", "k", 4, "it went round a dead-letter cycle"),)
    assert BrokerModel([topology], consumed={"qb"}).follow("a", "k").landings == (Landing("qb", "k", 1, ("qa",)),)


def test_an_entity_declared_twice_with_other_arguments_conflicts():
    one = _custom(Queue("q", queue_arguments={"x-message-ttl": 1}))
    other = _custom(Queue("q", queue_arguments={"x-message-ttl": 2}))
    BrokerModel([one, one])  # the same declaration twice is idempotent
    with pytest.raises(TopologyConflictError, match="queue 'q' is declared with x-message-ttl=1 and with "
                                                    "x-message-ttl=2") as raised:
        BrokerModel([one, other])
    assert (raised.value.entity, raised.value.argument) == ("q", "x-message-ttl")
    with pytest.raises(TopologyConflictError, match="exchange 'e'"):
        BrokerModel([_custom(exchanges=[Exchange("e", "topic")]), _custom(exchanges=[Exchange("e", "fanout")])])
    with pytest.raises(ConfigurationError, match="'headers'"):
        BrokerModel([_custom(exchanges=[Exchange("h", "headers")])])
