"""Replay's commits on a fake broker that keeps RabbitMQ 3.x's or 4's terms for a queue deleted mid-transaction.

RabbitMQ 3.x returns (``basic.return``) a copy whose queue is gone at the commit, and the commit succeeds.
RabbitMQ 4 refuses the commit (``PRECONDITION_FAILED - partial tx completion``) and closes the channel, after
the transaction's acks and its copies to queues that exist took effect (as RabbitMQ 4.0.5 does; the
integration test ``test_a_queue_deleted_inside_a_transaction...`` shows it on the real brokers). The fake
plays py-amqp too: deliveries are dispatched inside any wait (a drain, a synchronous method of any channel),
and a channel the broker closed is reopened bare. Whatever the queues, the deletions, the window, the
limit and the batches in which deliveries arrive, every archived message ends up exactly once, in the
archive or in one queue, and is looked at and reported once.
"""
from __future__ import annotations

import bisect
import itertools
import socket
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from amqp import Message
from amqp.exceptions import NotFound, PreconditionFailed
from hypothesis import given, settings, strategies as st

from kombu_events.core import headers as wire
from kombu_events.ops.archive import ArchivedMessage, ReplayProgress, _Settled, _undelivered, replay

ARCHIVE = "svc.archive"
HANDLERS = ("svc.a", "svc.b", "svc.c")
TOPOLOGY: Any = SimpleNamespace(
    archive_exchange=ARCHIVE, handler_queues=tuple(SimpleNamespace(name=q) for q in HANDLERS),
    address=lambda queue, delay_ms: SimpleNamespace(exchange="svc.events", routing_key=queue))
AGAIN = "returned by the broker (its queue was deleted during the replay); archived again"


class FakeBroker:
    """Classic queues (a message requeued goes back to its place) and the replay's one connection."""

    def __init__(self, version: int, batch: int) -> None:
        self.version, self.batch = version, batch  # batch: deliveries dispatched per wait at most
        self.queues: dict[str, list[tuple[int, Message]]] = {q: [] for q in (ARCHIVE, *HANDLERS)}
        self.positions = itertools.count()
        self.channels: list[FakeChannel] = []
        self.dropped: list[str] = []  # ids of the messages in queues deleted
        self.userid = "guest"

    def put(self, queue: str, message: Message, position: int | None = None) -> None:
        entries = self.queues[queue]
        position = next(self.positions) if position is None else position
        entries.insert(bisect.bisect([p for p, _ in entries], position), (position, message))

    def delete(self, queue: str) -> None:
        """An operator deletes ``queue``: the copies it held were delivered all the same."""
        self.dropped.extend(m.properties["message_id"] for _, m in self.queues.pop(queue))

    def channel(self) -> FakeChannel:
        channel = FakeChannel(self)
        self.channels.append(channel)
        return channel

    def pump(self) -> int:
        """Dispatch up to ``batch`` deliveries to the consumers, as py-amqp does inside a wait."""
        sent = 0
        for channel in self.channels:
            while sent < self.batch and channel.deliver():
                sent += 1
        return sent

    def drain_events(self, timeout: float) -> None:
        if not self.pump():
            raise socket.timeout()

    def ids(self, queue: str) -> list[str]:
        return [m.properties["message_id"] for _, m in self.queues[queue]]


