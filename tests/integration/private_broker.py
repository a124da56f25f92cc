"""A RabbitMQ node of the tests' own (scripts/rabbitmq-cluster), on free loopback ports: one they may stop.

The shared node on 5672 is never stopped; this one is, for real (``stop_app`` closes
every connection and refuses new ones, as a broker that is down does).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import uuid
from pathlib import Path

from kombu import Connection

from .harness import ROOT

SCRIPT = ROOT / "scripts" / "rabbitmq-cluster"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateBroker:
    """One node started by scripts/rabbitmq-cluster under ``directory``, with a name of its own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.name = f"kebl{uuid.uuid4().hex[:8]}"
        self.env = dict(os.environ, KE_CLUSTER_DIR=str(directory), KE_CLUSTER_NAME=self.name,
                        KE_CLUSTER_AMQP_PORT=str(free_port()), KE_CLUSTER_DIST_PORT=str(free_port()))
        self.url = f"amqp://guest:guest@127.0.0.1:{self.env['KE_CLUSTER_AMQP_PORT']}//"
        self.app_running = False

    def run(self, *args: str, timeout: float = 180) -> str:
        result = subprocess.run([str(SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"rabbitmq-cluster {' '.join(args)} failed ({result.returncode}): "
                               f"{result.stdout}{result.stderr}")
        return result.stdout

    def start(self) -> None:
        self.run("start", "--nodes", "1")
        self.app_running = True

    def stop_app(self) -> None:
        """The broker goes away: connections close, new ones are refused."""
        self.run("stop-app", "1")
        self.app_running = False

    def start_app(self) -> None:
        """The broker is back (returns once it serves AMQP)."""
        self.run("start-app", "1")
        self.app_running = True

    def stop(self) -> list[int]:
        """Stop the node; return the pids of any of its Erlang processes left behind (killed -9)."""
        try:
            self.run("stop", timeout=90)
        finally:
            strays = self.strays()
            for pid in strays:
                os.kill(pid, signal.SIGKILL)
        return strays

    def strays(self) -> list[int]:
        """Pids of processes whose command line names this node (its beam VM, its epmd-less helpers)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if f"{self.name}1@localhost".encode() in cmdline and b"beam" in cmdline:
                found.append(int(entry.name))
        return found

    def declare(self, exchange: str, queue: str, key: str = "#") -> None:
        """A durable topic exchange and a durable queue bound to it."""
        with Connection(self.url) as conn:
            channel = conn.channel()
            channel.exchange_declare(exchange, "topic", durable=True, auto_delete=False)
            channel.queue_declare(queue, durable=True, auto_delete=False)
            channel.queue_bind(queue, exchange, key)

    def delete(self, exchange: str, queue: str) -> None:
        with Connection(self.url) as conn:
            channel = conn.channel()
            channel.queue_delete(queue)
            channel.exchange_delete(exchange)

    def drain(self, queue: str) -> list[str]:
        """Every message id in ``queue``, in queue order (the queue is emptied)."""
        ids = []
        with Connection(self.url) as conn:
            channel = conn.channel()
            channel.basic_qos(0, 1000, False)
            while True:
                message = channel.basic_get(queue, no_ack=True)
                if message is None:
                    return ids
                ids.append(message.properties["message_id"])
