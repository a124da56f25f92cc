"""core/backoff.py: Exponential and Constant policies, property-tested."""
from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings, strategies as st

from kombu_events.core.backoff import Backoff, Constant, Exponential
from kombu_events.errors import ConfigurationError

PROPS = settings(max_examples=300, deadline=None)

base_st = st.floats(min_value=0, max_value=1e7)
factor_st = st.floats(min_value=1, max_value=100)
cap_st = st.floats(min_value=0, max_value=1e10)
retry_st = st.integers(min_value=1, max_value=10_000)
unit_interval = st.floats(min_value=0, max_value=1, exclude_max=True)


@PROPS
@given(base_st, factor_st, cap_st, retry_st, retry_st)
def test_exponential_without_jitter_is_monotonic_and_capped(base, factor, cap, r1, r2):
    policy = Exponential(base_ms=base, factor=factor, max_delay_ms=cap)
    low, high = sorted((r1, r2))
    d_low = policy.delay_ms(retry=low, rand=lambda: 0.0)
    d_high = policy.delay_ms(retry=high, rand=lambda: 0.0)
    assert 0 <= d_low <= d_high <= cap
    if low < 50:  # small enough to compute the formula directly
        assert d_low == min(cap, base * factor ** (low - 1))


@pytest.mark.parametrize(
    "retry, expected",
    [(1, 1000), (2, 2000), (3, 4000), (6, 32_000), (12, 2_048_000), (13, 3_600_000), (100, 3_600_000)],
)
def test_exponential_default_sequence(retry, expected):
    assert Exponential().delay_ms(retry=retry, rand=lambda: 0.0) == expected


@PROPS
@given(base_st, factor_st, cap_st, st.floats(min_value=0, max_value=1), retry_st, unit_interval)
def test_exponential_jitter_stays_within_its_band(base, factor, cap, jitter, retry, r):
    plain = Exponential(base_ms=base, factor=factor, max_delay_ms=cap).delay_ms(retry=retry)
    jittered = Exponential(base_ms=base, factor=factor, max_delay_ms=cap, jitter=jitter)
    delay = jittered.delay_ms(retry=retry, rand=lambda: r)
    slack = 1e-9 * plain
    assert (1 - jitter) * plain - slack <= delay <= plain
    assert delay <= cap


def test_jitter_uses_the_random_draw():
    policy = Exponential(base_ms=1000, jitter=0.25)
    assert policy.delay_ms(retry=1, rand=lambda: 0.0) == 1000
    assert policy.delay_ms(retry=1, rand=lambda: 0.5) == 875
    assert policy.delay_ms(retry=1, rand=lambda: 1.0) == 750
    delays = {policy.delay_ms(retry=1) for _ in range(50)}
    assert len(delays) > 1 and all(750 <= d <= 1000 for d in delays)


@PROPS
@given(base_st, factor_st, cap_st, st.integers(min_value=10**3, max_value=10**30))
def test_huge_retry_numbers_do_not_overflow(base, factor, cap, retry):
    policy = Exponential(base_ms=base, factor=factor, max_delay_ms=cap)
    delay = policy.delay_ms(retry=retry)
    assert math.isfinite(delay)
    assert 0 <= delay <= cap
    if base == 0:
        assert delay == 0, "a zero base stays zero however many retries"
    elif factor >= 2 and base >= 1:  # >= 2**999 ms: past any cap
        assert delay == cap


def test_zero_base_is_zero_even_past_float_overflow():
    assert Exponential(base_ms=0, factor=2).delay_ms(retry=5000) == 0


@pytest.mark.parametrize("retry", [0, -1])
def test_retry_numbers_start_at_one(retry):
    with pytest.raises(ValueError, match="start at 1"):
        Exponential().delay_ms(retry=retry)


@pytest.mark.parametrize(
    "kwargs, setting",
    [
        ({"base_ms": -1}, "base_ms"),
        ({"base_ms": "1000"}, "base_ms"),
        ({"base_ms": True}, "base_ms"),
        ({"base_ms": None}, "base_ms"),
        ({"base_ms": float("nan")}, "base_ms"),
        ({"factor": 0.5}, "factor"),
        ({"factor": -2}, "factor"),
        ({"factor": float("nan")}, "factor"),
        ({"max_delay_ms": -1}, "max_delay_ms"),
        ({"max_delay_ms": float("nan")}, "max_delay_ms"),
        ({"jitter": -0.1}, "jitter"),
        ({"jitter": 1.5}, "jitter"),
        ({"jitter": float("nan")}, "jitter"),
        ({"jitter": "0.1"}, "jitter"),
        # non-finite: inf would make 0 * inf = NaN delays, or a cap no ladder can hold
        ({"base_ms": float("inf")}, "base_ms"),
        ({"base_ms": 10**400}, "base_ms"),  # an int too large for a float
        ({"factor": float("inf")}, "factor"),
        ({"factor": float("-inf")}, "factor"),
        ({"max_delay_ms": float("inf")}, "max_delay_ms"),
        ({"max_delay_ms": float("-inf")}, "max_delay_ms"),
        ({"jitter": float("inf")}, "jitter"),
        ({"jitter": float("-inf")}, "jitter"),
    ],
)
def test_exponential_rejects_invalid_arguments(kwargs, setting):
    with pytest.raises(ConfigurationError) as info:
        Exponential(**kwargs)
    message = str(info.value)
    assert setting in message
    assert repr(kwargs[setting]) in message  # names the bad value
    assert ">=" in message or ".." in message  # says what would be valid


