"""core/schedule.py: the pure decision of periodic events, by example and against a model of the broker with crashes."""
from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from kombu_events.core.schedule import (
    Advance,
    Begin,
    Later,
    Run,
    Schedule,
    Stale,
    State,
    Token,
    action_for,
    iso,
    next_token,
    summary,
)

EVERY = 10


def schedule(catch_up: str = "latest", every_ms: int = EVERY, origin_ms: int = 0) -> Schedule:
    return Schedule("s", every_ms, origin_ms, catch_up, 1000, "svc.schedule.s", "svc.schedule.s.state")


SIG = schedule().signature


def token(period: int | None, signature: dict | None = None) -> Token:
    return Token("s", period, SIG if signature is None else signature)


def state(last: int | None, nxt: int | None, signature: dict | None = None) -> State:
    return State(last, None if last is None else last * EVERY, nxt, SIG if signature is None else signature)


# -- periods -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("when, first, after, latest", [
    (0, 0, 1, 0), (1, 1, 1, 0), (9, 1, 1, 0), (10, 1, 2, 1), (-5, 0, 0, -1),
])
def test_period_arithmetic(when, first, after, latest):
    s = schedule()
    assert (s.first_at_or_after(when), s.first_after(when), s.latest_due(when)) == (first, after, latest)


def test_a_start_aligns_the_periods_and_none_comes_before_it():
    s = schedule(origin_ms=1003)
    assert s.due_ms(0) == 1003 and s.due_ms(2) == 1023
    assert s.first_at_or_after(0) == 0 and s.first_at_or_after(1004) == 1 and s.latest_due(1002) == -1


def test_token_and_state_round_trip_their_json():
    assert Token.from_dict(token(7).as_dict()) == token(7)
    st_ = State(3, 30, 4, SIG, {"ran_at": "x"})
    again = State.from_dict(st_.as_dict())
    assert again == st_ and again.info == {"ran_at": "x"}
    assert st_.as_dict()["last_due"] == iso(30) == "1970-01-01T00:00:00.030+00:00"
    for bad in ({}, {"schedule": "s", "period": "7"}, {"schedule": "s", "period": True}, []):
        with pytest.raises(ValueError):
            Token.from_dict(bad)
    with pytest.raises(ValueError):
        State.from_dict({"signature": {}, "last_run": 1.5})


# -- the rules ---------------------------------------------------------------------------------------

def test_without_state_a_schedule_first_records_where_it_begins():
    assert action_for(schedule(), token(None), None, 31) == Begin(4)
    assert action_for(schedule(), token(7), None, 31) == Begin(7)
    begun = Begin(4).state(schedule())
    assert begun == State(None, None, 4, SIG)
    assert action_for(schedule(), token(None), begun, 31) == Later(4, 9)
    assert action_for(schedule(), token(None), begun, 40) == Run(4, 40, 4, 4)
    assert action_for(schedule(), token(None), begun, 75) == Run(7, 70, 4, 4), "a late seed still begins there"


def test_a_seed_with_state_stands_for_the_period_after_the_last_run():
    assert action_for(schedule(), token(None), state(5, 6), 55) == Later(6, 5)
    assert action_for(schedule(), token(None), state(5, 6), 60) == Run(6, 60, 6, 6)


def test_a_token_never_runs_early():
    assert action_for(schedule(), token(6), state(5, 6), 59) == Later(6, 1)


def test_a_token_whose_period_ran_is_stale_once_the_next_token_is_recorded():
    assert isinstance(action_for(schedule(), token(6), state(6, 7), 65), Stale)
    assert isinstance(action_for(schedule(), token(5), state(6, 7), 65), Stale)


def test_a_token_whose_period_ran_without_its_next_token_recorded_advances():
    assert action_for(schedule(), token(6), state(6, 6), 65) == Advance(6)
    assert action_for(schedule(), token(6), state(6, None), 65) == Advance(6)
    assert isinstance(action_for(schedule(), token(5), state(6, 6), 65), Stale), "an older duplicate does not"


def test_catch_up_latest_runs_once_for_the_latest_due_period_and_lists_the_missed():
    decision = action_for(schedule("latest"), token(6), state(5, 6), 93)
    assert decision == Run(9, 90, 6, 6) and list(decision.missed) == [6, 7, 8]


def test_catch_up_all_runs_the_first_missed_period_and_chains():
    decision = action_for(schedule("all"), token(6), state(5, 6), 93)
    assert decision == Run(6, 60, 6, 6) and list(decision.missed) == []
    assert next_token(schedule("all"), 6, 93) == Later(7, 0)


def test_a_token_of_another_timing_is_stale():
    assert isinstance(action_for(schedule(), token(6, {"every_ms": 5, "origin_ms": 0}), state(5, 6), 60), Stale)


def test_a_changed_period_numbers_from_the_last_run_s_due_time():
    old = State(5, 50, 6, {"every_ms": 20, "origin_ms": 0})
    s = schedule(every_ms=15)  # new boundaries 45, 60, ...: the first after 50 is period 4 (60)
    assert action_for(s, Token("s", None, s.signature), old, 52) == Later(4, 8)
    assert action_for(s, Token("s", None, s.signature), old, 61) == Run(4, 60, 4, None)


