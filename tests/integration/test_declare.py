"""broker/declare.py's passive declares on the real broker: a missing queue among existing ones reads as None and
the others keep their counts; a missing exchange is named; no channel is left open (py-amqp reopens the
channel a 404 closed: the helper closes it)."""
from __future__ import annotations

import pytest
from amqp import Message
from kombu import Connection, Exchange

from kombu_events.broker.declare import QueueCounts, absent_exchanges, peek_queue, peek_queues

from .harness import unique

pytestmark = pytest.mark.integration


@pytest.fixture
def conn(broker_url):
    with Connection(broker_url) as conn:
        conn.connect()
        yield conn


@pytest.fixture
def queues(conn):
    """Three queues: ``full`` holds 2 messages, ``watched`` 0 and one consumer, ``single`` 1 message.

    Exclusive to ``conn``, the one connection the tests peek through: a transient queue that is not
    exclusive is deprecated in RabbitMQ 4.0 (``transient_nonexcl_queues``) and denied in 4.3.
    """
    made = {role: unique(f"peek-{role}.") for role in ("full", "watched", "single")}
    channel = conn.channel()
    channel.confirm_select()  # a confirmed publish is in its queue: the counts are exact at once
    for name in made.values():
        channel.queue_declare(name, durable=False, exclusive=True, auto_delete=False)
    for queue, count in ((made["full"], 2), (made["single"], 1)):
        for _ in range(count):
            channel.basic_publish(Message(b"x"), exchange="", routing_key=queue)
    consumer = conn.channel()
    consumer.basic_consume(made["watched"], callback=lambda message: None)
    try:
        yield made
    finally:
        consumer.close()
        for name in made.values():
            channel.queue_delete(name)
        channel.close()


def test_a_missing_queue_among_existing_ones_is_none_and_the_others_have_their_counts(conn, queues):
    missing, also_missing = unique("peek-missing."), unique("peek-missing.")
    order = [queues["full"], missing, queues["watched"], also_missing, queues["single"]]
    open_before = set(conn.connection.channels)
    found = peek_queues(conn, order)
    assert found == {queues["full"]: QueueCounts(messages=2, consumers=0), missing: None,
                     queues["watched"]: QueueCounts(messages=0, consumers=1), also_missing: None,
                     queues["single"]: QueueCounts(messages=1, consumers=0)}
    assert list(found) == order
    assert set(conn.connection.channels) == open_before, "every channel opened was closed, the reopened ones too"
    assert peek_queue(conn, missing) is None and peek_queue(conn, queues["single"]) == (1, 0)
    assert set(conn.connection.channels) == open_before


def test_missing_exchanges_are_named_and_existing_ones_are_not(conn):
    missing = unique("peek-exchange.")
    exchanges = [Exchange("amq.topic", "topic"), Exchange(missing, "topic"), Exchange("amq.fanout", "fanout")]
    open_before = set(conn.connection.channels)
    assert absent_exchanges(conn, exchanges) == [missing]
    assert set(conn.connection.channels) == open_before
