"""Delayed publishing, routed by the pure model of RabbitMQ in test_ladder_routing.

Two services share one events exchange. An event published with a delay must wait
exactly its whole units in the exchange's ladder, then reach every queue of every
service bound for its key -- the same queues a publish without delay reaches -- and
nothing else; an event no queue is bound for must land in ``<exchange>.unrouted``.
"""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kombu_events.core import ladder
from kombu_events.core.config import Settings
from kombu_events.core.topology import Topology, build_topology

from .test_ladder_routing import FakeBroker, _handler

UNIT_MS = 250
LEVELS = 5
KEYS = ("orders.*.created", "orders.#", "#", "refunds.*", "a.b.c", "*", "orders.1.created.#")


def _service(name: str, keys: tuple[str, ...]) -> Topology:
    settings_ = Settings(service=name, delay_levels=3, publish_delay_levels=LEVELS, publish_delay_unit_ms=UNIT_MS)
    return build_topology(settings_, [_handler(f"{name}.{i}", key) for i, key in enumerate(keys)])


BILLING = _service("billing", KEYS[:4])
AUDIT = _service("audit", KEYS[3:])


class SharedBroker(FakeBroker):
    """Several services' topologies on one broker, with alternate exchanges."""

    def __init__(self, *topologies: Topology) -> None:
        super().__init__(topologies[0])
        self.alternates = {}
        for topology in topologies:
            other = FakeBroker(topology)
            self.types.update(other.types)
            self.bindings += [b for b in other.bindings if b not in self.bindings]
            self.links += [link for link in other.links if link not in self.links]
            self.args.update(other.args)
            self.alternates.update({e.name: e.arguments["alternate-exchange"] for e in topology.exchanges
                                    if (e.arguments or {}).get("alternate-exchange")})

    def route(self, exchange: str, key: str, seen: frozenset = frozenset()) -> list[str]:
        """As RabbitMQ: an exchange that routes a message nowhere hands it to its alternate exchange,
        also when the message came to it through an exchange-to-exchange binding."""
        reached = super().route(exchange, key, seen)
        if not reached and exchange in self.alternates:
            return self.route(self.alternates[exchange], key, seen | {exchange})
        return reached

    def deliver(self, exchange: str, key: str) -> tuple[list[str], int]:
        """Follow every copy of a message: (the queues consumers get it from, ms it waited)."""
        waited_ms = 0
        for _hop in range(100):
            reached = self.route(exchange, key)
            waiting = [q for q in reached if "x-message-ttl" in self.args[q]]
            if not waiting:
                return sorted(reached), waited_ms
            assert len(reached) == 1, f"a waiting copy is never duplicated: {reached}"
            waited_ms += self.args[waiting[0]]["x-message-ttl"]
            exchange = self.args[waiting[0]]["x-dead-letter-exchange"]
        raise AssertionError("the message never settles")


BROKER = SharedBroker(BILLING, AUDIT)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["orders", "1", "created", "refunds", "a", "b", "c", "x"]), min_size=1, max_size=5),
       st.integers(min_value=0, max_value=ladder.max_delay_units(levels=LEVELS) * UNIT_MS))
def test_a_delayed_event_reaches_what_an_immediate_one_reaches_after_its_whole_units(words, delay_ms):
    key = ".".join(words)
    address = BILLING.publish_address(key, delay_ms)
    assert address == AUDIT.publish_address(key, delay_ms), "every service publishes the same way"
    reached, waited_ms = BROKER.deliver(address.exchange, address.routing_key)
    immediate = sorted(BROKER.route("events", key)) or ["events.unrouted"]
    assert reached == immediate
    assert waited_ms == address.delay_ms >= delay_ms > waited_ms - UNIT_MS


def test_an_event_nobody_is_bound_for_when_due_waits_in_the_unrouted_queue():
    only = SharedBroker(_service("solo", ("orders.#",)))
    published = _service("solo", ("orders.#",)).publish_address("refunds.7", 1000)
    assert only.deliver(published.exchange, published.routing_key) == (["events.unrouted"], 1000)
    published = _service("solo", ("orders.#",)).publish_address("orders.7", 1000)
    assert only.deliver(published.exchange, published.routing_key) == (["solo.0"], 1000)