class FakeChannel:
    """A channel as py-amqp shows it: ``tx_select``, a consumer, ``basic.return`` callbacks, revived on an error."""

    def __init__(self, broker: FakeBroker) -> None:
        self.broker, self.events = broker, {"basic_return": set()}
        self._reset()

    def _reset(self) -> None:
        """A channel just opened: what a channel the broker closed has, once py-amqp reopened it."""
        self.tx, self.consumer, self.prefetch = False, None, 0
        self.unacked: dict[int, tuple[int, Message]] = {}
        self.tags = itertools.count(1)
        self.published: list[tuple[str, str, Message]] = []
        self.acked: list[int] = []

    def queue_declare(self, name: str, passive: bool) -> tuple[str, int, int]:
        self.broker.pump()
        if name not in self.broker.queues:
            self._requeue()
            self._reset()
            raise NotFound(f"NOT_FOUND - no queue '{name}'")
        return name, len(self.broker.queues[name]), 0

    def tx_select(self) -> None:
        self.tx = True

    def basic_qos(self, size: int, count: int, global_: bool) -> None:
        self.prefetch = count

    def basic_consume(self, queue: str, no_ack: bool, callback: Any) -> None:
        self.consumer = (queue, callback)

    def deliver(self) -> bool:
        if self.consumer is None or (self.prefetch and len(self.unacked) >= self.prefetch):
            return False
        queue, callback = self.consumer
        if not self.broker.queues[queue]:
            return False
        position, message = self.broker.queues[queue].pop(0)
        tag = next(self.tags)
        self.unacked[tag] = (position, message)
        callback(SimpleNamespace(body=message.body, properties=dict(message.properties), delivery_tag=tag,
                                 delivery_info={"routing_key": "", "delivery_tag": tag}))
        return True

    def basic_publish(self, message: Message, exchange: str, routing_key: str, mandatory: bool) -> None:
        assert self.tx and mandatory
        self.published.append((ARCHIVE if exchange == ARCHIVE else routing_key, routing_key, message))

    def basic_ack(self, tag: int, multiple: bool = False) -> None:
        assert self.tx
        self.acked.extend(t for t in self.unacked if t == tag or (multiple and t <= tag))

    def tx_commit(self) -> None:
        self.broker.pump()
        gone = [p for p in self.published if p[0] not in self.broker.queues]
        for tag in self.acked:
            self.unacked.pop(tag, None)
        for queue, _, message in self.published:
            if queue in self.broker.queues:
                self.broker.put(queue, message)
        self.published, self.acked = [], []
        if gone and self.broker.version >= 4:
            self._requeue()
            self._reset()
            raise PreconditionFailed("PRECONDITION_FAILED - partial tx completion")
        for _, routing_key, message in gone:
            for callback in list(self.events["basic_return"]):
                callback(None, "svc.events", routing_key, message)

    def close(self) -> None:
        self._requeue()
        self._reset()
        self.broker.channels.remove(self)

    def _requeue(self) -> None:
        for position, message in self.unacked.values():
            self.broker.put(self.consumer[0] if self.consumer else ARCHIVE, message, position)


def archived(index: int, queue: str) -> Message:
    headers = wire.archive_headers({}, attempt=3, queue=queue, routing_key=f"e.{index}",
                                   reason="gave up after 3 attempts: KeyError", exception="KeyError",
                                   traceback="Traceback ...")
    return Message(f"body {index}".encode(), message_id=f"m{index}", delivery_mode=2, application_headers=headers)


scenarios = st.fixed_dictionaries({
    "version": st.sampled_from([3, 4]),
    "targets": st.lists(st.sampled_from([*HANDLERS, "svc.other"]), min_size=1, max_size=14),
    "unmatched": st.sets(st.integers(0, 13), max_size=4),
    "deletions": st.dictionaries(st.integers(0, 13), st.sampled_from(HANDLERS), max_size=2),
    "window": st.integers(1, 6),
    "limit": st.none() | st.integers(0, 14),
    "batch": st.integers(1, 20),
})


