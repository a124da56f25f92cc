"""The ``kombu-events`` command: declare, status, health, archive list/show/replay/purge, publish, backlog
status/flush, schedules, migrate."""
from __future__ import annotations

__all__ = ["main", "cli"]

import dataclasses
import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import click
from amqp.exceptions import NotFound
from kombu import Connection

from . import registry
from .broker import lenient_amqp as wire_guard
from .broker.declare import declare as declare_topology
from .core.config import Settings, broker_url
from .core.logs import safe_text, safe_url
from .core.schedule import summary
from .core.topology import build_topology
from .errors import BrokerUnavailableError, KombuEventsError
from .ops import archive as archive_ops, migrate as migrate_ops
from .ops.health import missing_exchanges, problems
from .ops.status import PAUSED, gather
from .periodic.runner import now_ms, peek_state
from .publishing.backlog import Backlog
from .publishing.buffered import BacklogPublisher
from .publishing.checks import broker_check
from .publishing.circuits import Guard
from .publishing.publisher import Publisher, addressed, build_message

logger = logging.getLogger(__name__)


class Context:
    """What every sub-command needs: the app's Events service and a broker URL."""

    def __init__(self, app_name: str | None, broker: str | None, service: str | None) -> None:
        self.app_name, self.broker, self.service_name = app_name, broker, service
        self._events: Any = None

    @property
    def events(self) -> Any:
        """The selected :class:`~kombu_events.Events` of the ``-A`` app."""
        if self._events is None:
            self._events = _select(self.app_name, self.service_name)
        return self._events

    @property
    def url(self) -> str:
        """``--broker``, else ``RABBIT_URL``, else the app's broker."""
        app = self.events.app if self.app_name else None
        return broker_url(app, self.broker)

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A connected kombu Connection; an unreachable broker becomes one clear error."""
        conn = Connection(self.url, connect_timeout=5)
        try:
            conn.ensure_connection(max_retries=1)
        except Exception as exc:
            conn.release()
            raise BrokerUnavailableError(f"cannot reach the broker at {safe_url(self.url)}: {exc}") from exc
        try:
            yield conn
        finally:
            conn.release()


def _select(app_name: str | None, service: str | None) -> Any:
    from celery.app.utils import find_app

    if not app_name:
        raise click.UsageError("no app given: pass -A/--app MODULE (e.g. -A proj.events)")
    try:
        app = find_app(app_name)
    except Exception as exc:
        raise KombuEventsError(f"cannot load app {app_name!r}: {type(exc).__name__}: {exc}") from exc
    services = registry.services_of(app)
    if not services:
        raise KombuEventsError(f"app {app_name!r} registers no Events(app, service=...)")
    if service is None:
        if len(services) > 1:
            names = ", ".join(e.service for e in services)
            raise KombuEventsError(f"app {app_name!r} has several services ({names}); pick one with --service")
        return services[0]
    for events in services:
        if events.service == service:
            return events
    raise KombuEventsError(f"unknown service {service!r}; app {app_name!r} has: "
                           + ", ".join(e.service for e in services))


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn every expected failure into one line on stderr and exit code 1 (never a traceback)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except (KombuEventsError, OSError, ConnectionError) as exc:
            raise click.ClickException(safe_text(str(exc))) from exc
        except Exception as exc:  # amqp/kombu errors: still one clear line
            raise click.ClickException(safe_text(f"{type(exc).__name__}: {exc}")) from exc

    return wrapper


@click.group()
@click.option("-A", "--app", "app_name", envvar="KOMBU_EVENTS_APP", help="Celery app module, as for celery -A.")
@click.option("--broker", help="Broker URL (default: RABBIT_URL, then the app's broker_url).")
@click.option("--service", help="Service to act on when the app has several.")
@click.pass_context
def cli(ctx: click.Context, app_name: str | None, broker: str | None, service: str | None) -> None:
    """Operate kombu-events: topology, queue status, archive, publishing, the local backlog, periodic schedules."""
    sys.path.insert(0, ".")  # as `celery -A` does: the app module is found from the current directory
    wire_guard.install()  # archived messages py-amqp cannot decode are still listed and replayed
    ctx.obj = Context(app_name, broker, service)


@cli.command()
@click.option("--dry-run", is_flag=True, help="Print every exchange, queue, argument and binding; do not connect.")
@click.option("--format", "fmt", type=click.Choice(["text", "dot"]), default="text", show_default=True,
              help="With --dry-run: one line per entity, or a Graphviz dot graph (render with `dot -Tsvg`).")
@click.pass_obj
@_guarded
def declare(obj: Context, dry_run: bool, fmt: str) -> None:
    """Create the service's topology (idempotent)."""
    if fmt == "dot" and not dry_run:
        raise click.UsageError("--format dot prints the topology without declaring it: add --dry-run")
    topology = obj.events.topology()
    if dry_run:
        if fmt == "dot":
            click.echo(topology.to_dot(), nl=False)
            return
        for line in topology.describe():
            click.echo(line)
        return
    with obj.connection() as conn:
        counts = declare_topology(topology, conn)
    click.echo(f"declared on {safe_url(obj.url)}: {counts['exchanges']} exchanges, {counts['queues']} queues, "
               f"{counts['bindings']} queue bindings, {counts['exchange_bindings']} exchange bindings")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--max-archive", type=click.IntRange(min=0), help="Exit 2 when the archive holds more messages.")
