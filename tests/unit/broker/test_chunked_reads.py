"""broker/chunked_reads.py: one ``recv`` for many frames, and no whole frame left unread in the buffer.

py-amqp's own framing (``TCPTransport.read_frame``, ``Connection.drain_events`` and
``blocking_read``, ``frame_handler``) runs on a stand-in socket that hands out prepared
bytes and counts the ``recv`` calls; no socket is opened.
"""
from __future__ import annotations

import errno
import socket
from struct import pack
from types import SimpleNamespace
from typing import Any

import amqp
import pytest
from amqp.method_framing import frame_handler
from amqp.transport import SSLTransport, TCPTransport

from kombu_events.broker import chunked_reads
from kombu_events.broker.chunked_reads import dispatch_buffered, holds_whole_frame, install, on_readable

CONSUME_OK = (60, 21)
DELIVER = (60, 60)


def frame(frame_type: int, channel: int, payload: bytes) -> bytes:
    return pack(">BHI", frame_type, channel, len(payload)) + payload + b"\xce"


def method(channel: int, sig: tuple[int, int], args: bytes = b"") -> bytes:
    return frame(1, channel, pack(">HH", *sig) + args)


def delivery(channel: int, body: bytes) -> bytes:
    """basic.deliver, its content header and its body: the three frames of one message."""
    deliver_args = b"\x03tag" + pack(">Q", 1) + b"\x00" + b"\x02ex" + b"\x02rk"
    header = pack(">HHQH", 60, 0, len(body), 0)
    return method(channel, DELIVER, deliver_args) + frame(2, channel, header) + frame(3, channel, body)


class Sock:
    """A socket with ``chunks`` waiting, handed out as ``recv`` asks; then EAGAIN (non-blocking) or a timeout."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)
        self.recvs = 0
        self.timeout: float | None = None

    def recv(self, n: int, flags: int = 0) -> bytes:
        self.recvs += 1
        if not self.chunks:
            if not flags & socket.MSG_DONTWAIT and (self.timeout is None or self.timeout > 0):
                raise socket.timeout("timed out")
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        head, rest = self.chunks[0][:n], self.chunks[0][n:]
        self.chunks[0:1] = [rest] if rest else []
        return head

    def gettimeout(self) -> float | None:
        return self.timeout

    def settimeout(self, timeout: float | None) -> None:
        self.timeout = timeout


class Raw:
    """py-amqp's Connection as far as reading goes: its own drain_events, blocking_read and frame handler."""

    drain_events = amqp.Connection.drain_events
    blocking_read = amqp.Connection.blocking_read
    connection_errors = amqp.Connection.connection_errors
    channel_errors = amqp.Connection.channel_errors

    def __init__(self, sock: Sock) -> None:
        self._transport: Any = TCPTransport("localhost:5672")
        self.transport.sock = sock  # type: ignore[assignment]
        self.transport._quick_recv = sock.recv  # what py-amqp's _setup_transport sets
        self.transport.connected = True
        self.bytes_recv = 0
        self.methods: list[tuple[int, tuple[int, int], Any]] = []
        self.on_inbound_frame = frame_handler(self, self._on_method)

    @property
    def transport(self) -> Any:  # py-amqp's connects a closed connection again: the module never reads it
        assert self._transport is not None, "read the transport of a closed connection"
        return self._transport

    def _on_method(self, channel: int, sig: tuple[int, int], args: Any, content: Any) -> None:
        self.methods.append((channel, sig, content.body if content is not None else None))


class Kombu:
    """kombu's Connection as far as install goes: the py-amqp connection and kombu's transport with its reader."""

    def __init__(self, raw: Raw) -> None:
        self.connection = raw
        self.transport = SimpleNamespace(on_readable=lambda connection, loop: None)


class Hub:
    """kombu's Hub as far as install goes: its tick callbacks and its readers."""

    def __init__(self) -> None:
        self.on_tick: set[Any] = set()
        self.readers: dict[Any, tuple[Any, tuple[Any, ...]]] = {}

    def add_reader(self, fd: Any, callback: Any, *args: Any) -> None:
        self.readers[fd] = callback, args

    def tick(self) -> None:
        for callback in list(self.on_tick):
            callback()


