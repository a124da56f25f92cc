"""A handler's ``concurrency``: at most N of its calls at once in a worker, across the pool's processes or
threads, ``async def`` included; the service's other handlers keep the whole pool. Each call records its
start and end; the overlap is counted from those records, across every process of the worker."""
from __future__ import annotations

import collections
import time

import pytest

from .harness import queue_counts, wait_for
from .test_async_handlers import _overlap, publish

pytestmark = pytest.mark.integration

N = 30

APP = """
import asyncio

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4, max_retries=3)

@events.handler("limited.#", bind=True, concurrency=2)
def limited(event):
    record(kind="start", handler="limited", id=event.message_id)
    time.sleep(0.15)
    if event.payload.get("fail") and event.attempt == 1:
        record(kind="end", handler="limited", id=event.message_id, failed=True)
        raise RuntimeError("fails once, by design")
    record(kind="end", handler="limited", id=event.message_id)

@events.handler("awaited.#", bind=True, concurrency=3)
async def awaited(event):
    record(kind="start", handler="awaited", id=event.message_id)
    await asyncio.sleep(0.2)
    record(kind="end", handler="awaited", id=event.message_id)

@events.handler("free.#", bind=True)
def free(event):
    record(kind="start", handler="free", id=event.message_id)
    time.sleep(0.3)
    record(kind="end", handler="free", id=event.message_id)
"""


def peak(project, handler: str) -> int:
    """The most calls of ``handler`` running at one time, over every process (attempts told apart)."""
    starts = project.records(kind="start", handler=handler)
    ends = project.records(kind="end", handler=handler)
    for i, r in enumerate(starts):
        r["id"] = f"{r['id']}#{i}"
    by_id: dict[str, list[dict]] = collections.defaultdict(list)
    for r in ends:
        by_id[r["id"]].append(r)
    seen: dict[str, int] = collections.Counter()
    paired = {}
    for r in starts:
        base = r["id"].rsplit("#", 1)[0]
        paired[r["id"]] = by_id[base][seen[base]]  # a retry's end follows its own start, in the file's order
        seen[base] += 1
    return _overlap(starts, paired)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_at_most_concurrency_calls_of_a_handler_at_once_and_the_others_keep_the_pool(make_project, broker_url,
                                                                                     pool):
    project = make_project(APP)
    project.worker(pool=pool, concurrency=4).wait_ready()
    items = [(f"limited.{i}", {"i": i, "fail": i % 10 == 0}, f"l-{i}") for i in range(N)]
    items += [(f"awaited.{i}", {"i": i}, f"a-{i}") for i in range(N)]
    items += [(f"free.{i}", {"i": i}, f"f-{i}") for i in range(N)]
    publish(broker_url, project.exchange, items)
    wait_for(lambda: len(project.records(kind="end")) >= 3 * N + 3, timeout=120, interval=0.3,
             what=f"{3 * N + 3} calls ended")
    time.sleep(0.5)  # a late duplicate would show by now

    peaks = {handler: peak(project, handler) for handler in ("limited", "awaited", "free")}
    print(f"\n{pool} -c 4: most calls at once {peaks}")
    assert peaks["limited"] == 2, "at most 2 at once, and the pool gave it 2"
    assert peaks["awaited"] == 3, "at most 3 coroutines at once, and the loop awaited 3 together"
    assert peaks["free"] >= 3, "the handler without a limit of its own used more of the pool"
    done = collections.Counter(r["id"] for r in project.records(kind="end") if not r.get("failed"))
    assert done == collections.Counter(m for _, _, m in items), "each handled once, the failed ones retried"
    counts = queue_counts(broker_url)  # the archive (a stream) left unread: nothing was archived
    mine = {n: counts[n][:2] for n in counts if n.startswith(project.service + ".") and not n.endswith(".archive")}
    assert all(c == (0, 0) for c in mine.values()), f"left in the broker: {mine}"
