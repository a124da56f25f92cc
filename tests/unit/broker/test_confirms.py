"""broker/confirms.py: pipelined publisher confirms on a fake channel."""
from __future__ import annotations

import collections

import pytest
from amqp import Message, spec
from hypothesis import given, settings, strategies as st

from kombu_events.broker.confirms import NACKED, RETURNED, Confirmer


class FakeChannel:
    """Just what Confirmer uses of an amqp channel; the test plays the broker.

    Records a publish whether it goes through ``basic_publish`` or straight to
    ``send_method(Basic.Publish, "Bssbb", (ticket, exchange, routing_key, mandatory, immediate))``.
    """

    def __init__(self) -> None:
        self.events = collections.defaultdict(set)
        self.confirming = False
        self.published: list[tuple[bytes, str, str, bool]] = []

    def confirm_select(self) -> None:
        self.confirming = True

    def basic_publish(self, message, exchange, routing_key, mandatory=False):
        assert self.confirming, "publish before confirm_select"
        self.published.append((message.body, exchange, routing_key, mandatory))

    def send_method(self, method, signature, args, content=None):
        assert self.confirming, "publish before confirm_select"
        assert (method, signature) == (spec.Basic.Publish, "Bssbb")
        _ticket, exchange, routing_key, mandatory, immediate = args
        assert immediate is False
        self.published.append((content.body, exchange, routing_key, mandatory))

    def ack(self, tag: int, multiple: bool = False) -> None:
        for callback in list(self.events["basic_ack"]):
            callback(tag, multiple)

    def nack(self, tag: int, multiple: bool = False) -> None:
        for callback in list(self.events["basic_nack"]):
            callback(tag, multiple)

    def returned(self, exchange: str, routing_key: str, message: Message) -> None:
        for callback in list(self.events["basic_return"]):
            callback(Exception("312 NO_ROUTE"), exchange, routing_key, message)


class Outcomes:
    """Records which callback ran for each publish, and how often."""

    def __init__(self) -> None:
        self.settled: dict[int, list[str]] = collections.defaultdict(list)

    def callbacks(self, index: int):
        return (lambda: self.settled[index].append("ok"), lambda why: self.settled[index].append(why))


def _message(message_id: str = "m1", body: bytes = b"{}") -> Message:
    return Message(body, message_id=message_id)


@pytest.fixture
def channel() -> FakeChannel:
    return FakeChannel()


@pytest.fixture
def confirmer(channel) -> Confirmer:
    return Confirmer(channel)


def _publish(confirmer, outcomes, index, exchange="ex", routing_key="rk", message_id="m1"):
    return confirmer.publish(_message(message_id), exchange, routing_key, *outcomes.callbacks(index))


def test_confirm_mode_and_callbacks_are_set_up(channel, confirmer):
    assert channel.confirming
    assert len(channel.events["basic_ack"]) == len(channel.events["basic_nack"]) == 1
    assert len(channel.events["basic_return"]) == 1


def test_publish_is_mandatory_and_numbered(channel, confirmer):
    outcomes = Outcomes()
    tags = [_publish(confirmer, outcomes, i, routing_key=f"rk{i}") for i in range(3)]
    assert tags == [1, 2, 3]
    assert channel.published == [(b"{}", "ex", f"rk{i}", True) for i in range(3)]
    assert confirmer.pending == 3


def test_on_ok_runs_only_after_the_ack(channel, confirmer):
    outcomes = Outcomes()
    tag = _publish(confirmer, outcomes, 0)
    assert outcomes.settled == {}
    channel.ack(tag)
    assert outcomes.settled == {0: ["ok"]}
    assert confirmer.pending == 0
    channel.ack(tag)  # a duplicate ack settles nothing twice
    assert outcomes.settled == {0: ["ok"]}


def test_single_ack_settles_only_its_tag(channel, confirmer):
    outcomes = Outcomes()
    for i in range(3):
        _publish(confirmer, outcomes, i)
    channel.ack(2)
    assert outcomes.settled == {1: ["ok"]}
    assert confirmer.pending == 2


def test_multiple_ack_settles_every_tag_up_to_it(channel, confirmer):
    outcomes = Outcomes()
    for i in range(5):
        _publish(confirmer, outcomes, i)
    channel.ack(3, multiple=True)
    assert outcomes.settled == {0: ["ok"], 1: ["ok"], 2: ["ok"]}
    assert confirmer.pending == 2
    channel.ack(5, multiple=True)
    assert outcomes.settled == {i: ["ok"] for i in range(5)}


def test_nack_fails(channel, confirmer):
    outcomes = Outcomes()
    for i in range(3):
        _publish(confirmer, outcomes, i)
    channel.nack(1)
    channel.nack(3, multiple=True)
    assert outcomes.settled == {0: [NACKED], 1: [NACKED], 2: [NACKED]}
    assert confirmer.pending == 0