@click.option("--management-url", help="RabbitMQ management API (default http://<broker host>:15672).")
@click.pass_obj
@_guarded
def status(obj: Context, as_json: bool, max_archive: int | None, management_url: str | None) -> None:
    """Ready/unacked messages and consumers of every queue, delay level and the archive.

    A handler queue with no consumer shows as PAUSED: its circuit breaker is open, or no worker runs.
    """
    with obj.connection() as conn:
        rows = gather(conn, obj.events.topology(), management_url)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        click.echo(f"{'queue':<48} {'role':<8} {'ready':>8} {'unacked':>8} {'consumers':>9}  state")
        for r in rows:
            cells = ["-" if v is None else str(v) for v in (r.ready, r.unacked, r.consumers)]
            name = r.queue if r.exists else f"{r.queue} (missing)"
            state = "PAUSED (no consumer)" if r.state == PAUSED else (r.state or "")
            click.echo(f"{name:<48} {r.role:<8} {cells[0]:>8} {cells[1]:>8} {cells[2]:>9}  {state}".rstrip())
    for r in rows:
        if r.state == PAUSED:
            click.echo(f"WARNING: handler queue {r.queue} has no consumer: paused (its circuit breaker is open) "
                       f"or no worker consumes it; {r.ready} message(s) wait in it", err=True)
        if r.role == "unrouted" and r.ready:
            click.echo(f"WARNING: {r.ready} delayed event(s) came due with no queue bound for their key: "
                       f"they wait in {r.queue}", err=True)
    archived = next((r.ready or 0) for r in rows if r.role == "archive")
    if max_archive is not None and archived > max_archive:
        click.echo(f"ALERT: archive holds {archived} messages (more than --max-archive {max_archive})", err=True)
        sys.exit(2)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: healthy, problems, queues.")
@click.option("--max-archive", type=click.IntRange(min=0), help="A problem when the archive holds more messages.")
@click.pass_obj
@_guarded
def health(obj: Context, as_json: bool, max_archive: int | None) -> None:
    """Exit 0 when the broker is reachable, the topology exists and every handler queue has a consumer.

    Exit 1 otherwise (also when the archive holds more than --max-archive messages),
    with one line per problem: a readiness check or an alert.
    """
    topology = obj.events.topology()
    rows: list[Any] = []
    try:
        with obj.connection() as conn:
            rows = gather(conn, topology)
            found = problems(rows, missing=missing_exchanges(conn, topology), max_archive=max_archive)
    except BrokerUnavailableError as exc:
        found = [f"broker: {safe_text(str(exc))}"]
    if as_json:
        click.echo(json.dumps({"healthy": not found, "problems": found, "queues": [r.as_dict() for r in rows]},
                              indent=2))
    else:
        for line in found:
            click.echo(line)
        if not found:
            click.echo(f"healthy: {obj.events.service} on {safe_url(obj.url)}")
    if found:
        sys.exit(1)


@cli.group()
def archive() -> None:
    """Inspect, replay and purge archived messages."""


def _matcher(queue: str | None, routing_key: str | None) -> Callable[[Any], bool]:
    return lambda m: (queue is None or m.queue == queue) and (routing_key is None or m.routing_key == routing_key)


