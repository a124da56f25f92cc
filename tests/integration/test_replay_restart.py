"""``kombu-events archive replay`` across a broker restart, on a quorum service: the CLI connects again and goes
on with the copies it selected first, less those it settled; every archived copy reaches its queue, the only
copies sent twice are those confirmed and not settled when the connection went (one window at most), and the
archive ends with none pending. The node is the tests' own (``private_broker``): stopped mid-replay."""
from __future__ import annotations

import collections
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import amqp
import pytest
from kombu import Connection

from kombu_events.core import wire
from kombu_events.ops.archive import read

from .harness import Project, run_cli, wait_for

pytestmark = pytest.mark.integration

N = 10_000
WINDOW = 200  # ops.archive_replay's window: copies confirmed and not yet settled at any moment

APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, queue_type="quorum", delay_levels=2)

@events.handler("orders.#", name="orders")
def orders(event):
    pass
"""


def archive(project: Project, port: int, n: int) -> dict[str, str]:
    """``n`` copies archived as a worker archives them (no confirms: the stream is read until it holds them all);
    {archive key: message id}."""
    events = project_events(project)
    keys = {}
    conn = amqp.Connection(f"127.0.0.1:{port}", userid="guest", password="guest")
    conn.connect()
    try:
        channel = conn.channel()
        for i in range(n):
            headers = wire.archive_headers({}, attempt=3, queue=f"{project.service}.orders", routing_key=f"orders.{i}",
                                           reason="gave up after 3 attempts: ValueError", exception="ValueError",
                                           traceback="Traceback ...\nValueError\n")
            keys[headers[wire.ARCHIVE_KEY]] = f"m{i:06d}"
            channel.basic_publish(amqp.Message(b'{"i": %d}' % i, message_id=f"m{i:06d}", delivery_mode=2,
                                               content_type="application/json", application_headers=headers),
                                  exchange=events.topology().archive_exchange, routing_key="")
    finally:
        conn.close()
    wait_for(lambda: len(pending(project)) == n, timeout=120, interval=1.0, what=f"{n} copies archived")
    return keys


def project_events(project: Project):
    sys.path.insert(0, str(project.dir))
    try:
        return __import__(project.module).events
    finally:
        sys.path.remove(str(project.dir))


def pending(project: Project) -> list:
    with Connection(project.broker_url) as conn:
        return read(conn, project_events(project).topology(), bodies=False)


def take(project: Project, port: int) -> list[amqp.Message]:
    taken = []
    conn = amqp.Connection(f"127.0.0.1:{port}", userid="guest", password="guest")
    conn.connect()
    try:
        channel = conn.channel()
        while (message := channel.basic_get(f"{project.service}.orders", no_ack=True)) is not None:
            taken.append(message)
    finally:
        conn.close()
    return taken


def test_a_cli_replay_goes_on_across_a_broker_restart_and_loses_none(private_broker, tmp_path):
    project = Project(tmp_path, private_broker.url, APP)
    port = private_broker.ports[0]
    try:
        assert run_cli(project, "declare").returncode == 0
        keys = archive(project, port, N)
        cli = Path(sys.executable).parent / "kombu-events"
        replay = subprocess.Popen([str(cli), "-A", project.module, "archive", "replay"], cwd=project.dir,
                                  env=project.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The test reads the CLI's output until a window is settled, then not at all while the node stops and
        # starts again: the pipe fills, and the CLI waits on it mid-replay, whatever the machine's speed.
        lines: list[str] = []
        resume = threading.Event()

        def read_output() -> None:
            for line in replay.stdout:
                lines.append(line)
                if len(lines) >= WINDOW:
                    resume.wait()
        reader = threading.Thread(target=read_output, daemon=True)
        reader.start()
        began = time.monotonic()
        while len(lines) < WINDOW:
            assert replay.poll() is None and time.monotonic() - began < 120, (replay.poll(), len(lines))
            time.sleep(0.02)
        time.sleep(1.0)
        private_broker.stop_app()
        private_broker.start_app()
        resume.set()
        stderr = replay.stderr.read()
        assert replay.wait(timeout=300) == 0, stderr[-3000:]
        reader.join(timeout=10)
        assert "connecting again (1 of 30)" in stderr, stderr[-3000:]
        at_loss = int(re.search(r"connection lost \(.*\) with (\d+) replayed and settled", stderr).group(1))
        assert 0 < at_loss < N, f"the node stopped mid-replay: {at_loss} of {N} settled then"
        assert f"{N} replayed, 0 kept" in stderr, stderr[-3000:]
        printed = [line.split()[1] for line in lines if line.startswith("replayed ")]
        assert sorted(printed) == sorted(keys), "each copy said replayed once"

        wait_for(lambda: pending(project) == [], timeout=60, what="every copy settled")
        copies = take(project, port)
        by_key = collections.Counter(m.properties["application_headers"][wire.REPLAY_OF] for m in copies)
        assert set(by_key) == set(keys), f"{len(set(keys) - set(by_key))} lost"
        twice = sorted(k for k, c in by_key.items() if c > 1)
        assert len(twice) <= WINDOW and max(by_key.values()) <= 2, (len(twice), max(by_key.values()))
        assert all(keys[k] == m.properties["message_id"] for m in copies
                   for k in [m.properties["application_headers"][wire.REPLAY_OF]]), "each under its id"
        print(f"\n{N:,} copies replayed across a restart ({at_loss:,} settled when the connection went): "
              f"{len(copies):,} delivered, {len(twice)} twice (confirmed, not settled, when the connection went)")
    finally:
        if private_broker.app_running:
            project.cleanup()