def test_returned_then_acked_fails_only_the_matching_publish(channel, confirmer):
    outcomes = Outcomes()
    _publish(confirmer, outcomes, 0, routing_key="rk", message_id="m1")
    _publish(confirmer, outcomes, 1, routing_key="rk", message_id="m2")  # other message id
    _publish(confirmer, outcomes, 2, routing_key="other", message_id="m1")  # other routing key
    _publish(confirmer, outcomes, 3, exchange="ex2", routing_key="rk", message_id="m1")  # other exchange
    channel.returned("ex", "rk", _message("m1"))
    assert outcomes.settled == {}, "a return alone settles nothing: the ack follows it"
    channel.ack(4, multiple=True)
    assert outcomes.settled == {0: [RETURNED], 1: ["ok"], 2: ["ok"], 3: ["ok"]}


def test_returned_matches_every_pending_duplicate(channel, confirmer):
    outcomes = Outcomes()
    _publish(confirmer, outcomes, 0)
    _publish(confirmer, outcomes, 1)
    channel.returned("ex", "rk", _message("m1"))
    channel.ack(2, multiple=True)
    assert outcomes.settled == {0: [RETURNED], 1: [RETURNED]}


def test_returned_then_nacked_fails_once(channel, confirmer):
    outcomes = Outcomes()
    _publish(confirmer, outcomes, 0)
    channel.returned("ex", "rk", _message("m1"))
    channel.nack(1)
    assert outcomes.settled == {0: [NACKED]}


def test_return_for_a_settled_publish_does_not_leak_onto_the_next(channel, confirmer):
    outcomes = Outcomes()
    _publish(confirmer, outcomes, 0)
    channel.ack(1)
    channel.returned("ex", "rk", _message("m1"))  # late, unknown: matches nothing pending
    _publish(confirmer, outcomes, 1)
    channel.ack(2)
    assert outcomes.settled == {0: ["ok"], 1: ["ok"]}


def test_a_publish_that_raises_registers_nothing(channel, confirmer, mocker):
    outcomes = Outcomes()
    mocker.patch.object(channel, "send_method", side_effect=ConnectionError("gone"))
    mocker.patch.object(channel, "basic_publish", side_effect=ConnectionError("gone"))
    with pytest.raises(ConnectionError):
        _publish(confirmer, outcomes, 0)
    assert confirmer.pending == 0
    mocker.stopall()
    assert _publish(confirmer, outcomes, 1) == 1, "the broker numbers only what it received"
    channel.ack(1)
    assert outcomes.settled == {1: ["ok"]}


def test_fail_all(channel, confirmer):
    outcomes = Outcomes()
    for i in range(3):
        _publish(confirmer, outcomes, i)
    channel.ack(1)
    channel.returned("ex", "rk", _message("m1"))
    confirmer.fail_all("connection lost")
    assert outcomes.settled == {0: ["ok"], 1: ["connection lost"], 2: ["connection lost"]}
    assert confirmer.pending == 0
    channel.ack(3, multiple=True)  # nothing left to settle
    assert outcomes.settled == {0: ["ok"], 1: ["connection lost"], 2: ["connection lost"]}