@archive.command("list")
@click.option("--queue", help="Only messages that failed in this queue.")
@click.option("--routing-key", help="Only messages with this routing key.")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON lines.")
@click.pass_obj
@_guarded
def archive_list(obj: Context, queue: str | None, routing_key: str | None, limit: int, as_json: bool) -> None:
    """What is in the archive and why (messages stay in the archive)."""
    with obj.connection() as conn:
        found = archive_ops.read(conn, obj.events.topology(), _matcher(queue, routing_key), limit)
    for m in found:
        if as_json:
            click.echo(json.dumps(m.summary()))
        else:
            click.echo(f"{m.id}  {m.archived_at}  queue={m.queue} key={m.routing_key} "
                       f"attempts={m.attempts}  {m.reason}")
    if not as_json:
        click.echo(f"{len(found)} message(s) shown", err=True)


@archive.command("show")
@click.argument("message_id")
@click.pass_obj
@_guarded
def archive_show(obj: Context, message_id: str) -> None:
    """Everything about one archived message (it stays in the archive)."""
    with obj.connection() as conn:
        found = archive_ops.read(conn, obj.events.topology(), lambda m: m.id == message_id, 1)
    if not found:
        raise KombuEventsError(f"no archived message with id {message_id!r}")
    click.echo(json.dumps(found[0].summary(), indent=2))


@archive.command("replay")
@click.option("--queue", help="Only messages that failed in this queue.")
@click.option("--routing-key", help="Only messages with this routing key.")
@click.option("--limit", type=click.IntRange(min=1), help="Replay at most this many.")
@click.option("--dry-run", is_flag=True, help="Show what would be replayed; change nothing.")
@click.pass_obj
@_guarded
def archive_replay(obj: Context, queue: str | None, routing_key: str | None, limit: int | None,
                   dry_run: bool) -> None:
    """Put archived messages back into their queue, attempt counter reset (confirmed, at-least-once)."""
    match = _matcher(queue, routing_key)
    with obj.connection() as conn:
        if dry_run:
            for m in archive_ops.read(conn, obj.events.topology(), match, limit):
                click.echo(f"would replay {m.id} to {m.queue} (key {m.routing_key})")
            return
        replayed, kept = archive_ops.replay(conn, obj.events.topology(), match, limit)
    for m in replayed:
        click.echo(f"replayed {m.id} to {m.queue}")
    for m, why in kept:
        click.echo(f"kept {m.id} in the archive: {why}", err=True)
    click.echo(f"{len(replayed)} replayed, {len(kept)} kept", err=True)
    if kept:
        sys.exit(1)


@archive.command("purge")
@click.option("--queue", help="Only messages that failed in this queue.")
@click.option("--yes", is_flag=True, help="Really delete them.")
@click.pass_obj
@_guarded
def archive_purge(obj: Context, queue: str | None, yes: bool) -> None:
    """Delete archived messages for good."""
    if not yes:
        raise click.UsageError("purge deletes archived messages for good: add --yes to confirm")
    with obj.connection() as conn:
        count = archive_ops.purge(conn, obj.events.topology(), _matcher(queue, None) if queue else None)
    click.echo(f"purged {count} message(s)")


@cli.command()
@click.argument("routing_key")
@click.argument("payload")
@click.option("--exchange", help="Exchange (default: the service's, else 'events').")
@click.option("--delay", type=click.FloatRange(min=0), default=0, show_default=True,
              help="Seconds the event waits in the broker before it goes to every queue bound for its key.")
@click.pass_obj
@_guarded
def publish(obj: Context, routing_key: str, payload: str, exchange: str | None, delay: float) -> None:
    """Publish one JSON event (confirmed, mandatory), now or after --delay seconds."""
    try:
        data = json.loads(payload)
    except ValueError as exc:
        raise KombuEventsError(f"PAYLOAD is not valid JSON: {exc}") from exc
    if obj.app_name:
        settings, url = obj.events.settings, obj.url
    else:
        settings, url = Settings(service="kombu-events"), broker_url(None, obj.broker)
    if exchange:
        settings = dataclasses.replace(settings, exchange=exchange)
    message = build_message(data)
    target, key = addressed(build_topology(settings, ()), routing_key, message, delay)
    publisher = Publisher(url)
    try:
        publisher.publish(target, key, message)
    finally:
        publisher.close()
    click.echo(message.properties["message_id"])


@cli.group()
def backlog() -> None:
    """The local backlog of events published while the broker was away (Events(..., backlog=PATH))."""


