"""``kombu-events migrate --to quorum|classic``: move a service's queues to the other type, losing nothing.

A queue's type cannot change in place. For each queue ``Q`` of the service whose
declaration differs from the target one, the messages go through a holding queue
``Q.migrating`` that takes ``Q``'s bindings meanwhile:

1. declare ``Q.migrating`` (plain, durable, of the target type) and bind it as ``Q`` is bound;
2. unbind ``Q``: from now on new messages reach ``Q.migrating``;
3. move every message ``Q`` -> ``Q.migrating``; delete ``Q`` once empty;
4. declare ``Q`` anew (the target type and arguments) and bind it;
5. unbind ``Q.migrating``; move its messages back; delete it once empty.

A move republishes each message (same body, properties and headers) with publisher
confirms and acks the original only once the copy is confirmed: a crash duplicates at
most the messages in flight and never loses one. Every step is decided from what the
broker holds, so a run that died anywhere is finished by running the command again.

:func:`migration_steps` is pure: it turns the queues' states into the steps; :func:`observe`
reads the states and :func:`execute` carries the steps out.

``kombu-events migrate --archive`` moves an earlier version's archive queue into a stream the same
way: :mod:`kombu_events.ops.migrate_archive`.
"""
from __future__ import annotations

__all__ = ["QueueState", "MigrationStep", "migration_steps", "observe", "execute", "holding_name", "MigrationError",
           "move", "transfer"]

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from amqp import Message
from amqp.exceptions import PreconditionFailed
from kombu import Queue

from ..broker.confirms import Confirmer
from ..broker.declare import QueueCounts, close_quietly, peek_queues, queue_counts
from ..core.wire import _PROPERTIES, DELIVERY_COUNT, as_sent
from ..errors import KombuEventsError

logger = logging.getLogger(__name__)

SUFFIX = ".migrating"
_DELETE_TRIES = 5  # move-then-delete rounds before giving up on a queue that keeps filling


class MigrationError(KombuEventsError):
    """The migration cannot start or go on (consumers attached, a refused publish...): nothing was lost."""


def holding_name(queue: str) -> str:
    """The queue that holds ``queue``'s messages while it is declared anew."""
    return queue + SUFFIX


@dataclass(frozen=True)
class QueueState:
    """What the broker holds under one name: ``exists``; ``matches`` the target declaration; counts."""

    name: str
    exists: bool
    matches: bool = False
    messages: int = 0
    consumers: int = 0
    why: str = ""  # the broker's reason when it does not match


@dataclass(frozen=True)
class MigrationStep:
    """One action on the broker: ``action`` on ``queue`` (``source`` for a move)."""

    action: str  # declare-holding | bind | unbind | move | delete | declare | declare-stream | fill (the archive)
    queue: str
    source: str = ""
    messages: int = 0

    def describe(self) -> str:
        """One line for the operator."""
        if self.action == "move":
            return f"move {self.source} -> {self.queue}: {self.messages} message(s) (each confirmed, then acked)"
        if self.action == "declare-holding":
            return f"declare {self.queue} (holds the messages meanwhile)"
        if self.action == "declare":
            return f"declare {self.queue} with the target type and arguments"
        if self.action == "delete":
            return f"delete {self.queue} once empty"
        if self.action == "declare-stream":
            return f"declare {self.queue} as a stream (the topology's arguments)"
        if self.action == "fill":
            return (f"copy {self.source} -> {self.queue}: {self.messages} message(s) (each keyed, confirmed, then "
                    f"acked), bind {self.queue}, unbind {self.source}, copy what came meanwhile")
        return f"{self.action} {self.queue}"


def migration_steps(queues: Sequence[Queue], states: Mapping[str, QueueState]) -> list[MigrationStep]:
    """The steps that bring every queue of ``queues`` (target declarations) to its target.

    ``states`` has each queue's state and its holding queue's (by name). Raises
    MigrationError, before any step, when a queue or holding queue has consumers.
    """
    busy = [s for q in queues for s in (states[q.name], states[holding_name(q.name)])
            if s.exists and s.consumers]
    if busy:
        names = ", ".join(f"{s.name} ({s.consumers})" for s in busy)
        raise MigrationError(f"consumers are attached to {names}: stop the service's workers first "
                             "(nothing was changed)")
    steps: list[MigrationStep] = []
    for queue in queues:
        steps += _queue_steps(queue.name, states[queue.name], states[holding_name(queue.name)])
    return steps


