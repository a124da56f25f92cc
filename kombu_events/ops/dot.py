"""The topology of a service as a Graphviz ``dot`` graph (``declare --dry-run --format dot``); no I/O."""
from __future__ import annotations

__all__ = ["to_dot"]

from typing import Any, Iterable

from ..core.topology import Topology

#: Queue arguments worth showing inside a queue's ellipse (the dead-letter ones become edges).
_SHOWN = {"x-message-ttl": "ttl {} ms", "x-max-length": "max-length {}", "x-queue-type": "{} queue",
          "x-max-age": "max-age {}", "x-max-length-bytes": "max-length-bytes {}",
          "x-expires": "expires {} ms", "x-single-active-consumer": "single active consumer"}


def to_dot(topology: Topology) -> str:
    """Exchanges as boxes, queues as ellipses, bindings as labelled edges, dead-lettering dashed,
    an exchange's alternate exchange dotted.

    The output depends only on the topology (bindings are sorted), so it can be
    committed or compared.
    """
    lines = [f"digraph {_quote(topology.settings.service)} {{",
             "  rankdir=TB;",
             '  node [fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=9];']
    for exchange in topology.exchanges:
        label = f"{exchange.name}\n{exchange.type}"
        lines.append(f"  {_id('exchange', exchange.name)} [shape=box, label={_quote(label)}];")
    for queue in topology.queues:
        args = _arguments(queue)
        label = "\n".join([queue.name] + [_SHOWN[k].format(args[k]) for k in sorted(args) if k in _SHOWN])
        lines.append(f"  {_id('queue', queue.name)} [shape=ellipse, label={_quote(label)}];")
    for queue in topology.queues:
        for exchange_name, key in _bindings(queue.bindings):
            lines.append(f"  {_id('exchange', exchange_name)} -> {_id('queue', queue.name)} "
                         f"[label={_quote(key)}];")
    for link in topology.exchange_bindings:
        lines.append(f"  {_id('exchange', link.source.name)} -> {_id('exchange', link.destination.name)} "
                     f"[label={_quote(link.routing_key)}, style=bold];")
    for exchange in topology.exchanges:
        alternate = (getattr(exchange, "arguments", None) or {}).get("alternate-exchange")
        if alternate:
            lines.append(f"  {_id('exchange', exchange.name)} -> {_id('exchange', str(alternate))} "
                         f"[label=\"unroutable\", style=dotted];")
    for queue in topology.queues:
        args = _arguments(queue)
        if "x-dead-letter-exchange" in args:
            why = "dead-letter " + str(args.get("x-dead-letter-routing-key", "(same key)"))
            lines.append(f"  {_id('queue', queue.name)} -> {_id('exchange', str(args['x-dead-letter-exchange']))} "
                         f"[label={_quote(why)}, style=dashed];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _arguments(queue: Any) -> dict[str, Any]:
    return dict(getattr(queue, "queue_arguments", None) or {})


def _bindings(bindings: Iterable[Any]) -> list[tuple[str, str]]:
    """(exchange, routing key) of each binding, sorted: kombu keeps them in a set."""
    return sorted((b.exchange.name, b.routing_key or "") for b in bindings)


def _id(kind: str, name: str) -> str:
    # An exchange and a queue may share a name (``S.delay.0``, ``S.archive``): the kind keeps them apart.
    return _quote(f"{kind}:{name}")


def _quote(text: str) -> str:
    """A dot double-quoted string: backslashes and quotes escaped, newlines as dot's ``\\n``."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