def _wait_for(raw: Raw, sig: tuple[int, int], timeout: float = 1.0) -> None:
    """What py-amqp's ``Channel.wait`` does for a synchronous call: drain until ``sig`` arrived."""
    while not any(m[1] == sig for m in raw.methods):
        raw.drain_events(timeout=timeout)


def test_one_recv_of_the_event_loop_dispatches_every_frame_it_brought():
    wire = b"".join(delivery(1, b"event %d" % i) for i in range(10))
    raw = Raw(Sock(wire))
    on_readable(raw, Hub())  # the socket is readable: the hub calls its reader
    assert [m[2] for m in raw.methods] == [b"event %d" % i for i in range(10)]
    assert raw.transport.sock.recvs == 1  # py-amqp alone: 3 per frame, 90
    assert raw.transport._read_buffer == b""


def test_frames_split_anywhere_are_read_whole():
    wire = b"".join(delivery(1, b"x" * (i * 700)) for i in range(1, 8))
    sock = Sock(*[wire[i:i + 613] for i in range(0, len(wire), 613)])
    raw = Raw(sock)
    while sock.chunks:
        on_readable(raw, Hub())
        assert not holds_whole_frame(raw.transport._read_buffer)  # never a whole frame left unread
    assert [len(m[2]) for m in raw.methods] == [i * 700 for i in range(1, 8)]
    assert raw.transport._read_buffer == b""


def test_a_synchronous_call_reads_exactly_its_reply_and_leaves_the_rest_to_the_event_loop():
    """The earlier stall: consume-ok and the deliveries behind it on the socket at once.

    A synchronous call reads as py-amqp does, up to its reply, so the deliveries stay on the
    socket, where epoll sees them (and where py-amqp has registered the consumer's callback by the
    time the hub's reader dispatches them).
    """
    sock = Sock(method(1, CONSUME_OK, b"\x03tag") + delivery(1, b"first") + delivery(1, b"second"))
    raw = Raw(sock)
    install(Kombu(raw), Hub())
    _wait_for(raw, CONSUME_OK)
    assert len(raw.methods) == 1 and raw.transport._read_buffer == b""
    assert sock.chunks  # still on the socket: readable for epoll
    on_readable(raw, Hub())
    assert [m[2] for m in raw.methods[1:]] == [b"first", b"second"]


def test_a_partial_frame_stays_buffered_until_its_rest_arrives():
    wire = delivery(1, b"whole") + delivery(1, b"cut in two")
    sock = Sock(wire[:-5])
    raw = Raw(sock)
    on_readable(raw, Hub())
    assert [m[2] for m in raw.methods] == [b"whole"]
    assert raw.transport._read_buffer and not holds_whole_frame(raw.transport._read_buffer)
    on_readable(raw, Hub())  # a spurious wake-up: nothing to read, nothing raised
    sock.chunks.append(wire[-5:])  # the socket turns readable again
    on_readable(raw, Hub())
    assert [m[2] for m in raw.methods] == [b"whole", b"cut in two"]


def test_a_closed_or_lost_connection_raises_for_celery_to_reconnect():
    raw = Raw(Sock(b""))
    with pytest.raises(OSError, match="unexpectedly closed"):
        on_readable(raw, Hub())
    assert raw.transport.connected is False
    with pytest.raises(amqp.exceptions.RecoverableConnectionError):
        on_readable(raw, Hub())


def test_install_replaces_kombus_reader_in_the_hub_and_adds_one_tick():
    hub, raw = Hub(), Raw(Sock())
    kombu = Kombu(raw)
    assert install(kombu, hub)
    assert kombu.transport.on_readable is on_readable and len(hub.on_tick) == 1
    assert hub.readers == {raw.transport.sock: (on_readable, (raw, hub))}  # in place of the one Celery added
    assert "_read" not in vars(raw.transport) and "drain_events" not in vars(raw)  # py-amqp's own reads