@settings(max_examples=300, deadline=None)
@given(scenarios)
def test_every_archived_message_ends_up_once_in_the_archive_or_one_queue(case):
    broker = FakeBroker(case["version"], case["batch"])
    ids = []
    for index, queue in enumerate(case["targets"]):
        broker.put(ARCHIVE, archived(index, queue))
        ids.append(f"m{index}")
    looked_at: list[str] = []

    def match(message: ArchivedMessage) -> bool:
        looked_at.append(message.id)
        index = int(message.id[1:])
        if case["deletions"].get(index) in broker.queues:
            broker.delete(case["deletions"][index])  # after its check, before the commit perhaps
        return index not in case["unmatched"]

    progress = ReplayProgress()
    replayed, kept = replay(broker, TOPOLOGY, match, case["limit"], progress=progress, window=case["window"],
                            commit_every_s=3600, idle_s=0)

    delivered = [i for q in HANDLERS if q in broker.queues for i in broker.ids(q)] + broker.dropped
    assert Counter(broker.ids(ARCHIVE) + delivered) == Counter(ids)  # none lost, none twice
    assert len(set(looked_at)) == len(looked_at)  # none looked at twice
    reported = [m.id for m in replayed] + [m.id for m, _ in kept]
    assert len(set(reported)) == len(reported)
    assert sorted(m.id for m in replayed) == sorted(delivered) and progress.copies_confirmed == len(replayed)
    assert {m.id for m, why in kept if why == AGAIN} <= set(broker.ids(ARCHIVE))
    matching = [i for i in ids if int(i[1:]) not in case["unmatched"]]
    assert len(reported) == min(len(matching), len(ids) if case["limit"] is None else case["limit"])
    assert not broker.channels  # every channel the replay opened is closed


@pytest.mark.parametrize("version", [3, 4])
def test_a_queue_deleted_mid_transaction_archives_its_copies_originals_again_and_reads_on(version, caplog):
    """a, b, a, b in one transaction, b deleted before the commit, then a, b: on both versions the same."""
    broker = FakeBroker(version, batch=100)
    targets = ["svc.a", "svc.b", "svc.a", "svc.b", "svc.a", "svc.b"]
    for index, queue in enumerate(targets):
        broker.put(ARCHIVE, archived(index, queue))

    def match(message: ArchivedMessage) -> bool:
        if message.id == "m3":
            broker.delete("svc.b")
        return True

    replayed, kept = replay(broker, TOPOLOGY, match, window=4, commit_every_s=3600, idle_s=0)
    assert [m.id for m in replayed] == ["m0", "m2", "m4"]
    assert [(m.id, why) for m, why in kept] == [
        ("m1", AGAIN), ("m3", AGAIN),
        ("m5", "queue 'svc.b' does not exist on the broker (declare it, or replay to another queue)")]
    assert broker.ids(ARCHIVE) == ["m5", "m1", "m3"] and broker.ids("svc.a") == ["m0", "m2", "m4"]
    refused = [r for r in caplog.records if "refused a replay's commit" in r.getMessage()]
    assert [(r.levelname, "4 copies sent, 2 delivered, 2 not" in r.getMessage()) for r in refused] == (
        [("WARNING", True)] if version >= 4 else [])


def _copy(queue: str, key: str) -> Any:
    return SimpleNamespace(queue=queue, returned_as=(key, queue, b""), original=key)


@pytest.mark.parametrize(("returns", "gone", "back"), [
    ([], set(), []),
    ([("m1", "a", b"")], set(), ["m1"]),
    ([], {"b"}, ["m2", "m3"]),
    ([("m2", "b", b""), ("m2", "b", b"")], set(), ["m2"]),  # one return settles one copy
    ([("m9", "a", b"")], {"a"}, ["m1"]),  # a return of no copy of this transaction
])
def test_undelivered_splits_a_transaction_by_its_returns_and_its_queues_gone(returns, gone, back):
    copies = [_copy("a", "m1"), _copy("b", "m2"), _copy("b", "m3")]
    delivered, undelivered = _undelivered(copies, returns, gone)
    assert [c.original for c in undelivered] == back
    assert [c.original for c in delivered] == [c.original for c in copies if c.original not in back]


def test_settled_passes_over_what_comes_again_left_or_archived_again_once_each():
    settled = _Settled()
    settled.left("x")
    settled.archived_again("y")
    assert not settled.passed_over("x")  # left on the channel still open: not delivered to it again
    assert settled.passed_over("y") and not settled.passed_over("y")
    settled.channel_closed()  # x (left) and y (passed over, so left again) come back on the next channel
    assert settled.expected() == 2
    assert settled.passed_over("x") and settled.passed_over("y") and not settled.passed_over("x")
    assert settled.expected() == 0
