"""`kombu-events migrate --archive` and `archive_rewrite.rewrite` on the real broker, a vhost per test: an
earlier version's archive (classic or quorum queue) moves into the stream while a publisher keeps archiving,
every message once; a move cut at any step is finished by the next run; a rewrite removes purged copies."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from amqp import Message
from kombu import Connection

from kombu_events.broker import streams
from kombu_events.core import wire
from kombu_events.core.config import Settings
from kombu_events.core.topology import build_topology
from kombu_events.ops import archive, archive_rewrite, migrate_archive
from kombu_events.testing import temporary_vhost

from .harness import Project, management_queue, run_cli, unique, wait_for

pytestmark = pytest.mark.integration

BODY = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("a.#")
def alpha(payload):
    pass
"""

LEGACY_ARGS = {
    "classic": {"x-queue-type": "classic", "x-message-ttl": 604_800_000, "x-max-length": 100_000},
    "quorum": {"x-queue-type": "quorum", "x-message-ttl": 604_800_000, "x-max-length": 100_000,
               "x-delivery-limit": 2_147_483_647},
}


@pytest.fixture
def project(tmp_path, broker_url):
    with temporary_vhost(broker_url) as url:
        yield Project(tmp_path, url, BODY)


def make_legacy_archive(project: Project, kind: str) -> str:
    """The archive as an earlier version declared it: a queue bound to the fanout exchange; then the rest."""
    name = f"{project.service}.archive"
    with Connection(project.broker_url) as conn:
        channel = conn.channel()
        channel.exchange_declare(name, "fanout", durable=True, auto_delete=False)
        channel.queue_declare(name, durable=True, auto_delete=False, arguments=LEGACY_ARGS[kind])
        channel.queue_bind(name, exchange=name, routing_key="")
    project.declare()  # keeps the old archive, with a warning
    return name


def archived(message_id: str, *, keyed: bool) -> Message:
    """An archived copy as a worker of an earlier version (no key) or of this one (keyed) publishes it."""
    headers = {wire.ARCHIVED_AT: f"2026-01-01T00:00:00.{message_id}", wire.REASON: "boom", "nested": {"a": [1]}}
    if keyed:
        headers[wire.ARCHIVE_KEY] = wire.new_archive_key()
    return Message(f'{{"id": "{message_id}"}}'.encode(), message_id=message_id, delivery_mode=2,
                   content_type="application/json", application_headers=headers)


def publish(url: str, exchange: str, ids: list[str]) -> None:
    with Connection(url) as conn:
        conn.connect()
        channel = conn.connection.channel()
        channel.confirm_select()
        for n, message_id in enumerate(ids):
            channel.basic_publish(archived(message_id, keyed=n % 2 == 0), exchange=exchange, routing_key="")


class Archiver(threading.Thread):
    """Keeps archiving through the exchange (confirmed, one at a time) until stopped: what workers do."""

    def __init__(self, url: str, exchange: str) -> None:
        super().__init__(daemon=True)
        self.url, self.exchange, self.sent, self.stop = url, exchange, [], threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Connection(self.url) as conn:
                conn.connect()
                channel = conn.connection.channel()
                channel.confirm_select()
                while not self.stop.is_set():
                    message_id = unique("live")
                    channel.basic_publish(archived(message_id, keyed=len(self.sent) % 3 == 0),
                                          exchange=self.exchange, routing_key="")
                    self.sent.append(message_id)
                    time.sleep(0.003)
        except BaseException as exc:  # the test fails on it
            self.error = exc

    def finish(self) -> list[str]:
        self.stop.set()
        self.join(30)
        assert self.error is None, self.error
        return self.sent


def stream_records(url: str, name: str) -> list[tuple[int, object]]:
    with Connection(url) as conn:
        conn.connect()
        return list(streams.read(conn.connection, name))


def ids_in_stream(url: str, name: str) -> Counter:
    found: Counter = Counter()
    for _offset, message in stream_records(url, name):
        headers = message.properties.get("application_headers") or {}
        if wire.SETTLEMENT not in headers:
            found[message.properties["message_id"]] += 1
    return found


def gone(url: str, name: str) -> bool:
    with Connection(url) as conn:
        try:
            conn.channel().queue_declare(name, passive=True)
        except Exception as exc:
            return "NOT_FOUND" in str(exc)
    return False


