"""Plain Celery tasks for the baselines: ``celery -A benchmarks.apps.celery_app worker -Q <queue>``.

``task_acks_late`` is on (the safety the events step gives); everything else is
Celery's default (prefetch multiplier 4, no result backend).
"""
from __future__ import annotations

import os

from celery import Celery

from benchmarks import probe

NOOP = "kebench.noop"
COUNTDOWN = "kebench.retry_countdown"

app = Celery("kebench", broker=os.environ.get("KEB_BROKER", "amqp://guest:guest@127.0.0.1:5672//"))
app.conf.broker_connection_retry_on_startup = True
app.conf.task_acks_late = True
app.conf.task_default_queue = os.environ.get("KEB_TASKQ", "kebench.tasks")
WAIT_S = float(os.environ.get("KEB_WAIT_S", "120"))
if os.environ.get("KEB_PREFETCH_MULTIPLIER"):  # only the countdown baseline sets it (see scenarios.py)
    app.conf.worker_prefetch_multiplier = int(os.environ["KEB_PREFETCH_MULTIPLIER"])


@app.task(name=NOOP)
def noop(i):
    probe.handled(i)


@app.task(name=COUNTDOWN, bind=True)
def retry_countdown(self, i, warm=False):
    if warm:
        return
    if self.request.retries == 0:
        probe.failed(i)
        raise self.retry(countdown=WAIT_S)
    probe.handled(i)


if "KEB_OUT" in os.environ:
    probe.install()
