"""The commands that shape the service's topology on the broker: ``declare`` prints it (``--dry-run``, as text
or a Graphviz graph) or creates it, and ``migrate`` moves every queue of the service to quorum (or classic)
queues through holding queues, an earlier version's archive into the archive stream, or an ordered handler's
events to a new count of partitions, without losing a message."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import click
from kombu import Queue

from ..broker.declare import declare, require_plugins
from ..broker.partitions import check_partitions
from ..broker.version import QUORUM_QUEUES, require
from ..core import names
from ..core.logs import safe_url
from ..core.topology import Topology, build_topology
from ..ops import migrate, migrate_archive, repartition
from ..ops.dot import to_dot
from .common import Context, emit_json, examples, guarded, json_option


@click.command("declare")
@click.option("--dry-run", is_flag=True, help="Print every exchange, queue, argument and binding; do not connect.")
@click.option("--format", "fmt", type=click.Choice(["text", "dot"]), default="text", show_default=True,
              help="With --dry-run: one line per entity, or a Graphviz dot graph (render with `dot -Tsvg`).")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout instead: what was declared (JSON Schema: "
                   "kombu_events/cli/schemas/declare.json), with --dry-run the topology "
                   "(kombu_events/cli/schemas/declare-dry-run.json).")
@click.pass_obj
@guarded
def declare_topology(obj: Context, dry_run: bool, fmt: str, as_json: bool) -> None:
    """Create the service's topology (idempotent)."""
    if fmt == "dot" and not dry_run:
        raise click.UsageError("--format dot prints the topology without declaring it: add --dry-run")
    if fmt == "dot" and as_json:
        raise click.UsageError("--format dot and --json are two outputs: pick one")
    topology = obj.events.topology()
    if dry_run:
        if as_json:
            emit_json(topology_document(topology))
        elif fmt == "dot":
            click.echo(to_dot(topology), nl=False)
        else:
            for line in topology.describe():
                click.echo(line)
        return
    with obj.connection() as conn:
        if topology.settings.queue_type == "quorum":
            require(conn, *QUORUM_QUEUES)
        check_partitions(topology, conn)
        counts = declare(topology, conn)
    if as_json:
        emit_json({"service": topology.settings.service, "broker": safe_url(obj.url),
                   "declared": {key: counts[key] for key in ("exchanges", "queues", "bindings", "exchange_bindings")}})
        return
    click.echo(f"declared on {safe_url(obj.url)}: {counts['exchanges']} exchanges, {counts['queues']} queues, "
               f"{counts['bindings']} queue bindings, {counts['exchange_bindings']} exchange bindings")


examples(declare_topology,
         "kombu-events -A proj.events declare --dry-run   # print every exchange, queue and binding",
         "kombu-events -A proj.events declare --dry-run --format dot   # Graphviz: pipe it to dot -Tsvg",
         "kombu-events -A proj.events declare --dry-run --json          # the same as one JSON document",
         "kombu-events -A proj.events declare             # create them on the broker")


def topology_document(topology: Topology) -> dict[str, Any]:
    """``declare --dry-run --json``: every exchange, queue (with its role and bindings) and exchange binding,
    in the order ``declare --dry-run`` prints them."""
    settings = topology.settings
    return {
        "service": settings.service,
        "exchange": settings.exchange,
        "queue_type": settings.queue_type,
        "exchanges": [{"name": e.name, "type": e.type, "durable": bool(e.durable),
                       "arguments": _arguments(e, "arguments")} for e in topology.exchanges],
        "queues": [{"name": q.name, "role": topology.role(q.name), "durable": bool(q.durable),
                    "arguments": _arguments(q, "queue_arguments"),
                    # kombu keeps bindings in a set: sorted, as the text plan
                    "bindings": [{"exchange": b.exchange.name, "routing_key": b.routing_key or ""}
                                 for b in sorted(q.bindings, key=lambda b: (b.exchange.name, b.routing_key or ""))]}
                   for q in topology.queues],
        "exchange_bindings": [{"destination": eb.destination.name, "source": eb.source.name,
                               "routing_key": eb.routing_key} for eb in topology.exchange_bindings],
    }


def _arguments(entity: Any, attribute: str) -> dict[str, Any]:
    """An exchange's or queue's arguments, sorted by name (kombu leaves them None when there are none)."""
    return dict(sorted((getattr(entity, attribute, None) or {}).items()))


@click.command("migrate")
@click.option("--to", "to", type=click.Choice(["quorum", "classic"]),
              help="The queue type to move every queue of the service to (the archive stays a stream).")
@click.option("--archive", is_flag=True,
              help="Move the archive of an earlier version (a classic or quorum queue) into the archive stream, "
                   "every message with it; workers may run meanwhile.")