@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_the_archive_moves_to_a_stream_while_workers_archive_every_message_once(project, kind):
    url = project.broker_url
    name = make_legacy_archive(project, kind)
    old = [unique("old") for _ in range(1000)]
    publish(url, name, old)
    wait_for(lambda: int(management_queue(url, name).get("messages", 0)) == 1000, timeout=30,
             what="the old archive filled")
    archiver = Archiver(url, name)
    archiver.start()
    time.sleep(0.3)
    done = run_cli(project, "migrate", "--archive", timeout=180)
    time.sleep(0.3)
    live = archiver.finish()
    assert done.returncode == 0, done.stderr + done.stdout
    assert management_queue(url, name)["type"] == "stream"
    assert gone(url, migrate_archive.archive_holding_name(name)), "the holding queue is deleted"
    found = ids_in_stream(url, name)
    expected = set(old) | set(live)
    duplicates = sum(n - 1 for n in found.values())
    print(f"\n[migrate --archive, {kind}] {len(old)} old + {len(live)} archived meanwhile: "
          f"{sum(found.values())} in the stream, lost {len(expected - set(found))}, duplicates {duplicates}\n"
          + done.stdout)
    assert set(found) == expected and duplicates == 0, "every message in the stream, exactly once"
    moved = re.search(rf"moved the archive {name} to a stream: (\d+) of (\d+) message", done.stdout)
    assert moved and moved.group(1) == moved.group(2) and int(moved.group(1)) >= 1000, done.stdout
    records = [m for _o, m in stream_records(url, name)]
    assert all((m.properties.get("application_headers") or {}).get(wire.ARCHIVE_KEY) or
               wire.SETTLEMENT in m.properties["application_headers"] or
               m.properties["message_id"] in live for m in records), "every moved copy has a key"
    again = run_cli(project, "migrate", "--archive")
    assert again.returncode == 0 and "already a stream: nothing to do" in again.stdout


class Crash(Exception):
    """Stands for a kill -9 in the middle of a move: copies sent and confirmed, their originals not acked."""


def dies_after(n: int):
    real = migrate_archive._IntoStream.__call__
    calls = {"n": 0}

    def copy(self, message):
        calls["n"] += 1
        if calls["n"] > n:
            raise Crash()
        return real(self, message)
    return copy


@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_a_move_cut_after_any_step_or_inside_a_copy_is_finished_by_the_next_run(project, kind, monkeypatch):
    url = project.broker_url
    name = make_legacy_archive(project, kind)
    old = [unique("old") for _ in range(600)]
    publish(url, name, old)
    wait_for(lambda: int(management_queue(url, name).get("messages", 0)) == 600, timeout=30, what="filled")
    topology = build_topology(Settings(service=project.service, exchange=project.exchange), ())
    with Connection(url) as conn:
        conn.connect()
        initial = migrate_archive.archive_steps(name, migrate_archive.observe_archive(conn, name))
    between, crashed = [], False
    for cut in initial:  # a run dies after each step of the first plan, once; the next plans anew
        with Connection(url) as conn:
            conn.connect()
            steps = migrate_archive.archive_steps(name, migrate_archive.observe_archive(conn, name))
            where = [(st.action, st.queue, st.source) for st in steps]
            if (cut.action, cut.queue, cut.source) not in where:
                continue  # done by an earlier run
            steps = steps[:where.index((cut.action, cut.queue, cut.source)) + 1]
            if cut.action == "fill":  # dies inside the copy: copies confirmed, originals not acked
                crashed = True
                monkeypatch.setattr(migrate_archive._IntoStream, "__call__", dies_after(450))
                with pytest.raises(Crash):
                    migrate_archive.move_archive(conn, topology, steps, report=lambda line: None)
                monkeypatch.undo()
            else:
                migrate_archive.move_archive(conn, topology, steps, report=lambda line: None)
        between.append(unique(f"after-{cut.action}-"))
        publish(url, name, between[-1:])
    finished = run_cli(project, "migrate", "--archive", timeout=180)
    assert finished.returncode == 0, finished.stderr + finished.stdout
    assert crashed
    found = ids_in_stream(url, name)
    print(f"\n[migrate --archive cut, {kind}] {len(between)} runs cut, one inside the copy: "
          f"{sum(found.values())} in the stream, lost {len(set(old) | set(between)) - len(set(found))}, "
          f"duplicates {sum(n - 1 for n in found.values())}")
    assert set(found) == set(old) | set(between), "nothing lost"
    assert sum(n - 1 for n in found.values()) == 0, "a copy confirmed before the crash is not copied again"
    assert management_queue(url, name)["type"] == "stream" and gone(url, migrate_archive.archive_holding_name(name))


