"""The console with 10,000 archived events on a private RabbitMQ node: its index is built once and pages answer
fast from it, and a replay job survives a broker restart: every event sent back, none lost, and a copy sent
twice only if the broker confirmed it just before the restart and it was not settled yet (an inbox drops it).

The node is the tests' own (``private_broker``): it is stopped and started again mid-replay; the shared
node on 5672 is never touched. Figures are printed (``-s``); the only timed asserts are the issue's own
"under a second" for a page served from the index.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from typing import Any
from urllib.parse import urlparse

import amqp
import pytest
from kombu import Connection
from starlette.testclient import TestClient

from kombu_events.console import AuthSettings, ConsoleSettings, create_app
from kombu_events.core import wire

from .console_helpers import Seeded
from .harness import unique, wait_for

pytestmark = pytest.mark.integration

N = 10_000
TOKEN = "k" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}", "Sec-Fetch-Site": "same-origin"}
RATE = 400  # the job lasts 25 s at least: a 4.0 node in its root took over 15 s to stop under load (a CI run)
#: Copies a replay window holds at this rate (console.jobs): at most this many may be sent twice.
WINDOW = 200
KINDS = ["KeyError: 'order {n} not found'", "TimeoutError: ledger took {n}.5 s", "ValueError: bad amount {n}",
         "ConnectionError: payments down"]


def _depth(service: Seeded, name: str) -> int:
    with Connection(service.broker_url) as conn:
        return int(conn.default_channel.queue_declare(service.queue(name), passive=True)[1])


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


def _seed(service: Seeded) -> list[str]:
    """10,000 archived events published straight into the archive, headers as a worker writes them
    (:func:`kombu_events.core.wire.archive_headers`, an archive key each), no confirm each: the stream's
    count is waited for."""
    archive, queue, ids = service.events.topology().archive_exchange, service.queue("orders"), []
    conn = amqp.Connection(urlparse(service.broker_url).netloc.rsplit("@", 1)[1], userid="guest", password="guest")
    conn.connect()
    try:
        channel = conn.channel()
        for i in range(N):
            exception = KINDS[i % len(KINDS)].format(n=i)
            headers = wire.archive_headers({}, attempt=3, queue=queue, routing_key=f"orders.{i % 20}.created",
                                           reason=f"gave up after 3 attempts: {exception}", exception=exception,
                                           traceback=f"Traceback ...\n{exception}\n")
            ids.append(unique("m"))
            channel.basic_publish(amqp.Message(json.dumps({"order": i}).encode(), message_id=ids[-1],
                                               content_type="application/json", delivery_mode=2,
                                               application_headers=headers), exchange=archive, routing_key="")
    finally:
        conn.close()
    deadline = time.monotonic() + 60
    while _depth(service, "archive") < N and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _depth(service, "archive") >= N
    return ids


def _get(web: TestClient, path: str, **params: Any) -> tuple[float, str]:
    started = time.perf_counter()
    answer = web.get(path, params=params, headers=AUTH)
    assert answer.status_code == 200, answer.text[:300]
    return time.perf_counter() - started, answer.text


def _job(web: TestClient, job_id: str) -> dict[str, Any]:
    found: dict[str, Any] = web.get(f"/api/jobs/{job_id}", headers=AUTH).json()
    return found


def _restart(broker: Any, stopped: threading.Event) -> None:
    broker.stop_app()
    stopped.set()
    broker.start_app()


def test_10k_pages_fast_and_replay_across_a_broker_restart_loses_none(private_broker, tmp_path):
    service = Seeded(private_broker.url, handlers=("orders",))
    try:
        started = time.perf_counter()
        ids = _seed(service)
        print(f"\nseeded {N:,} archived events in {time.perf_counter() - started:.1f} s")
        settings = ConsoleSettings(auth=AuthSettings(tokens={TOKEN: ("ci", "operator")}),
                                   audit_path=tmp_path / "audit.jsonl")
        rss_before = _rss_mib()
        with TestClient(create_app(service.events, settings), base_url="http://127.0.0.1") as web:
            started = time.perf_counter()
            index = web.app.state.service.index
            assert index.wait_caught_up(120)
            caught = time.perf_counter() - started
            wait_for(lambda: len(index.view().entries) == N, 30, what="every copy indexed")  # some still arriving
            built = time.perf_counter() - started
            first, text = _get(web, "/failures")
            assert f"<strong>{N}</strong> of {N}" in text, re.findall(r'<p class="(?:meta|alert)".*', text)
            grouped, text = _get(web, "/failures", by="key")
            assert "orders.19.created" in text
            search, text = _get(web, "/failures", q="exception:TimeoutError key:orders.*.created")
            assert f"<strong>{N // 4}</strong> of {N}" in text
            words, text = _get(web, "/failures", q="ledger 5")
            api, _ = _get(web, "/api/archive", limit="500", q="exception:ValueError")
            print(f"index of {N:,} caught up in {caught:.2f} s, complete in {built:.2f} s (console RSS "
                  f"+{_rss_mib() - rss_before:.0f} MiB); failures page {first:.3f} s; grouped by key {grouped:.3f} s; "
                  f"search {search:.3f} s; words {words:.3f} s; API page of 500 {api:.3f} s")
            assert max(first, grouped, search, words, api) < 1.0, (first, grouped, search, words, api)

            # rabbitmqctl takes seconds to start: it is started once 500 are settled, and a rate limit (the
            # form's "at most N a second") keeps the job going for 25 s at least, so the node stops mid-replay.
            answer = web.post("/replay", data={"q": "", "scope": "matching", "rate": str(RATE)}, headers=AUTH,
                              follow_redirects=False)
            assert answer.status_code == 303, answer.text[:300]
            job_id = answer.headers["location"].rsplit("/", 1)[1]
            began = time.perf_counter()
            while _job(web, job_id)["replayed"] < 500:
                assert time.perf_counter() - began < 60, _job(web, job_id)
                time.sleep(0.05)
            stopped = threading.Event()
            restart = threading.Thread(target=_restart, args=(private_broker, stopped))
            restart.start()
            stopped_at = -1
            while (state := _job(web, job_id))["state"] not in ("done", "failed", "cancelled") or restart.is_alive():
                if stopped.is_set() and stopped_at < 0:
                    stopped_at = state["replayed"]
                assert time.perf_counter() - began < 180, state
                time.sleep(0.1)
            restart.join()
            took = time.perf_counter() - began
            print(f"replay job: {state['state']}, {state['replayed']:,} replayed in {took:.1f} s "
                  f"({N / took:,.0f} msg/s, rate limit {RATE}/s, the restart included); {stopped_at:,} "
                  f"settled when the node stopped; reconnects {state['reconnects']}, windows {state['commits']}")
            assert 0 < stopped_at < N, "the node did not stop mid-replay"
            assert state["state"] == "done", state
            assert state["reconnects"] >= 1, "the broker restart did not happen mid-replay"
            wait_for(lambda: "<strong>0</strong> of 0" in _get(web, "/failures")[1], 30,
                     what="the index reading on after the restart")
        copies = service.take("orders")
        by_id = Counter(m.properties["message_id"] for m in copies)
        assert set(by_id) == set(ids), (len(set(ids) - set(by_id)), "lost")
        duplicated = sorted(i for i, c in by_id.items() if c > 1)
        print(f"counted by id: {len(copies):,} copies of {len(by_id):,} ids, lost 0, sent twice {len(duplicated)} "
              f"(confirmed, not settled yet, when the connection went)")
        # A window is settled once the broker confirmed its copies: only one window can be confirmed and not
        # settled when the connection goes; its copies are sent again with the same message id and archive key.
        assert len(duplicated) <= WINDOW and max(by_id.values()) <= 2
        keys = {}
        for m in copies:
            assert keys.setdefault(m.properties["message_id"], m.properties["application_headers"][wire.REPLAY_OF]) \
                == m.properties["application_headers"][wire.REPLAY_OF]
        assert service.pending() == []
    finally:
        service.cleanup()