@pytest.mark.parametrize(
    "kwargs, valid",
    [({"base_ms": float("inf")}, "a finite number >= 0"), ({"factor": float("inf")}, "a finite number >= 1"),
     ({"max_delay_ms": float("nan")}, "a finite number >= 0"), ({"jitter": 2}, "a finite number within 0 .. 1")],
)
def test_the_message_says_what_would_be_valid(kwargs, valid):
    [(setting, value)] = kwargs.items()
    with pytest.raises(ConfigurationError, match="^" + re.escape(f"backoff {setting} must be {valid}, got {value!r}")):
        Exponential(**kwargs)


non_finite = st.sampled_from([float("inf"), float("-inf"), float("nan")])


@PROPS
@given(st.sampled_from(["base_ms", "factor", "max_delay_ms", "jitter"]), non_finite)
def test_no_setting_takes_a_non_finite_value(setting, value):
    with pytest.raises(ConfigurationError, match=setting):
        Exponential(**{setting: value})


# Every valid value, extremes included: 0, subnormals, up to the largest float.
any_ms = st.floats(min_value=0, allow_infinity=False)
any_factor = st.floats(min_value=1, allow_infinity=False)
any_jitter = st.floats(min_value=0, max_value=1)
closed_unit_interval = st.floats(min_value=0, max_value=1)


def delays_of(policy, retry: int, r: float) -> float:
    """The policy's delay, checked: a finite float within 0 .. max_delay_ms."""
    delay = policy.delay_ms(retry=retry, rand=lambda: r)
    assert isinstance(delay, float) and math.isfinite(delay), delay
    assert 0 <= delay <= policy.max_delay_ms
    return delay


@PROPS
@given(any_ms, any_factor, any_ms, any_jitter, retry_st, closed_unit_interval)
def test_every_valid_exponential_gives_a_finite_delay_within_its_cap(base, factor, cap, jitter, retry, r):
    delays_of(Exponential(base_ms=base, factor=factor, max_delay_ms=cap, jitter=jitter), retry, r)


@PROPS
@given(any_ms | st.integers(min_value=0, max_value=2**53), retry_st, closed_unit_interval)
def test_every_valid_constant_gives_a_finite_delay_within_its_cap(every, retry, r):
    delays_of(Constant(every_ms=every), retry, r)


# Hypothesis seldom draws inf on its own: mix it (and NaN) in, half of the time.
or_non_finite = st.sampled_from([float("inf"), float("-inf"), float("nan")])


@PROPS
@given(any_ms | or_non_finite, any_factor | or_non_finite, any_ms | or_non_finite, any_jitter | or_non_finite,
       retry_st, closed_unit_interval)
def test_a_policy_with_a_non_finite_setting_is_refused(base, factor, cap, jitter, retry, r):
    finite = all(map(math.isfinite, (base, factor, cap, jitter)))
    try:
        policy = Exponential(base_ms=base, factor=factor, max_delay_ms=cap, jitter=jitter)
    except ConfigurationError:
        assert not finite, "refused a valid policy"
        return
    assert finite, "took a non-finite setting"
    delays_of(policy, retry, r)


@PROPS
@given(st.floats(min_value=0, max_value=1e10), retry_st)
def test_constant_is_the_same_before_every_retry(every, retry):
    policy = Constant(every_ms=every)
    assert policy.delay_ms(retry=retry) == every == policy.max_delay_ms


@pytest.mark.parametrize("every", [-1, "5", None, True, float("nan"), float("inf"), 10**400])
def test_constant_rejects_invalid_delay(every):
    with pytest.raises(ConfigurationError, match="every_ms"):
        Constant(every_ms=every)


def test_the_protocol_asks_for_a_read_only_max_delay_ms():
    """A settable protocol attribute would reject frozen dataclasses under ``mypy --strict``."""
    assert isinstance(Backoff.__dict__["max_delay_ms"], property)
    assert "max_delay_ms" not in getattr(Backoff, "__annotations__", {})
