"""The acks sent together (``worker/acks.py``): never over an unsettled delivery, each settled one acked once."""
from __future__ import annotations

from typing import Any

from hypothesis import given, settings, strategies as st

from kombu_events.worker.acks import MAX_WAIT_S, Acks, AckWindow
from kombu_events.worker.mailbox import Mailbox


class Broker:
    """What RabbitMQ keeps of one channel: the outstanding tags; an unknown one closes the channel."""

    def __init__(self) -> None:
        self.outstanding: set[int] = set()
        self.acked: list[int] = []
        self.frames: list[tuple[int, bool]] = []

    def deliver(self, tag: int) -> None:
        self.outstanding.add(tag)

    def basic_ack(self, tag: int, multiple: bool = False) -> None:
        assert tag in self.outstanding, f"PRECONDITION_FAILED - unknown delivery tag {tag}"
        self.frames.append((tag, multiple))
        covered = sorted(t for t in self.outstanding if t <= tag) if multiple else [tag]
        self.outstanding.difference_update(covered)
        self.acked.extend(covered)


def run(window: AckWindow, broker: Broker) -> None:
    for tag, multiple, count in window.take():
        before = len(broker.acked)
        broker.basic_ack(tag, multiple)
        assert len(broker.acked) - before == count


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 60), unseen=st.sets(st.integers(1, 60), max_size=3))
def test_acks_never_cover_an_unsettled_tag_and_ack_each_settled_once(data: Any, n: int, unseen: set[int]) -> None:
    """Random settle orders and flushes, with deliveries the window never saw (py-amqp rejected them, or
    a bug): only settled tags are acked, each exactly once; the unsettled and unseen stay outstanding."""
    window, broker = AckWindow(), Broker()
    for tag in range(1, n + 1):
        broker.deliver(tag)
        if tag not in unseen:
            window.delivered(tag)
    seen = [tag for tag in range(1, n + 1) if tag not in unseen]
    order = data.draw(st.permutations(seen))
    cut = data.draw(st.integers(0, len(order)))  # the rest is never settled (held, or still running)
    settled: set[int] = set()
    for tag in order[:cut]:
        assert window.settle(tag)
        assert not window.settle(tag)  # settled twice: acked once all the same
        settled.add(tag)
        if data.draw(st.booleans()):
            run(window, broker)
            assert set(broker.acked) <= settled
    run(window, broker)
    assert sorted(broker.acked) == sorted(settled)  # each settled tag once, nothing else
    assert broker.outstanding == set(range(1, n + 1)) - settled
    assert len(window) == 0


def test_in_order_settles_go_in_one_multiple_ack() -> None:
    window, broker = AckWindow(), Broker()
    for tag in range(1, 101):
        broker.deliver(tag)
        window.delivered(tag)
        window.settle(tag)
    run(window, broker)
    assert broker.frames == [(100, True)]


def test_settled_tags_behind_an_unsettled_one_are_acked_alone_and_the_run_resumes() -> None:
    window, broker = AckWindow(), Broker()
    for tag in range(1, 11):
        broker.deliver(tag)
        window.delivered(tag)
    for tag in (1, 2, 4, 5):
        window.settle(tag)
    run(window, broker)
    assert broker.frames == [(2, True), (4, False), (5, False)]
    for tag in (3, 6, 7, 8, 9, 10):
        window.settle(tag)
    run(window, broker)
    assert broker.frames[3:] == [(10, True)]
    assert not broker.outstanding


def test_a_tag_never_seen_is_never_covered() -> None:
    window, broker = AckWindow(), Broker()
    for tag in range(1, 6):
        broker.deliver(tag)
        if tag != 3:
            window.delivered(tag)
    for tag in (1, 2, 4, 5):
        window.settle(tag)
    run(window, broker)
    assert broker.outstanding == {3}
    assert broker.frames == [(2, True), (4, False), (5, False)]


class Channel(Broker):
    is_open = True


class Message:
    def __init__(self, channel: Any, tag: int) -> None:
        self.channel, self.delivery_tag, self.own_acks = channel, tag, 0

    def ack(self) -> None:
        self.own_acks += 1
        self.channel.basic_ack(self.delivery_tag)


class Hub:
    pass


