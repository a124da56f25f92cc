"""Periodic events with real workers: one run per period, phased, crashes, restarts, retirement, a new period.

Every schedule records each run (period, due, missed, pid, parent pid, start and end
times) in the project's records file; the assertions count those records exactly.
Periods are short (0.3 - 0.5 s) and the service's ladder unit 50 ms, so a test takes
seconds.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from .harness import queue_counts, run_cli, wait_for

pytestmark = pytest.mark.integration

PROJECT = """
import random

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=50, delay_levels=12, publish_delay_levels=0)

def periodic_run(event, seconds):
    started = time.time()
    record(kind="start", schedule=event.payload["schedule"], period=event.payload["period"], ppid=os.getppid(),
           start=started)
    time.sleep(seconds)
    record(kind="run", **event.payload, ppid=os.getppid(), start=started, end=time.time())
"""


def runs(project, schedule: str = "tick") -> list[dict]:
    return sorted(project.records(kind="run", schedule=schedule), key=lambda r: r["start"])


def periods(records: list[dict]) -> Counter:
    return Counter(r["period"] for r in records)


def worker_of(record: dict, workers) -> int:
    """Which of ``workers`` ran ``record`` (its process, or the parent of its prefork child)."""
    return next(i for i, w in enumerate(workers) if w.proc.pid in (record["pid"], record["ppid"]))


def test_three_workers_racing_run_every_period_exactly_once(make_project):
    project = make_project(PROJECT + """
@events.periodic("tick", every=0.4, catch_up="all", retire_after=30)
def tick(event):
    periodic_run(event, random.uniform(0.05, 0.15))
""")
    workers = [project.worker(pool=pool, concurrency=2) for pool in ("prefork", "threads", "solo")]
    for w in workers:
        w.wait_ready()
    # Stop the active worker twice on the way (warm): the single active consumer moves to another. A slow
    # hand-over may make periods late: catch_up="all" still runs each, so each is counted.
    for stop_at in (10, 20):
        wait_for(lambda n=stop_at: len(periods(runs(project))) >= n, timeout=30, what=f"{stop_at} periods")
        workers[worker_of(runs(project)[-1], workers)].stop()
    wait_for(lambda: len(periods(runs(project))) >= 31, timeout=30, what="31 periods")
    counted = periods(runs(project))
    first = min(counted)
    window = range(first, first + 30)
    assert [counted[p] for p in window] == [1] * 30, f"every period once: {dict(counted)}"
    assert max(counted.values()) == 1, "none twice"
    by_worker = Counter(worker_of(r, workers) for r in runs(project) if r["period"] in window)
    print(f"\n3-worker race: periods {first}..{first + 29}; runs per worker (prefork, threads, solo): "
          f"{[by_worker[i] for i in range(3)]}; total {sum(by_worker.values())}")
    assert len(by_worker) >= 2, "the schedule moved to another worker when its active one stopped"


def test_a_run_longer_than_the_period_delays_the_next_and_never_overlaps_it(make_project):
    project = make_project(PROJECT + """
@events.periodic("tick", every=0.3, retire_after=30)
def tick(event):
    periodic_run(event, 0.7)
""")
    for _ in range(2):
        project.worker(pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: len(runs(project)) >= 6, timeout=30, what="6 runs")
    done = runs(project)
    overlaps = [(a["period"], b["period"]) for a, b in zip(done, done[1:]) if b["start"] < a["end"]]
    assert overlaps == [], "phased: a run never starts while the previous one runs"
    assert all(b["start"] - a["end"] < 0.5 for a, b in zip(done, done[1:])), "the next runs as soon as it can"
    covered = sorted(p for r in done for p in (r["period"], *r["missed"]))
    assert covered == list(range(done[0]["period"], done[-1]["period"] + 1)), "every period run or caught up"
    assert all(r["missed"] for r in done[1:]), "each later run stands for the periods it delayed"


def test_a_worker_killed_in_a_run_runs_that_period_again_elsewhere_and_the_schedule_goes_on(make_project):
    project = make_project(PROJECT + """
@events.periodic("tick", every=0.5, catch_up="all", retire_after=30)
def tick(event):
    periodic_run(event, 0.3)
