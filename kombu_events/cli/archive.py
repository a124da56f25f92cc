"""The ``archive`` command group, for the messages whose handler gave up: ``list`` and ``show`` read them
(they stay in the archive), ``replay`` puts them back into their queue with the attempt counter reset
(confirmed, at-least-once; exit 1 when some stay archived) and ``purge`` deletes them for good (only with
``--yes``)."""
from __future__ import annotations

import json
import sys
from typing import Any, Callable

import click

from ..errors import KombuEventsError
from ..ops.archive import purge, read, replay
from .common import Context, examples, guarded


@click.group()
def archive() -> None:
    """Inspect, replay and purge archived messages."""


examples(archive,
         "kombu-events -A proj.events archive list --queue billing.audit",
         "kombu-events -A proj.events archive replay --queue billing.audit --dry-run")


def _matcher(queue: str | None, routing_key: str | None) -> Callable[[Any], bool]:
    return lambda m: (queue is None or m.queue == queue) and (routing_key is None or m.routing_key == routing_key)


@archive.command("list")
@click.option("--queue", help="Only messages that failed in this queue.")
@click.option("--routing-key", help="Only messages with this routing key.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@click.pass_obj
@guarded
def archive_list(obj: Context, queue: str | None, routing_key: str | None, limit: int, as_json: bool) -> None:
    """What is in the archive and why (messages stay in the archive)."""
    with obj.connection() as conn:
        found = read(conn, obj.events.topology(), _matcher(queue, routing_key), limit)
    for m in found:
        if as_json:
            click.echo(json.dumps(m.summary()))
        else:
            click.echo(f"{m.id}  {m.archived_at}  queue={m.queue} key={m.routing_key} "
                       f"attempts={m.attempts}  {m.reason}")
    if not as_json:
        click.echo(f"{len(found)} message(s) shown", err=True)


examples(archive_list,
         "kombu-events -A proj.events archive list",
         "kombu-events -A proj.events archive list --routing-key orders.7.created --json")


@archive.command("show")
@click.argument("message_id")
@click.pass_obj
@guarded
def archive_show(obj: Context, message_id: str) -> None:
    """Everything about one archived message (it stays in the archive)."""
    with obj.connection() as conn:
        found = read(conn, obj.events.topology(), lambda m: m.id == message_id, 1)
    if not found:
        raise KombuEventsError(f"no archived message with id {message_id!r}")
    click.echo(json.dumps(found[0].summary(), indent=2))


examples(archive_show,
         "kombu-events -A proj.events archive show 4fbcc4187f8e49a687d3721b2007dc15")


@archive.command("replay")
@click.option("--queue", help="Only messages that failed in this queue.")
@click.option("--routing-key", help="Only messages with this routing key.")
@click.option("--limit", type=click.IntRange(min=1), help="Replay at most this many.")
@click.option("--dry-run", is_flag=True, help="Show what would be replayed; change nothing.")
@click.pass_obj
@guarded
def archive_replay(obj: Context, queue: str | None, routing_key: str | None, limit: int | None,
                   dry_run: bool) -> None:
    """Put archived messages back into their queue, attempt counter reset (confirmed, at-least-once)."""
    match = _matcher(queue, routing_key)
    with obj.connection() as conn:
        if dry_run:
            for m in read(conn, obj.events.topology(), match, limit):
                click.echo(f"would replay {m.id} to {m.queue} (key {m.routing_key})")
            return
        replayed, kept = replay(conn, obj.events.topology(), match, limit)
    for m in replayed:
        click.echo(f"replayed {m.id} to {m.queue}")
    for m, why in kept:
        click.echo(f"kept {m.id} in the archive: {why}", err=True)
    click.echo(f"{len(replayed)} replayed, {len(kept)} kept", err=True)
    if kept:
        sys.exit(1)


examples(archive_replay,
         "kombu-events -A proj.events archive replay --queue billing.audit --dry-run   # what would go back",
         "kombu-events -A proj.events archive replay --queue billing.audit --limit 100")


@archive.command("purge")
@click.option("--queue", help="Only messages that failed in this queue.")
@click.option("--yes", is_flag=True, help="Really delete them.")
@click.pass_obj
@guarded
def archive_purge(obj: Context, queue: str | None, yes: bool) -> None:
    """Delete archived messages for good."""
    if not yes:
        raise click.UsageError("purge deletes archived messages for good: add --yes to confirm")
    with obj.connection() as conn:
        count = purge(conn, obj.events.topology(), _matcher(queue, None) if queue else None)
    click.echo(f"purged {count} message(s)")


examples(archive_purge,
         "kombu-events -A proj.events archive purge --queue billing.audit --yes")