def test_the_hub_tick_dispatches_whole_frames_left_in_the_buffer():
    """Frames another reader (or a dispatch that raised) left buffered go at the next turn of the loop."""
    hub = Hub()
    raw = Raw(Sock())
    install(Kombu(raw), hub)
    raw.transport._read_buffer = delivery(1, b"left behind") + delivery(2, b"too")
    hub.tick()
    assert [m[2] for m in raw.methods] == [b"left behind", b"too"]
    assert raw.transport.sock.recvs == 0


def test_the_tick_of_an_earlier_connection_is_replaced_and_a_closed_one_reads_nothing():
    hub = Hub()
    old, new = Raw(Sock()), Raw(Sock())
    install(Kombu(old), hub)
    install(Kombu(new), hub)
    assert len(hub.on_tick) == 1
    new.transport.connected = False
    new.transport._read_buffer = delivery(1, b"after the connection was lost")
    hub.tick()
    assert new.methods == []


def test_the_tick_logs_a_failure_of_its_own_and_lets_a_connection_error_go_on(caplog):
    hub = Hub()
    raw = Raw(Sock())
    install(Kombu(raw), hub)
    raw.transport._read_buffer = delivery(1, b"boom")
    raw.on_inbound_frame = _raising(ValueError("a bug"))
    hub.tick()  # logged, not raised into the hub
    assert "could not dispatch frames" in caplog.text
    raw.transport._read_buffer = delivery(1, b"closed")
    raw.on_inbound_frame = _raising(amqp.exceptions.ConnectionForced("closed by the broker"))
    with pytest.raises(amqp.exceptions.ConnectionForced):  # as from kombu's reader: Celery reconnects
        hub.tick()


def _raising(exc: Exception) -> Any:
    def on_frame(frame: Any) -> None:
        raise exc

    return on_frame


def test_a_left_behind_frame_is_dispatched_before_the_socket_is_read_again():
    raw = Raw(Sock(delivery(1, b"new")))
    raw.transport._read_buffer = delivery(1, b"old")
    on_readable(raw, Hub())
    assert [m[2] for m in raw.methods] == [b"old"] and raw.transport.sock.recvs == 0
    on_readable(raw, Hub())  # the socket is still readable
    assert [m[2] for m in raw.methods] == [b"old", b"new"]


def test_tls_and_unconnected_transports_are_left_alone():
    raw = Raw(Sock())
    raw._transport = SSLTransport("localhost:5671")
    raw._transport.sock = Sock()
    kombu, hub = Kombu(raw), Hub()
    assert not install(kombu, hub)
    assert kombu.transport.on_readable is not on_readable and not hub.on_tick and not hub.readers
    raw._transport = TCPTransport("localhost:5672")
    assert not install(kombu, hub)  # no socket yet
    raw._transport = None
    assert not install(kombu, hub)  # closed: never connected again
    assert not install(Kombu(Raw(Sock())), None)  # no event loop (gevent, eventlet): py-amqp's reads


def test_a_frame_that_closes_the_connection_ends_the_dispatch():
    """connection.close-ok drops the transport (py-amqp's ``collect``): nothing behind it is read or reconnects."""
    raw = Raw(Sock())
    raw._transport._read_buffer = delivery(1, b"before") + delivery(1, b"after")
    on_frame = raw.on_inbound_frame

    def closing(frame: Any) -> Any:
        result = on_frame(frame)
        if raw.methods:
            raw._transport = None
        return result

    raw.on_inbound_frame = closing
    assert dispatch_buffered(raw) == 3
    assert [m[2] for m in raw.methods] == [b"before"]


def test_whole_frame_needs_its_end_octet():
    one = frame(3, 1, b"abc")
    assert holds_whole_frame(one) and not holds_whole_frame(one[:-1]) and not holds_whole_frame(b"")
    raw = Raw(Sock())
    raw.transport._read_buffer = one[:-1]
    assert dispatch_buffered(raw) == 0


def test_chunk_size_is_a_few_messages():
    assert 1024 <= chunked_reads.CHUNK_BYTES <= 65536
