"""The example app that the files of deploy/ run: replace it with your own project.

``celery -A events_app worker --with-events-step --events-metrics-port 9808`` runs it.
Everything a deployment changes comes from the environment:

- ``CELERY_BROKER_URL``: the broker (Celery reads it before the URL below);
- ``EVENTS_SERVICE``: the service name, unique per consuming service (``example``);
- ``EVENTS_EXCHANGE``: the events exchange (``events``);
- ``KOMBU_EVENTS_METRICS_HOST``: where ``/metrics`` and ``/healthz`` listen (``127.0.0.1``;
  ``0.0.0.0`` in a container, so that the kubelet and Prometheus reach them).

tests/integration/test_deployment.py starts it with the command line of
deploy/kubernetes/deployment.yaml against a real RabbitMQ.
"""
import logging
import os

from celery import Celery

from kombu_events import Events, poisonous

SERVICE = os.environ.get("EVENTS_SERVICE", "example")

app = Celery(SERVICE, broker="amqp://guest:guest@localhost:5672//")
app.conf.broker_connection_retry_on_startup = True
app.conf.task_default_queue = f"{SERVICE}.tasks"  # Celery tasks of this service, if any: not the shared `celery`
app.conf.kombu_events_metrics_host = os.environ.get("KOMBU_EVENTS_METRICS_HOST", "127.0.0.1")

events = Events(app, service=SERVICE, exchange=os.environ.get("EVENTS_EXCHANGE", "events"))
logger = logging.getLogger(__name__)


@events.handler("orders.*.created")
def on_order_created(payload):
    with poisonous():  # an order without an id will never have one: archived at once
        order_id = payload["order_id"]
    logger.info("order %s created", order_id)


@events.handler("orders.*.cancelled")
def on_order_cancelled(payload):
    logger.info("order %s cancelled", payload.get("order_id"))
