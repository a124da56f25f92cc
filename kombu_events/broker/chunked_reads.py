"""Read a worker's plain-TCP AMQP socket a chunk at a time on the event loop, and never leave a whole frame unread.

Why: py-amqp's ``TCPTransport._read`` asks the socket for exactly the bytes it wants
next, and ``read_frame`` wants each frame in three pieces (the 7-byte header, the
payload, the end octet): about nine ``recv`` calls for one message (method, content
header, body), the largest cost of a solo worker with a no-op handler. :func:`install`
gives Celery's hub a reader for the connection's socket that takes what the socket holds,
up to :data:`CHUNK_BYTES`, in one ``recv`` into py-amqp's own ``transport._read_buffer``,
then dispatches every whole frame there through py-amqp's ``read_frame`` (which finds them
in the buffer) and ``on_inbound_frame``: the same frames, in the same order.

The stall it must not cause: bytes in ``_read_buffer`` are invisible to ``epoll``, so a
whole frame left there waits until the broker sends more, which may be never (a prefetch
window whose deliveries all sit in the buffer unacked). An earlier attempt chunked every
read, synchronous calls' too: ``basic.consume`` read its ``consume-ok`` and the deliveries
behind it, and stopped at the reply. Dispatching those deliveries inside the call is no
cure: py-amqp registers a consumer's callback after ``consume-ok``, and rejects (requeues)
a delivery it has no callback for. So:

1. only the hub's reader, on the event loop and outside any synchronous call, reads in
   chunks, and it dispatches every whole frame it buffered before it returns; a callback
   that makes a synchronous call meanwhile reads the buffer first, then exactly its reply;
2. everything else (synchronous calls, kombu's and Celery's ``drain_events``) reads as
   py-amqp does, exactly, and so never buffers a frame beyond the one it reads;
3. a hub tick, before each poll, dispatches whole frames a failed dispatch left behind.

A partial frame may stay buffered: the rest of it is on its way, and its arrival makes
the socket readable. TLS (``SSLTransport``, with its own ``pending()`` buffer) and other
transports are left as they are.
"""
from __future__ import annotations

__all__ = ["CHUNK_BYTES", "install", "dispatch_buffered", "holds_whole_frame"]

import errno
import logging
import socket
from struct import unpack_from
from typing import Any, Callable

from amqp.exceptions import RecoverableConnectionError
from amqp.transport import TCPTransport

logger = logging.getLogger(__name__)

#: The most one read of the event loop asks the socket for (a no-op event's three frames take ~300 bytes).
CHUNK_BYTES = 4096
#: An AMQP frame: type (1), channel (2), payload size (4), payload, frame-end (1).
_FRAME_OVERHEAD = 8
#: Without waiting: the hub calls the reader when the socket is readable (0 where the flag does not exist).
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
#: The hub's tick of this module, replaced when the step starts on a new connection.
_HUB_TICK = "_kombu_events_chunked_reads_tick"


def install(connection: Any, hub: Any = None) -> bool:
    """Make kombu ``connection``'s reader on the event loop read in chunks (see the module's docstring).

    It takes the place of kombu's reader for the socket in ``hub`` (Celery registers it when it
    connects, and again on every reconnect, before the step starts); ``hub`` is None under
    gevent, eventlet or a blocking loop, which read as py-amqp does.
    Returns whether the reader is replaced: a TLS connection or another transport is left alone.
    """
    raw = getattr(connection, "connection", None)  # kombu's Connection -> py-amqp's (connected by Celery)
    transport = _transport_of(raw)
    kombu_transport: Any = getattr(connection, "transport", None)
    if hub is None or type(transport) is not TCPTransport or getattr(transport, "sock", None) is None \
            or not hasattr(kombu_transport, "on_readable") or not hasattr(hub, "add_reader"):
        logger.debug("kombu-events: reads left as they are on %r", type(transport).__name__)
        return False
    kombu_transport.on_readable = on_readable  # what kombu's register_with_event_loop gives the hub from now on
    hub.add_reader(transport.sock, on_readable, raw, hub)  # Celery registered kombu's reader when it connected
    _watch(hub, raw)
    return True


def on_readable(raw: Any, hub: Any) -> None:
    """The hub's reader for py-amqp connection ``raw``: one ``recv`` of up to :data:`CHUNK_BYTES`, then every
    whole frame buffered dispatched. What a dispatch raises goes on to the hub, as from kombu's reader."""
    transport = _transport_of(raw)
    if transport is None or not transport.connected:
        raise RecoverableConnectionError("Socket was disconnected")
    if not holds_whole_frame(transport._read_buffer):  # frames left behind go first, without a read
        try:
            chunk = transport.sock.recv(CHUNK_BYTES, _DONTWAIT)
        except socket.timeout:
            return  # a socket with a timeout of its own: nothing came within it
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EINTR):
                return  # readable no longer: another read took the bytes
            transport.connected = False
            raise
        if not chunk:
            transport.connected = False
            raise OSError("Server unexpectedly closed connection")
        transport._read_buffer += chunk
    dispatch_buffered(raw)


def holds_whole_frame(buffer: bytes) -> bool:
    """Whether ``buffer`` starts with a whole AMQP frame."""
    return len(buffer) >= _FRAME_OVERHEAD and len(buffer) >= _FRAME_OVERHEAD + unpack_from(">I", buffer, 3)[0]


def dispatch_buffered(raw: Any) -> int:
    """Dispatch each whole frame in py-amqp connection ``raw``'s read buffer, in order; how many.

    Reads no socket. What a frame's dispatch raises goes on, as from py-amqp's own read
    (a connection error: Celery reconnects); the frames behind it stay buffered.
    """
    count = 0
    transport = _transport_of(raw)
    while transport is not None and transport.connected and holds_whole_frame(transport._read_buffer):
        raw.on_inbound_frame(transport.read_frame())
        count += 1
        transport = _transport_of(raw)  # None once a frame closed the connection (connection.close-ok)
    return count


def _transport_of(raw: Any) -> Any:
    """py-amqp's transport of ``raw``, or None once closed: its ``transport`` property would connect again."""
    return getattr(raw, "_transport", None)


def _watch(hub: Any, raw: Any) -> None:
    """Make ``hub``'s tick dispatch the whole frames ``raw`` has buffered (this connection's; an earlier one's
    tick is dropped)."""
    ticks = getattr(hub, "on_tick", None)
    if ticks is None:
        return
    ticks.discard(getattr(hub, _HUB_TICK, None))
    tick = _buffer_tick(raw)
    setattr(hub, _HUB_TICK, tick)
    ticks.add(tick)


def _buffer_tick(raw: Any) -> Callable[[], None]:
    """The hub tick for py-amqp connection ``raw``: dispatch whole frames left buffered; never raise for itself."""
    errors = tuple(getattr(raw, "connection_errors", ())) + tuple(getattr(raw, "channel_errors", ()))

    def dispatch_left_behind() -> None:
        try:
            transport = _transport_of(raw)
            if transport is None or not transport.connected or not holds_whole_frame(transport._read_buffer):
                return
            count = dispatch_buffered(raw)
        except errors:
            raise  # as from kombu's reader: Celery reconnects
        except Exception:
            logger.exception("kombu-events: could not dispatch frames left in the read buffer; going on")
            return
        logger.debug("kombu-events: dispatched %d frames left in the read buffer", count)

    return dispatch_left_behind