operations = st.lists(
    st.tuples(st.sampled_from(["publish", "ack", "nack", "return"]), st.integers(min_value=1, max_value=12),
              st.booleans(), st.sampled_from(["m1", "m2"])),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_every_publish_is_settled_exactly_once(ops):
    channel = FakeChannel()
    confirmer = Confirmer(channel)
    outcomes = Outcomes()
    ids: dict[int, str] = {}
    returned: set[str] = set()
    for op, tag, multiple, message_id in ops:
        if op == "publish":
            seq = _publish(confirmer, outcomes, len(ids), message_id=message_id)
            ids[seq - 1] = message_id
        elif op == "ack":
            channel.ack(tag, multiple)
        elif op == "nack":
            channel.nack(tag, multiple)
        else:
            channel.returned("ex", "rk", _message(message_id))
            returned.add(message_id)
        assert confirmer.pending == len(ids) - len(outcomes.settled)
    channel.ack(len(ids), multiple=True)
    assert confirmer.pending == 0
    assert set(outcomes.settled) == set(ids)
    for index, results in outcomes.settled.items():
        assert len(results) == 1, f"publish {index} settled {results}"
        if results == [RETURNED]:
            assert ids[index] in returned


def test_an_ack_that_arrives_inside_a_callback_settles_each_publish_once(channel, confirmer):
    """Issue 19: on_ok drained frames (a synchronous basic_cancel) and a later multiple ack arrived."""
    outcomes = Outcomes()
    ok, fail = outcomes.callbacks(0)

    def on_ok():
        ok()
        channel.ack(3, multiple=True)  # the broker's next confirm, read while the first is being settled

    confirmer.publish(_message(), "ex", "rk", on_ok, fail)
    for i in (1, 2):
        _publish(confirmer, outcomes, i)
    channel.ack(2, multiple=True)
    assert outcomes.settled == {0: ["ok"], 1: ["ok"], 2: ["ok"]}
    assert confirmer.pending == 0


def test_a_callback_that_raises_is_logged_and_the_others_still_run(channel, confirmer, caplog):
    outcomes = Outcomes()

    def boom():
        raise RuntimeError("hook failed")

    confirmer.publish(_message("m7"), "ex", "rk7", boom, boom)
    _publish(confirmer, outcomes, 1)
    channel.ack(2, multiple=True)  # raises nothing into py-amqp
    assert outcomes.settled == {1: ["ok"]}
    [record] = [r for r in caplog.records if r.levelname == "ERROR"]
    assert record.exc_info[0] is RuntimeError
    assert "publish 1 to 'ex'/'rk7' (message id 'm7')" in record.getMessage()


def test_unknown_and_duplicate_tags_settle_nothing(channel, confirmer):
    outcomes = Outcomes()
    _publish(confirmer, outcomes, 0)
    channel.ack(5)
    channel.nack(0)
    channel.ack(5, multiple=False)
    assert outcomes.settled == {} and confirmer.pending == 1
    channel.ack(1)
    channel.nack(1)
    assert outcomes.settled == {0: ["ok"]}


def test_fail_all_inside_a_callback_fails_the_rest_once(channel, confirmer):
    outcomes = Outcomes()
    ok, fail = outcomes.callbacks(0)

    def on_ok():
        ok()
        confirmer.fail_all("connection lost")

    confirmer.publish(_message(), "ex", "rk", on_ok, fail)
    for i in (1, 2):
        _publish(confirmer, outcomes, i)
    channel.ack(2, multiple=True)
    assert outcomes.settled == {0: ["ok"], 1: ["ok"], 2: ["connection lost"]}
    channel.ack(3)
    assert outcomes.settled[2] == ["connection lost"] and confirmer.pending == 0


class ClosingChannel(FakeChannel):
    """A FakeChannel with py-amqp's per-channel method handlers, which the broker's Channel.Close reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.reopened: list[tuple] = []
        self._callbacks = {spec.Channel.Close: lambda *args: self.reopened.append(args)}
        self.sent: list[tuple] = []
        self.collected = False

    def send_method(self, method, signature=None, args=None, content=None):
        if method == spec.Basic.Publish:
            return super().send_method(method, signature, args, content)
        self.sent.append(method)

    def collect(self) -> None:
        self.collected = True

    def close_by_broker(self, code: int, text: str, method_sig=(60, 40)) -> None:
        self._callbacks[spec.Channel.Close](code, text, *method_sig)


REFUSED = "ACCESS_REFUSED - access to exchange 'shop.delay.3' in vhost 'shop' refused for user 'shop'"


def test_access_refused_fails_every_pending_publish_once_and_closes_the_channel_for_good():
    channel, outcomes, refusals = ClosingChannel(), Outcomes(), []
    confirmer = Confirmer(channel, on_refused=refusals.append)
    for index in range(2):
        _publish(confirmer, outcomes, index, exchange="shop.delay.3", message_id=f"m{index}")
    channel.close_by_broker(403, REFUSED)
    why = "RabbitMQ refused write to exchange 'shop.delay.3' for user 'shop' (ACCESS_REFUSED)"
    assert confirmer.refused == why and refusals == [why]
    assert outcomes.settled == {0: [why], 1: [why]} and confirmer.pending == 0
    assert channel.sent == [spec.Channel.CloseOk] and channel.collected and not channel.reopened
    channel.ack(2, multiple=True)  # a late confirm settles nothing more
    assert outcomes.settled == {0: [why], 1: [why]}


def test_other_channel_closes_and_a_confirmer_without_on_refused_keep_py_amqps_handling():
    channel, outcomes = ClosingChannel(), Outcomes()
    confirmer = Confirmer(channel, on_refused=lambda why: None)
    _publish(confirmer, outcomes, 0)
    channel.close_by_broker(404, "NOT_FOUND - no exchange 'ex'")
    assert channel.reopened == [(404, "NOT_FOUND - no exchange 'ex'", 60, 40)] and confirmer.refused is None
    assert not outcomes.settled and confirmer.pending == 1
    plain = ClosingChannel()
    Confirmer(plain)
    plain.close_by_broker(403, REFUSED)
    assert len(plain.reopened) == 1 and not plain.collected
