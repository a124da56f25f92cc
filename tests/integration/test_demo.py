"""``python -m kombu_events.demo``: for real in a vhost of its own, and with no broker at its URL (one line
saying what to do, never a traceback).

Without a broker, the demo runs as a subprocess against a port where nothing listens, so these tests need no
RabbitMQ and never touch the one on 5672. "Installed" is a fake ``rabbitmq-server`` on PATH
that records being run; "not installed" is a PATH without one. The demo also looks in the
sbin directories the packages use, so the subprocess empties that list first.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import pytest

from kombu_events.testing import temporary_vhost

from .harness import _management, wait_for

pytestmark = pytest.mark.integration

# Runs the demo as `python -m kombu_events.demo` does, without the sbin directories of this machine.
RUN_DEMO = ("import runpy, kombu_events.demo.broker as broker; broker.SBIN_DIRS = (); "
            "runpy.run_module('kombu_events.demo', run_name='__main__', alter_sys=True)")


def closed_port() -> int:
    """A local port nothing listens on (the kernel's free pick, released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_demo(tmp_path: Path, *, installed: bool) -> tuple[subprocess.CompletedProcess[str], Path]:
    bin_dir, ran = tmp_path / "bin", tmp_path / "rabbitmq-server-ran"
    bin_dir.mkdir()
    if installed:
        for name in ("rabbitmq-server", "rabbitmqctl"):
            fake = bin_dir / name
            fake.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {ran}\nexit 1\n")
            fake.chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir), "RABBIT_URL": f"amqp://guest:s3cret@127.0.0.1:{closed_port()}//"}
    result = subprocess.run([sys.executable, "-c", RUN_DEMO], env=env, capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    return result, ran


@pytest.mark.parametrize(("installed", "says"), [
    (True, "RabbitMQ is installed but nothing listens at amqp://guest:**@127.0.0.1:"),
    (False, "RabbitMQ is not reachable at amqp://guest:**@127.0.0.1:"),
])
def test_no_broker_at_the_url_is_one_line_on_stderr_and_exit_1(tmp_path, installed, says):
    result, ran = run_demo(tmp_path, installed=installed)
    assert result.returncode == 1, result
    assert result.stdout == "", result
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kombu-events demo: " + says), lines[0]
    assert "s3cret" not in lines[0]
    assert not installed or "correct RABBIT_URL" in lines[0]
    assert installed or "not installed: install it (sudo apt-get install rabbitmq-server)" in lines[0]
    assert not ran.exists(), "the demo started a RabbitMQ for a port that is not the default one"


def test_the_demo_handles_every_event_and_leaves_no_queue_or_exchange_behind(tmp_path, broker_url):
    """The README's demo, for real, in a vhost of its own: 10 of 10 handled, then nothing of it is left."""
    with temporary_vhost(broker_url) as url:
        env = {**os.environ, "RABBIT_URL": url}
        result = subprocess.run([sys.executable, "-m", "kombu_events.demo"], env=env, capture_output=True,
                                text=True, timeout=180, cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "10 of 10 deliveries handled" in result.stdout
        assert "succeeded" in result.stdout  # the Celery task beside the handlers
        vhost = quote(unquote(urlsplit(url).path[1:]), safe="")

        def only_lasting_queues() -> list[str] | None:  # the worker's auto-delete queues go once it has gone
            queues = _management(url, f"queues/{vhost}")
            return None if any(q["auto_delete"] for q in queues) else [q["name"] for q in queues]

        assert wait_for(lambda: only_lasting_queues() is not None, what="the worker's auto-delete queues gone")
        assert only_lasting_queues() == []
        exchanges = [e["name"] for e in _management(url, f"exchanges/{vhost}")]
        # Celery's remote-control exchange, which every worker on a vhost shares, is not the demo's to delete.
        assert [e for e in exchanges if e and not e.startswith("amq.")] == ["celery.pidbox"]