@click.option("--partitions", is_flag=True,
              help="Move the events waiting in each ordered handler's partitions to the app's count of partitions "
                   "(after a change of partitions=), each key's in order; workers stopped.")
@click.option("--dry-run", is_flag=True, help="Print what each queue holds and every step; change nothing.")
@json_option("migrate", note=", each step's progress on stderr")
@click.pass_obj
@guarded
def migrate_queues(obj: Context, to: str | None, archive: bool, partitions: bool, dry_run: bool,
                   as_json: bool) -> None:
    """Move the service's queues to quorum (or classic) queues, its archive of an earlier version to a
    stream, or its ordered handlers' events to a new count of partitions, without losing a message.

    With --to and --partitions, stop the service's workers first: a queue with a consumer is refused.
    A run that stopped anywhere is finished by running the command again.
    """
    if [bool(to), archive, partitions].count(True) != 1:
        raise click.UsageError("give one of --to quorum|classic (the service's queues), --archive (its archive) "
                               "or --partitions (its ordered handlers' partitions)")
    if archive or partitions:
        if as_json:
            raise click.UsageError(f"--{'archive' if archive else 'partitions'} prints text only (no JSON document "
                                   "yet)")
        (_migrate_archive if archive else _migrate_partitions)(obj, dry_run)
        return
    assert to is not None
    _migrate_queue_type(obj, to, dry_run, as_json)


def _migrate_queue_type(obj: Context, to: str, dry_run: bool, as_json: bool) -> None:
    """``migrate --to``: what each queue holds, the steps, and the count of the move (``--json``: one document)."""
    events = obj.events
    topology = build_topology(dataclasses.replace(events.settings, queue_type=to), events.handlers,
                              events.schedules)
    # The exchange's delayed-publishing ladder is every service's: it keeps its type (docs/rabbitmq-versions.md).
    # The archive is a stream whatever the type: `migrate --archive` moves an earlier version's.
    queues = [q for q in topology.queues if not topology.shared(q.name) and topology.role(q.name) != "archive"]
    say = (lambda line: None) if as_json else click.echo  # the JSON document holds the same
    total: int | None = None
    with obj.connection() as conn:
        states = migrate.observe(conn, queues)
        steps = migrate.migration_steps(queues, states)
        if not steps:
            total = None if dry_run else 0
            say(f"every queue of service {events.service} is already declared as {to}: nothing to do")
        else:
            _say_queue_states(say, queues, states)
            if dry_run:
                say(f"dry run: {len(steps)} step(s) would run:")
                for step in steps:
                    say(f"  {step.describe()}")
            else:
                for exchange in topology.exchanges:  # what the queues bind to (idempotent)
                    exchange.bind(conn.default_channel).declare()
                progress = (lambda line: click.echo(line, err=True)) if as_json else click.echo
                moved = migrate.execute(conn, queues, steps, report=progress)
                total = sum(n for name, n in moved.items() if not name.endswith(migrate.SUFFIX))
                say(f"migrated service {events.service} to {to} queues: {total} message(s) moved "
                    f"through holding queues, none left behind")
    if as_json:
        emit_json({"service": events.service, "to": to, "dry_run": dry_run,
                   "declared_queue_type": events.settings.queue_type,
                   "queues": [_queue_entry(states, q.name) for q in queues],
                   "steps": [{"action": st.action, "queue": st.queue, "source": st.source or None,
                              "messages": st.messages, "description": st.describe()} for st in steps],
                   "moved": total})
    if events.settings.queue_type != to:
        click.echo(f"warning: the app declares queue_type={events.settings.queue_type!r}: set "
                   f"queue_type={to!r} before starting its workers, or they cannot declare these queues", err=True)


def _say_queue_states(say: Callable[[str], Any], queues: Iterable[Queue],
                      states: dict[str, migrate.QueueState]) -> None:
    """``migrate --to``: each queue with messages to move, and each holding queue left by an unfinished run."""
    for queue in queues:
        state, holding = states[queue.name], states[migrate.holding_name(queue.name)]
        if state.exists and not state.matches:
            say(f"{queue.name}: {state.messages} message(s), to move ({state.why})")
        if holding.exists:
            say(f"{holding.name}: {holding.messages} message(s) from an unfinished run")


def _queue_entry(states: dict[str, migrate.QueueState], name: str) -> dict[str, Any]:
    """One queue in ``migrate --json``: what it held, and its holding queue, before the run."""
    state, holding = states[name], states[migrate.holding_name(name)]
    return {"queue": name, "exists": state.exists, "matches": state.matches, "messages": state.messages,
            "why": state.why or None, "holding_queue": holding.name,
            "holding_messages": holding.messages if holding.exists else None}


