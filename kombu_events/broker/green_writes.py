"""One writer at a time on a connection that greenlets share: what gevent and eventlet workers need of py-amqp.

Under ``--pool=gevent`` or ``--pool=eventlet`` every handler runs in a greenlet of the
worker's main process, and its message is settled from that greenlet: the ack, and the
publish of a retry or archive copy, are written on the worker's connection by whichever
handler finished. A write that fills the socket's send buffer yields to the other
greenlets, and one of them may write too. py-amqp serialises its frame writer from 5.4.0
on (celery/py-amqp#466); before that (kombu 5.3 to 5.6 accept py-amqp 5.1 to 5.3) the
second writer raises gevent's ``ConcurrentObjectUseError`` (the message is held unacked and
its queue stalls) or eventlet's "Second simultaneous write" (Celery ends the worker), or
interleaves its bytes with the first frame's. :func:`serialize_writes` puts a lock
around the connection's frame writer; on py-amqp 5.4 it is a second, uncontended lock.
"""
from __future__ import annotations

__all__ = ["serialize_writes"]

import logging
import threading
from functools import wraps
from typing import Any, Callable

logger = logging.getLogger(__name__)

#: Marks a frame writer this module wrapped (a restart of the step on the same connection wraps it once).
_WRAPPED = "_kombu_events_one_writer"


def serialize_writes(connection: Any) -> bool:
    """Make the py-amqp connection behind kombu ``connection`` write one frame (a whole message) at a time.

    Call it in the process whose greenlets write, after the pool monkeypatched
    ``threading`` (the lock must be a green one). Returns whether the writer is wrapped
    now; a connection without a py-amqp frame writer (another transport) is left alone.
    """
    raw = getattr(connection, "connection", connection)  # kombu's Connection -> py-amqp's
    writer = getattr(raw, "frame_writer", None)
    if writer is None:
        logger.debug("kombu-events: %r has no frame writer to serialise", type(raw).__name__)
        return False
    if not getattr(writer, _WRAPPED, False):
        raw.frame_writer = _one_at_a_time(writer, threading.Lock())
    return True


def _one_at_a_time(writer: Callable[..., Any], lock: Any) -> Callable[..., Any]:
    @wraps(writer)
    def write_frame(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return writer(*args, **kwargs)

    setattr(write_frame, _WRAPPED, True)
    return write_frame
