"""Integration harness: unique services, real `celery worker` subprocesses, broker inspection."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from kombu import Connection

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "tests" / "node"


def unique(prefix: str = "t") -> str:
    """A name no other test uses."""
    return f"{prefix}{uuid.uuid4().hex[:10]}"


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll ``predicate`` until truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


HEADER = '''
import json, os, time
from celery import Celery
from kombu_events import *

app = Celery({service!r}, broker={broker!r})
app.conf.broker_connection_retry_on_startup = True
RECORDS = {records!r}

def record(**fields):
    fields.setdefault("pid", os.getpid())
    fields.setdefault("time", time.time())
    with open(RECORDS, "a") as fh:
        fh.write(json.dumps(fields) + "\\n")
'''


class Project:
    """A throw-away Celery project in ``tmp_path`` whose handlers append JSON lines to a file."""

    def __init__(self, tmp_path: Path, broker_url: str, body: str, service: str | None = None,
                 module: str | None = None) -> None:
        self.dir = tmp_path
        self.broker_url = broker_url
        self.service = service or unique("svc")
        self.module = module or unique("proj_")
        self.records_path = tmp_path / f"{self.module}.records"
        source = HEADER.format(service=self.service, broker=broker_url, records=str(self.records_path))
        source += textwrap.dedent(body).replace("SERVICE", repr(self.service))
        (tmp_path / f"{self.module}.py").write_text(source)
        self.workers: list[Worker] = []

    def records(self) -> list[dict[str, Any]]:
        """Everything the handlers recorded so far."""
        if not self.records_path.exists():
            return []
        lines = self.records_path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.dir), str(ROOT), env.get("PYTHONPATH", "")])
        env.pop("RABBIT_URL", None)
        return env

    def worker(self, *args: str, events: bool = True, pool: str = "solo", concurrency: int = 1) -> "Worker":
        """Start ``celery worker`` for this project (with ``--with-events-step`` unless events=False)."""
        cmd = [sys.executable, "-m", "celery", "-A", self.module, "worker", f"--pool={pool}",
               f"--concurrency={concurrency}", "--without-mingle", "--without-gossip",
               "--without-heartbeat", "--loglevel=INFO", f"--hostname={unique('w')}@%h", *args]
        if events:
            cmd.append("--with-events-step")
        worker = Worker(cmd, self)
        self.workers.append(worker)
        return worker

    def run_python(self, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``code`` with the project importable (e.g. to publish through ``events``)."""
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=self.dir, env=self.env(),
                              capture_output=True, text=True, timeout=timeout)

    def cleanup(self) -> None:
        """Stop workers, delete every entity of the service."""
        for worker in self.workers:
            worker.stop()
        delete_service(self.broker_url, self.service)


class Worker:
    """A `celery worker` subprocess with its log in a file."""

    def __init__(self, cmd: list[str], project: Project) -> None:
        self.log_path = project.dir / f"worker-{len(project.workers)}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=project.dir, env=project.env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> "Worker":
        """Wait until the worker says it is ready."""
        wait_for(lambda: " ready." in self.log or self.proc.poll() is not None, timeout, what="worker ready")
        if self.proc.poll() is not None:
            raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log[-4000:]}")
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the main process (SIGKILL by default) and its pool children."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM), then kill if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # orphaned pool children, if any
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


def queue_depth(broker_url: str, queue: str) -> tuple[int, int]:
    """(ready messages, consumers) of ``queue``."""
    with Connection(broker_url) as conn:
        _name, messages, consumers = conn.default_channel.queue_declare(queue, passive=True)
        return messages, consumers


def delete_service(broker_url: str, service: str, exchanges: tuple[str, ...] = ()) -> None:
    """Delete every queue and exchange named ``<service>`` or ``<service>.*`` (and ``exchanges``)."""
    out = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name"], capture_output=True, text=True).stdout
    queues = [n for n in out.split() if n == service or n.startswith(service + ".")]
    out = subprocess.run(["rabbitmqctl", "-q", "list_exchanges", "name"], capture_output=True, text=True).stdout
    names = [n for n in out.split() if n.startswith(service + ".")] + list(exchanges)
    with Connection(broker_url) as conn:
        for name in queues:
            conn.default_channel.queue_delete(name)
        for name in names:
            conn.default_channel.exchange_delete(name)


def node_publish(broker_url: str, exchange: str, messages: list[dict[str, Any]]) -> None:
    """Publish with the Node.js ``amqplib`` client: [{routing_key, body (str), properties}]."""
    subprocess.run(["node", str(NODE_DIR / "publish.js"), broker_url, exchange],
                   input=json.dumps(messages), text=True, check=True, capture_output=True, timeout=60,
                   cwd=NODE_DIR)
