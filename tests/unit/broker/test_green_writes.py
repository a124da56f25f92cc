"""broker/green_writes.py: one frame writer at a time on a connection greenlets share; the step wires it
for the gevent and eventlet pools only.

Threads stand in for greenlets (both yield inside a write that waits on the socket); the
frame writer is a stand-in that sleeps while it "writes" and counts who is inside.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import celery
import pytest

from kombu_events.broker.green_writes import serialize_writes
from kombu_events.worker.bootstep import EventsStep


class Raw:
    """py-amqp's Connection as far as writing goes: ``frame_writer(type, channel, method, args, content)``."""

    def __init__(self) -> None:
        self.inside = self.most_inside = 0
        self.frames: list[tuple[Any, ...]] = []
        self._count = threading.Lock()
        self.frame_writer = self._write

    def _write(self, *frame: Any) -> int:
        with self._count:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        time.sleep(0.005)  # a full send buffer: the writer yields mid-frame
        with self._count:
            self.inside -= 1
            self.frames.append(frame)
        return len(self.frames)


def _write_from_threads(raw: Raw, threads: int = 8, frames: int = 5) -> None:
    def writer(n: int) -> None:
        for i in range(frames):
            raw.frame_writer(1, n, (60, 40), b"args", i)

    workers = [threading.Thread(target=writer, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def test_without_it_writers_overlap():
    """The stand-in shows what py-amqp before 5.4 allows: several writers inside one frame writer."""
    raw = Raw()
    _write_from_threads(raw)
    assert raw.most_inside > 1


def test_writers_take_turns_and_every_frame_is_written():
    raw = Raw()
    assert serialize_writes(SimpleNamespace(connection=raw)) is True  # kombu's Connection: py-amqp's behind it
    _write_from_threads(raw)
    assert raw.most_inside == 1
    assert sorted(raw.frames) == sorted((1, n, (60, 40), b"args", i) for n in range(8) for i in range(5))


def test_the_writer_keeps_its_arguments_result_and_errors():
    raw = Raw()
    serialize_writes(raw)
    assert raw.frame_writer(8, 0, None, None, None) == 1
    assert raw.frames == [(8, 0, None, None, None)]

    def broken(*frame: Any) -> None:
        raise ConnectionResetError("gone")

    raw.frame_writer = broken
    serialize_writes(raw)
    with pytest.raises(ConnectionResetError):
        raw.frame_writer(1, 1, (60, 40), b"", None)
    with pytest.raises(ConnectionResetError):  # the lock was released by the first error
        raw.frame_writer(1, 1, (60, 40), b"", None)


def test_a_restart_on_the_same_connection_wraps_once():
    raw = Raw()
    serialize_writes(raw)
    wrapped = raw.frame_writer
    assert serialize_writes(raw) is True
    assert raw.frame_writer is wrapped


def test_a_connection_without_a_frame_writer_is_left_alone():
    other = SimpleNamespace(connection=SimpleNamespace())  # another transport's connection
    assert serialize_writes(other) is False
    assert not hasattr(other.connection, "frame_writer")


class _Consumer:
    settings = SimpleNamespace(service="billing")

    def start(self, connection: Any, pool: Any, hub: Any, call_soon: Any = None) -> None:
        self.frame_writer = connection.connection.frame_writer


@pytest.mark.parametrize("is_green", [True, False])
def test_the_step_serialises_writes_under_a_green_pool_only(is_green):
    raw = Raw()
    original = raw.frame_writer
    parent = SimpleNamespace(app=celery.Celery("proj", broker="memory://", set_as_current=False),
                             connection=SimpleNamespace(connection=raw), pool=SimpleNamespace(is_green=is_green),
                             hub=None)
    step = EventsStep(parent)
    consumer = _Consumer()
    step.consumers = [consumer]  # type: ignore[list-item]
    step.start(parent)
    assert (consumer.frame_writer is not original) is is_green, "wrapped before the consumers start"
