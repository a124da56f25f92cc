"""broker/declare.py: a refused declare becomes one clear error, with what to do about it; passive declares
(peek_queues, absent_exchanges) read what exists, a missing entity among others included."""
from __future__ import annotations

import logging

import pytest
from amqp.exceptions import NotFound, PreconditionFailed
from kombu import Exchange

from kombu_events.broker.declare import (
    QueueCounts,
    absent_exchanges,
    conflict_error,
    peek_queue,
    peek_queues,
    queue_counts,
)


def refused(text: str) -> PreconditionFailed:
    return PreconditionFailed(text, method_sig=(50, 10), reply_code=406)


def test_an_inequivalent_queue_names_the_argument_and_the_migrate_command():
    error = conflict_error(refused("PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'svc.h' in vhost "
                                   "'/': received the value 'quorum' of type 'longstr' but current is none"),
                           "queue", "svc.h")
    assert error.argument == "x-queue-type" and error.entity == "svc.h"
    assert str(error).startswith("queue 'svc.h' already exists on the broker with a different argument 'x-queue-type'")
    assert "kombu-events migrate --to quorum" in str(error)


def test_an_inequivalent_exchange_is_not_sent_to_migrate():
    error = conflict_error(refused("PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'events' in vhost "
                                   "'/': received 'topic' but current is 'direct'"), "exchange", "events")
    assert "a different argument 'type'" in str(error) and "migrate" not in str(error)


def test_a_value_rabbitmq_refuses_is_not_called_a_conflict():
    error = conflict_error(refused("PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue 'svc.delay.31' in "
                                   "vhost '/': {value_too_large,2147483648000}"), "queue", "svc.delay.31")
    assert str(error).startswith("RabbitMQ refused argument 'x-message-ttl' of queue 'svc.delay.31'")
    assert "already exists" not in str(error) and error.argument == "x-message-ttl"


class Channel:
    """py-amqp's channel as a passive declare sees it: a missing entity raises NotFound, and the broker's
    close of the channel is followed by py-amqp reopening it (it stays open until closed)."""

    def __init__(self, broker, log):
        self.broker, self.log, self.open = broker, log, True

    def queue_declare(self, name, passive):
        assert passive, "a peek never creates a queue"
        self.log.append(("queue", name))
        if name not in self.broker:
            raise NotFound(f"no queue '{name}'", (50, 10), 404)
        return (name, *self.broker[name])

    def exchange_declare(self, name, type, passive):
        assert passive, "a peek never creates an exchange"
        self.log.append(("exchange", name))
        if name not in self.broker:
            raise NotFound(f"no exchange '{name}'", (40, 10), 404)

    def close(self):
        self.open = False


class Connection:
    def __init__(self, broker, fail_close=False):
        self.broker, self.declared, self.channels, self.fail_close = broker, [], [], fail_close

    def channel(self):
        channel = Channel(self.broker, self.declared)
        if self.fail_close:
            channel.close = self._refuse
        self.channels.append(channel)
        return channel

    def _refuse(self):
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_missing_queue_among_existing_ones_is_none_and_the_others_have_their_counts():
    connection = Connection({"a": (3, 1), "c": (0, 0), "d": (7, 2)})
    assert peek_queues(connection, ["a", "b", "c", "d"]) == {
        "a": QueueCounts(3, 1), "b": None, "c": QueueCounts(0, 0), "d": QueueCounts(7, 2)}
    assert connection.declared == [("queue", n) for n in "abcd"], "one passive declare each, in order"
    assert len(connection.channels) == 2, "one channel until the missing queue, then a fresh one"
    assert not any(c.open for c in connection.channels), "every channel closed, the reopened one too"


def test_one_channel_serves_every_queue_when_all_exist_and_none_is_opened_for_no_queue():
    connection = Connection({"a": (1, 0), "b": (2, 0)})
    assert peek_queues(connection, ["a", "b"]) == {"a": (1, 0), "b": (2, 0)}
    assert len(connection.channels) == 1 and not connection.channels[0].open
    assert peek_queues(connection, []) == {} and len(connection.channels) == 1


def test_peek_queue_reads_one_queue():
    connection = Connection({"a": (5, 3)})
    assert peek_queue(connection, "a") == QueueCounts(messages=5, consumers=3)
    assert peek_queue(connection, "gone") is None
    assert not any(c.open for c in connection.channels)


def test_queue_counts_on_the_callers_channel_raises_not_found_and_leaves_it_to_the_caller():
    connection = Connection({"a": (2, 0)})
    channel = connection.channel()
    assert queue_counts(channel, "a") == (2, 0)
    with pytest.raises(NotFound):
        queue_counts(channel, "gone")
    assert channel.open, "the caller closes its channel"


def test_absent_exchanges_are_named_in_order_and_every_channel_is_closed():
    connection = Connection({"events": None, "svc.delivery": None})
    exchanges = [Exchange(n, "topic") for n in ("events", "svc.delay.0", "svc.delivery", "svc.archive")]
    assert absent_exchanges(connection, exchanges) == ["svc.delay.0", "svc.archive"]
    assert connection.declared == [("exchange", e.name) for e in exchanges]
    assert len(connection.channels) == 2, "the last missing one opens no fresh channel: none is left to declare"
    assert not any(c.open for c in connection.channels)


def test_a_channel_that_fails_to_close_is_logged_at_debug_and_the_counts_are_still_returned(caplog):
    connection = Connection({"a": (1, 0)}, fail_close=True)
    with caplog.at_level(logging.DEBUG, logger="kombu_events.broker.declare"):
        assert peek_queues(connection, ["a", "b"]) == {"a": (1, 0), "b": None}
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert "closing a channel failed" in caplog.records[0].getMessage()


def test_an_error_other_than_not_found_is_raised_and_the_channel_closed():
    connection = Connection({"a": (1, 0)})
    connection.broker = None  # `name not in None`: a TypeError stands for a lost connection
    with pytest.raises(TypeError):
        peek_queues(connection, ["a"])
    assert not connection.channels[0].open
