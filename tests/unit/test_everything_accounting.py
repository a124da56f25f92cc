"""The everything-on accounting forgives exactly one loss: a message the broker dropped while dead-lettering it
out of a classic delay queue as the node stopped (docs/failures.md). Anything else lost is reported, with its
history."""
from __future__ import annotations

from tests.integration.everything_accounting import Ledger, account, dead_lettered_at_a_stop

STOP = (100.0, 102.0)  # the broker stopped at t=100 and served again at t=102


def _ledger(queue_type: str = "classic") -> Ledger:
    return Ledger(expected={"a"}, queue_type=queue_type, broker_stops=[STOP])


def _settled(t: float, action: str = "retry", delay_ms: float = 400.0) -> dict:
    return {"hook": "settled", "id": "a", "t": t, "pid": 1, "queue": "s.q", "attempt": 1, "action": action,
            "outcome": "failed", "delay_ms": delay_ms}


def test_a_retry_waiting_in_the_ladder_as_the_broker_stopped_is_the_brokers_loss():
    assert dead_lettered_at_a_stop(_ledger(), [_settled(99.8)], {"a"}) == ["a"]
    assert dead_lettered_at_a_stop(_ledger(), [_settled(102.5, action="requeue")], {"a"}) == ["a"]


def test_a_delayed_event_a_handler_published_just_before_the_stop_is_the_brokers_loss_too():
    ledger = Ledger(expected={"later-x"}, broker_stops=[STOP], publish_delays={"later-": 0.5})
    published = {"hook": "after_publish", "id": "later-x", "t": 98.7, "pid": 1, "error": None}
    assert dead_lettered_at_a_stop(ledger, [published], {"later-x"}) == ["later-x"]
    assert dead_lettered_at_a_stop(ledger, [{**published, "t": 97.0}], {"later-x"}) == []  # due before the stop
    assert dead_lettered_at_a_stop(ledger, [{**published, "error": "UnroutableError()"}], {"later-x"}) == []
    assert dead_lettered_at_a_stop(Ledger(expected={"other"}, broker_stops=[STOP]),  # no delay known for it
                                   [{**published, "id": "other"}], {"other"}) == []


def test_anything_else_lost_is_not_forgiven():
    hooks_received_after = [_settled(99.8), {**_settled(100.3), "hook": "received"}]
    assert dead_lettered_at_a_stop(_ledger("quorum"), [_settled(99.8)], {"a"}) == []  # quorum: at least once
    assert dead_lettered_at_a_stop(_ledger(), [_settled(99.8, action="ack")], {"a"}) == []
    assert dead_lettered_at_a_stop(_ledger(), [_settled(90.0)], {"a"}) == []  # back in its queue long before
    assert dead_lettered_at_a_stop(_ledger(), [_settled(104.0)], {"a"}) == []  # sent after the broker was back
    assert dead_lettered_at_a_stop(_ledger(), hooks_received_after, {"a"}) == []  # a worker got it again
    assert dead_lettered_at_a_stop(_ledger(), [], {"a"}) == []


def test_the_report_counts_the_brokers_loss_apart_and_shows_the_history_of_any_other():
    hooks = [{"hook": "received", "id": "a", "t": 99.7, "pid": 1, "queue": "s.q", "attempt": 1}, _settled(99.8)]
    forgiven = account(_ledger(), {"hooks": hooks}, [], None, {})
    assert not [p for p in forgiven.problems if "never handled" in p or "history" in p]
    assert forgiven.figures["lost by the broker's dead-lettering at a stop (classic queues, docs/failures.md)"] == \
        "1: ['a']"
    report = account(_ledger("quorum"), {"hooks": hooks}, [], None, {})
    assert report.problems[0] == "1 events never handled: ['a']"
    assert report.problems[1] == ("history of a: 99.700 received pid 1 attempt 1; "
                                  "99.800 settled pid 1 attempt 1 retry 400.0")