def _queue_steps(name: str, current: QueueState, holding: QueueState) -> list[MigrationStep]:
    hold = holding_name(name)
    stage_one = current.exists and not current.matches
    if not stage_one and current.exists and not holding.exists:
        return []  # done, or never needed
    steps: list[MigrationStep] = []
    if stage_one:  # empty the old queue into the holding queue, which takes its bindings
        if not holding.exists:
            steps.append(MigrationStep("declare-holding", hold))
        steps += [MigrationStep("bind", hold), MigrationStep("unbind", name),
                  MigrationStep("move", hold, source=name, messages=current.messages), MigrationStep("delete", name)]
    steps += [MigrationStep("declare", name), MigrationStep("bind", name)]
    if stage_one or holding.exists:  # back from the holding queue
        back = holding.messages + (current.messages if stage_one else 0)
        steps += [MigrationStep("unbind", hold), MigrationStep("move", name, source=hold, messages=back),
                  MigrationStep("delete", hold)]
    return steps


def observe(connection: Any, queues: Iterable[Queue]) -> dict[str, QueueState]:
    """Each queue's and its holding queue's state, read with passive declares.

    Whether an existing queue matches its target declaration is learnt by declaring it
    so (an equivalent declare changes nothing); a refusal (406) says it does not.
    """
    targets = list(queues)
    counts = peek_queues(connection, [name for q in targets for name in (q.name, holding_name(q.name))])
    states: dict[str, QueueState] = {}
    for queue in targets:
        states[queue.name] = observed_state(connection, queue.name, counts[queue.name], queue)
        hold = holding_name(queue.name)
        states[hold] = observed_state(connection, hold, counts[hold], None)
    return states


def observed_state(connection: Any, name: str, counts: QueueCounts | None, target: Queue | None) -> QueueState:
    if counts is None:
        return QueueState(name, exists=False)
    messages, consumers = counts
    if target is None:
        return QueueState(name, exists=True, messages=messages, consumers=consumers)
    channel = connection.channel()
    try:
        target.bind(channel).queue_declare()
    except PreconditionFailed as exc:
        return QueueState(name, exists=True, matches=False, messages=messages, consumers=consumers,
                          why=str(getattr(exc, "reply_text", "") or exc))
    finally:
        close_quietly(channel)
    return QueueState(name, exists=True, matches=True, messages=messages, consumers=consumers)


def holding_queue(queue: Queue) -> Queue:
    """``queue``'s holding queue: durable, of the same type, no TTL, no dead-lettering, no limits."""
    queue_type = (getattr(queue, "queue_arguments", None) or {}).get("x-queue-type", "classic")
    return Queue(holding_name(queue.name), durable=True, queue_arguments={"x-queue-type": queue_type})


def execute(connection: Any, queues: Sequence[Queue], steps: Sequence[MigrationStep],
            report: Callable[[str], Any] = logger.info) -> dict[str, int]:
    """Carry ``steps`` out for ``queues`` (target declarations); messages moved per queue.

    ``report`` is told each step before it runs and each move's count after it.
    """
    by_name = {q.name: q for q in queues}
    by_name.update({holding_name(q.name): q for q in queues})  # a holding queue takes its queue's bindings
    moved: dict[str, int] = {}
    for step in steps:
        report(step.describe())
        if step.action == "move":
            count = move(connection, step.source, step.queue)
            moved[step.source] = moved.get(step.source, 0) + count
            report(f"  moved {count} message(s)")
        elif step.action == "delete":
            moved[step.queue] = moved.get(step.queue, 0) + delete_when_empty(connection, step.queue, report)
        else:
            channel = connection.channel()
            try:
                _declare_or_bind(channel, step, by_name[step.queue])
            finally:
                close_quietly(channel)
    return moved


def _declare_or_bind(channel: Any, step: MigrationStep, queue: Queue) -> None:
    """A declare, bind or unbind step; ``queue`` is the target declaration it follows."""
    if step.action == "declare-holding":
        holding_queue(queue).bind(channel).queue_declare()
    elif step.action == "declare":
        queue.bind(channel).queue_declare()
    else:
        _bindings(channel, step.queue, queue, bind=step.action == "bind")


def _bindings(channel: Any, name: str, queue: Queue, *, bind: bool) -> None:
    for b in queue.bindings:
        if bind:
            channel.queue_bind(name, exchange=b.exchange.name, routing_key=b.routing_key)
        else:  # unbinding what is not bound is no error
            channel.queue_unbind(name, exchange=b.exchange.name, routing_key=b.routing_key)