def _backlog_publisher(obj: Context, path: str | None) -> BacklogPublisher:
    """The app's backlog publisher (its hooks see flushed events), or one over ``--path`` publishing to ``--broker``."""
    if path is None:
        if obj.events.backlog_publisher is None:
            raise KombuEventsError(f"service {obj.events.service!r} has no backlog (Events(..., backlog=PATH)); "
                                   "or name the file with --path")
        return obj.events.backlog_publisher
    if not os.path.exists(path):
        raise KombuEventsError(f"no backlog at {path!r}")
    url = obj.url if obj.app_name else broker_url(None, obj.broker)
    publisher = Publisher(url)
    return BacklogPublisher(Backlog(path), lambda: publisher, Guard([broker_check(url)]))


@backlog.command("status")
@click.option("--path", type=click.Path(dir_okay=False), help="The backlog file (default: the app's backlog=).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--max-depth", type=click.IntRange(min=0), help="Exit 2 when more events wait.")
@click.option("--max-age", type=click.FloatRange(min=0), help="Exit 2 when the oldest has waited longer (seconds).")
@click.pass_obj
@_guarded
def backlog_status(obj: Context, path: str | None, as_json: bool, max_depth: int | None,
                   max_age: float | None) -> None:
    """How many events wait, and for how long (no broker needed)."""
    found = _backlog_publisher(obj, path).backlog.status()
    age = found.age_s(time.time())
    if as_json:
        click.echo(json.dumps(found.as_dict(time.time()), indent=2))
    else:
        click.echo(f"{found.path}: {found.depth} waiting, oldest {'-' if age is None else f'{age:.1f} s'} old, "
                   f"{found.rejected} set aside (unroutable), {found.used_bytes} of {found.max_bytes} bytes")
    alerts = []
    if max_depth is not None and found.depth > max_depth:
        alerts.append(f"{found.depth} events wait (more than --max-depth {max_depth})")
    if max_age is not None and age is not None and age > max_age:
        alerts.append(f"the oldest has waited {age:.1f} s (more than --max-age {max_age:g})")
    if alerts:
        click.echo("ALERT: backlog: " + "; ".join(alerts), err=True)
        sys.exit(2)


@backlog.command("flush")
@click.option("--path", type=click.Path(dir_okay=False), help="The backlog file (default: the app's backlog=).")
@click.option("--timeout", type=click.FloatRange(min=0), help="Give up after this many seconds.")
@click.option("--retry-rejected", is_flag=True, help="First put unroutable events back in line (bind a queue first).")
@click.pass_obj
@_guarded
def backlog_flush(obj: Context, path: str | None, timeout: float | None, retry_rejected: bool) -> None:
    """Publish waiting events in order, confirmed; delete each once confirmed (one flusher at a time)."""
    publisher = _backlog_publisher(obj, path)
    if retry_rejected:
        click.echo(f"{publisher.backlog.retry_rejected()} set-aside event(s) back in line", err=True)
    report = publisher.flush(timeout_s=timeout)
    left = publisher.backlog.status()
    click.echo(f"published {report.published}, set aside {report.rejected} (unroutable), {left.depth} waiting")
    if report.error is not None:
        raise KombuEventsError(f"flush stopped: {report.error}")
    if left.depth:
        sys.exit(1)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.pass_obj
@_guarded
def schedules(obj: Context, as_json: bool) -> None:
    """Each periodic schedule: its period, its last run and the next due time (read from the broker)."""
    with obj.connection() as conn:
        rows = [summary(s, _peek(conn, s.state_queue), now_ms()) for s in obj.events.schedules]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo(f"service {obj.events.service} has no periodic schedules", err=True)
    click.echo(f"{'schedule':<24} {'every':>10} {'last run':>11} {'last due':<29} {'next due':<29} outcome")
    for r in rows:
        last = "-" if r["last_run"] is None else str(r["last_run"])
        outcome = r.get("outcome") or r.get("note") or ""
        click.echo(f"{r['schedule']:<24} {r['every_s']:>9g}s {last:>11} {r['last_due'] or '-':<29} "
                   f"{r['next_due'] or '-':<29} {outcome}")


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


@cli.command()
@click.option("--to", "to", type=click.Choice(["quorum", "classic"]), required=True,
              help="The queue type to move every queue of the service to.")
