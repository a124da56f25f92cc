"""failures.py: Retry, Archive, Poisoned and poisonous()."""
from __future__ import annotations

import pytest

from kombu_events.failures import Archive, Poisoned, Retry, poisonous


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
