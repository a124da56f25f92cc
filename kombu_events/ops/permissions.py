"""The RabbitMQ permissions of a service's users, derived from its topology (``kombu-events permissions``); no I/O.

Two users: the *deploy* user declares the topology (``kombu-events declare``) and needs
configure, write and read on every name of it; the *runtime* user runs workers with
``declare=False`` and publishers, and needs no configure on any of them: write on the
exchanges it publishes to, read on the queues it consumes or reads. A Celery worker
also declares and uses Celery's own entities (its task queues, remote control and
events), so the runtime user's permissions include those, from the app's settings.
Every regex is anchored and every name escaped: another service's names never match.
"""
from __future__ import annotations

__all__ = ["Grant", "CeleryEntities", "pattern", "celery_entities", "runtime_grant", "deploy_grant",
           "topic_grant", "TopicGrant"]

import re
import shlex
from dataclasses import dataclass
from typing import Any, Iterable

from ..core import names
from ..core.topology import Topology


@dataclass(frozen=True)
class Grant:
    """The three regexes of ``rabbitmqctl set_permissions``."""

    configure: str
    write: str
    read: str

    def command(self, vhost: str, user: str) -> str:
        """The ``rabbitmqctl set_permissions`` line that grants them to ``user`` on ``vhost``, shell-quoted."""
        return shlex.join(["rabbitmqctl", "set_permissions", "-p", vhost, user, self.configure, self.write, self.read])


@dataclass(frozen=True)
class TopicGrant:
    """``rabbitmqctl set_topic_permissions``: the routing keys ``user`` may publish to ``exchange`` with."""

    exchange: str
    write: str
    read: str

    def command(self, vhost: str, user: str) -> str:
        """The shell-quoted ``rabbitmqctl set_topic_permissions`` line."""
        return shlex.join(["rabbitmqctl", "set_topic_permissions", "-p", vhost, user, self.exchange, self.write,
                           self.read])


@dataclass(frozen=True)
class CeleryEntities:
    """What a Celery worker of the app declares and uses: exact names, and regexes for names it makes up
    (a node's remote-control queue, a reply queue, an events queue)."""

    task_queues: tuple[str, ...]
    task_exchanges: tuple[str, ...]
    control_exchange: str  # ``<control_exchange>.pidbox``, fanout
    reply_exchange: str  # ``reply.<control_exchange>.pidbox``, direct
    event_exchange: str
    made_up_queues: tuple[str, ...]  # regexes: ``<node>.celery.pidbox`` (and replies), ``celeryev.<id>``

    @property
    def exchanges(self) -> tuple[str, ...]:
        """Every exchange, by name."""
        return (*self.task_exchanges, self.control_exchange, self.reply_exchange, self.event_exchange)


def celery_entities(app: Any) -> CeleryEntities:
    """Celery's own entities for ``app`` (its task queues, ``control_exchange``, ``event_exchange`` and
    ``event_queue_prefix`` settings)."""
    conf = app.conf
    queues = list(app.amqp.queues.values())
    namespace = conf.control_exchange
    return CeleryEntities(
        task_queues=tuple(sorted(q.name for q in queues)),
        task_exchanges=tuple(sorted({q.exchange.name for q in queues if q.exchange is not None and q.exchange.name})),
        control_exchange=f"{namespace}.pidbox", reply_exchange=f"reply.{namespace}.pidbox",
        event_exchange=conf.event_exchange,
        made_up_queues=(rf".+\.{re.escape(namespace)}\.pidbox", rf"{re.escape(conf.event_queue_prefix)}\..+"))


def pattern(exact: Iterable[str] = (), regexes: Iterable[str] = ()) -> str:
    """One anchored regex matching the names ``exact`` (escaped) and the unanchored ``regexes``; ``^$`` for none.

    Names are grouped by their first word (``^(billing\\.(audit|archive)|events)$``) so that the regex reads.
    """
    groups: dict[str, list[str | None]] = {}
    for name in sorted(set(exact)):
        head, dot, rest = name.partition(".")
        groups.setdefault(head, []).append(rest if dot else None)
    parts = [_group(head, rests) for head, rests in groups.items()] + list(regexes)
    return f"^({'|'.join(parts)})$" if parts else "^$"


def _group(head: str, rests: list[str | None]) -> str:
    tails = [re.escape(rest) for rest in rests if rest is not None]
    if not tails:
        return re.escape(head)
    tail = tails[0] if len(tails) == 1 else f"({'|'.join(tails)})"
    return re.escape(head) + (rf"(\.{tail})?" if None in rests else rf"\.{tail}")


def _published_to(topology: Topology) -> list[str]:
    """Every exchange of the topology a worker or publisher publishes to: all but the ones only the broker
    routes into (the due exchange of delayed publishing and its unrouted exchange, fed by dead-lettering)."""
    s = topology.settings
    broker_only = {names.deferred_exchange(s.exchange), names.unrouted_name(s.exchange)} \
        if s.publish_delay_levels else set()
    return [e.name for e in topology.exchanges if e.name not in broker_only]


def runtime_grant(topology: Topology, celery: CeleryEntities) -> Grant:
    """Workers with ``declare=False`` and publishers: configure on Celery's entities only; write on the exchanges
    they publish to (and the default exchange, for the schedules' state queues); read on the queues they consume
    (handlers, schedules' tokens, readers' lock queues) and read (schedules' states, readers' positions, the archive
    stream: the metrics count it; the logs' streams: readers and ``log status`` read them). The broker appends to a
    log itself: nobody writes to its stream."""
    consumed = [q.name for q in topology.queues
                if topology.role(q.name) in ("handler", "schedule", "state", "archive", "log", "reader")]
    written = _published_to(topology)
    if any(topology.role(q.name) in ("state", "reader") for q in topology.queues):
        written.append("amq.default")  # a schedule's state, a reader's position: written through the default exchange
    own = (*celery.task_queues, *celery.exchanges)
    return Grant(configure=pattern(own, celery.made_up_queues),
                 write=pattern([*written, *own], celery.made_up_queues),
                 read=pattern([*consumed, *own], celery.made_up_queues))


def deploy_grant(topology: Topology) -> Grant:
    """``kombu-events declare``: configure, write and read on every exchange and queue of the topology (declaring
    a binding needs write on its destination and read on its source; dead-lettering and alternate exchanges,
    write on their targets)."""
    every = pattern([*(e.name for e in topology.exchanges), *(q.name for q in topology.queues)])
    return Grant(every, every, every)


def topic_grant(topology: Topology) -> TopicGrant:
    """Topic permissions on the events exchange: where any are set, the runtime user needs write for every
    routing key it publishes (``.*``: narrow it to those keys)."""
    return TopicGrant(exchange=pattern([topology.settings.exchange]), write=".*", read="^$")
