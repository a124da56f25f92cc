"""ops/dot.py: the topology as a Graphviz graph: every entity and binding drawn, the same text every time."""
from __future__ import annotations

import re

import pytest
from kombu import Exchange, Queue, binding

from kombu_events.core.backoff import Exponential
from kombu_events.core.config import Settings
from kombu_events.core.handlers import Handler
from kombu_events.core.topology import Topology, build_topology
from kombu_events.ops.dot import to_dot


def _handler(queue: str, *keys: str) -> Handler:
    return Handler(fn=lambda payload: None, name=queue.rsplit(".", 1)[-1], queue=queue,
                   binding_keys=keys, max_retries=5, backoff=Exponential())


HANDLERS = (
    _handler("billing.on_order_created", "orders.*.created"),
    _handler("billing.audit", "orders.#", "refunds.#"),
)


def _topology(**settings) -> Topology:
    settings.setdefault("publish_delay_levels", 0)
    return build_topology(Settings(service="billing", delay_levels=4, **settings), HANDLERS)


def _edges(dot: str) -> set[tuple[str, str, str, str]]:
    """(source, destination, label, style) of every edge line."""
    found = set()
    for line in dot.splitlines():
        m = re.fullmatch(r'  "([^"]+)" -> "([^"]+)" \[label="([^"]*)"(?:, style=(\w+))?\];', line)
        if m:
            found.add((m[1], m[2], m[3], m[4] or ""))
    return found


def test_every_exchange_is_a_box_and_every_queue_an_ellipse():
    topology = _topology()
    dot = to_dot(topology)
    for exchange in topology.exchanges:
        assert f'"exchange:{exchange.name}" [shape=box, label="{exchange.name}\\n{exchange.type}"];' in dot
    for queue in topology.queues:
        assert re.search(rf'"queue:{re.escape(queue.name)}" \[shape=ellipse, label="{re.escape(queue.name)}', dot)
    assert dot.count("shape=box") == len(topology.exchanges) == 1 + 4 + 2  # events, 4 levels, delivery, archive
    assert dot.count("shape=ellipse") == len(topology.queues) == 2 + 4 + 1  # handlers, levels, archive


def test_every_queue_binding_is_an_edge_labelled_with_its_key():
    topology = _topology()
    edges = _edges(to_dot(topology))
    for queue in topology.queues:
        for b in queue.bindings:
            assert (f"exchange:{b.exchange.name}", f"queue:{queue.name}", b.routing_key or "", "") in edges
    assert ("exchange:events", "queue:billing.audit", "refunds.#", "") in edges
    assert ("exchange:billing.delivery", "queue:billing.audit", "*.*.*.*.billing.audit", "") in edges


def test_exchange_to_exchange_bindings_are_bold_edges():
    topology = _topology()
    edges = _edges(to_dot(topology))
    for link in topology.exchange_bindings:
        assert (f"exchange:{link.source.name}", f"exchange:{link.destination.name}", link.routing_key,
                "bold") in edges
    assert ("exchange:billing.delay.0", "exchange:billing.delivery", "*.*.*.0.#", "bold") in edges


def test_dead_letter_arguments_are_dashed_edges():
    edges = _edges(to_dot(_topology()))
    dashed = {(src, dst, label) for src, dst, label, style in edges if style == "dashed"}
    assert ("queue:billing.audit", "exchange:billing.delay.0", "dead-letter 0.0.0.1.billing.audit") in dashed
    assert ("queue:billing.delay.3", "exchange:billing.delay.2", "dead-letter (same key)") in dashed
    assert ("queue:billing.delay.0", "exchange:billing.delivery", "dead-letter (same key)") in dashed
    assert len(dashed) == 2 + 4  # the archive dead-letters nowhere


def test_every_edge_joins_declared_nodes():
    dot = to_dot(_topology())
    nodes = set(re.findall(r'^  "([^"]+)" \[shape=', dot, flags=re.M))
    for src, dst, _label, _style in _edges(dot):
        assert src in nodes and dst in nodes, (src, dst)
    assert len(_edges(dot)) == dot.count(" -> ")  # every edge line was parsed


def test_queue_arguments_worth_seeing_are_in_the_label():
    dot = to_dot(_topology(delay_unit_ms=500, archive_max_bytes=7_000_000, archive_ttl_ms=60_500,
                           queue_type="quorum"))
    assert '"queue:billing.delay.3" [shape=ellipse, label="billing.delay.3\\nttl 4000 ms\\nquorum queue"];' in dot
    assert ('"queue:billing.archive" [shape=ellipse, label="billing.archive\\nmax-age 61s\\n'
            'max-length-bytes 7000000\\nstream queue"];') in dot


def test_output_is_deterministic_whatever_the_order_of_kombus_binding_sets():
    first = to_dot(_topology())
    again = to_dot(_topology())
    assert first == again
    events = Exchange("events", "topic")
    keys = [f"k{n}.#" for n in range(20)]
    one = Queue("q", bindings=[binding(events, routing_key=k) for k in keys])
    other = Queue("q", bindings=[binding(events, routing_key=k) for k in reversed(keys)])
    base = _topology()
    assert (to_dot(Topology(base.settings, base.exchanges, (one,), ()))
            == to_dot(Topology(base.settings, base.exchanges, (other,), ())))


@pytest.mark.parametrize("name", ['svc"quoted', "back\\slash"])
def test_names_are_escaped_for_dot(name):
    exchange = Exchange(name, "topic")
    base = _topology()
    dot = to_dot(Topology(base.settings, (exchange,), (), ()))
    escaped = name.replace("\\", "\\\\").replace('"', '\\"')
    assert f'"exchange:{escaped}" [shape=box, label="{escaped}\\ntopic"];' in dot


def test_the_graph_is_one_digraph_named_after_the_service():
    dot = to_dot(_topology())
    assert dot.startswith('digraph "billing" {\n') and dot.endswith("}\n")


def test_an_alternate_exchange_is_a_dotted_edge():
    edges = _edges(to_dot(_topology(publish_delay_levels=2)))
    assert ("exchange:events.deferred", "exchange:events.unrouted", "unroutable", "dotted") in edges
    assert not [e for e in _edges(to_dot(_topology())) if e[3] == "dotted"]
