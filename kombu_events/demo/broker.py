"""The demo's broker check: probe the URL, find RabbitMQ, start it when it is local and stopped (the I/O)."""
from __future__ import annotations

__all__ = ["ready", "probe", "find_server", "start", "SBIN_DIRS"]

import logging
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable

from kombu_events.broker.connections import broker_connection

from .preflight import Probe, Verdict, after_start, verdict_for

logger = logging.getLogger(__name__)

#: Searched after PATH: the packages install rabbitmq-server there, and a Debian user's PATH has no sbin.
SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/opt/homebrew/sbin")
START_TIMEOUT_S = 60.0


def ready(url: str, say: Callable[[str], None]) -> bool:
    """True when the demo can run on ``url`` (after starting RabbitMQ if it may); else one line on stderr."""
    server = find_server()
    verdict = verdict_for(probe(url), url=url, server=server)
    if verdict.action == "start" and server is not None:
        say(verdict.line)
        verdict = start(server, url)
    if verdict.action == "fail":
        print(verdict.line, file=sys.stderr, flush=True)
        return False
    return True


def probe(url: str, timeout_s: float = 3.0) -> Probe:
    """One connection attempt to ``url``, no retry."""
    try:
        with broker_connection(url, connect_timeout=timeout_s) as conn:
            conn.ensure_connection(max_retries=0)
    except Exception as exc:  # whatever the URL or the broker does, the demo says it in one line
        if isinstance(exc, OSError) or isinstance(exc.__cause__, OSError):  # kombu wraps socket errors
            return Probe(ok=False, down=True, error=str(exc) or type(exc).__name__)
        return Probe(ok=False, error=f"{type(exc).__name__}: {exc}")
    return Probe(ok=True)


def find_server(path: str | None = None) -> str | None:
    """Where ``rabbitmq-server`` is: on ``path`` (default ``PATH``), else in ``SBIN_DIRS``; None if nowhere."""
    path = os.environ.get("PATH", os.defpath) if path is None else path
    return shutil.which("rabbitmq-server", path=os.pathsep.join([path, *SBIN_DIRS]))


def start(
    server: str, url: str, *, timeout_s: float = START_TIMEOUT_S, run: Callable[..., Any] = subprocess.run,
    check: Callable[[str], Probe] = probe, sleep: Callable[[float], Any] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> Verdict:
    """Run ``server -detached``, then probe ``url`` each second until it answers or ``timeout_s`` passes."""
    error = _run_detached(server, run)
    began = clock()
    found = check(url)
    while not error and not found.ok and clock() - began < timeout_s:
        sleep(1.0)
        found = check(url)
    return after_start(found, url=url, start_error=error, waited_s=timeout_s)


def _run_detached(server: str, run: Callable[..., Any]) -> str:
    """Empty once ``server -detached`` has forked the node, else the last line it printed."""
    try:
        done = run([server, "-detached"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc) or type(exc).__name__
    if done.returncode == 0:
        return ""
    lines = [line for line in f"{done.stdout}\n{done.stderr}".splitlines() if line.strip()]
    return lines[-1] if lines else f"{server} -detached exited with status {done.returncode}"
