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


def free_port(span: int = 1) -> int:
    """A port free on loopback, with the ``span - 1`` ports after it free too (a node each)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + span <= 65_535 and all(_free(p) for p in range(port + 1, port + span)):
            return port
    raise RuntimeError(f"no {span} consecutive free ports found")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class PrivateBroker:
    """Nodes started by scripts/rabbitmq-cluster under ``directory``, with names of their own
    (one node unless ``nodes`` says more: nodes 2.. join node 1)."""

    def __init__(self, directory: Path, nodes: int = 1) -> None:
        self.directory = directory
        self.nodes = nodes
        self.name = f"kebl{uuid.uuid4().hex[:8]}"
        self.env = dict(os.environ, KE_CLUSTER_DIR=str(directory), KE_CLUSTER_NAME=self.name,
                        KE_CLUSTER_AMQP_PORT=str(free_port(nodes)), KE_CLUSTER_DIST_PORT=str(free_port(nodes)))
        self.ports = [int(self.env["KE_CLUSTER_AMQP_PORT"]) + n for n in range(nodes)]
        self.url = self.node_url(1)
        self.app_running = False

    def node_url(self, node: int) -> str:
        """AMQP URL of node ``node`` (1-based)."""
        return f"amqp://guest:guest@127.0.0.1:{self.ports[node - 1]}//"

    def urls(self, *order: int) -> str:
        """A fail-over URL list (``;``-separated), nodes in ``order`` (default 1, 2, ...)."""
        return ";".join(self.node_url(n) for n in (order or range(1, self.nodes + 1)))

    def ctl(self, node: int, *args: str, timeout: float = 60) -> str:
        """``rabbitmqctl ARGS`` against ``node``; its output."""
        return self.run("ctl", str(node), *args, timeout=timeout)

    def kill_node(self, node: int) -> None:
        """kill -9 the node's Erlang VM: its connections drop at once, as on a crash."""
        self.run("kill-node", str(node))

    def start_node(self, node: int) -> None:
        """Start a killed node again; returns once it serves AMQP (it rejoins on its own)."""
        self.run("start-node", str(node))

    def run(self, *args: str, timeout: float = 180) -> str:
        result = subprocess.run([str(SCRIPT), *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"rabbitmq-cluster {' '.join(args)} failed ({result.returncode}): "
                               f"{result.stdout}{result.stderr}")
        return result.stdout

    def start(self) -> None:
        self.run("start", "--nodes", str(self.nodes))
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
            if f"{self.name}".encode() in cmdline and b"beam" in cmdline:
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