""")
    workers = [project.worker(pool="prefork", concurrency=1).wait_ready() for _ in range(3)]
    killed, mid_run = [], []
    for k in range(2):
        wait_for(lambda n=3 * (k + 1): len(runs(project)) >= n, timeout=30, what="runs before a kill")

        def in_progress() -> list[dict]:
            done = {r["period"] for r in runs(project)}
            return [r for r in project.records(kind="start") if r["period"] not in done | set(killed)]

        victim = wait_for(in_progress, timeout=10, interval=0.02, what="a run in progress")[-1]
        workers[worker_of(victim, workers)].kill()
        killed.append(victim["period"])
        if not project.records(kind="run", period=victim["period"], pid=victim["pid"]):
            mid_run.append(victim["period"])
    wait_for(lambda: all(p in periods(runs(project)) for p in killed), timeout=30, what="the killed periods again")
    last = max(periods(runs(project)))
    wait_for(lambda: max(periods(runs(project))) >= last + 3, timeout=30, what="the schedule goes on")
    counted = periods(runs(project))
    first = min(counted)
    missing = [p for p in range(first, max(counted) + 1) if p not in counted]
    starts = Counter(r["period"] for r in project.records(kind="start"))
    duplicate_runs = sum(n - 1 for n in starts.values())
    print(f"\nkill -9 in a run: periods {first}..{max(counted)}, killed in {killed}, "
          f"runs started twice: {duplicate_runs}, completed twice: {sum(n - 1 for n in counted.values())}")
    assert missing == [], "a period is never lost"
    assert mid_run and all(starts[p] == 2 for p in mid_run), "a period killed in its run ran again"
    assert duplicate_runs <= len(killed), "duplicates are at most the kills"


def test_after_every_worker_stopped_for_three_periods_latest_runs_once_and_all_runs_each(make_project):
    project = make_project(PROJECT + """
@events.periodic("tick", every=0.5, retire_after=60)
def tick(event):
    periodic_run(event, 0.01)

@events.periodic("each", every=0.5, catch_up="all", retire_after=60)
def each(event):
    periodic_run(event, 0.01)
""")
    worker = project.worker(pool="threads", concurrency=2).wait_ready()
    wait_for(lambda: len(runs(project)) >= 3 and len(runs(project, "each")) >= 3, timeout=30, what="3 runs each")
    worker.stop()
    before = {name: max(periods(runs(project, name))) for name in ("tick", "each")}
    time.sleep(2.2)  # at least 4 periods with no worker
    project.worker(pool="threads", concurrency=2).wait_ready()
    wait_for(lambda: len([r for r in runs(project) if r["period"] > before["tick"]]) >= 2, timeout=30,
             what="latest: runs after the restart")
    first_after = next(r for r in runs(project) if r["period"] > before["tick"])
    print(f"\nrestart after an outage: latest ran period {first_after['period']} once for missed "
          f"{first_after['missed']}")
    assert len(first_after["missed"]) >= 3, "one run for the missed periods, which it lists"
    assert first_after["missed"] == list(range(before["tick"] + 1, first_after["period"]))
    assert periods(runs(project))[first_after["period"]] == 1
    latest_now = max(periods(runs(project, "each")))
    wait_for(lambda: max(periods(runs(project, "each"))) >= latest_now + 6, timeout=30, what="all: catching up")
    each = periods(runs(project, "each"))
    assert sorted(each) == list(range(min(each), max(each) + 1)), "all: every missed period ran"
    assert max(each.values()) == 1 and all(not r["missed"] for r in runs(project, "each"))


def test_a_schedule_removed_from_the_code_is_retired_and_a_changed_period_is_picked_up(make_project):
    v1 = make_project(PROJECT + """
@events.periodic("gone", every=0.3, retire_after=2)
def gone(event):
    periodic_run(event, 0.01)

@events.periodic("tick", every=0.5, retire_after=20)
def tick(event):
    periodic_run(event, 0.01)
