"""The commands that look at a running service and change nothing: ``status`` (the broker's version, then
ready/unacked messages and consumers of every queue, delay level and the archive; exit 2 past ``--max-archive``),
``health`` (exit 2 and one line per problem, for a readiness probe or an alert; exit 1 when the broker cannot be
reached) and ``schedules`` (each periodic schedule's period, last run and next due time, read from its state
queue on the broker)."""
from __future__ import annotations

from typing import Any

import click
from amqp.exceptions import NotFound
from kombu import Connection

from ..broker.version import broker_name, describe, reported_version
from ..core.config import MANAGEMENT_URL_ENV, check_management_url, management_base_url
from ..core.logs import safe_text, safe_url
from ..core.schedule import summary
from ..errors import BrokerUnavailableError
from ..ops.health import missing_exchanges, problems, reader_problems
from ..ops.log_status import readers_of
from ..ops.status import PAUSED, gather
from ..periodic.tokens import now_ms, peek_state
from .common import Context, emit_json, examples, failed, guarded, json_option, over_threshold

#: Every key of a ``schedules --json`` row, null when it does not apply (a schedule that never ran).
SCHEDULE_KEYS = ("schedule", "every_s", "catch_up", "queue", "last_run", "last_due", "next", "next_due", "ran_at",
                 "outcome", "duration_ms", "note")


def _management_url_option(fn: Any) -> Any:
    """``--management-url`` of ``status`` and ``health`` (the console has one too), checked by :func:`_checked`."""
    return click.option("--management-url", help="RabbitMQ management API (default: the management_url setting, "
                                                  f"{MANAGEMENT_URL_ENV}, else http://<broker host>:15672).")(fn)


def _checked(management_url: str | None) -> str | None:
    """``--management-url`` as given, refused (one line, no credential shown) before anything connects."""
    if management_url is not None:
        check_management_url(management_url, setting="--management-url")
    return management_url


@click.command()
@json_option("status", "a JSON array on stdout instead, one object per queue")
@click.option("--max-archive", type=click.IntRange(min=0), help="Exit 2 when the archive holds more messages.")
@_management_url_option
@click.pass_obj
@guarded
def status(obj: Context, as_json: bool, max_archive: int | None, management_url: str | None) -> None:
    """The broker's version, then ready/unacked messages and consumers of every queue, delay level and the archive.

    A handler queue with no consumer shows as PAUSED: its circuit breaker is open, or no worker runs.
    """
    management_url = _checked(management_url)
    with obj.connection() as conn:
        rows = gather(conn, obj.events.topology(), management_url)
        broker, version = describe(conn), reported_version(conn)
        guessed = management_base_url(None, conn.hostname) \
            if management_url is None and obj.events.settings.management_url is None else None
    if as_json:
        emit_json([{**r.as_dict(), "broker_version": version} for r in rows])
    else:
        click.echo(f"broker: {broker}")
        click.echo(f"{'queue':<48} {'role':<8} {'ready':>8} {'unacked':>8} {'consumers':>9}  state")
        for r in rows:
            cells = ["-" if v is None else str(v) for v in (r.ready, r.unacked, r.consumers)]
            name = r.queue if r.exists else f"{r.queue} (missing)"
            state = "PAUSED (no consumer)" if r.state == PAUSED else (r.state or "")
            state += f" (active: {r.holder})" if r.holder else ""
            click.echo(f"{name:<48} {r.role:<8} {cells[0]:>8} {cells[1]:>8} {cells[2]:>9}  {state}".rstrip())
    for r in rows:
        if r.state == PAUSED:
            click.echo(f"WARNING: handler queue {r.queue} has no consumer: paused (its circuit breaker is open) "
                       f"or no worker consumes it; {r.ready} message(s) wait in it", err=True)
        if r.role == "unrouted" and r.ready:
            click.echo(f"WARNING: {r.ready} delayed event(s) came due with no queue bound for their key: "
                       f"they wait in {r.queue}", err=True)
    if guessed is not None:
        answered = any(r.unacked is not None for r in rows if r.role != "archive")  # a stream's 0 is not asked
        click.echo(_guess(safe_url(guessed), answered=answered), err=True)
    archived = next((r.ready or 0) for r in rows if r.role == "archive")
    if max_archive is not None and archived > max_archive:
        over_threshold(f"ALERT: archive holds {archived} messages (more than --max-archive {max_archive})")