@click.option("--dry-run", is_flag=True, help="Print what each queue holds and every step; change nothing.")
@click.pass_obj
@_guarded
def migrate(obj: Context, to: str, dry_run: bool) -> None:
    """Move the service's queues to quorum (or classic) queues without losing a message.

    Stop the service's workers first: a queue with a consumer is refused. A run that
    stopped anywhere is finished by running the command again.
    """
    events = obj.events
    topology = build_topology(dataclasses.replace(events.settings, queue_type=to), events.handlers,
                              events.schedules)
    queues = list(topology.queues)
    with obj.connection() as conn:
        states = migrate_ops.observe(conn, queues)
        steps = migrate_ops.migration_steps(queues, states)
        if not steps:
            click.echo(f"every queue of service {events.service} is already declared as {to}: nothing to do")
        else:
            for queue in queues:
                state, holding = states[queue.name], states[migrate_ops.holding_name(queue.name)]
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
                moved = migrate_ops.execute(conn, queues, steps, report=click.echo)
                total = sum(n for name, n in moved.items() if not name.endswith(migrate_ops.SUFFIX))
                click.echo(f"migrated service {events.service} to {to} queues: {total} message(s) moved "
                           f"through holding queues, none left behind")
    if events.settings.queue_type != to:
        click.echo(f"warning: the app declares queue_type={events.settings.queue_type!r}: set "
                   f"queue_type={to!r} before starting its workers, or they cannot declare these queues", err=True)


def _examples(command: click.Command, *lines: str) -> None:
    """End ``command``'s help with an Examples block of ``lines`` (``\\b``: click prints it as written)."""
    command.epilog = "\b\nExamples:\n" + "\n".join("  " + line for line in lines)


# One table for every command, so that a command's options and its examples change together here.
_examples(cli,
          "kombu-events -A proj.events declare --dry-run   # the topology, without connecting",
          "kombu-events -A proj.events status              # queue depths, delay levels, archive",
          "kombu-events -A proj.events health              # exit 1 when something is wrong",
          "kombu-events -A proj.events archive list        # what failed, and why",
          "kombu-events publish orders.7.created '{\"order_id\": 7}'")
_examples(declare,
          "kombu-events -A proj.events declare --dry-run   # print every exchange, queue and binding",
          "kombu-events -A proj.events declare --dry-run --format dot   # Graphviz: pipe it to dot -Tsvg",
          "kombu-events -A proj.events declare             # create them on the broker")
_examples(status,
          "kombu-events -A proj.events status",
          "kombu-events -A proj.events status --json --max-archive 0   # exit 2 if anything is archived")
_examples(health,
          "kombu-events -A proj.events health                  # exit 1 and one line per problem",
          "kombu-events -A proj.events health --max-archive 100 --json   # for a readiness probe or an alert")
_examples(archive,
          "kombu-events -A proj.events archive list --queue billing.audit",
          "kombu-events -A proj.events archive replay --queue billing.audit --dry-run")
_examples(archive_list,
          "kombu-events -A proj.events archive list",
          "kombu-events -A proj.events archive list --routing-key orders.7.created --json")
_examples(archive_show,
          "kombu-events -A proj.events archive show 4fbcc4187f8e49a687d3721b2007dc15")
_examples(archive_replay,
          "kombu-events -A proj.events archive replay --queue billing.audit --dry-run   # what would go back",
          "kombu-events -A proj.events archive replay --queue billing.audit --limit 100")
_examples(archive_purge,
          "kombu-events -A proj.events archive purge --queue billing.audit --yes")
_examples(schedules,
          "kombu-events -A proj.events schedules          # period, last run, next due of each schedule",
          "kombu-events -A proj.events schedules --json   # the same as JSON")
_examples(publish,
          "kombu-events publish orders.7.created '{\"order_id\": 7}'              # to 'events' on RABBIT_URL",
          "kombu-events publish --delay 30 orders.7.remind '{\"order_id\": 7}'    # every subscriber, in 30 s",
          "kombu-events -A proj.events publish billing.invoice.paid '{\"id\": 7}'  # to the service's exchange")

_examples(migrate,
          "kombu-events -A proj.events migrate --to quorum --dry-run   # what each queue holds, every step",
          "kombu-events -A proj.events migrate --to quorum             # workers stopped; then set queue_type")
_examples(backlog,
          "kombu-events -A proj.events backlog status",
          "kombu-events -A proj.events backlog flush")
_examples(backlog_status,
          "kombu-events -A proj.events backlog status",
          "kombu-events -A proj.events backlog status --json --max-age 300   # exit 2 past 5 minutes",
          "kombu-events backlog status --path /var/lib/myapp/events-backlog.sqlite3")
_examples(backlog_flush,
          "kombu-events -A proj.events backlog flush                # while the app's own flusher is not running",
          "kombu-events -A proj.events backlog flush --timeout 60 --retry-rejected",
          "kombu-events --broker amqp://rabbit// backlog flush --path /var/lib/myapp/events-backlog.sqlite3")


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cli(prog_name="kombu-events")