""")
    service = v1.service
    worker = v1.worker(pool="threads", concurrency=2).wait_ready()
    wait_for(lambda: len(runs(v1, "gone")) >= 3 and len(runs(v1)) >= 3, timeout=30, what="v1 runs")
    worker.stop()
    old_ticks, gone_runs = runs(v1), len(runs(v1, "gone"))
    v2 = make_project(PROJECT + """
@events.periodic("tick", every=0.3, retire_after=20)
def tick(event):
    periodic_run(event, 0.01)
""", service=service, exchange=v1.exchange)
    v2.worker(pool="threads", concurrency=2).wait_ready()
    wait_for(lambda: len(runs(v2)) >= 4, timeout=30, what="v2 runs at its new period")
    new_ticks = runs(v2)
    last_old_due = old_ticks[-1]["due"]
    assert new_ticks[0]["due"] > last_old_due, "the new period numbers on from the last run"
    dues = [r["due"] for r in new_ticks]
    assert all(_ms(d) % 300 == 0 for d in dues), f"every due time on the new period: {dues}"
    covered = sorted(p for r in new_ticks for p in (r["period"], *r["missed"]))
    assert covered == list(range(covered[0], covered[-1] + 1)), "the new numbering goes on without a gap"
    gone = (f"{service}.schedule.gone", f"{service}.schedule.gone.state")

    def retired() -> bool:
        return not any(name in queue_counts(v1.broker_url) for name in gone)

    wait_for(retired, timeout=15, interval=0.5, what="the removed schedule's queues expired with its token")
    assert not [n for n in queue_counts(v1.broker_url) if n.startswith(f"{service}.") and "gone" in n]

    def tokens() -> dict[str, int]:
        """Messages ready or unacked in the service's queues, but the live schedule's state."""
        return {n: c[0] + c[1] for n, c in queue_counts(v1.broker_url).items()
                if n.startswith(f"{service}.") and c[0] + c[1] and n != f"{service}.schedule.tick.state"}

    # A run publishes the next token before it acks its own: for a moment two are counted (the
    # next in the ladder, the running one unacked). A token that stays duplicated never settles.
    deadline = time.monotonic() + 5
    waiting = tokens()
    while sum(waiting.values()) > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        waiting = tokens()
    assert sum(waiting.values()) <= 1, f"nothing left but the live schedule's token: {waiting}"
    assert len(runs(v1, "gone")) == gone_runs, "a removed schedule never runs again"
    listed = run_cli(v2, "schedules", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["schedule"], row["every_s"], row["catch_up"]) == ("tick", 0.3, "latest")
    assert row["last_run"] >= new_ticks[-1]["period"] and row["outcome"] == "ok"
    assert _ms(row["next_due"]) == (row["last_run"] + 1) * 300
    table = run_cli(v2, "schedules")
    assert table.returncode == 0 and "tick" in table.stdout and "0.3s" in table.stdout, table.stdout


def _ms(iso: str) -> int:
    from datetime import datetime

    return round(datetime.fromisoformat(iso).timestamp() * 1000)


SAC = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("ordered.#", prefetch=1, single_active_consumer=True)
def ordered(payload):
    started = time.time()
    time.sleep(0.05)
    record(n=payload["n"], ppid=os.getppid(), start=started, end=time.time())
"""


def test_a_single_active_consumer_with_prefetch_one_handles_one_message_at_a_time_in_the_fleet(make_project):
    project = make_project(SAC)
    workers = [project.worker(pool="prefork", concurrency=2).wait_ready() for _ in range(2)]
    result = project.run_python(f"""
        from {project.module} import events
        events.publish_many([("ordered.x", {{"n": n}}) for n in range(12)])
    """)
    assert result.returncode == 0, result.stderr
    wait_for(lambda: len(project.records()) >= 12, timeout=30, what="12 handled")
    done = sorted(project.records(), key=lambda r: r["start"])
    assert [r["n"] for r in done] == list(range(12)), "in queue order"
    assert all(b["start"] >= a["end"] for a, b in zip(done, done[1:])), "one at a time"
    assert len({worker_of(r, workers) for r in done}) == 1, "by the single active consumer"
    assert queue_counts(project.broker_url)[f"{project.service}.ordered"][2] == 2, "both workers subscribed"
