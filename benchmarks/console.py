"""The console with 10,000 archived events, on a RabbitMQ node of its own (scripts/rabbitmq-cluster):

1. the time of the failures page (grouped three ways) and of searches, first from a cold start (the
   archive read included), then from the snapshot the pages share; the archive is unchanged after;
2. "replay all matching" as a console job, first without a restart (its rate), then again with the node
   stopped and started again half-way: the job connects again and goes on, and every id is counted in the
   handler queues (lost, duplicated; a duplicate can only be a copy in flight when the connection died).

    python -m benchmarks.console [--n 10000]

It prints one line per figure. The shared node on 5672 is never touched.
"""
from __future__ import annotations

import argparse
import json
import re
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from pathlib import Path
from typing import Any

from kombu import Connection
from starlette.testclient import TestClient

from kombu_events.console import AuthSettings, ConsoleSettings, create_app
from kombu_events.ops.archive import read
from tests.integration.console_helpers import Seeded
from tests.integration.private_broker import PrivateBroker

TOKEN = "b" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}", "Sec-Fetch-Site": "same-origin"}
GROUPS = ["KeyError: 'order {n} not found'", "TimeoutError: ledger took {n}.5 s", "ValueError: bad amount {n}",
          "ConnectionError: payments down", "LookupError: customer {n} unknown"]


def _seed(service: Seeded, n: int) -> list[str]:
    batch, ids = 1000, []
    for start in range(0, n, batch):
        ids += service.archive([
            ("orders" if i % 3 else "users", f"{'orders' if i % 3 else 'users'}.{i % 20}.created",
             GROUPS[i % len(GROUPS)].format(n=i), json.dumps({"order": i, "note": f"item {i}"}).encode())
            for i in range(start, min(n, start + batch))], confirm=False)
    deadline = time.monotonic() + 120
    while _depth(service) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _depth(service) == n, f"{_depth(service)} archived of {n}"
    return ids


def _depth(service: Seeded) -> int:
    with Connection(service.broker_url) as conn:
        return int(conn.default_channel.queue_declare(service.queue("archive"), passive=True)[1])


def _timed(web: TestClient, path: str, **params: Any) -> tuple[float, str]:
    started = time.perf_counter()
    answer = web.get(path, params=params, headers=AUTH)
    assert answer.status_code == 200, answer.text[:500]
    return time.perf_counter() - started, answer.text


def _archive_ids(service: Seeded) -> list[str]:
    with Connection(service.broker_url) as conn:
        return [m.id for m in read(conn, service.events.topology())]


def _job(web: TestClient, job_id: str) -> dict[str, Any]:
    found: dict[str, Any] = web.get(f"/api/jobs/{job_id}", headers=AUTH).json()
    return found


def _start_replay(web: TestClient, rate: int | None = None) -> str:
    answer = web.post("/replay", data={"q": "", "scope": "matching", "rate": str(rate or "")}, headers=AUTH,
                      follow_redirects=False)
    assert answer.status_code == 303, answer.text[:500]
    return str(answer.headers["location"].rsplit("/", 1)[1])


def _wait(web: TestClient, job_id: str, until: Any, timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _job(web, job_id)
        if until(state):
            return state
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id}: {state}")


def pages(web: TestClient, service: Seeded, n: int) -> None:
    cold, text = _timed(web, "/failures")
    assert f"<strong>{n}</strong> of {n}" in text
    print(f"failures page, cold (archive of {n:,} read):     {cold:6.2f} s", flush=True)
    read_s = float(re.search(r"in ([0-9.]+) s", text).group(1))
    print(f"  of which the archive read (ops.archive.browse): {read_s:6.2f} s")
    started = time.perf_counter()
    _archive_ids(service)
    print(f"the same archive read with ops.archive.read (basic.get each, as `archive list`): "
          f"{time.perf_counter() - started:6.2f} s", flush=True)
    for by in ("exception", "key", "hour"):
        print(f"failures page grouped by {by:<9} (snapshot): {_timed(web, '/failures', by=by)[0]:6.3f} s")
    group = re.search(r"q=(group%3A[0-9a-f]+)", text)
    for q in ("exception:TimeoutError key:orders.*.created", "handler:users item",
              urllib.parse.unquote(group.group(1) if group else "group:none"), "since:2000-01-01 until:2999-01-01"):
        print(f"search {q!r:<48} {_timed(web, '/failures', q=q)[0]:6.3f} s")
    listed = _timed(web, "/api/archive", q="orders", limit=100)[0]
    print(f"JSON API list (100 of a search):             {listed:6.3f} s")


