"""The ``log`` commands, over the service's logs of events (``events.log(...)``, docs/logs.md): ``log status``
prints each log's binding keys, retention, first and last offset and their times, read from the broker
without changing anything."""
from __future__ import annotations

from typing import Any

import click

from ..core.config import MANAGEMENT_URL_ENV, check_management_url, management_base_url
from ..core.logs import safe_url
from ..ops.log_rewind import plan_rewind, rewind
from ..ops.log_status import LogStatus, Position, gather_logs
from .common import Context, emit_json, examples, guarded, json_option


@click.group("log")
def log() -> None:
    """The service's logs of events: RabbitMQ streams that keep every event of their keys (docs/logs.md)."""


@log.command("status")
@json_option("log-status", "a JSON array on stdout instead, one object per log")
@click.option("--management-url", help="RabbitMQ management API (default: the management_url setting, "
                                        f"{MANAGEMENT_URL_ENV}, else http://<broker host>:15672).")
@click.pass_obj
@guarded
def log_status(obj: Context, as_json: bool, management_url: str | None) -> None:
    """Each log: its binding keys and retention, the messages it holds, its first and last offset and their times.

    Read from the stream without changing it. A time is the message's timestamp property
    (kombu-events sets it; another publisher may not: then it is unknown).
    """
    if management_url is not None:
        check_management_url(management_url, setting="--management-url")
    topology = obj.events.topology()
    with obj.connection() as conn:
        rows = gather_logs(conn, topology, management_url)
        asked = management_base_url(management_url or topology.settings.management_url, conn.hostname)
    if as_json:
        emit_json([row.as_dict() for row in rows])
    else:
        _print(obj.events.service, rows)
    for row in rows:
        if not row.exists:
            click.echo(f"WARNING: the stream {row.queue} of log {row.name} does not exist: run `kombu-events "
                       "declare` or start a worker", err=True)
    if rows and not any(row.management for row in rows):
        click.echo(f"NOTE: no management API answered at {safe_url(asked)}: segments unknown (name it with "
                   f"--management-url or {MANAGEMENT_URL_ENV})", err=True)


def _print(service: str, rows: list[LogStatus]) -> None:
    if not rows:
        click.echo(f"service {service} declares no log (events.log(...), docs/logs.md)")
    for row in rows:
        retention = " and ".join(filter(None, [f"max-age {row.max_age}" if row.max_age else "",
                                               f"max {row.max_bytes} bytes" if row.max_bytes else ""]))
        click.echo(f"log {row.name}: stream {row.queue}, keys {', '.join(row.binding_keys)}")
        click.echo(f"  retention: {retention}, segments of {row.segment_bytes} bytes"
                   + (f" ({row.segments} on disk)" if row.segments is not None else ""))
        if not row.exists:
            click.echo("  missing on the broker")
            continue
        click.echo(f"  messages: {row.messages}" + (f", consumers: {row.consumers}" if row.consumers else ""))
        for label, position in (("first", row.first), ("last", row.last)):
            click.echo(f"  {label}: {_where(position)}")
        for r in row.readers:
            where = "no position yet" if r.position is None else f"position {r.position}, lag {r.lag}"
            if r.position is not None and row.first is not None and r.position < row.first.offset:
                where += f" (the log now starts at offset {row.first.offset}: any event before it was removed unread)"
            holder = {True: "read by a worker", False: "no worker reading", None: "its queue is missing"}[r.reading]
            waiting = f", {r.rewinds_waiting} rewind(s) waiting" if r.rewinds_waiting else ""
            click.echo(f"  reader {r.name}: {where}; {holder}{waiting}")


def _where(position: Position | None) -> Any:
    if position is None:
        return "- (empty)"
    return f"offset {position.offset}, at {position.timestamp or 'unknown time (no timestamp property)'}"


@log.command("rewind")
@click.argument("reader")
@click.option("--to", "to", required=True, metavar="OFFSET|TIME",
              help="An offset of the log, or an ISO 8601 time (UTC unless it says): the first event at or after it.")
@click.option("--dry-run", is_flag=True, help="Say what the rewind would run again; send nothing.")
@click.option("--yes", is_flag=True, help="Really rewind.")
@json_option("log-rewind", "one JSON object on stdout instead")
@click.pass_obj
@guarded
def log_rewind(obj: Context, reader: str, to: str, dry_run: bool, yes: bool, as_json: bool) -> None:
    """Make READER go on from an offset or a time: the events from there run again, in order.

    The request waits in the reader's queue for the worker that reads it (or the next one to start), which
    writes its new position and says so in its log. Counted: the events already read that run again.
    """
    if not (yes or dry_run):
        raise click.UsageError("rewind runs events again: add --yes to confirm (or --dry-run to see how many)")
    topology = obj.events.topology()
    with obj.connection() as conn:
        plan = plan_rewind(conn, topology, reader, to)
        if not dry_run:
            rewind(conn, topology, plan)
    if as_json:
        emit_json({**plan.as_dict(), "dry_run": dry_run})
        return
    where = "no position yet" if plan.position is None else f"at offset {plan.position}"
    verb = "would rewind" if dry_run else "rewound"
    click.echo(f"reader {plan.reader} ({where}) {verb} to offset {plan.offset} of log {plan.log}: "
               f"{plan.again} event(s) already read run again; {plan.to_run} event(s) from there to the last")
    if not dry_run:
        click.echo("the worker reading it takes the request (or the next one to start); its log says when",
                   err=True)


examples(log_rewind,
         "kombu-events -A proj.events log rewind projector --to 5000 --dry-run",
         "kombu-events -A proj.events log rewind projector --to 2026-11-29T10:00:00Z --yes")
examples(log_status,
         "kombu-events -A proj.events log status            # each log: keys, retention, first and last offset",
         "kombu-events -A proj.events log status --json     # one JSON array, one object per log")
examples(log, "kombu-events -A proj.events log status",
         "kombu-events -A proj.events log rewind projector --to 5000 --yes")
