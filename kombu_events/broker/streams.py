"""Read a RabbitMQ stream by offset over AMQP 0-9-1, changing nothing in it.

A stream consumer (``x-stream-offset``) reads without removing: its acks only give the
broker credit to send more, and nothing a reader does counts a delivery, sets
``redelivered`` or moves a message. AMQP 0-9-1 does not say where a stream ends, so
:func:`read` first asks for its last chunk (``x-stream-offset: last``, one message) and
reads up to that offset, then what arrives within ``settle_s`` after it (the rest of
that chunk, committed with it). Every confirmed publish made before a read began is
at or before the last chunk's offsets, so it is read. A queue that is not a stream
refuses the consumer argument (on RabbitMQ 3.10 and 4.x alike) before any message
moves: :class:`NotAStreamError`.
"""
from __future__ import annotations

__all__ = ["NotAStreamError", "StreamStalledError", "is_not_a_stream", "last_chunk_offset", "read", "follow",
           "offset_of", "body_of"]

import logging
import socket
import time
from collections import deque
from datetime import datetime
from typing import Any, Iterator

from amqp.exceptions import PreconditionFailed

from ..errors import KombuEventsError

logger = logging.getLogger(__name__)

OFFSET_HEADER = "x-stream-offset"
#: Unacked stream messages the broker may send ahead (acks are only credit on a stream).
PREFETCH = 100
#: Acks are sent this many messages at a time (``multiple``): half the prefetch, so that credit never runs out.
_ACK_EVERY = PREFETCH // 2
#: A read waiting for its end looks this often whether the stream still holds anything (retention may empty it).
_PROBE_S = 2.0


class NotAStreamError(KombuEventsError):
    """The queue exists and is not a stream (a classic or quorum queue: the broker refused the offset)."""

    def __init__(self, queue: str) -> None:
        super().__init__(f"queue {queue!r} is not a stream")
        self.queue = queue


class StreamStalledError(KombuEventsError):
    """The broker sent nothing for a long time before the end a read had found."""


def close_quietly(channel: Any) -> None:
    """Close ``channel``; a failure (the connection went away meanwhile) is logged at debug, never raised."""
    try:
        channel.close()
    except Exception as exc:
        logger.debug("kombu-events: closing a stream channel failed: %s", exc)


def is_not_a_stream(exc: BaseException) -> bool:
    """Whether ``exc`` is the broker refusing ``x-stream-offset`` on a queue that is not a stream."""
    return isinstance(exc, PreconditionFailed) and OFFSET_HEADER in str(getattr(exc, "reply_text", "") or exc)


def body_of(message: Any) -> bytes:
    """The body of a message read from a stream, as bytes (py-amqp gives an empty body as ``''``)."""
    body = message.body
    return bytes(body) if isinstance(body, (bytes, bytearray, memoryview)) else str(body or "").encode()


def offset_of(message: Any) -> int:
    """The stream offset of a message read from a stream."""
    return int((message.properties.get("application_headers") or {})[OFFSET_HEADER])


def _consume(connection: Any, queue: str, start: int | str | datetime, prefetch: int, sink: Any) -> Any:
    channel = connection.channel()
    channel.auto_decode = False  # bodies exactly as stored
    channel.kombu_events_stopping = False

    def take(message: Any) -> None:  # what arrives once the read stops (cancelled) is dropped, never held
        if not channel.kombu_events_stopping:
            sink(message)

    try:
        channel.basic_qos(0, prefetch, False)
        channel.kombu_events_tag = channel.basic_consume(queue, no_ack=False, callback=take,
                                                         arguments={OFFSET_HEADER: start})
    except PreconditionFailed as exc:
        close_quietly(channel)
        if is_not_a_stream(exc):
            raise NotAStreamError(queue) from exc
        raise
    except BaseException:
        close_quietly(channel)
        raise
    return channel


def _emptied(connection: Any, queue: str, wait_s: float) -> bool:
    """Whether ``queue`` holds no record now: retention may remove every one up to the end a read found, since it
    found it (a stream cut to a segment of the broker's own records). Asked twice, the second time twice as long:
    a busy broker is not taken for an empty stream."""
    return all(last_chunk_offset(connection, queue, wait_s=wait) is None for wait in (wait_s, 2 * wait_s))


def _stop(channel: Any, sink: deque[Any]) -> None:
    """Cancel the consumer (what the broker sent until it confirmed is dropped from ``sink``), then close the
    channel: closing alone would leave every message on its way to be logged by py-amqp as it arrives."""
    sink.clear()
    channel.kombu_events_stopping = True  # the sink drops what arrives from here
    try:
        if channel.is_open:
            channel.basic_cancel(channel.kombu_events_tag)
    except Exception:  # the connection went away: close_quietly says so at debug
        pass
    sink.clear()
    close_quietly(channel)


