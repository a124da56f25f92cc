"""``kombu-events permissions``: the ``rabbitmqctl`` lines that give a service's runtime user (workers with
``declare=False``, publishers) and deploy user (``kombu-events declare``) what they need and no more, derived
from the service's topology and the app's Celery settings; nothing is contacted."""
from __future__ import annotations

from typing import Any

import click
from kombu import Connection

from ..ops.permissions import CeleryEntities, celery_entities, deploy_grant, runtime_grant, topic_grant
from .common import Context, emit_json, examples, guarded, json_option


@click.command("permissions")
@click.option("--user", default="RUNTIME_USER", show_default=True,
              help="The runtime user: workers started with --events-no-declare (declare=False), and publishers.")
@click.option("--deploy-user", default="DEPLOY_USER", show_default=True,
              help="The user that runs `kombu-events declare` in the deploy.")
@json_option("permissions")
@click.pass_obj
@guarded
def permissions(obj: Context, user: str, deploy_user: str, as_json: bool) -> None:
    """Print the rabbitmqctl commands that grant the service's users their permissions (regexes of exact names)."""
    events = obj.events
    topology = events.topology()
    vhost = Connection(obj.url).virtual_host or "/"  # parsed, not connected
    celery = celery_entities(events.app)
    runtime, deploy, topic = runtime_grant(topology, celery), deploy_grant(topology), topic_grant(topology)
    if as_json:
        emit_json({
            "service": events.service, "vhost": vhost,
            "runtime": {"user": user, **vars(runtime), "command": runtime.command(vhost, user)},
            "topic": {"user": user, **vars(topic), "command": topic.command(vhost, user)},
            "deploy": {"user": deploy_user, **vars(deploy), "command": deploy.command(vhost, deploy_user)},
            "celery": _celery_document(celery)})
        return
    s = topology.settings
    for line in (
        (f"# Service {events.service} on vhost {vhost}: {len(topology.exchanges)} exchanges, {len(topology.queues)} "
        "queues (kombu-events declare --dry-run lists them)."),
        ("# Runtime user: workers started with --events-no-declare (declare=False) and publishers. It configures "
        "none of the service's names; it writes to the exchanges it publishes to, reads the queues it consumes."),
        *_celery_comment(celery),
        runtime.command(vhost, user),
        (f"# Topic permissions are checked only where set: if any apply to exchange {s.exchange}, the runtime user "
        "needs write for every routing key it publishes there (narrow '.*' to those keys)."),
        topic.command(vhost, user),
        ("# Deploy user: `kombu-events declare` (and `migrate`). Workers that declare (declare=True, the default) "
        "need these too, plus Celery's entities."),
        deploy.command(vhost, deploy_user),
    ):
        click.echo(line)


def _celery_comment(celery: CeleryEntities) -> list[str]:
    return [
        ("# A Celery worker also declares and uses Celery's own entities, included in the runtime user's "
        "configure, write and read:"),
        (f"#   task queues {', '.join(celery.task_queues) or '(none)'} (exchanges "
        f"{', '.join(celery.task_exchanges) or '(none)'}); a worker started with -Q needs its queues too;"),
        (f"#   remote control: exchanges {celery.control_exchange} and {celery.reply_exchange}, queues "
        f"<node>.{celery.control_exchange} and <id>.{celery.reply_exchange};"),
        f"#   events and gossip: exchange {celery.event_exchange}, queues {celery.event_exchange}.<id>.",
    ]


def _celery_document(celery: CeleryEntities) -> dict[str, Any]:
    return {"task_queues": list(celery.task_queues), "exchanges": list(celery.exchanges),
            "queue_patterns": list(celery.made_up_queues)}


examples(permissions,
         "kombu-events -A proj.events permissions --user billing --deploy-user deployer   # rabbitmqctl lines",
         "kombu-events -A proj.events permissions --json    # the regexes as one JSON document")
