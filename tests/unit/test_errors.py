"""errors.py: Retry, Archive, Poisoned and poisonous()."""
from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import given, settings, strategies as st

from kombu_events.core import ladder
from kombu_events.core.backoff import Exponential
from kombu_events.core.decision import RETRY, Outcome, decide
from kombu_events.errors import Archive, Poisoned, Retry, poisonous


@pytest.mark.parametrize("exc", [Retry(3), Retry(), Archive("gone"), Poisoned("already")])
def test_poisonous_passes_retry_and_archive_through_unchanged(exc):
    with pytest.raises(type(exc)) as info, poisonous():
        raise exc
    assert info.value is exc


@pytest.mark.parametrize("exc", [ValueError("bad field"), KeyError("order_id"), ZeroDivisionError("x")])
def test_poisonous_turns_other_failures_into_poisoned(exc):
    with pytest.raises(Poisoned) as info, poisonous():
        raise exc
    assert isinstance(info.value, Archive)
    assert info.value.__cause__ is exc
    assert info.value.reason.startswith(f"poisonous section failed: {type(exc).__name__}: ")
    assert str(exc) in info.value.reason


def test_poisonous_without_failure_changes_nothing():
    with poisonous():
        value = 42
    assert value == 42


def test_poisonous_leaves_base_exceptions_alone():
    with pytest.raises(KeyboardInterrupt), poisonous():
        raise KeyboardInterrupt


@pytest.mark.parametrize(
    "kwargs, delay, message",
    [({}, None, "retry"), ({"delay": 2.5}, 2.5, "retry in 2.5 s"), ({"delay": 0}, 0, "retry in 0 s"),
     ({"delay": 3, "reason": "upstream busy"}, 3, "upstream busy")],
)
def test_retry(kwargs, delay, message):
    exc = Retry(**kwargs)
    assert exc.delay == delay
    assert str(exc) == message
    assert exc.reason == kwargs.get("reason", "")


@pytest.mark.parametrize("delay", [-1, -0.001, "5", True, float("nan"), [1]])
def test_retry_validates_its_delay(delay):
    with pytest.raises(ValueError) as info:
        Retry(delay)
    assert "seconds >= 0 or None" in str(info.value)
    assert repr(delay) in str(info.value)


def test_archive():
    assert Archive().reason == "archived by handler"
    assert Archive("duplicate order").reason == str(Archive("duplicate order")) == "duplicate order"
    assert issubclass(Poisoned, Archive)


@pytest.mark.parametrize(
    "delay, delay_ms",
    [(None, None), (0, 0.0), (3, 3000.0), (2.5, 2500.0), (16.1, 16100.0), (0.1, 100.0), (0.3, 300.0),
     (0.001, 1.0), (1.005, 1005.0), (123456789.123, 123456789123.0), (1e-7, 0.0001),
     (4e-10, 4e-7),  # a positive delay never becomes "no delay"
     (float("inf"), float("inf"))],
)
def test_retry_delay_ms_is_the_decimal_seconds_times_1000(delay, delay_ms):
    assert Retry(delay).delay_ms == delay_ms
    assert Retry(delay).delay == delay


def test_a_decimal_delay_costs_no_extra_ladder_unit():
    assert 16.1 * 1000 > 16100  # what a plain float conversion would hand the ladder
    assert ladder.units_for(delay_ms=16.1 * 1000, unit_ms=100, levels=8) == 162
    assert ladder.units_for(delay_ms=Retry(16.1).delay_ms, unit_ms=100, levels=8) == 161


UNITS_MS = st.sampled_from([1, 3, 7, 10, 100, 250, 1000, 60_000])


@settings(max_examples=500, deadline=None)
@given(st.integers(min_value=0, max_value=10**12), st.sampled_from([10, 1000]), UNITS_MS)
def test_decimal_seconds_round_up_to_exactly_the_units_they_need(k, per_second, unit_ms):
    """``k / per_second`` seconds is exactly ``k * 1000 / per_second`` ms: never a unit more or less."""
    exact_ms = k * (1000 // per_second)
    exact_units = -(-exact_ms // unit_ms)
    delay_ms = Retry(k / per_second).delay_ms
    assert delay_ms == exact_ms
    assert math.ceil(delay_ms / unit_ms) == exact_units
    levels = max(1, exact_units.bit_length())
    assert ladder.units_for(delay_ms=delay_ms, unit_ms=unit_ms, levels=levels) == exact_units


def test_retry_at_a_wall_clock_time_is_the_seconds_until_then():
    at = datetime.now(timezone.utc) + timedelta(seconds=30)
    retry = Retry(at=at)
    assert 29 < retry.delay <= 30
    assert retry.at is at and str(retry) == f"retry at {at.isoformat()}"


def test_retry_at_a_naive_time_is_local_and_a_past_time_retries_at_once():
    assert 59 < Retry(at=datetime.now() + timedelta(minutes=1)).delay <= 60
    assert Retry(at=datetime.now(timezone.utc) - timedelta(hours=1)).delay == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"at": "2026-01-01T00:00:00"}, "takes a datetime"),
    ({"at": datetime.now(), "delay": 5}, "not both"),
])
def test_retry_at_refuses_what_is_not_one_time(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Retry(**kwargs)


def test_retry_at_beyond_the_ladder_archives_naming_the_delay():
    retry = Retry(at=datetime.now(timezone.utc) + timedelta(days=2))
    decision = decide(Outcome(RETRY, str(retry), delay_ms=retry.delay_ms), attempt=1, max_retries=5,
                      backoff=Exponential(), max_delay_ms=65_535_000, lost_delay_ms=1000)
    assert decision.action == "archive" and "exceeds the ladder's 6.5535e+07 ms" in decision.reason