def replay_all(web: TestClient, service: Seeded, ids: list[str]) -> None:
    """Replay everything, no restart: the job's rate (reading, publishing, confirms and acks pipelined)."""
    started = time.perf_counter()
    done = _wait(web, _start_replay(web), lambda s: s["state"] in ("failed", "done"))
    took = time.perf_counter() - started
    print(f"replay job, no restart: {done['state']}, {done['replayed']:,} replayed in {took:.1f} s "
          f"({done['replayed'] / took:,.0f} msg/s)", flush=True)
    _count(service, ids)


def replay_with_restart(web: TestClient, broker: PrivateBroker, service: Seeded, ids: list[str]) -> None:
    # rabbitmqctl takes seconds to start: a rate limit keeps the job going long enough for the stop to land.
    n, rate = len(ids), 700
    started = time.perf_counter()
    job = _start_replay(web, rate)
    _wait(web, job, lambda s: s["replayed"] >= n // 10)
    print(f"{n // 10:,} confirmed after {time.perf_counter() - started:.1f} s (rate limit {rate}/s); "
          "stopping the node", flush=True)
    stopper = threading.Thread(target=broker.stop_app)
    stopper.start()
    stopped = _job(web, job)
    while stopper.is_alive():
        stopped = _job(web, job)
        time.sleep(0.05)
    broker.start_app()
    print(f"node stopped at {stopped['replayed']:,} confirmed, back after {time.perf_counter() - started:.1f} s")
    done = _wait(web, job, lambda s: s["state"] in ("failed", "done", "cancelled"))
    took = time.perf_counter() - started
    print(f"replay job with a restart: {done['state']}, {done['replayed']:,} replayed in {took:.1f} s "
          f"({done['replayed'] / took:,.0f} msg/s, the restart included); reconnects {done['reconnects']}, "
          f"commits {done['commits']}")
    _count(service, ids)


def _count(service: Seeded, ids: list[str]) -> None:
    copies = Counter(m.properties["message_id"] for m in service.take("orders") + service.take("users"))
    lost = set(ids) - set(copies)
    duplicated = {i: c for i, c in copies.items() if c > 1}
    print(f"handler queues: {sum(copies.values()):,} copies of {len(copies):,} ids; lost {len(lost)}, "
          f"duplicated {len(duplicated)}; archive left {len(_archive_ids(service))}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Seed, browse, replay with a restart; print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    args = parser.parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="console-bench-"))
    broker = PrivateBroker(directory / "rabbitmq")
    broker.start()
    try:
        service = Seeded(broker.url)
        started = time.perf_counter()
        ids = _seed(service, args.n)
        print(f"seeded {len(ids):,} archived events in {time.perf_counter() - started:.1f} s")
        settings = ConsoleSettings(auth=AuthSettings(tokens={TOKEN: ("bench", "operator")}), max_age_s=600,
                                   audit_path=directory / "audit.jsonl")
        with TestClient(create_app(service.events, settings), base_url="http://127.0.0.1") as web:
            pages(web, service, args.n)
            assert _archive_ids(service) == ids, "browsing changed the archive"
            print("archive after browsing: same ids, same order")
            replay_all(web, service, ids)
            ids = _seed(service, args.n)
            web.get("/failures", params={"fresh": "1"}, headers=AUTH)
            replay_with_restart(web, broker, service, ids)
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
