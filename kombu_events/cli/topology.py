"""The commands that shape the service's topology on the broker: ``declare`` prints it (``--dry-run``, as text
or a Graphviz graph) or creates it, and ``migrate`` moves every queue of the service to quorum (or classic)
queues through holding queues, without losing a message."""
from __future__ import annotations

import dataclasses

import click

from ..broker.declare import declare
from ..core.logs import safe_url
from ..core.topology import build_topology
from ..ops import migrate
from ..ops.dot import to_dot
from .common import Context, examples, guarded


@click.command("declare")
@click.option("--dry-run", is_flag=True, help="Print every exchange, queue, argument and binding; do not connect.")
@click.option("--format", "fmt", type=click.Choice(["text", "dot"]), default="text", show_default=True,
              help="With --dry-run: one line per entity, or a Graphviz dot graph (render with `dot -Tsvg`).")
@click.pass_obj
@guarded
def declare_topology(obj: Context, dry_run: bool, fmt: str) -> None:
    """Create the service's topology (idempotent)."""
    if fmt == "dot" and not dry_run:
        raise click.UsageError("--format dot prints the topology without declaring it: add --dry-run")
    topology = obj.events.topology()
    if dry_run:
        if fmt == "dot":
            click.echo(to_dot(topology), nl=False)
            return
        for line in topology.describe():
            click.echo(line)
        return
    with obj.connection() as conn:
        counts = declare(topology, conn)
    click.echo(f"declared on {safe_url(obj.url)}: {counts['exchanges']} exchanges, {counts['queues']} queues, "
               f"{counts['bindings']} queue bindings, {counts['exchange_bindings']} exchange bindings")


examples(declare_topology,
         "kombu-events -A proj.events declare --dry-run   # print every exchange, queue and binding",
         "kombu-events -A proj.events declare --dry-run --format dot   # Graphviz: pipe it to dot -Tsvg",
         "kombu-events -A proj.events declare             # create them on the broker")


@click.command("migrate")
@click.option("--to", "to", type=click.Choice(["quorum", "classic"]), required=True,
              help="The queue type to move every queue of the service to.")
@click.option("--dry-run", is_flag=True, help="Print what each queue holds and every step; change nothing.")
@click.pass_obj
@guarded
def migrate_queues(obj: Context, to: str, dry_run: bool) -> None:
    """Move the service's queues to quorum (or classic) queues without losing a message.

    Stop the service's workers first: a queue with a consumer is refused. A run that
    stopped anywhere is finished by running the command again.
    """
    events = obj.events
    topology = build_topology(dataclasses.replace(events.settings, queue_type=to), events.handlers,
                              events.schedules)
    queues = list(topology.queues)
    with obj.connection() as conn:
        states = migrate.observe(conn, queues)
        steps = migrate.migration_steps(queues, states)
        if not steps:
            click.echo(f"every queue of service {events.service} is already declared as {to}: nothing to do")
        else:
            for queue in queues:
                state, holding = states[queue.name], states[migrate.holding_name(queue.name)]
                if state.exists and not state.matches:
                    click.echo(f"{queue.name}: {state.messages} message(s), to move ({state.why})")
                if holding.exists:
                    click.echo(f"{holding.name}: {holding.messages} message(s) from an unfinished run")
            if dry_run:
                click.echo(f"dry run: {len(steps)} step(s) would run:")
                for step in steps:
                    click.echo(f"  {step.describe()}")
            else:
                for exchange in topology.exchanges:  # what the queues bind to (idempotent)
                    exchange.bind(conn.default_channel).declare()
                moved = migrate.execute(conn, queues, steps, report=click.echo)
                total = sum(n for name, n in moved.items() if not name.endswith(migrate.SUFFIX))
                click.echo(f"migrated service {events.service} to {to} queues: {total} message(s) moved "
                           f"through holding queues, none left behind")
    if events.settings.queue_type != to:
        click.echo(f"warning: the app declares queue_type={events.settings.queue_type!r}: set "
                   f"queue_type={to!r} before starting its workers, or they cannot declare these queues", err=True)


examples(migrate_queues,
         "kombu-events -A proj.events migrate --to quorum --dry-run   # what each queue holds, every step",
         "kombu-events -A proj.events migrate --to quorum             # workers stopped; then set queue_type")
