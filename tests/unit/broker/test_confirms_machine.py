"""broker/confirms.py as a state machine: any broker behaviour, callbacks that raise or re-enter the Confirmer.

The test plays py-amqp's frame dispatch and the broker, including a broker that
misbehaves (duplicate and unknown delivery tags, returns that match nothing). A
callback may raise, or re-enter the Confirmer the way a worker's does: publish a
copy, or drain frames (a synchronous channel method) so that another ack, nack or
return arrives while a confirm is being settled, or lose the channel.

A model decides each publish's fate when the frame (or channel loss) that settles it
arrives -- ack: ok, or RETURNED if a return matched it first; nack: NACKED; loss:
its reason -- and the callbacks must agree with it exactly once, never early.
"""
from __future__ import annotations

import collections
import logging
import traceback
from typing import Any

from amqp import Message, spec
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kombu_events.broker.confirms import NACKED, RETURNED, Confirmer
from kombu_events.errors import PublishError

LOST = "channel lost"
FRAME_MAX = 4096


class CallbackError(Exception):
    """What a caller's callback raises on purpose."""


class FakeConnection:
    frame_max = FRAME_MAX


class FakeChannel:
    """Just what Confirmer uses of an amqp channel; ``dispatch`` plays py-amqp handing it a frame."""

    def __init__(self) -> None:
        self.events: dict[str, set[Any]] = collections.defaultdict(set)
        self.connection = FakeConnection()
        self.confirming = False
        self.fail_next_send = False
        self.escaped: list[str] = []  # what escaped the Confirmer (into py-amqp, or the caller of fail_all)

    def confirm_select(self) -> None:
        self.confirming = True

    def send_method(self, method: Any, signature: str, args: tuple, content: Any = None) -> None:
        assert self.confirming and (method, signature) == (spec.Basic.Publish, "Bssbb")
        if self.fail_next_send:
            self.fail_next_send = False
            raise ConnectionError("connection reset while sending")

    def dispatch(self, event: str, *args: Any) -> None:
        for callback in list(self.events[event]):
            try:
                callback(*args)
            except BaseException:  # recorded: in a worker, anything raised here ends it
                self.escaped.append(traceback.format_exc())


