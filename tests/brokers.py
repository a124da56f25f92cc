"""The one place the tests learn which RabbitMQ they run on, and how to reach it.

``scripts/test`` runs the integration suite twice: on the host's RabbitMQ 3.10 (the
defaults below) and on a RabbitMQ 4.0 node of the project's own (``scripts/rabbitmq4-node
env`` sets these variables). No test names a port or calls ``rabbitmqctl`` by itself.
"""
from __future__ import annotations

import os
import shlex
import subprocess
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

#: AMQP URL of the shared node (guest, vhost ``/``).
BROKER_URL = os.environ.get("KOMBU_EVENTS_TEST_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
#: Its management API (also what the testing kit's ``temporary_vhost`` reads).
MANAGEMENT_URL = os.environ.get("KOMBU_EVENTS_TEST_MANAGEMENT", "http://127.0.0.1:15672").rstrip("/")
#: The command that runs ``rabbitmqctl`` against the shared node.
RABBITMQCTL = shlex.split(os.environ.get("KOMBU_EVENTS_TEST_RABBITMQCTL", "rabbitmqctl"))
#: The Debian root whose RabbitMQ the private nodes (scripts/rabbitmq-cluster) run; empty: the host's.
RABBITMQ_ROOT = os.environ.get("KE_RABBITMQ_ROOT", "")

_HOST_PORT = urlsplit(BROKER_URL)
#: Host and AMQP port of the shared node.
HOST, PORT = _HOST_PORT.hostname or "127.0.0.1", _HOST_PORT.port or 5672


def rabbitmqctl(*args: str, check: bool = True, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess:
    """``rabbitmqctl -q ARGS`` on the shared node (text output captured)."""
    return subprocess.run([*RABBITMQCTL, "-q", *args], capture_output=True, text=True, check=check,
                          timeout=timeout, **kwargs)


def amqp_url(user: str = "guest", password: str = "guest", vhost: str = "/", host: str | None = None) -> str:
    """AMQP URL of the shared node for ``user`` on ``vhost`` (``host``: another loopback name of it)."""
    return (f"amqp://{quote(user, safe='')}:{quote(password, safe='')}@{host or HOST}:{PORT}/"
            f"{quote(vhost, safe='')}")


def with_credentials(broker_url: str, user: str, password: str) -> str:
    """``broker_url`` (host, port, vhost kept) as ``user``."""
    parts = urlsplit(broker_url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname or HOST}:{parts.port or PORT}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _version() -> tuple[int, ...]:
    out = rabbitmqctl("version", check=False, timeout=60).stdout.strip()
    try:
        return tuple(int(p) for p in out.split(".")[:3])
    except ValueError:
        return ()


_VERSION: tuple[int, ...] | None = None


def version() -> tuple[int, ...]:
    """The shared node's RabbitMQ version, e.g. ``(4, 0, 5)`` (``()`` if rabbitmqctl cannot tell)."""
    global _VERSION
    if _VERSION is None:
        _VERSION = _version()
    return _VERSION
