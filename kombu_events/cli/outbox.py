"""The ``outbox`` command group, for ``Events(..., database=..., outbox=True)``: ``relay`` publishes committed
outbox rows in the foreground (for publishers without a worker), ``status`` says how many wait and for how long
(exit 2 past ``--max-depth`` or ``--max-age``), ``create-tables`` creates the inbox and outbox tables in an
SQLAlchemy database (Django projects run ``manage.py migrate``)."""
from __future__ import annotations

import signal
from typing import Any

import click

from ..database import status, upkeep
from ..database.backends import SQLAlchemyBackend
from ..errors import KombuEventsError
from .common import Context, emit_json, examples, guarded, json_option, over_threshold

_no_sqlalchemy = ""  # why the SQLAlchemy tables cannot be imported
try:  # SQLAlchemy is an extra: kombu-events[sqlalchemy]
    from ..database.tables import metadata
except ImportError as exc:
    metadata = None  # type: ignore[assignment]
    _no_sqlalchemy = str(exc)


@click.group()
def outbox() -> None:
    """The transactional outbox and the inbox of the app's database (docs/effectively-once.md)."""


examples(outbox,
         "kombu-events -A proj.events outbox status",
         "kombu-events -A proj.events outbox relay",
         "kombu-events -A proj.events outbox create-tables")


def _database(obj: Context) -> Any:
    """The service's database backend; a service without ``database=`` is a clear error."""
    backend = getattr(obj.events, "database", None)
    if backend is None:
        raise KombuEventsError(f"service {obj.events.service!r} has no database (Events(..., database=...))")
    return backend


@outbox.command("status")
@json_option("outbox-status")
@click.option("--max-depth", type=click.IntRange(min=0), help="Exit 2 when more events wait.")
@click.option("--max-age", type=click.FloatRange(min=0), help="Exit 2 when the oldest has waited longer (seconds).")
@click.pass_obj
@guarded
def outbox_status(obj: Context, as_json: bool, max_depth: int | None, max_age: float | None) -> None:
    """How many committed events wait in the outbox, and for how long (no broker needed)."""
    backend = _database(obj)
    found = status(backend)
    if as_json:
        emit_json({"database": backend.name, **found.as_json()})
    else:
        age = "-" if found.oldest_age_s is None else f"{found.oldest_age_s:.1f} s"
        click.echo(f"{backend.name}: {found.depth} waiting, oldest {age} old, {found.failing} failed at least once")
    alerts = []
    if max_depth is not None and found.depth > max_depth:
        alerts.append(f"{found.depth} events wait (more than --max-depth {max_depth})")
    if max_age is not None and found.oldest_age_s is not None and found.oldest_age_s > max_age:
        alerts.append(f"the oldest has waited {found.oldest_age_s:.1f} s (more than --max-age {max_age:g})")
    if alerts:
        over_threshold("ALERT: outbox: " + "; ".join(alerts))


examples(outbox_status,
         "kombu-events -A proj.events outbox status",
         "kombu-events -A proj.events outbox status --json --max-age 60   # exit 2 past a minute")


@outbox.command("relay")
@click.option("--once", "just_once", is_flag=True, help="Publish what waits now, then exit.")
@json_option("outbox-relay", note=" (with --once)")
@click.pass_obj
@guarded
def outbox_relay(obj: Context, just_once: bool, as_json: bool) -> None:
    """Publish committed outbox rows with confirms until stopped (SIGINT, SIGTERM), as a worker's relay does."""
    events = obj.events
    _database(obj)
    if events.outbox is None:
        raise KombuEventsError(f"service {events.service!r} has no outbox (Events(..., outbox=True))")
    if as_json and not just_once:
        raise click.UsageError("--json reports a --once run: add --once")
    thread = upkeep(events)
    assert thread is not None and thread.relay is not None, "a service with an outbox has a relay"
    if just_once:
        total = 0
        while True:
            claimed = thread.relay.run_once()
            total += claimed
            if claimed < thread.relay.batch_size:
                break
        if as_json:
            emit_json({"database": thread.backend.name, "published": total,
                       "waiting": status(thread.backend).depth})
        else:
            click.echo(f"{total} events published from {thread.backend.name}")
        return
    signal.signal(signal.SIGTERM, lambda *_: thread.stop(timeout=0))
    click.echo(f"relaying the outbox of {thread.backend.name}; Ctrl-C stops", err=True)
    try:
        thread.run()
    except KeyboardInterrupt:
        pass


examples(outbox_relay,
         "kombu-events -A proj.events outbox relay",
         "kombu-events -A proj.events outbox relay --once   # e.g. from cron")


@outbox.command("create-tables")
@json_option("outbox-create-tables")
@click.pass_obj
@guarded
def create_tables(obj: Context, as_json: bool) -> None:
    """Create the inbox and outbox tables in the service's SQLAlchemy database (those missing)."""
    backend = _database(obj)
    if not isinstance(backend, SQLAlchemyBackend):
        raise KombuEventsError(f"{backend.name}: add 'kombu_events.django' to INSTALLED_APPS and run "
                               "`manage.py migrate` instead")
    if metadata is None:
        raise KombuEventsError(f"creating the tables needs SQLAlchemy: pip install 'kombu-events[sqlalchemy]' "
                               f"({_no_sqlalchemy})")
    metadata.create_all(backend.engine)
    if as_json:
        emit_json({"database": backend.name, "tables": sorted(metadata.tables)})
    else:
        click.echo(f"{backend.name}: tables {', '.join(sorted(metadata.tables))} are there")


examples(create_tables, "kombu-events -A proj.events outbox create-tables")
