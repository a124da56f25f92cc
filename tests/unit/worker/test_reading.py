"""A reader in the worker (worker/reading.py) against a fake channel: the lock refused means waiting; taken, the
position read decides where the stream is consumed from; one event at a time goes to the pool; an ack moves the
position, written every COMMIT_EVERY; an ack from before a rewind moves nothing; a rewind starts the stream again
at its offset and acks the request only once the new position is confirmed."""
from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
from amqp.exceptions import AccessRefused

from kombu_events.core.event_log import event_log
from kombu_events.core.readers import COMMIT_EVERY, GENERATION_HEADER, OFFSET_HEADER, Position, Rewind, reader
from kombu_events.worker import reading
from kombu_events.worker.reading import ReaderState

LOG = event_log("shop", ("orders.#",), keep=timedelta(days=1))
READER = reader("shop", LOG, name="projector", start="first")


class Channel:
    def __init__(self, *, refuse=False, position=None):
        self.refuse, self.position, self.is_open = refuse, position, True
        self.consumed, self.rejected, self.acked, self.cancelled = [], [], [], []

    def basic_qos(self, *args):
        pass

    def basic_consume(self, queue, no_ack=False, exclusive=False, callback=None, arguments=None, **kw):
        if exclusive and self.refuse:
            self.is_open = False
            raise AccessRefused("queue in exclusive use")
        self.consumed.append((queue, exclusive, arguments))
        return f"tag{len(self.consumed)}"

    def basic_get(self, queue, no_ack=False):
        if self.position is None:
            return None
        return SimpleNamespace(body=self.position.body(reader="projector", stream=LOG.queue), delivery_tag=99)

    def basic_reject(self, tag, requeue):
        self.rejected.append((tag, requeue))

    def basic_ack(self, tag):
        self.acked.append(tag)

    def basic_cancel(self, tag, **kw):
        self.cancelled.append(tag)

    def close(self):
        self.is_open = False


class Confirmer:
    def __init__(self):
        self.published = []

    def publish(self, message, exchange, routing_key, on_ok, on_fail):
        self.published.append((Position.parse(message.body), exchange, routing_key, on_ok))


@pytest.fixture
def make(monkeypatch):
    monkeypatch.setattr(reading, "EagerConsumer", FakeConsumer)

    def make(channel):
        posted, dispatched, confirmer = [], [], Confirmer()
        route = SimpleNamespace(handler=SimpleNamespace(reader=READER, queue=READER.queue, name="projector"))
        state = ReaderState(route, service="shop", post=posted.append, confirmer=lambda: confirmer,
                            dispatch=dispatched.append)
        state.attach(SimpleNamespace(channel=lambda: channel))
        return state, posted, dispatched, confirmer
    return make


class FakeConsumer:
    def __init__(self, channel, queues, on_message, **kw):
        self.channel, self.queue, self.on_message = channel, queues[0], on_message
        self.cancelled = False

    def consume(self):
        self.channel.consumed.append((self.queue.name, False, self.queue.consumer_arguments))

    def cancel(self):
        self.cancelled = True


def event(tag, offset):
    return SimpleNamespace(delivery_tag=tag, headers={OFFSET_HEADER: offset},
                           properties={"application_headers": {OFFSET_HEADER: offset}})


def test_a_refused_lock_means_waiting_and_consuming_nothing(make):
    channel = Channel(refuse=True)
    state, *_ = make(channel)
    assert state.try_lock() is False
    assert not state.holding and channel.consumed == []


def test_without_a_position_it_reads_from_its_start_and_with_one_from_there(make):
    channel = Channel()
    state, *_ = make(channel)
    assert state.try_lock()
    assert channel.consumed[0][:2] == (READER.queue, True)
    assert channel.consumed[1] == (LOG.queue, False, {OFFSET_HEADER: "first"})
    channel = Channel(position=Position(1234, 3))
    state, *_ = make(channel)
    state.try_lock()
    assert channel.consumed[1] == (LOG.queue, False, {OFFSET_HEADER: 1234})
    assert channel.rejected == [(99, True)] and state.generation == 3  # read, put back


def test_one_event_at_a_time_goes_to_the_pool_and_an_ack_moves_the_position(make):
    state, posted, dispatched, _ = make(Channel())
    state.try_lock()
    for tag in (1, 2, 3):
        state.consumer.on_message(event(tag, 100 + tag))
    assert [m.delivery_tag for m in dispatched] == [1]
    assert dispatched[0].properties["application_headers"][GENERATION_HEADER] == 0
    state.acked(dispatched[0])
    assert state.next_offset == 102
    posted.pop()()  # the next, on the event loop
    assert [m.delivery_tag for m in dispatched] == [1, 2]


def test_the_position_is_written_every_commit_every_events(make):
    state, posted, dispatched, confirmer = make(Channel())
    state.try_lock()
    for tag in range(1, COMMIT_EVERY + 1):
        state.consumer.on_message(event(tag, tag))
        state.acked(dispatched[-1])
        posted.pop()()
    assert [(p.offset, exchange, key) for p, exchange, key, _ in confirmer.published] == \
        [(COMMIT_EVERY + 1, "", READER.position_queue)]


def test_a_rewind_reads_again_from_its_offset_and_an_older_ack_moves_nothing(make):
    channel = Channel(position=Position(500))
    state, posted, dispatched, confirmer = make(channel)
    state.try_lock()
    state.consumer.on_message(event(1, 500))
    request = SimpleNamespace(body=Rewind(10, "ops").body(), channel=channel, delivery_tag=7)
    state._on_request(request)
    posted.pop()()
    assert channel.consumed[-1] == (LOG.queue, False, {OFFSET_HEADER: 10})
    assert state.generation == 1 and state.next_offset == 10
    (written, _, _, on_ok), = confirmer.published
    assert written == Position(10, 1) and channel.acked == []  # acked once confirmed, not before
    on_ok()
    assert channel.acked == [7]
    state.acked(dispatched[0])  # the event of before the rewind finishes: no move
    assert state.next_offset == 10
