"""Everything on, under faults (issue 19, item 4): one service with every feature, a prefork and a solo worker.

Middleware counting its hooks, a circuit breaker, a periodic schedule, delayed
publishing, metrics, tracing, Sentry and a publisher with a local backlog, all in one
service (``everything_app``); 2,000 events from the Node.js publisher, each with its own
message id; first attempts failing by design (a hash of SEED and the id); then, one
after each chunk of events: the breaker's dependency down for 3 s, a pool child
killed with -9 (prefork), the broker restarted (a private node), the worker's
connection gone silent behind a proxy while that dependency is down again and the
circuit open (heartbeats must notice within 20 s), and the worker killed with -9 and
started again. Exact accounting by message id (``everything_accounting``): every event
handled at least once, the archive holding exactly the poison events, the worker never
exiting on its own, no "Unrecoverable error", the hooks consistent with the handler
calls, the spans, the Sentry reports and the metrics, no period of the schedule lost.
About a minute per pool.

The queues are classic, the default, which dead-letter at most once (docs/failures.md): a
message expiring in a delay queue as the node stops may be dropped by the broker. The
accounting counts such a loss apart, and only for an event whose last trace is a confirmed
publish into a ladder (a retry, a requeue, a handler's delayed event) that was waiting there
while the broker stopped; any other loss fails, with the event's history printed.

Run with ``-s`` to see the timeline and the figures; ``SEED=...`` replays a run.
``python -m benchmarks.soak`` runs the same scenario for as long as asked.
"""
from __future__ import annotations

import os
import random

import pytest

from .everything import Scenario

pytestmark = pytest.mark.integration

SEED = os.environ.get("SEED") or str(random.SystemRandom().randrange(1_000_000))
EVENTS = 2000


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_everything_on_under_faults_every_event_is_handled_and_the_worker_never_exits(private_broker, tmp_path,
                                                                                      pool):
    print(f"\nSEED={SEED} (SEED={SEED} replays this run)")
    scenario = Scenario(private_broker, tmp_path, pool=pool, seed=SEED, events=EVENTS)
    try:
        scenario.start()
        scenario.cycle(0)
        report = scenario.finish()
    finally:
        scenario.close()
    print("\n".join(report.lines()))
    assert not report.problems, f"SEED={SEED}, pool {pool}:\n" + "\n".join(report.problems)