def test_a_run_killed_in_the_move_is_finished_by_the_next(project):
    url = project.broker_url
    name = make_legacy_archive(project, "classic")
    old = [unique("old") for _ in range(5000)]
    publish(url, name, old)
    cli = Path(sys.executable).parent / "kombu-events"
    run = subprocess.Popen([str(cli), "-A", project.module, "migrate", "--archive"], cwd=project.dir,
                           env=project.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    def holding() -> int:
        with Connection(url) as conn:
            try:
                return int(conn.channel().queue_declare(migrate_archive.archive_holding_name(name), passive=True)[1])
            except Exception:
                return 0

    wait_for(lambda: holding() >= 1500 or run.poll() is not None, timeout=60, interval=0.02,
             what="the move under way")
    assert run.poll() is None, "still moving when killed: " + run.communicate()[1]
    run.send_signal(signal.SIGKILL)
    run.wait()
    time.sleep(0.5)
    finished = run_cli(project, "migrate", "--archive", timeout=180)
    assert finished.returncode == 0, finished.stderr + finished.stdout
    assert "from an unfinished run" in finished.stdout
    found = ids_in_stream(url, name)
    print(f"\n[migrate --archive killed] {len(old)}: lost {len(set(old) - set(found))}, "
          f"duplicates {sum(n - 1 for n in found.values())}")
    assert set(found) == set(old) and sum(n - 1 for n in found.values()) == 0


def test_rewrite_removes_purged_copies_for_good_and_keeps_the_others_with_their_keys(project):
    url = project.broker_url
    project.declare()  # the archive, a stream
    name = f"{project.service}.archive"
    topology = build_topology(Settings(service=project.service, exchange=project.exchange), ())
    ids = [unique("a") for _ in range(300)]
    publish(url, name, ids)  # every other one keyed; the rest keyed by their offset
    with Connection(url) as conn:
        conn.connect()
        before = {m.id: m.key for m in archive.read(conn, topology, bodies=False)}
        purged = archive.purge(conn, topology, lambda m: m.id in ids[:40], by="test", note="GDPR")
        erase_too = before[ids[50]]
        archiver = Archiver(url, name)
        archiver.start()
        time.sleep(0.3)
        counts = archive_rewrite.rewrite(conn, topology, erase_keys=[erase_too])
        time.sleep(0.3)
        live = archiver.finish()
        again = archive_rewrite.rewrite(conn, topology)
        after = {m.id: m.key for m in archive.read(conn, topology, bodies=False)}
    erased = {m.id for m in purged} | {ids[50]}
    raw = stream_records(url, name)
    bodies = b"".join(bytes(m.body) for _o, m in raw)
    found = ids_in_stream(url, name)
    print(f"\n[rewrite] {len(ids)} archived, {len(erased)} erased, {len(live)} archived meanwhile: {counts}; "
          f"duplicates in the stream {sum(n - 1 for n in found.values())}")
    assert counts["erased"] == len(erased) and again["erased"] == 0
    assert not any(f'"{i}"'.encode() in bodies for i in erased), "their bodies are gone from the stream"
    assert set(found) == (set(ids) - erased) | set(live)
    assert sum(n - 1 for n in found.values()) == 0
    assert {i: after[i] for i in ids if i not in erased} == {i: before[i] for i in ids if i not in erased}, \
        "every kept copy under its key"
    settled = [archive.records_.parse_settlement(m.properties["application_headers"], bytes(m.body), o)
               for o, m in raw if wire.SETTLEMENT in (m.properties.get("application_headers") or {})]
    named = {k for s in settled for k in s.keys}
    assert not named & {before[i] for i in erased}, "no settlement names an erased key"
    assert any("GDPR" in s.note and "erased for good" in s.note for s in settled), "the purge's audit stays"
    assert gone(url, name + archive_rewrite.REWRITE_SUFFIX)


def test_a_rewrite_that_died_after_deleting_the_archive_is_finished_by_the_next(project, monkeypatch):
    url = project.broker_url
    project.declare()
    name = f"{project.service}.archive"
    topology = build_topology(Settings(service=project.service, exchange=project.exchange), ())
    ids = [unique("a") for _ in range(200)]
    publish(url, name, ids)
    real = archive_rewrite.transfer
    calls = {"n": 0}

    def dies_on_the_way_back(connection, source, target, exchange, keep):
        calls["n"] += 1
        if calls["n"] == 2:
            raise Crash()
        return real(connection, source, target, exchange, keep)

    with Connection(url) as conn:
        conn.connect()
        archive.purge(conn, topology, lambda m: m.id in ids[:10], by="test")
        monkeypatch.setattr(archive_rewrite, "transfer", dies_on_the_way_back)
        with pytest.raises(Crash):
            archive_rewrite.rewrite(conn, topology)
        monkeypatch.undo()
        publish(url, name, ["while-gone"])  # reaches the temporary stream only
        counts = archive_rewrite.rewrite(conn, topology)
    found = ids_in_stream(url, name)
    assert counts["resumed"] > 0 and counts["erased"] == 0
    assert set(found) == set(ids[10:]) | {"while-gone"} and sum(n - 1 for n in found.values()) == 0
    assert gone(url, name + archive_rewrite.REWRITE_SUFFIX)
