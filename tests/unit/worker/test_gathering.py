"""worker/gathering.py and the hand-off of a batch handler's messages: held until full or waited, one job."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from kombu_events.core import decision
from kombu_events.core.delivery import read_delivery
from kombu_events.worker import batch_handlers, runner
from kombu_events.worker.gathering import Gatherer
from kombu_events.worker.handoff import Handoff, Received
from kombu_events.worker.mailbox import Mailbox

from .fakes import Pool, Settles

OK = decision.Outcome(decision.OK)


class Hub:
    def __init__(self) -> None:
        self.timers: list[tuple[float, Any, tuple[Any, ...]]] = []

    def call_later(self, delay_s, fn, *args):
        self.timers.append((delay_s, fn, args))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_batch_goes_when_full_or_when_its_first_has_waited():
    sent: list[list[int]] = []
    hub, clock = Hub(), Clock()
    gatherer: Gatherer[int] = Gatherer({"q": (3, 50)}, sent.append, clock=clock)
    gatherer.attach(hub)
    for i in range(4):
        gatherer.add("q", i)
    assert sent == [[0, 1, 2]] and gatherer.held("q") == 1
    assert [delay for delay, _, _ in hub.timers] == [0.05, 0.05]
    clock.now = 0.02
    hub.timers[1][1](*hub.timers[1][2])  # too early (the first batch's timer): waits on
    assert sent == [[0, 1, 2]] and hub.timers[-1][0] == 0.03
    clock.now = 0.05
    gatherer.due("q")
    assert sent == [[0, 1, 2], [3]] and gatherer.held("q") == 0
    gatherer.due("q")  # nothing held: nothing sent
    assert len(sent) == 2 and "q" in gatherer and "other" not in gatherer


def test_without_a_hub_each_message_goes_at_once_and_a_reconnect_drops_what_was_held():
    sent: list[list[int]] = []
    gatherer: Gatherer[int] = Gatherer({"q": (3, 50)}, sent.append)
    gatherer.attach(None)
    gatherer.add("q", 1)
    assert sent == [[1]]
    gatherer.attach(Hub())
    gatherer.add("q", 2)
    gatherer.attach(Hub())  # the broker redelivers what was held
    assert gatherer.held("q") == 0 and sent == [[1]]


def received(i: int, queue: str = "svc.store") -> Received:
    d = read_delivery(queue, json.dumps({"i": i}).encode(), {"message_id": f"m{i}", "content_type": "application/json"},
                      {"routing_key": "orders.created", "redelivered": False}, received=0.0)
    route = SimpleNamespace(handler=SimpleNamespace(queue=queue, max_retries=3, backoff=None, fn=print))
    return Received(route, d, SimpleNamespace(body=d.body), (queue, d.body, d.content_type, None, (), False))


def test_the_handoff_sends_a_batch_queue_s_messages_as_one_job_and_settles_each():
    settles, pool, hub = Settles(), Pool(), Hub()
    pool.limit = 4
    handoff = Handoff("svc", awaited=frozenset(), async_concurrency=10, mailbox=Mailbox("svc"), settler=settles,
                      batches={"svc.store": (3, 50)})
    handoff.attach(None, pool, hub, in_flight=100)
    for i in range(3):
        handoff.add(received(i))
    handoff.add(received(9, queue="svc.other"))  # not a batch queue: as before
    batch_jobs = [job for job in pool.jobs if job[0] is batch_handlers.run]
    assert len(batch_jobs) == 1 and [json.loads(item[1])["i"] for item in batch_jobs[0][1][0]] == [0, 1, 2]
    batch_jobs[0][2]([OK, OK, OK])
    assert [m for m, _ in settles.settled] == ["m0", "m1", "m2"]
    handoff.gatherer.clock = clock = Clock()
    handoff.add(received(3))
    handoff.add(received(4))
    clock.now = 1.0
    delay_s, due, args = hub.timers[-1]
    assert delay_s == 0.05
    due(*args)  # waited: the partial batch goes
    assert [json.loads(item[1])["i"] for item in pool.jobs[-1][1][0]] == [3, 4]
    pool.jobs[-1][3](SimpleNamespace(exception=RuntimeError("lost"), traceback=""))  # each again, on its own
    assert [fn for fn, *_ in pool.jobs[-2:]] == [batch_handlers.run_one] * 2
    assert runner.run not in [fn for fn, *_ in pool.jobs[-2:]]
