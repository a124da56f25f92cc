"""The service of ``benchmarks.breaker_scenario``: a flaky handler behind a circuit breaker, and a healthy one.

Imported by the worker as the top-level module ``breaker_app`` (``benchmarks/apps`` on its
``PYTHONPATH``, nothing else of the repository), so that ``kombu_events`` comes from the
runner's ``--pythonpath`` when given (e.g. a worktree of an older commit), else from the
installed package.
The configuration is issue 19's: ``CircuitBreaker(max_failures=3, window_s=30, reset_s=3)``,
``Constant(every_ms=200)``, ``max_retries=50``; the other settings are the library's defaults.

``KEB_BRK_*`` environment variables: ``SERVICE``, ``EXCHANGE``, ``RECORDS`` (JSON lines
appended by the handlers and the ``circuit_changed`` signal), ``DOWN`` (the flaky handler
raises while this file exists), ``WORK_MS`` (each handler call sleeps that long first).
"""
from __future__ import annotations

import json
import os
import time

from celery import Celery

import kombu_events
from kombu_events import CircuitBreaker, Constant, Events, signals

SERVICE = os.environ["KEB_BRK_SERVICE"]
RECORDS = os.environ["KEB_BRK_RECORDS"]
DOWN = os.environ["KEB_BRK_DOWN"]
WORK_S = float(os.environ.get("KEB_BRK_WORK_MS") or 0) / 1000

# The runner reads this line to report which code the worker runs.
print(f"breaker_app: kombu_events from {kombu_events.__file__}", flush=True)

app = Celery(SERVICE, broker=os.environ["KEB_BROKER"])
app.conf.broker_connection_retry_on_startup = True
app.conf.task_default_queue = f"{SERVICE}.tasks"  # its own, deleted with the run

events = Events(app, service=SERVICE, exchange=os.environ["KEB_BRK_EXCHANGE"])


def record(**fields: object) -> None:
    """Append one JSON line (one ``write`` of a line: the runner may read while this writes)."""
    fields["t"] = time.time()
    with open(RECORDS, "a") as fh:
        fh.write(json.dumps(fields) + "\n")


@events.handler("flaky.#", bind=True, backoff=Constant(every_ms=200), max_retries=50,
                circuit_breaker=CircuitBreaker(max_failures=3, window_s=30, reset_s=3))
def flaky(event):
    """Fails while the dependency is down (the ``DOWN`` file exists)."""
    if WORK_S:
        time.sleep(WORK_S)
    down = os.path.exists(DOWN)
    record(handler="flaky", id=event.message_id, attempt=event.attempt, ok=not down)
    if down:
        raise ConnectionError("dependency down: connection refused")


@events.handler("healthy.#", bind=True)
def healthy(event):
    """Always succeeds."""
    if WORK_S:
        time.sleep(WORK_S)
    record(handler="healthy", id=event.message_id, attempt=event.attempt, ok=True)


@signals.circuit_changed.connect
def circuit_changed(sender, queue, state, previous, reason, **kwargs):
    record(circuit=state, previous=previous, reason=reason, queue=queue)