def test_the_next_token_is_due_at_the_next_period():
    assert next_token(schedule(), 6, 62) == Later(7, 8)


def test_summary_of_a_schedule_for_the_cli():
    row = summary(schedule(), State(5, 50, 6, SIG, {"outcome": "ok", "ran_at": "t"}), 52)
    assert row["last_run"] == 5 and row["next"] == 6 and row["next_due"] == iso(60) and row["outcome"] == "ok"
    fresh = summary(schedule(), None, 52)
    assert fresh["last_run"] is None and fresh["next_due"] == iso(60) and "not started" in fresh["note"]
    changed = summary(schedule(every_ms=15), State(5, 50, 6, SIG), 52)
    assert changed["next"] == 4 and changed["next_due"] == iso(60) and "period changed" in changed["note"]


# -- the model: one token queue (single active consumer, prefetch 1), the ladder, the state queue ----

CRASH_POINTS = ("after begin", "before run", "in run", "after write 1", "after publish", "after write 2")


class Broker:
    """Tokens in the ladder (a heap by arrival time), one state message, and what ran."""

    def __init__(self, s: Schedule) -> None:
        self.s = s
        self.ladder: list[tuple[int, int, Token]] = []
        self.seq = 0
        self.state: State | None = None
        self.runs: Counter[int] = Counter()
        self.covered: set[int] = set()
        self.crashes_in_run = 0
        self.early: list[tuple[int, int]] = []

    def publish(self, at: int, tok: Token) -> None:
        self.seq += 1
        heapq.heappush(self.ladder, (at, self.seq, tok))

    def deliver(self, now: int, tok: Token, crash: str | None, duration: int) -> int:
        """Handle one token as the worker's wrapper does; return the time it is settled (or crashed)."""
        s = self.s
        decision = action_for(s, tok, self.state, now)
        if isinstance(decision, Begin):
            self.state = decision.state(s)
            if crash == "after begin":
                return self._crashed(now, tok)
            decision = action_for(s, tok, self.state, now)
        if isinstance(decision, Later):
            self.publish(now + decision.delay_ms, Token("s", decision.period, s.signature))
            return self._crashed(now, tok) if crash == "after publish" else now
        if isinstance(decision, Advance):
            nxt = next_token(s, decision.last_run, now)
            self.publish(now + nxt.delay_ms, Token("s", nxt.period, s.signature))
            if crash == "after publish":
                return self._crashed(now, tok)
            self.state = replace(self.state, next=nxt.period)  # type: ignore[arg-type]
            return self._crashed(now, tok) if crash == "after write 2" else now
        if not isinstance(decision, Run):
            return now
        if crash == "before run":
            return self._crashed(now, tok)
        if now < decision.due_ms:
            self.early.append((decision.target, now))
        self.runs[decision.target] += 1
        self.covered.update([decision.target, *decision.missed])
        now += duration
        if crash == "in run":
            self.crashes_in_run += 1
            return self._crashed(now, tok)
        self.state = State(decision.target, decision.due_ms, decision.previous_next, s.signature)
        if crash == "after write 1":
            return self._crashed(now, tok)
        nxt = next_token(s, decision.target, now)
        self.publish(now + nxt.delay_ms, Token("s", nxt.period, s.signature))
        if crash == "after publish":
            return self._crashed(now, tok)
        self.state = replace(self.state, next=nxt.period)
        if crash == "after write 2":
            return self._crashed(now, tok)
        return now

    def _crashed(self, now: int, tok: Token) -> int:
        # Unacked: the broker redelivers it; the next worker requeues it through the ladder (one unit), and
        # that worker's start publishes a seed.
        self.publish(now + 1, tok)
        self.publish(now, Token("s", None, self.s.signature))
        return now


@settings(max_examples=150, deadline=None)
@given(catch_up=st.sampled_from(["latest", "all"]), data=st.data(),
       start=st.integers(0, 3 * EVERY), seeds=st.lists(st.integers(0, 400), max_size=4))
def test_every_period_runs_at_least_once_and_duplicates_are_at_most_the_crashes(catch_up, data, start, seeds):
    s = schedule(catch_up)
    broker = Broker(s)
    broker.publish(start, Token("s", None, s.signature))
    for at in seeds:  # more workers starting later: their seeds
        broker.publish(at, Token("s", None, s.signature))
    now, end = start, 400
    while broker.ladder and broker.ladder[0][0] <= end:
        at, _seq, tok = heapq.heappop(broker.ladder)
        now = max(now, at)  # one token at a time: the next waits for the previous to be settled
        crash = data.draw(st.sampled_from((None,) * 6 + CRASH_POINTS))
        duration = data.draw(st.integers(0, 2 * EVERY + 5))
        now = broker.deliver(now, tok, crash, duration)
    assert broker.early == [], "a period never runs before it is due"
    ran = sorted(broker.runs)
    assert ran, "the schedule ran"
    first = s.first_at_or_after(start)
    if catch_up == "all":
        assert ran == list(range(first, ran[-1] + 1)), "every period ran"
    else:
        assert sorted(broker.covered) == list(range(first, ran[-1] + 1)), "every period ran or was caught up"
        assert ran[-1] >= s.latest_due(now) - 3, "the schedule goes on"
    duplicates = sum(n - 1 for n in broker.runs.values())
    assert duplicates <= broker.crashes_in_run
