"""Worker-side instrumentation: exact, cheap counting of handled messages and of acks.

Imported by the benchmark apps inside the worker (and its pool processes). Handlers
call :func:`handled` -- a few hundred nanoseconds: one bytearray increment and a
timestamp -- and nothing is written to disk while messages flow, except one small
file when an expected number of acks is reached. Everything else is written when
the process shuts down (Celery's ``worker_process_shutdown`` in pool processes,
``worker_shutdown`` in the main process).

Configured by environment variables set by the benchmark runner:

``KEB_OUT``      directory for the files of this run
``KEB_N``        number of distinct message ids (``payload["i"]`` is in ``0 .. N-1``)
``KEB_ACKS``     comma-separated ack counts at which ``acks-<count>`` is written (an ack with
                 ``multiple`` counts every delivery it acks)
"""
from __future__ import annotations

__all__ = ["handled", "failed", "latency", "acked", "install", "dump", "OUT"]

import atexit
import importlib
import json
import os
import sys
import time
from array import array
from pathlib import Path

OUT = Path(os.environ.get("KEB_OUT", "."))
N = int(os.environ.get("KEB_N", "0"))
ACK_TARGETS = frozenset(int(n) for n in os.environ.get("KEB_ACKS", "").split(",") if n)


class _State:
    """Counters of one process (reset after fork: pool processes count for themselves)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.ok = bytearray(N)
        self.fail = bytearray(N)
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.latencies = array("d")
        self.acks = 0
        self.ack_last = 0.0


_state = _State()


def _current() -> _State:
    global _state
    if _state.pid != os.getpid():
        _state = _State()
    return _state


def _count(counts: bytearray, i: int) -> None:
    s = _current()
    now = time.time()
    if not s.count:
        s.first = now
    s.count += 1
    s.last = now
    counts[i] = min(counts[i] + 1, 255)


def handled(i: int) -> None:
    """Count message ``i`` as handled successfully."""
    _count(_current().ok, i)


def failed(i: int) -> None:
    """Count a (deliberately) failed attempt of message ``i``."""
    _count(_current().fail, i)


def latency(sent_at: float) -> None:
    """Record publish -> handler start for a message published at ``sent_at`` (``time.time()``)."""
    _current().latencies.append(time.time() - sent_at)


def acked(count: int) -> None:
    """Count ``count`` acks sent (a consumer that acks without kombu's ``Message.ack``)."""
    s = _current()
    before, s.acks = s.acks, s.acks + count
    for target in ACK_TARGETS:
        if before < target <= s.acks:
            s.ack_last = time.time()
            (OUT / f"acks-{target}").write_text(repr(s.ack_last))


def _counting_ack(ack):
    def ack_and_count(message, *args, **kwargs):
        result = ack(message, *args, **kwargs)
        acked(1)
        return result
    ack_and_count.__wrapped__ = ack
    return ack_and_count


def _counting_send(send):
    """kombu-events' coalesced acks (``worker/acks.py``): one ``basic.ack`` counts the deliveries it acks."""
    def send_and_count(acks, channel, tag, multiple, count):
        result = send(acks, channel, tag, multiple, count)
        acked(count)
        return result
    send_and_count.__wrapped__ = send
    return send_and_count


def dump(*_args, **_kwargs) -> None:
    """Write this process's counters (idempotent per process)."""
    s = _current()
    path = OUT / f"proc-{s.pid}"
    if path.with_suffix(".json").exists():
        return
    path.with_suffix(".ok").write_bytes(bytes(s.ok))
    path.with_suffix(".fail").write_bytes(bytes(s.fail))
    path.with_suffix(".lat").write_bytes(s.latencies.tobytes())
    meta = {"pid": s.pid, "count": s.count, "first": s.first, "last": s.last, "acks": s.acks}
    path.with_suffix(".json").write_text(json.dumps(meta))


def install() -> None:
    """Count acks (kombu's ``Message.ack``: Celery, the events step and raw kombu all use it) and dump at exit."""
    from kombu.message import Message

    if not hasattr(Message.ack, "__wrapped__"):
        Message.ack = _counting_ack(Message.ack)
    try:  # an events worker (a tree from before the acks were coalesced has no such module)
        Acks = importlib.import_module("kombu_events.worker.acks").Acks if "kombu_events" in sys.modules else None
    except ImportError:
        Acks = None
    if Acks is not None and not hasattr(Acks.send, "__wrapped__"):
        Acks.send = _counting_send(Acks.send)
    atexit.register(dump)
    try:
        from celery import signals
    except ImportError:
        return
    signals.worker_process_shutdown.connect(dump, weak=False)
    signals.worker_shutdown.connect(dump, weak=False)
    signals.worker_ready.connect(_ready, weak=False)


def _ready(*_args, **_kwargs) -> None:
    (OUT / "ready").write_text(str(time.time()))
