"""The ``backlog`` command group, for the local file of events published while the broker was away
(``Events(..., backlog=PATH)``, or any file named with ``--path``): ``status`` says how many wait and for how
long (no broker needed; exit 2 past ``--max-depth`` or ``--max-age``), ``flush`` publishes them in order,
confirmed, deleting each once confirmed (exit 1 while some still wait)."""
from __future__ import annotations

import os
import time

import click

from ..core.config import broker_url
from ..core.logs import safe_text
from ..errors import KombuEventsError
from ..publishing.backlog import Backlog
from ..publishing.breakers import PublisherBreakers
from ..publishing.buffered import BacklogPublisher
from ..publishing.health import broker_check
from ..publishing.publisher import Publisher
from .common import Context, emit_json, examples, failed, guarded, json_option, over_threshold


@click.group()
def backlog() -> None:
    """The local backlog of events published while the broker was away (Events(..., backlog=PATH))."""


examples(backlog,
         "kombu-events -A proj.events backlog status",
         "kombu-events -A proj.events backlog flush")


def _backlog_publisher(obj: Context, path: str | None) -> BacklogPublisher:
    """The app's backlog publisher (its hooks see flushed events), or one over ``--path`` publishing to ``--broker``."""
    if path is None:
        if obj.events.publishing.backlog_publisher is None:
            raise KombuEventsError(f"service {obj.events.service!r} has no backlog (Events(..., backlog=PATH)); "
                                   "or name the file with --path")
        return obj.events.publishing.backlog_publisher
    if not os.path.exists(path):
        raise KombuEventsError(f"no backlog at {path!r}")
    url = obj.url if obj.app_name else broker_url(None, obj.broker)
    publisher = Publisher(url, app=obj.app)
    return BacklogPublisher(Backlog(path), lambda: publisher, PublisherBreakers([broker_check(url, obj.app)]))


@backlog.command("status")
@click.option("--path", type=click.Path(dir_okay=False), help="The backlog file (default: the app's backlog=).")
@json_option("backlog-status")
@click.option("--max-depth", type=click.IntRange(min=0), help="Exit 2 when more events wait.")
@click.option("--max-age", type=click.FloatRange(min=0), help="Exit 2 when the oldest has waited longer (seconds).")
@click.pass_obj
@guarded
def backlog_status(obj: Context, path: str | None, as_json: bool, max_depth: int | None,
                   max_age: float | None) -> None:
    """How many events wait, and for how long (no broker needed)."""
    found = _backlog_publisher(obj, path).backlog.status()
    age = found.age_s(time.time())
    if as_json:
        emit_json(found.as_dict(time.time()))
    else:
        click.echo(f"{found.path}: {found.depth} waiting, oldest {'-' if age is None else f'{age:.1f} s'} old, "
                   f"{found.rejected} set aside (unroutable), {found.used_bytes} of {found.max_bytes} bytes")
    alerts = []
    if max_depth is not None and found.depth > max_depth:
        alerts.append(f"{found.depth} events wait (more than --max-depth {max_depth})")
    if max_age is not None and age is not None and age > max_age:
        alerts.append(f"the oldest has waited {age:.1f} s (more than --max-age {max_age:g})")
    if alerts:
        over_threshold("ALERT: backlog: " + "; ".join(alerts))


examples(backlog_status,
         "kombu-events -A proj.events backlog status",
         "kombu-events -A proj.events backlog status --json --max-age 300   # exit 2 past 5 minutes",
         "kombu-events backlog status --path /var/lib/myapp/events-backlog.sqlite3")


@backlog.command("flush")
@click.option("--path", type=click.Path(dir_okay=False), help="The backlog file (default: the app's backlog=).")
@click.option("--timeout", type=click.FloatRange(min=0), help="Give up after this many seconds.")
@click.option("--retry-rejected", is_flag=True, help="First put unroutable events back in line (bind a queue first).")
@json_option("backlog-flush")
@click.pass_obj
@guarded
def backlog_flush(obj: Context, path: str | None, timeout: float | None, retry_rejected: bool,
                  as_json: bool) -> None:
    """Publish waiting events in order, confirmed; delete each once confirmed (one flusher at a time)."""
    publisher = _backlog_publisher(obj, path)
    back_in_line = None
    if retry_rejected:
        back_in_line = publisher.backlog.retry_rejected()
        click.echo(f"{back_in_line} set-aside event(s) back in line", err=True)
    report = publisher.flush(timeout_s=timeout)
    left = publisher.backlog.status()
    if as_json:
        emit_json({"path": left.path, "published": report.published, "rejected": report.rejected,
                   "waiting": left.depth, "retried_rejected": back_in_line,
                   "error": None if report.error is None else safe_text(str(report.error))})
    else:
        click.echo(f"published {report.published}, set aside {report.rejected} (unroutable), {left.depth} waiting")
    if report.error is not None:
        raise KombuEventsError(f"flush stopped: {report.error}")
    if left.depth:
        failed()


examples(backlog_flush,
         "kombu-events -A proj.events backlog flush                # while the app's own flusher is not running",
         "kombu-events -A proj.events backlog flush --timeout 60 --retry-rejected",
         "kombu-events --broker amqp://rabbit// backlog flush --path /var/lib/myapp/events-backlog.sqlite3")