def delete_when_empty(connection: Any, name: str, report: Callable[[str], Any], target: str | None = None,
                       copy: Copy | None = None) -> int:
    """Delete ``name`` if empty; messages that came in meanwhile go to ``target`` (by default its
    counterpart) first, through ``copy``."""
    moved = 0
    if target is None:
        target = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else holding_name(name)
    for _ in range(_DELETE_TRIES):
        channel = connection.channel()
        try:
            ready, consumers = queue_counts(channel, name)
            if not ready and not consumers:
                # Quorum queues refuse if_empty: the count just read stands in for it. The queue is
                # unbound, so only a publish to it by name could come in between: then say so.
                deleted = channel.queue_delete(name)
                if deleted:
                    raise MigrationError(f"{deleted} message(s) were published to {name} by name while it was "
                                         "being deleted, and went with it: stop whatever publishes to it by name")
                return moved
        finally:
            close_quietly(channel)
        count = move(connection, name, target, copy=copy)
        moved += count
        report(f"  {count} more message(s) arrived in {name}: moved to {target}")
    raise MigrationError(f"queue {name} keeps receiving messages: is something publishing to it by name? "
                         "Run the command again once it stops (nothing was lost)")


#: What a move sends for a message taken from the source: (body, properties), or None to drop it (acked).
Copy = Callable[[Any], "tuple[bytes, dict[str, Any]] | None"]


def move(connection: Any, source: str, target: str, batch: int = 200, *, copy: Copy | None = None) -> int:
    """Move every message now in ``source`` to ``target`` (default exchange, confirmed, then acked); how many.

    ``copy`` makes each copy (default: the same body and properties, see :func:`copy_properties`).
    """
    return transfer(connection, source, lambda message: ("", target), batch=batch, copy=copy, to=target)


#: Where a message taken from a queue is sent: (exchange, routing key).
Address = Callable[[Any], "tuple[str, str]"]


def transfer(connection: Any, source: str, address: Address, *, to: str, batch: int = 200,
             copy: Copy | None = None, until: Callable[[], bool] | None = None) -> int:
    """Send every message of ``source`` to ``address(message)``, mandatory and confirmed, and ack it once its
    copy is confirmed, until ``source`` is empty (or ``until()`` says stop, checked between batches); how
    many moved. ``to`` names where they go, for the error."""
    channel = connection.channel()
    channel.auto_decode = False  # bodies as they are
    confirmer = Confirmer(channel)
    userid = getattr(connection, "userid", None)
    make = copy or (lambda message: (message.body, copy_properties(message.properties, userid)))
    failures: list[str] = []
    moved = 0
    try:
        while not failures and not (until is not None and until()):
            got = taken = 0
            while got < batch:
                message = channel.basic_get(source, no_ack=False)
                if message is None:
                    break
                got += 1
                made = make(message)
                if made is None:
                    channel.basic_ack(message.delivery_tag)
                    continue
                taken += 1
                confirmer.publish(Message(made[0], **made[1]), *address(message),
                                  on_ok=_acker(channel, message.delivery_tag), on_fail=failures.append)
            while confirmer.pending:
                connection.drain_events(timeout=30)
            moved += taken - len(failures)
            if not got:
                break
    finally:
        close_quietly(channel)  # what was not acked goes back to ``source``
    if failures:
        raise MigrationError(f"moving {source} -> {to}: the broker refused a copy "
                             f"({failures[0]}); its original stays in place: run the command again")
    return moved


def _acker(channel: Any, delivery_tag: int) -> Callable[[], None]:
    """Ack the original once its copy is confirmed."""
    return lambda: channel.basic_ack(delivery_tag)


def copy_properties(properties: Mapping[str, Any], userid: str | None) -> dict[str, Any]:
    """The properties of a moved copy: the same, less what the broker set or would refuse.

    ``x-delivery-count`` (a quorum queue's) goes, and so does a ``user_id`` of another
    user; ``expiration`` stays. Text that arrived as invalid UTF-8 goes back as its bytes.
    """
    new = {name: as_sent(properties[name]) for name in (*_PROPERTIES, "expiration")
           if properties.get(name) is not None}
    if new.get("user_id") not in (None, userid):
        del new["user_id"]
    headers = dict(properties.get("application_headers") or {})
    headers.pop(DELIVERY_COUNT, None)
    new["application_headers"] = {key: as_sent(value) for key, value in headers.items()}
    return new
