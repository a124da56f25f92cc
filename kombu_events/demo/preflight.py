"""What the demo does about its broker before it starts a worker (pure: no socket, no process)."""
from __future__ import annotations

__all__ = ["Probe", "Verdict", "verdict_for", "after_start", "is_local_default", "PREFIX"]

import logging
from typing import NamedTuple
from urllib.parse import urlsplit

from kombu_events.core.logs import safe_text, safe_url

logger = logging.getLogger(__name__)

PREFIX = "kombu-events demo: "
DEFAULT_PORT = 5672
LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1"})
INSTALL = "sudo apt-get install rabbitmq-server"
START = "sudo rabbitmq-server -detached"


class Probe(NamedTuple):
    """What one connection attempt found: ``ok``; else ``down`` (no broker answered) and the error."""

    ok: bool
    down: bool = False  # False when the error is not the socket's: a refused login or vhost, a bad URL
    error: str = ""


class Verdict(NamedTuple):
    """``action`` is ``run``, ``start`` (RabbitMQ, then run) or ``fail``; ``line`` is what to print."""

    action: str
    line: str = ""


def is_local_default(url: str) -> bool:
    """True if ``url`` is one broker on this machine at RabbitMQ's default port (the one a local start opens)."""
    return _host(url) in LOCAL_HOSTS and _port(url) == DEFAULT_PORT


def verdict_for(probe: Probe, *, url: str, server: str | None) -> Verdict:
    """From one probe of ``url`` and the path of ``rabbitmq-server`` (None: not installed), what to do."""
    shown, error = safe_url(url), _one_line(probe.error)
    if probe.ok:
        return Verdict("run")
    if not probe.down:
        return _fail(f"cannot use the broker at {shown} ({error}): check RABBIT_URL (its user, password, vhost)")
    host = _host(url)
    if host not in LOCAL_HOSTS:
        return _fail(f"RabbitMQ is not reachable at {shown} ({error}): start it there, or set RABBIT_URL "
                     "to a running broker")
    if server is None:
        return _fail(f"RabbitMQ is not reachable at {shown} and is not installed: install it ({INSTALL}), "
                     "or set RABBIT_URL to a running broker")
    if not is_local_default(url):
        return _fail(f"RabbitMQ is installed but nothing listens at {shown}: correct RABBIT_URL "
                     f"(RabbitMQ's default port is {DEFAULT_PORT}) or start a broker on port {_port(url)}")
    return Verdict("start", f"{PREFIX}RabbitMQ is installed but not running at {shown}: "
                            f"starting it ({server} -detached)")


def after_start(probe: Probe, *, url: str, start_error: str, waited_s: float) -> Verdict:
    """After trying to start RabbitMQ: run if ``url`` now answers, else say why not and what to do."""
    if probe.ok:
        return Verdict("run")
    if start_error:
        return _fail(f"could not start RabbitMQ ({_one_line(start_error)}): start it yourself ({START}) "
                     "and run the demo again")
    return _fail(f"RabbitMQ did not answer at {safe_url(url)} within {waited_s:g} s of starting it "
                 f"({_one_line(probe.error)}): see /var/log/rabbitmq, or start it yourself ({START})")


def _fail(text: str) -> Verdict:
    return Verdict("fail", PREFIX + text)


def _host(url: str) -> str | None:
    """The one host of ``url`` ("" when it names none: kombu's localhost); None for a fail-over list."""
    return None if ";" in url else urlsplit(url).hostname or ""


def _port(url: str) -> int | None:
    """The port of ``url`` (RabbitMQ's default when it names none); None when it is not a number."""
    try:
        return urlsplit(url).port or DEFAULT_PORT
    except ValueError:
        return None


def _one_line(text: str) -> str:
    """An error message on one line, passwords masked (kombu and amqp errors can span lines)."""
    return " ".join(safe_text(text).split()) or "no error text"