def _migrate_partitions(obj: Context, dry_run: bool) -> None:
    """``migrate --partitions``: each ordered handler's partitions on the broker, the steps, the counts."""
    events = obj.events
    topology = events.topology()
    sets = topology.partition_sets()
    if not sets:
        click.echo(f"service {events.service} has no ordered handler (ordered_by=): nothing to do")
        return
    with obj.connection() as conn:
        require_plugins(topology, conn)
        for partitions in sets:
            observed = repartition.observe(conn, partitions)
            steps = repartition.repartition_steps(observed)
            found = f"{len(observed.existing)} partition queue(s) on the broker, {observed.waiting} event(s) waiting"
            if observed.holding is not None:
                holding = names.holding_partitions(partitions.queue)
                found += f", {observed.holding.messages} in {holding} from an unfinished run"
            click.echo(f"{partitions.queue}: {found}; the app declares {len(partitions.queues)}")
            if not steps:
                click.echo("  nothing to do")
                continue
            if dry_run:
                _say_steps(steps, indent="  ")
                continue
            for exchange in topology.exchanges:  # what the partitions and the holding queue bind to (idempotent)
                exchange.bind(conn.default_channel).declare()
            moved = repartition.execute(conn, topology, partitions, steps, report=lambda line: click.echo(f"  {line}"))
            _say_moved(partitions.queue, len(partitions.queues), moved)


def _say_moved(queue: str, count: int, moved: dict[str, int]) -> None:
    """``migrate --partitions``: the counts of one handler's move, its mismatches, and the bridge left."""
    click.echo(f"moved {queue} to {count} partitions: {moved['partitions']} event(s) from the partitions, "
               f"{moved['held']} published meanwhile, {moved['switch']} in the instant of the switch (these may run "
               f"after a later event of their key), {moved['late']} sent to a queue being deleted, "
               f"{moved['returns']} retry(ies) back from the ladder for a dropped partition")
    click.echo(f"counted {moved['counted']} event(s) waiting in the partitions, staged {moved['staged']}; "
               f"{moved['staging']} staged in all, sent {moved['partitions']} to the new partitions")
    for line in repartition.reconcile(moved):
        click.echo(line, err=True)
    if moved["bridge"]:
        click.echo(f"{repartition.returns_queue(queue)} stays (retries in the ladder may still come back to a "
                   "dropped partition): the workers may start; run `kombu-events migrate --partitions` again once "
                   "the retry ladder is empty", err=True)


def _say_steps(steps: Iterable[Any], indent: str = "") -> None:
    """A dry run's steps, one line each, under a line that counts them."""
    steps = list(steps)
    click.echo(f"{indent}dry run: {len(steps)} step(s) would run:")
    for step in steps:
        click.echo(f"{indent}  {step.describe()}")


def _migrate_archive(obj: Context, dry_run: bool) -> None:
    """``migrate --archive``: the archive's state, the steps, and the counts of the move."""
    topology = obj.events.topology()
    name = topology.archive_exchange
    with obj.connection() as conn:
        state = migrate_archive.observe_archive(conn, name)
        steps = migrate_archive.archive_steps(name, state)
        if state.kind == "queue":
            click.echo(f"{name}: a queue of an earlier kombu-events version, {state.messages} message(s), to move "
                       "into a stream")
        if state.holding.exists:
            click.echo(f"{state.holding.name}: {state.holding.messages} message(s) from an unfinished run")
        if not steps:
            click.echo(f"the archive {name} is already a stream: nothing to do" if state.kind == "stream" else
                       f"the archive {name} does not exist: `kombu-events declare` makes it a stream")
            return
        if dry_run:
            _say_steps(steps)
            return
        for exchange in topology.exchanges:  # the archive exchange, at least (idempotent)
            exchange.bind(conn.default_channel).declare()
        counts = migrate_archive.move_archive(conn, topology, steps, report=click.echo)
    click.echo(f"moved the archive {name} to a stream: {counts['verified']} of {counts['taken']} message(s) found "
               f"in the stream ({counts['old_queue']} from the old archive queue, {counts['copied']} copied, "
               f"{counts['duplicates']} already there and not copied again)")
    if counts["verified"] != counts["taken"]:
        raise click.ClickException(f"{counts['taken'] - counts['verified']} message(s) taken from the holding "
                                   "queue are not in the stream: did its retention (archive_max_bytes) drop its "
                                   "oldest segments? The copies were confirmed by the broker")


examples(migrate_queues,
         "kombu-events -A proj.events migrate --to quorum --dry-run   # what each queue holds, every step",
         "kombu-events -A proj.events migrate --to quorum             # workers stopped; then set queue_type",
         "kombu-events -A proj.events migrate --archive               # an earlier version's archive to a stream",
         "kombu-events -A proj.events migrate --partitions            # workers stopped, after partitions= changed")
