"""broker/waits.py: a wait on the worker's connection is bounded, and running out is a lost connection."""
from __future__ import annotations

import socket
from contextlib import contextmanager

import pytest

from kombu_events.broker.waits import BrokerSilent, answer_within
from kombu_events.middleware.control import Control


class Transport:
    """py-amqp's transport as answer_within uses it: a socket, and a context that bounds its reads."""

    def __init__(self) -> None:
        self.sock = object()
        self.timeouts: list[float] = []

    @contextmanager
    def having_timeout(self, seconds):
        self.timeouts.append(seconds)
        yield self.sock


class Connection:  # kombu's Connection: .connection is py-amqp's
    def __init__(self) -> None:
        self.connection = type("AmqpConnection", (), {"transport": Transport()})()


def test_reads_inside_are_bounded_and_a_timeout_is_a_lost_connection():
    connection = Connection()
    with pytest.raises(BrokerSilent, match=r"did not answer cancelling q within 3 s") as raised, \
            answer_within(connection, 3, doing="cancelling q"):
        raise socket.timeout("timed out")
    assert connection.connection.transport.timeouts == [3]
    assert isinstance(raised.value, ConnectionError), "Celery's loop reconnects on a connection error"


def test_other_errors_pass_unchanged():
    with pytest.raises(KeyError), answer_within(Connection()):
        raise KeyError("x")


@pytest.mark.parametrize("connection", [None, object(), type("C", (), {"transport": Transport()})()])
def test_without_a_socket_to_bound_the_block_runs_as_it_is(connection):
    if connection is not None and hasattr(connection, "transport"):
        connection.transport.sock = None  # a closed transport
    with answer_within(connection):
        ran = True
    assert ran


class Consuming:
    def pause_queue(self, queue):
        pass

    def resume_queue(self, queue, prefetch):
        pass

    def call_soon_threadsafe(self, fn):
        self.queued = fn


def test_a_timer_that_finds_the_broker_silent_is_not_swallowed():
    """Control logs and skips a failing timer, but a silent broker must reach Celery's loop."""
    control = Control("svc", ("svc.a",), Consuming())

    def read():
        raise BrokerSilent("silent")

    control.call_soon_threadsafe(read)
    with pytest.raises(BrokerSilent):
        control._consuming.queued()


def _consumer(*open_states, started=True):
    from types import SimpleNamespace
    return SimpleNamespace(_started=started, settings=SimpleNamespace(service="svc"),
                           _channels=[SimpleNamespace(is_open=state) for state in open_states])


def test_a_channel_the_broker_closed_makes_celery_reconnect():
    from kombu_events.worker.consumer import ServiceConsumer
    with pytest.raises(ConnectionError, match="a channel of service svc was closed by the broker"):
        ServiceConsumer._check_channels(_consumer(True, False))


@pytest.mark.parametrize("consumer", [_consumer(True, True), _consumer(False, started=False), _consumer()])
def test_open_channels_or_a_stopped_step_raise_nothing(consumer):
    from kombu_events.worker.consumer import ServiceConsumer
    ServiceConsumer._check_channels(consumer)
