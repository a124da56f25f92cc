"""The ``kombu-events`` command: the click group :func:`cli` with its global options (``-A/--app``,
``--broker``, ``--service``) and :func:`main`, the console-script entry point; the commands live in modules
by what they are for (:mod:`.topology`: declare, migrate; :mod:`.inspect`: status, health, schedules;
:mod:`.archive`: archive list/show/replay/purge; :mod:`.publish`: publish; :mod:`.backlog`: backlog
status/flush) and what they share in :mod:`.common`."""
from __future__ import annotations

__all__ = ["main", "cli"]

import logging
import sys

import click

from ..broker import lenient_amqp
from . import archive, backlog, inspect, publish, topology
from .common import Context, examples


@click.group()
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
cli.add_command(inspect.schedules)
cli.add_command(topology.migrate_queues)

examples(cli,
         "kombu-events -A proj.events declare --dry-run   # the topology, without connecting",
         "kombu-events -A proj.events status              # queue depths, delay levels, archive",
         "kombu-events -A proj.events health              # exit 1 when something is wrong",
         "kombu-events -A proj.events archive list        # what failed, and why",
         "kombu-events publish orders.7.created '{\"order_id\": 7}'")


def main() -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cli(prog_name="kombu-events")
