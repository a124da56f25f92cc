"""The budget of body bytes in flight (``inflight_max_bytes``) against the real RabbitMQ: twelve 15 MiB bodies
queued at once for a worker with a 48 MiB budget are each handled once (in publish order with solo), and the
broker never has more of them unacknowledged than the budget holds; one body larger than the budget is still
handled. The memory this saves is measured by ``python -m benchmarks.inflight_memory``, not asserted here."""
from __future__ import annotations

import threading

import pytest

from kombu_events.publishing.publisher import Publisher, build_message

from .harness import consumer_prefetch, queue_counts, wait_for

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
N = 12
BODY = 15 * MIB
BUDGET = 48 * MIB

APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, inflight_max_bytes={budget}, max_body_bytes={body_max})

@events.handler("big.#", bind=True)
def handle(event):
    time.sleep(0.2)
    record(kind="handled", id=event.payload["id"], size=len(event.body))
"""


def publish(broker_url: str, exchange: str, sizes: list[int]) -> None:
    """Publish one JSON body of about each size (ids 0, 1, ...), all confirmed."""
    publisher = Publisher(broker_url)
    try:
        items = [(exchange, f"big.{i}", build_message({"id": i, "pad": "x" * (size - 40)}, message_id=f"id-{i}"))
                 for i, size in enumerate(sizes)]
        assert publisher.send_many(items) == [None] * len(items)
    finally:
        publisher.close()


class UnackedWatch(threading.Thread):
    """Samples the queue's unacknowledged count through ``rabbitmqctl`` (exact, ~0.4 s a sample) until stopped."""

    def __init__(self, broker_url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.broker_url, self.queue = broker_url, queue
        self.samples: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            counts = queue_counts(self.broker_url).get(self.queue)
            if counts is not None:
                self.samples.append(counts[1])

    def stop(self) -> list[int]:
        self.done.set()
        self.join(timeout=10)
        return self.samples


def handler_queue(project) -> str:
    return f"{project.service}.handle"


@pytest.mark.parametrize("pool, concurrency", [("solo", 1), ("prefork", 2)])
def test_twelve_15_mib_bodies_with_a_48_mib_budget_are_each_handled_once_never_more_than_3_unacked(
        make_project, broker_url, pool, concurrency):
    project = make_project(APP.format(budget=BUDGET, body_max=16 * MIB))
    project.declare()
    queue = handler_queue(project)
    publish(broker_url, project.exchange, [BODY] * N)  # all waiting before the worker starts: the worst case
    watch = UnackedWatch(broker_url, queue)
    watch.start()
    try:
        worker = project.worker(pool=pool, concurrency=concurrency).wait_ready()
        assert consumer_prefetch(broker_url).get(queue) == [BUDGET // (16 * MIB)], "bodies of max_body_bytes fit"
        wait_for(lambda: len(project.records(kind="handled")) >= N, timeout=120, interval=0.3,
                 what=f"{N} bodies handled")
        wait_for(lambda: project.settled("handle"), timeout=30, what="every message acked")
    finally:
        samples = watch.stop()
    handled = [r["id"] for r in project.records(kind="handled")]
    if pool == "solo":
        assert handled == list(range(N)), "each once, in publish order"
    else:
        assert sorted(handled) == list(range(N)), "each once"
    assert all(r["size"] >= BODY - 64 for r in project.records(kind="handled"))
    allowed = BUDGET // BODY + 1  # what the budget holds, and the one a pause could come too late for
    assert samples and max(samples) <= allowed, f"unacknowledged over time: {samples}"
    assert max(samples) >= 1, f"the watch never saw the worker holding a message: {samples}"
    assert "Traceback" not in worker.log


def test_one_body_larger_than_the_whole_budget_is_handled_and_the_rest_follow(make_project, broker_url):
    # 15 MiB: under RabbitMQ 4's largest message (16 MiB), over this test's budget of 8 MiB.
    project = make_project(APP.format(budget=8 * MIB, body_max=16 * MIB))
    project.declare()
    publish(broker_url, project.exchange, [15 * MIB, 1000, 1000])
    # One pool process: the budget never caps the prefetch under the handlers the pool runs at once, so with
    # one the large body is taken alone; settled later than received, it makes a pause.
    worker = project.worker(pool="prefork", concurrency=1).wait_ready()
    wait_for(lambda: len(project.records(kind="handled")) >= 3, timeout=120, interval=0.3,
             what="the large body and the two after it handled")
    handled = [r["id"] for r in project.records(kind="handled")]
    assert handled[0] == 0 and sorted(handled) == [0, 1, 2], "alone first"
    wait_for(lambda: project.settled("handle"), timeout=30, what="every message acked")
    assert "over inflight_max_bytes" in worker.log and "consuming again" in worker.log, worker.log[-3000:]
    assert "Traceback" not in worker.log