class Records(logging.Handler):
    """Error records of kombu_events.broker.confirms (a guarded callback that raised)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


EXCHANGES = st.sampled_from(["ex", "ex2"])
ROUTING_KEYS = st.sampled_from(["rk", b"r\xffk"])  # bytes: invalid UTF-8, returned as surrogate escapes
MESSAGE_IDS = st.sampled_from(["m1", "m2", None])
KEYS = st.tuples(EXCHANGES, ROUTING_KEYS, MESSAGE_IDS)
#: A delivery tag relative to the last sequence number: negative and zero are old or unknown, positive not sent yet.
OFFSETS = st.integers(min_value=-6, max_value=2)

#: What a callback does after recording its call, besides perhaps raising.
ACTIONS = st.one_of(
    st.none(),
    st.tuples(st.just("publish"), KEYS, st.booleans()),  # (publish, key, raises): the new callbacks do not re-enter
    st.tuples(st.sampled_from(["ack", "nack"]), OFFSETS, st.booleans()),
    st.tuples(st.just("return"), KEYS),
    st.tuples(st.just("fail_all")),
)


def _text(routing_key: str | bytes) -> str:
    return routing_key.decode("utf-8", "surrogateescape") if isinstance(routing_key, bytes) else routing_key


class ConfirmsMachine(RuleBasedStateMachine):
    """A Confirmer on a fake channel, against a model of which publish is settled how."""

    def __init__(self) -> None:
        super().__init__()
        self.channel = FakeChannel()
        self.confirmer = Confirmer(self.channel, check_frame_size=True)
        self.seq = 0  # the model's last sequence number
        self.key_of: dict[int, tuple[str, str, Any]] = {}
        self.attempt_of: dict[int, int] = {}
        self.expected: dict[int, str] = {}  # seq -> outcome decided when it was settled
        self.returned: set[int] = set()
        self.calls: dict[int, list[str]] = collections.defaultdict(list)  # attempt -> outcomes called back
        self.attempts = 0
        self.raised = 0
        self.violations: list[str] = []  # found inside callbacks, where an assert would be swallowed
        self.log = Records()
        logging.getLogger("kombu_events.broker.confirms").addHandler(self.log)

    def teardown(self) -> None:
        logging.getLogger("kombu_events.broker.confirms").removeHandler(self.log)

    # -- the model ------------------------------------------------------------------------------

    def pending(self) -> list[int]:
        return [seq for seq in self.key_of if seq not in self.expected]

    def settle(self, seqs: list[int], outcome_of: Any) -> None:
        for seq in seqs:
            self.expected[seq] = outcome_of(seq)
            self.returned.discard(seq)

    # -- what the broker and the caller do (from rules, and from inside callbacks) ---------------

    def publish(self, key: tuple[str, Any, Any], action: Any, raises: bool, *, send_fails: bool = False,
                too_big: bool = False) -> None:
        self.attempts += 1
        attempt = self.attempts
        exchange, routing_key, message_id = key
        headers = {"pad": "x" * FRAME_MAX} if too_big else {}
        message = Message(b"{}", message_id=message_id, application_headers=headers)
        self.channel.fail_next_send = send_fails
        try:
            seq = self.confirmer.publish(message, exchange, routing_key, *self.callbacks(attempt, action, raises))
        except (ConnectionError, PublishError):
            assert send_fails or too_big, "publish raised for a publish that could be sent"
            self.channel.fail_next_send = False
            return  # never registered: its callbacks must never run
        assert not (send_fails or too_big), "publish did not raise"
        assert seq == self.seq + 1, f"publish numbered {seq}, the broker numbers it {self.seq + 1}"
        self.seq = seq
        self.key_of[seq] = (exchange, _text(routing_key), message_id)
        self.attempt_of[seq] = attempt

    def callbacks(self, attempt: int, action: Any, raises: bool) -> tuple[Any, Any]:
        def called(outcome: str) -> None:
            seq = next((s for s, a in self.attempt_of.items() if a == attempt), None)
            if seq is None:
                self.violations.append(f"attempt {attempt} called back {outcome!r}, but publish() raised for it")
            elif seq not in self.expected:
                self.violations.append(f"publish {seq} called back {outcome!r} before it was settled")
            elif self.calls[attempt]:
                self.violations.append(f"publish {seq} called back {outcome!r} after {self.calls[attempt]}")
            elif outcome != self.expected[seq]:
                self.violations.append(f"publish {seq} called back {outcome!r}, settled as {self.expected[seq]!r}")
            if self.confirmer.pending != len(self.pending()):
                self.violations.append(f"inside the callback of publish {seq}: pending {self.confirmer.pending}, "
                                       f"expected {len(self.pending())}")
            self.calls[attempt].append(outcome)
            self.act(action)
            if raises:
                self.raised += 1
                raise CallbackError(f"callback of attempt {attempt}")

        return (lambda: called("ok")), called

    def act(self, action: Any) -> None:
        if action is None:
            return
        kind, *args = action
        if kind == "publish":
            key, raises = args
            self.publish(key, None, raises)
        elif kind in ("ack", "nack"):
            offset, multiple = args
            getattr(self, kind)(self.seq + offset, multiple)
        elif kind == "return":
            self.returned_message(*args)
        else:
            self.lose_channel()

    def covered(self, tag: int, multiple: bool) -> list[int]:
        return [seq for seq in self.pending() if (seq <= tag if multiple else seq == tag)]

    def ack(self, tag: int, multiple: bool) -> None:
        self.settle(self.covered(tag, multiple), lambda seq: RETURNED if seq in self.returned else "ok")
        self.channel.dispatch("basic_ack", tag, multiple)

    def nack(self, tag: int, multiple: bool) -> None:
        self.settle(self.covered(tag, multiple), lambda seq: NACKED)
        self.channel.dispatch("basic_nack", tag, multiple)

    def returned_message(self, key: tuple[str, Any, Any]) -> None:
        exchange, routing_key, message_id = key
        text = _text(routing_key)
        self.returned.update(seq for seq in self.pending() if self.key_of[seq] == (exchange, text, message_id))
        self.channel.dispatch("basic_return", Exception("312 NO_ROUTE"), exchange, text,
                              Message(b"{}", message_id=message_id))

    def lose_channel(self) -> None:
        self.settle(self.pending(), lambda seq: LOST)
        self.returned.clear()
        try:
            self.confirmer.fail_all(LOST)
        except BaseException:  # the consumer calls it from its own error handling: it must not raise either
            self.channel.escaped.append(traceback.format_exc())

    # -- rules ----------------------------------------------------------------------------------

    @rule(key=KEYS, action=ACTIONS, raises=st.booleans())
    def publish_one(self, key: Any, action: Any, raises: bool) -> None:
        self.publish(key, action, raises)

    @rule(key=KEYS, send_fails=st.booleans())
    def publish_that_raises(self, key: Any, send_fails: bool) -> None:
        self.publish(key, None, False, send_fails=send_fails, too_big=not send_fails)

    @rule(offset=OFFSETS, multiple=st.booleans())
    def broker_acks(self, offset: int, multiple: bool) -> None:
        self.ack(self.seq + offset, multiple)

    @rule(offset=OFFSETS, multiple=st.booleans())
    def broker_nacks(self, offset: int, multiple: bool) -> None:
        self.nack(self.seq + offset, multiple)

    @rule(data=st.data(), like=st.sampled_from(["the same", "another exchange", "another key", "another id", None]))
    def broker_returns(self, data: st.DataObject, like: str | None) -> None:
        """Return a message like a pending publish (or one that differs in one part only), or any message."""
        pending = self.pending()
        if like is None or not pending:
            self.returned_message(data.draw(KEYS))
            return
        key = list(self.key_of[data.draw(st.sampled_from(pending))])
        if like != "the same":
            part = ["another exchange", "another key", "another id"].index(like)
            same = key[part]
            other = (EXCHANGES, ROUTING_KEYS.map(_text), MESSAGE_IDS)[part].filter(lambda value: value != same)
            key[part] = data.draw(other)
        self.returned_message(tuple(key))

    @rule()
    def channel_lost(self) -> None:
        self.lose_channel()

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        """Checked after every step, the most telling first."""
        self.nothing_escaped()
        self.callbacks_agree_with_the_model()
        self.every_settled_publish_called_back_once()
        self.pending_is_published_minus_settled()
        self.each_raising_callback_logged()

    def nothing_escaped(self) -> None:
        assert not self.channel.escaped, "raised out of the Confirmer:\n" + "\n".join(self.channel.escaped)

    def callbacks_agree_with_the_model(self) -> None:
        assert not self.violations, self.violations

    def every_settled_publish_called_back_once(self) -> None:
        for seq, attempt in self.attempt_of.items():
            want = [self.expected[seq]] if seq in self.expected else []
            assert self.calls.get(attempt, []) == want, f"publish {seq}: called back {self.calls.get(attempt)}"
        registered = set(self.attempt_of.values())
        assert all(not calls for attempt, calls in self.calls.items() if attempt not in registered)

    def pending_is_published_minus_settled(self) -> None:
        assert self.confirmer.pending == len(self.pending())

    def each_raising_callback_logged(self) -> None:
        assert len(self.log.records) == self.raised, [r.getMessage() for r in self.log.records]
        for record in self.log.records:
            assert record.exc_info and record.exc_info[0] is CallbackError, record.getMessage()


ConfirmsMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                             report_multiple_bugs=False,
                                             suppress_health_check=[HealthCheck.too_slow])
TestConfirmsMachine = ConfirmsMachine.TestCase