def consumer_channel(acks: Acks, n: int, *, hub: Any = None, limit: int = 50,
                     more: Any = lambda: False) -> tuple[Channel, list[Message]]:
    channel = Channel()
    acks.attach(channel, hub, limit=limit, more_to_read=more)
    messages = [Message(channel, tag) for tag in range(1, n + 1)]
    for message in messages:
        channel.deliver(message.delivery_tag)
        acks.delivered(message)
    return channel, messages


def test_acks_wait_for_the_end_of_the_read_then_go_together() -> None:
    acks, reading = Acks(Mailbox("s")), [True]
    channel, messages = consumer_channel(acks, 10, hub=Hub(), more=lambda: reading[0])
    for message in messages:
        assert acks.ack(message)
    acks.tick()
    assert channel.frames == []  # the loop has more to read, and nothing waited MAX_WAIT_S
    reading[0] = False
    acks.tick()
    assert channel.frames == [(10, True)]


def test_acks_go_once_the_limit_waits_or_the_oldest_waited_max_wait() -> None:
    acks = Acks(Mailbox("s"))
    channel, messages = consumer_channel(acks, 10, hub=Hub(), limit=4, more=lambda: True)
    for message in messages[:5]:
        acks.ack(message)
    assert channel.frames == [(4, True)]
    acks._since -= MAX_WAIT_S
    acks.tick()
    assert channel.frames == [(4, True), (5, False)]


def test_a_batchs_acks_go_in_one_frame_past_the_limit_and_the_limit_holds_again_after() -> None:
    acks = Acks(Mailbox("s"))
    channel, messages = consumer_channel(acks, 20, hub=Hub(), limit=4, more=lambda: True)
    with acks.together():
        with acks.together():  # nested: the outer one's end sends
            for message in messages[:5]:
                acks.ack(message)
        for message in messages[5:10]:
            acks.ack(message)
        assert channel.frames == []
    assert channel.frames == [(10, True)]
    for message in messages[10:14]:
        acks.ack(message)
    assert channel.frames == [(10, True), (14, True)]
    with acks.together():
        acks.ack(messages[14])
    assert channel.frames == [(10, True), (14, True)], "under the limit: left for the end of the read"


def test_without_an_event_loop_acks_go_through_the_mailbox() -> None:
    asked: list[Any] = []
    mailbox = Mailbox("s")
    mailbox.use_call_soon(asked.append)
    acks = Acks(mailbox)
    channel, messages = consumer_channel(acks, 3)
    for message in messages:
        acks.ack(message)
    assert channel.frames == [] and len(asked) == 1  # one call_soon for the three
    asked[0]()
    assert channel.frames == [(3, True)]


def test_a_new_channel_drops_what_the_old_one_had_pending() -> None:
    acks = Acks(Mailbox("s"))
    old, messages = consumer_channel(acks, 3, hub=Hub(), more=lambda: True)
    acks.ack(messages[0])
    new, _ = consumer_channel(acks, 2, hub=Hub())  # a reconnect: the broker redelivers the old ones
    acks.flush()
    assert old.frames == [] and new.frames == []
    assert acks.ack(messages[1])  # a message of the old channel: its own ack, as kombu would (it fails quietly there)
    assert messages[1].own_acks == 1


def test_a_message_settled_twice_is_acked_once() -> None:
    acks = Acks(Mailbox("s"))
    channel, messages = consumer_channel(acks, 2, hub=Hub())
    assert acks.ack(messages[0])
    acks.flush()
    assert not acks.ack(messages[0])  # kombu's own ack would have raised MessageStateError: no second frame
    acks.flush()
    assert channel.frames == [(1, False)] and messages[0].own_acks == 0


def test_after_stop_each_ack_goes_at_once() -> None:
    acks = Acks(Mailbox("s"))
    channel, messages = consumer_channel(acks, 3, hub=Hub(), more=lambda: True)
    acks.ack(messages[0])
    acks.stop()
    assert channel.frames == [(1, False)]
    acks.ack(messages[1])
    assert channel.frames == [(1, False), (2, False)]


def test_a_channel_that_fails_drops_the_pending_acks() -> None:
    acks = Acks(Mailbox("s"))
    channel, messages = consumer_channel(acks, 3, hub=Hub(), more=lambda: True)

    def closed(tag: int, multiple: bool = False) -> None:
        raise OSError("channel closed")

    channel.basic_ack = closed  # type: ignore[method-assign]
    for message in messages:
        acks.ack(message)
    acks.flush()  # logged, not raised: the broker redelivers them
    assert len(acks.window) == 0