def last_chunk_offset(connection: Any, queue: str, *, wait_s: float = 3.0) -> int | None:
    """The offset of the first message of ``queue``'s last chunk, or None when nothing came in ``wait_s``
    (an empty stream). A missing queue raises amqp's NotFound; a queue that is no stream, NotAStreamError."""
    got: deque[Any] = deque()
    channel = _consume(connection, queue, "last", 1, got.append)
    try:
        deadline = time.monotonic() + wait_s
        while not got:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                connection.drain_events(timeout=left)
            except socket.timeout:
                return None
        return offset_of(got[0])
    finally:
        _stop(channel, got)


def read(connection: Any, queue: str, *, start: int | str | datetime = "first", tail_wait_s: float = 3.0,
         settle_s: float = 0.2, stall_s: float = 60.0, prefetch: int = PREFETCH,
         end_if_emptied: bool = True) -> Iterator[tuple[int, Any]]:
    """(offset, message) for each message of stream ``queue`` from ``start`` (an offset, or ``"first"``) to the
    end the read found when it began (see the module), in order, on a channel of its own closed when the
    iteration ends or is abandoned. When nothing comes for a while before that end, the read asks again for the
    last chunk, twice (``tail_wait_s``, then twice that): none means retention has since removed everything up to
    the end, and the read ends there (``end_if_emptied=False``: it waits on, for a caller that must read every
    record, such as a copy that deletes its source). Nothing for ``stall_s`` before that end, with records still
    in the stream, raises StreamStalledError."""
    end = last_chunk_offset(connection, queue, wait_s=tail_wait_s)
    if end is None:
        return
    # A start past the end's first offset: only what is left of the last chunk after it (never before start).
    past_end = isinstance(start, int) and start > end
    for item in _records(connection, queue, start, end, settle_s, stall_s, prefetch, reached=past_end,
                         tail_wait_s=tail_wait_s if end_if_emptied else None):
        if item is not None:
            yield item


def follow(connection: Any, queue: str, *, start: int | str | datetime = "first", idle_s: float = 0.5,
           prefetch: int = PREFETCH) -> Iterator[tuple[int, Any] | None]:
    """(offset, message) for each message of stream ``queue`` from ``start``, then each one appended, for as long
    as the caller iterates; None whenever nothing came for ``idle_s`` (the caller may stop there)."""
    return _records(connection, queue, start, None, idle_s, 0.0, prefetch)


def _records(connection: Any, queue: str, start: int | str | datetime, end: int | None, settle_s: float, stall_s: float,
             prefetch: int, reached: bool = False, tail_wait_s: float | None = None,
             ) -> Iterator[tuple[int, Any] | None]:
    arrived: deque[Any] = deque()
    channel = _consume(connection, queue, start, prefetch, arrived.append)
    try:
        # Past the end, the read stops once it has *waited* settle_s in all (the rest of the end's chunk comes
        # at once): an idle time that each message reset would never end beside a steady writer, and a wall-clock
        # deadline would cut the chunk short behind a slow caller.
        unacked, last_tag, waited, idle = 0, 0, 0.0, 0.0
        while True:
            if not arrived:
                waiting_for_end = end is not None and not reached
                if end is not None and reached and waited >= settle_s:
                    return
                timeout = min(_PROBE_S, stall_s - idle) if waiting_for_end else (
                    settle_s - waited if end is not None else settle_s)
                began = time.monotonic()
                try:
                    connection.drain_events(timeout=timeout)
                    idle = 0.0
                    if end is not None and reached:
                        waited += time.monotonic() - began
                except socket.timeout:
                    if end is None:
                        yield None
                        continue
                    if reached:
                        return
                    idle += time.monotonic() - began
                    if tail_wait_s is not None and _emptied(connection, queue, tail_wait_s):
                        return
                    if idle >= stall_s:
                        raise StreamStalledError(f"stream {queue!r} sent nothing for {stall_s:g} s before its end "
                                                 f"(offset {end})") from None
                continue
            message = arrived.popleft()
            last_tag, unacked = message.delivery_tag, unacked + 1
            if unacked >= min(_ACK_EVERY, max(prefetch // 2, 1)):
                channel.basic_ack(last_tag, multiple=True)
                unacked = 0
            offset = offset_of(message)
            if end is not None and offset >= end:
                reached = True
            yield offset, message
    finally:
        _stop(channel, arrived)
