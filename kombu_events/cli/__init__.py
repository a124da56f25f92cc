"""The ``kombu-events`` command: the click group :func:`cli` with its global options (``-A/--app``,
``--broker``, ``--service``) and :func:`main`, the console-script entry point; the commands live in modules
by what they are for (:mod:`.topology`: declare, migrate; :mod:`.inspect`: status, health, schedules;
:mod:`.archive`: archive list/show/replay/purge; :mod:`.publish`: publish; :mod:`.backlog`: backlog
status/flush; :mod:`.asyncapi`: the service's AsyncAPI document; :mod:`.console`: the failed-message
console) and what they share in :mod:`.common`.

Made for scripts too (docs/cli.md): ``--version``; ``--json`` on every command that reports or changes
something, one document on stdout described by a JSON Schema shipped in ``schemas/``; and one exit-code
convention: 0 fine, 1 an error (a usage error included), 2 a check over its threshold."""
from __future__ import annotations

__all__ = ["main", "cli"]

import logging
import sys
from contextlib import contextmanager
from typing import Any, Iterator

import click

from ..broker import lenient_amqp
from ..version import __version__
from . import archive, asyncapi, backlog, console, inspect, logs, outbox, permissions, publish, topology
from .common import ERROR, Context, examples


@contextmanager
def _usage_errors_are_errors() -> Iterator[None]:
    """Click exits 2 on a usage error; here 2 means "over a threshold", so a usage error exits 1."""
    try:
        yield
    except click.UsageError as exc:
        exc.exit_code = ERROR  # type: ignore[misc, unused-ignore]  # a ClassVar in click >= 8.2; this one differs
        raise


class _Root(click.Group):
    """The ``kombu-events`` group: a usage error anywhere below it (a misspelt option, a missing argument,
    ``purge`` without ``--yes``) exits 1 with click's message on stderr."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        with _usage_errors_are_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> Any:
        with _usage_errors_are_errors():
            return super().invoke(ctx)


@click.group(cls=_Root)
@click.version_option(__version__, "--version", prog_name="kombu-events", message="%(prog)s %(version)s",
                      help="Print the version of kombu-events and exit.")
@click.option("-A", "--app", "app_name", envvar="KOMBU_EVENTS_APP", help="Celery app module, as for celery -A.")
@click.option("--broker", help="Broker URL (default: RABBIT_URL, then the app's broker_url).")
@click.option("--service", help="Service to act on when the app has several.")
@click.pass_context
def cli(ctx: click.Context, app_name: str | None, broker: str | None, service: str | None) -> None:
    """Operate kombu-events: topology, queue status, archive, publishing, the local backlog, periodic schedules."""
    sys.path.insert(0, ".")  # as `celery -A` does: the app module is found from the current directory
    lenient_amqp.install()  # archived messages py-amqp cannot decode are still listed and replayed
    ctx.obj = Context(app_name, broker, service)


cli.add_command(topology.declare_topology)
cli.add_command(inspect.status)
cli.add_command(inspect.health)
cli.add_command(archive.archive)
cli.add_command(publish.publish)
cli.add_command(backlog.backlog)
cli.add_command(outbox.outbox)
cli.add_command(inspect.schedules)
cli.add_command(topology.migrate_queues)
cli.add_command(asyncapi.asyncapi)
cli.add_command(permissions.permissions)
cli.add_command(console.console)
cli.add_command(logs.log)

examples(cli,
         "kombu-events -A proj.events declare --dry-run   # the topology, without connecting",
         "kombu-events -A proj.events status              # queue depths, delay levels, archive",
         "kombu-events -A proj.events health              # exit 2 when something is wrong",
         "kombu-events -A proj.events archive list        # what failed, and why",
         "kombu-events -A proj.events asyncapi            # the AsyncAPI document of the service",
         "kombu-events publish orders.7.created '{\"order_id\": 7}'")


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cli(prog_name="kombu-events")