def _guess(url: str, *, answered: bool) -> str:
    """The one line ``status`` adds when nothing named the management API and it asked the broker's host."""
    name = f"name it with --management-url or {MANAGEMENT_URL_ENV}"
    if answered:
        return f"NOTE: unacked counts from the management API at {url}, a guess from the broker's host ({name})"
    return f"NOTE: no management API answered at {url}, a guess from the broker's host: unacked unknown ({name})"


examples(status,
         "kombu-events -A proj.events status",
         "kombu-events -A proj.events status --json --max-archive 0   # exit 2 if anything is archived")


@click.command()
@json_option("health", "one JSON object on stdout instead: healthy, problems, queues")
@click.option("--max-archive", type=click.IntRange(min=0), help="A problem when the archive holds more messages.")
@click.option("--max-lag", type=click.IntRange(min=0),
              help="A problem when a reader of a log is more events behind it (docs/logs.md).")
@_management_url_option
@click.pass_obj
@guarded
def health(obj: Context, as_json: bool, max_archive: int | None, max_lag: int | None,
           management_url: str | None) -> None:
    """Exit 0 when the broker is reachable, the topology exists, every handler queue has a consumer and every
    reader of a log a worker that reads it.

    Exit 2 otherwise (also when the archive holds more than --max-archive messages, or a reader is more than
    --max-lag events behind its log),
    with one line per problem: a readiness check or an alert. Exit 1 when the
    broker cannot be reached (the one problem then).
    """
    management_url = _checked(management_url)
    topology = obj.events.topology()
    rows: list[Any] = []
    unreachable, name, version = False, "", None
    try:
        with obj.connection() as conn:
            rows = gather(conn, topology, management_url)
            found = problems(rows, missing=missing_exchanges(conn, topology), max_archive=max_archive)
            found += reader_problems(readers_of(conn, topology), max_lag=max_lag)
            name, version = broker_name(conn), reported_version(conn)
    except BrokerUnavailableError as exc:
        found, unreachable = [f"broker: {safe_text(str(exc))}"], True
    if as_json:
        emit_json({"healthy": not found, "problems": found, "broker_version": version,
                   "queues": [{**r.as_dict(), "broker_version": version} for r in rows]})
    else:
        for line in found:
            click.echo(line)
        if not found:
            click.echo(f"healthy: {obj.events.service} on {safe_url(obj.url)} ({name})")
    if unreachable:
        failed()
    if found:
        over_threshold()  # the problems are the report


examples(health,
         "kombu-events -A proj.events health                  # exit 2 and one line per problem",
         "kombu-events -A proj.events health --max-archive 100 --json   # for a readiness probe or an alert",
         "kombu-events -A proj.events health --max-lag 10000   # a reader of a log 10,000 events behind: exit 2")


@click.command()
@json_option("schedules", "a JSON array on stdout instead, one object per schedule")
@click.pass_obj
@guarded
def schedules(obj: Context, as_json: bool) -> None:
    """Each periodic schedule: its period, its last run and the next due time (read from the broker)."""
    with obj.connection() as conn:
        rows = [summary(s, _peek(conn, s.state_queue), now_ms()) for s in obj.events.schedules]
    if as_json:
        emit_json([{key: row.get(key) for key in SCHEDULE_KEYS} for row in rows])
        return
    if not rows:
        click.echo(f"service {obj.events.service} has no periodic schedules", err=True)
    click.echo(f"{'schedule':<24} {'every':>10} {'last run':>11} {'last due':<29} {'next due':<29} outcome")
    for r in rows:
        last = "-" if r["last_run"] is None else str(r["last_run"])
        outcome = r.get("outcome") or r.get("note") or ""
        click.echo(f"{r['schedule']:<24} {r['every_s']:>9g}s {last:>11} {r['last_due'] or '-':<29} "
                   f"{r['next_due'] or '-':<29} {outcome}")


examples(schedules,
         "kombu-events -A proj.events schedules          # period, last run, next due of each schedule",
         "kombu-events -A proj.events schedules --json   # the same as JSON")


def _peek(connection: Connection, queue: str) -> Any:
    """The state in ``queue`` (left there), or None when it was never written or has expired."""
    channel = connection.channel()
    try:
        return peek_state(channel, queue)
    except NotFound:
        return None
    finally:
        try:
            channel.close()
        except Exception:  # a basic_get on a missing queue already closed the channel
            pass

