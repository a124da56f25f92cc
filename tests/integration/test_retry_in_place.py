"""``retry_in_place_ms``: a retry whose delay is within it runs again in the worker, its message held unacked,
instead of going through the ladder; a worker killed -9 while retries wait in it loses none of them. Published
from Node.js, counted from the handlers' own records and the broker's queues."""
from __future__ import annotations

import collections

import pytest

from .harness import node_message, queue_counts, wait_for

pytestmark = pytest.mark.integration

N = 60

APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=8,
                retry_in_place_ms=IN_PLACE_MS, prefetch_count=100, max_body_bytes=2**20)  # room for N at once

@events.handler("orders.#", bind=True, backoff=Constant(every_ms=BACKOFF_MS), max_retries=3)
def orders(event):
    ladder = "kombu-events-attempts" in event.headers  # set on a copy republished through the ladder
    record(kind="start", seq=event.payload["seq"], attempt=event.attempt, ladder=ladder)
    if event.attempt == 1:
        raise RuntimeError("fails its first attempt, by design")
    record(kind="end", seq=event.payload["seq"], attempt=event.attempt, ladder=ladder)
"""


def publish(project) -> None:
    project.node_publish(*[node_message("orders.created", {"seq": seq}, messageId=f"m-{seq}") for seq in range(N)])


def left(project, broker_url) -> dict[str, tuple[int, int]]:
    counts = queue_counts(broker_url)
    return {n: counts[n][:2] for n in counts
            if n.startswith(project.service + ".") and not n.endswith(".archive") and counts[n][:2] != (0, 0)}


@pytest.mark.parametrize("in_place_ms, through_ladder", [(1000, False), (0, True)])
def test_a_retry_within_the_bound_runs_again_in_the_worker_not_through_the_ladder(make_project, broker_url,
                                                                                 in_place_ms, through_ladder):
    project = make_project(APP.replace("IN_PLACE_MS", str(in_place_ms)).replace("BACKOFF_MS", "300"))
    project.worker(pool="prefork", concurrency=2).wait_ready()
    publish(project)
    wait_for(lambda: len(project.records(kind="end")) >= N, timeout=60, what=f"{N} events handled")
    ends = project.records(kind="end")
    assert sorted(r["seq"] for r in ends) == list(range(N)), "each event handled once"
    assert {(r["attempt"], r["ladder"]) for r in ends} == {(2, through_ladder)}
    wait_for(lambda: not left(project, broker_url), timeout=20, what="nothing left in the service's queues")


def test_a_worker_killed_while_retries_wait_in_it_loses_none(make_project, broker_url):
    """Every event failed once and waits 6 s in the worker, unacked, when it is killed -9: the broker redelivers
    them to the next worker, which runs them again (at least once) and handles every one."""
    project = make_project(APP.replace("IN_PLACE_MS", "10000").replace("BACKOFF_MS", "6000"))
    first = project.worker(pool="prefork", concurrency=2).wait_ready()
    publish(project)
    wait_for(lambda: len(project.records(kind="start")) >= N, timeout=30, what=f"{N} first attempts")
    assert queue_counts(broker_url)[f"{project.service}.orders"][:2] == (0, N), "each waits in the worker, unacked"
    assert not project.records(kind="end"), "killed before any retry is due"
    first.kill()
    project.worker(pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: {r["seq"] for r in project.records(kind="end")} == set(range(N)), timeout=90,
             what=f"{N} events handled after the kill")
    starts = collections.Counter(r["seq"] for r in project.records(kind="start"))
    assert all(starts[seq] >= 2 for seq in range(N))
    wait_for(lambda: not left(project, broker_url), timeout=30, what="nothing left in the service's queues")
