"""The ``kombu-events`` command: declare, status, archive list/show/replay/purge, publish."""
from __future__ import annotations

__all__ = ["main", "cli"]

import json
import logging
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import click
from kombu import Connection

from . import archive as archive_ops, registry, wire_guard
from .config import broker_url
from .declare import declare as declare_topology
from .errors import BrokerUnavailableError, KombuEventsError
from .logs import safe_text, safe_url
from .publisher import Publisher, build_message
from .status import gather

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
    """Operate kombu-events: topology, queue status, archive, publishing."""
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
    """Ready/unacked messages and consumers of every queue, delay level and the archive."""
    with obj.connection() as conn:
        rows = gather(conn, obj.events.topology(), management_url)
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        click.echo(f"{'queue':<48} {'role':<8} {'ready':>8} {'unacked':>8} {'consumers':>9}")
        for r in rows:
            cells = ["-" if v is None else str(v) for v in (r.ready, r.unacked, r.consumers)]
            name = r.queue if r.exists else f"{r.queue} (missing)"
            click.echo(f"{name:<48} {r.role:<8} {cells[0]:>8} {cells[1]:>8} {cells[2]:>9}")
    archived = next((r.ready or 0) for r in rows if r.role == "archive")
    if max_archive is not None and archived > max_archive:
        click.echo(f"ALERT: archive holds {archived} messages (more than --max-archive {max_archive})", err=True)
        sys.exit(2)


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
@click.pass_obj
@_guarded
def publish(obj: Context, routing_key: str, payload: str, exchange: str | None) -> None:
    """Publish one JSON event (confirmed, mandatory)."""
    try:
        data = json.loads(payload)
    except ValueError as exc:
        raise KombuEventsError(f"PAYLOAD is not valid JSON: {exc}") from exc
    if obj.app_name:
        exchange = exchange or obj.events.settings.exchange
        url = obj.url
    else:
        exchange = exchange or "events"
        url = broker_url(None, obj.broker)
    publisher = Publisher(url)
    message = build_message(data)
    try:
        publisher.publish(exchange, routing_key, message)
    finally:
        publisher.close()
    click.echo(message.properties["message_id"])


def _examples(command: click.Command, *lines: str) -> None:
    """End ``command``'s help with an Examples block of ``lines`` (``\\b``: click prints it as written)."""
    command.epilog = "\b\nExamples:\n" + "\n".join("  " + line for line in lines)


# One table for every command, so that a command's options and its examples change together here.
_examples(cli,
          "kombu-events -A proj.events declare --dry-run   # the topology, without connecting",
          "kombu-events -A proj.events status              # queue depths, delay levels, archive",
          "kombu-events -A proj.events archive list        # what failed, and why",
          "kombu-events publish orders.7.created '{\"order_id\": 7}'")
_examples(declare,
          "kombu-events -A proj.events declare --dry-run   # print every exchange, queue and binding",
          "kombu-events -A proj.events declare --dry-run --format dot   # Graphviz: pipe it to dot -Tsvg",
          "kombu-events -A proj.events declare             # create them on the broker")
_examples(status,
          "kombu-events -A proj.events status",
          "kombu-events -A proj.events status --json --max-archive 0   # exit 2 if anything is archived")
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
_examples(publish,
          "kombu-events publish orders.7.created '{\"order_id\": 7}'              # to 'events' on RABBIT_URL",
          "kombu-events -A proj.events publish billing.invoice.paid '{\"id\": 7}'  # to the service's exchange")


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cli(prog_name="kombu-events")
