"""core/breaker.py: the breaker's policy and state machine (pure: the clock is an argument)."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kombu_events import ConfigurationError
from kombu_events.core.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, CircuitBreaker
from kombu_events.core.health import DEGRADED, HEALTHY, UNHEALTHY


def tripped(policy: CircuitBreaker | None = None, now: float = 0.0) -> Breaker:
    breaker = Breaker(policy or CircuitBreaker(max_failures=1, reset_s=30))
    assert breaker.failure(now) == OPEN
    return breaker


@pytest.mark.parametrize("field, value", [
    ("max_failures", 0), ("max_failures", 1.5), ("max_failures", True), ("window_s", 0), ("window_s", float("nan")),
    ("reset_s", -1), ("reset_growth", "quadratic"), ("max_unhealthy", 0), ("downgrade_after_s", float("inf")),
])
def test_a_bad_policy_names_the_field_and_what_is_valid(field, value):
    with pytest.raises(ConfigurationError, match=field):
        CircuitBreaker(**{field: value})


def test_max_reset_below_reset_is_refused():
    with pytest.raises(ConfigurationError, match="max_reset_s"):
        CircuitBreaker(reset_s=60, max_reset_s=30)


@pytest.mark.parametrize("growth, expected", [
    ("exponential", [30, 60, 120, 240, 300, 300]),
    ("linear", [30, 60, 90, 120, 150, 180]),
])
def test_reset_time_grows_with_trips_in_a_row_and_is_capped(growth, expected):
    policy = CircuitBreaker(reset_s=30, max_reset_s=300, reset_growth=growth)
    assert [policy.reset_delay_s(n) for n in range(1, 7)] == expected


def test_failures_trip_only_when_the_threshold_falls_within_the_window():
    breaker = Breaker(CircuitBreaker(max_failures=3, window_s=10))
    assert breaker.failure(0) is None
    assert breaker.failure(5) is None
    assert breaker.failure(10.5) is None  # the one at 0 is out of the window
    assert breaker.state == CLOSED
    assert breaker.failure(11) == OPEN
    assert breaker.reason == "3 failures within 10 s"


def test_an_open_circuit_refuses_until_its_reset_time_then_lets_one_probe_through():
    breaker = tripped()
    assert breaker.reopens_at == 30
    assert not breaker.allow(29.9)
    assert not breaker.due(29.9)
    assert breaker.due(30)
    assert breaker.allow(30)
    assert breaker.state == HALF_OPEN
    assert not breaker.allow(30.1), "one probe at a time"


def test_a_successful_probe_closes_and_resets_the_growth():
    breaker = tripped()
    breaker.allow(30)
    assert breaker.success(31) == CLOSED
    assert breaker.trips_in_a_row == 0
    assert breaker.allow(31) and breaker.allow(32)


def test_a_failed_probe_trips_again_for_longer():
    breaker = tripped()
    breaker.allow(30)
    assert breaker.failure(31) == OPEN
    assert breaker.reopens_at == 31 + 60
    assert breaker.reason == "the probe failed"


def test_failures_of_calls_started_before_the_trip_are_ignored():
    breaker = tripped()
    assert breaker.failure(1) is None
    assert breaker.reopens_at == 30


def test_success_while_closed_or_open_changes_nothing():
    breaker = Breaker(CircuitBreaker())
    assert breaker.success(0) is None
    breaker = tripped()
    assert breaker.success(1) is None
    assert breaker.state == OPEN


def test_the_seeds_health_example_two_unhealthy_or_ten_degraded_in_ten_seconds():
    breaker = Breaker(CircuitBreaker())
    assert breaker.health(UNHEALTHY, 0) is None
    assert breaker.health(UNHEALTHY, 9) == OPEN
    breaker = Breaker(CircuitBreaker())
    assert [breaker.health(DEGRADED, t) for t in range(9)] == [None] * 9
    assert breaker.health(HEALTHY, 9) is None
    assert breaker.health(DEGRADED, 9.5) == OPEN


def test_unhealthy_before_a_probe_keeps_the_circuit_open_and_healthy_does_not_close_it():
    breaker = tripped()
    assert breaker.health(HEALTHY, 30) is None
    assert breaker.state == OPEN
    assert breaker.health(UNHEALTHY, 30) is None  # already open: it stays open ...
    assert breaker.reopens_at == 30 + 60          # ... for longer
    assert breaker.health(DEGRADED, 31) is None


def test_an_unknown_health_status_is_an_error():
    with pytest.raises(ValueError, match="healthy, degraded, unhealthy"):
        Breaker(CircuitBreaker()).health("fine", 0)


def test_three_trips_in_five_minutes_log_at_error_until_thirty_minutes_later():
    breaker = Breaker(CircuitBreaker(max_failures=1, reset_s=1, max_reset_s=1))
    levels = []
    for now in (0, 60, 120):
        breaker.allow(now)
        breaker.failure(now)
        levels.append(breaker.log_level(now))
    assert levels == ["warning", "warning", "error"]
    assert breaker.log_level(120 + 1799) == "error"
    assert breaker.log_level(120 + 1800) == "warning"


@given(st.lists(st.tuples(st.sampled_from(["allow", "success", "failure", "health", "half_open", "release"]),
                          st.floats(min_value=0, max_value=50), st.sampled_from([HEALTHY, DEGRADED, UNHEALTHY])),
                max_size=60))
def test_invariants_hold_for_any_sequence_of_inputs(steps):
    """Open means a reset time; closed never refuses; a half-open circuit lets one probe through at a time."""
    breaker = Breaker(CircuitBreaker(max_failures=2, window_s=5, reset_s=3, max_reset_s=20))
    now = 0.0
    probes_in_half_open = 0
    for what, dt, status in steps:
        now += dt
        state_before = breaker.state
        if what == "allow":
            allowed = breaker.allow(now)
            if state_before == CLOSED:
                assert allowed
            if breaker.state == HALF_OPEN and allowed:
                probes_in_half_open += 1
        elif what == "success":
            breaker.success(now)
        elif what == "failure":
            breaker.failure(now)
        elif what == "half_open":
            breaker.half_open(now)
        elif what == "release":
            breaker.release()
            probes_in_half_open = 0
        else:
            breaker.health(status, now)
        if breaker.state != HALF_OPEN:
            probes_in_half_open = 0
        assert probes_in_half_open <= 1
        assert (breaker.reopens_at is not None) == (breaker.state != CLOSED)
        if breaker.reopens_at is not None:
            assert breaker.reopens_at <= now + 20, "never open for longer than max_reset_s"


def test_half_open_waits_for_the_reset_time_and_leaves_the_probe_to_the_next_call():
    breaker = tripped()
    assert breaker.half_open(29.9) is None
    assert breaker.state == OPEN
    assert breaker.half_open(30) == HALF_OPEN
    assert breaker.half_open(31) is None, "already half-open"
    assert breaker.allow(31), "the next call is the probe"
    assert not breaker.allow(31)


def test_a_released_probe_lets_the_next_call_probe_and_keeps_the_circuit_half_open():
    breaker = tripped()
    breaker.half_open(30)
    assert breaker.allow(30)
    breaker.release()
    assert breaker.state == HALF_OPEN
    assert breaker.allow(31) and not breaker.allow(31)


def test_release_of_a_closed_circuit_changes_nothing():
    breaker = Breaker(CircuitBreaker())
    breaker.release()
    assert breaker.state == CLOSED and breaker.allow(0)
