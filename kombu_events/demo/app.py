"""The demo's Celery project: two handlers, one flaky, and a plain Celery task beside them."""
from __future__ import annotations

import os

from celery import Celery

from kombu_events import Event, Events, Exponential

app = Celery("demo", broker=os.environ.get("RABBIT_URL", "amqp://guest:guest@127.0.0.1:5672//"))
app.conf.broker_connection_retry_on_startup = True
# Celery's default is 4 s; a busy machine (a CI run beside a second RabbitMQ node) once took longer to accept
# the connection that sends add(2, 3), and the demo failed for that alone.
app.conf.broker_connection_timeout = 30
app.conf.task_default_queue = "kombu-events-demo.tasks"  # the demo's own, deleted with the rest (not `celery`)
events = Events(app, service="kombu-events-demo", exchange="kombu-events-demo",
                backoff=Exponential(base_ms=1000, max_delay_ms=4000), max_retries=3)


@events.handler("orders.*.created")
def on_order_created(payload: dict) -> None:
    """Called with the decoded JSON body of every ``orders.<id>.created`` event."""
    print(f"[demo] handled order {payload['order_id']} created (pid {os.getpid()})", flush=True)


@events.handler("orders.#", bind=True)
def audit(event: Event) -> None:
    """Fails on the first attempt of order 3 to show a broker-side retry."""
    if event.payload.get("order_id") == 3 and event.attempt == 1:
        raise ConnectionError("audit store briefly unavailable")
    print(f"[demo] audited {event.routing_key} attempt {event.attempt}", flush=True)


@app.task
def add(x: int, y: int) -> int:
    """A normal Celery task, served by the same worker."""
    return x + y
