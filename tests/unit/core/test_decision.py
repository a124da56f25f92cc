"""core/decision.py: every branch of decide(), and its safety properties."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kombu_events.core.backoff import Constant, Exponential
from kombu_events.core.decision import (
    ARCHIVE,
    FAILED,
    LOST,
    OK,
    REDELIVERED,
    RETRY,
    UNDECODABLE,
    Decision,
    Outcome,
    decide,
    likely_action,
    retry_delay_ms,
)

BACKOFF = Exponential(base_ms=1000, factor=2, max_delay_ms=60_000)
MAX_DELAY_MS = 65_535_000
LOST_DELAY_MS = 1000


def _decide(outcome: Outcome, attempt: int = 1, max_retries: int = 5, **kwargs) -> Decision:
    options = {"backoff": BACKOFF, "max_delay_ms": MAX_DELAY_MS, "lost_delay_ms": LOST_DELAY_MS}
    options.update(kwargs)
    return decide(outcome, attempt=attempt, max_retries=max_retries, **options)


@pytest.mark.parametrize("attempt", [1, 6, 100])
def test_ok_acks_whatever_the_attempt(attempt):
    assert _decide(Outcome(OK), attempt=attempt) == Decision("ack")


@pytest.mark.parametrize(
    "outcome, reason",
    [
        (Outcome(ARCHIVE, "order is cancelled"), "order is cancelled"),
        (Outcome(ARCHIVE), ARCHIVE),
        (Outcome(UNDECODABLE, "body is not valid JSON: ..."), "body is not valid JSON: ..."),
        (Outcome(UNDECODABLE), UNDECODABLE),
    ],
)
@pytest.mark.parametrize("attempt", [1, 3])
def test_archive_and_undecodable_archive_at_once(outcome, reason, attempt):
    assert _decide(outcome, attempt=attempt) == Decision("archive", reason=reason)


@pytest.mark.parametrize("attempt, delay", [(1, 1000), (2, 2000), (3, 4000), (5, 16_000)])
def test_failure_with_attempts_left_retries_after_the_backoff(attempt, delay):
    decided = _decide(Outcome(FAILED, "builtins.ValueError: boom"), attempt=attempt)
    assert decided == Decision("retry", delay_ms=delay, reason="builtins.ValueError: boom")


def test_backoff_gets_the_attempt_and_the_random_source(mocker):
    backoff = mocker.Mock(max_delay_ms=5000)
    backoff.delay_ms.return_value = 1234
    rand = lambda: 0.5  # noqa: E731
    decided = _decide(Outcome(FAILED), attempt=3, backoff=backoff, rand=rand)
    backoff.delay_ms.assert_called_once_with(retry=3, rand=rand)
    assert decided == Decision("retry", delay_ms=1234, reason=FAILED)


@pytest.mark.parametrize("kind", [FAILED, RETRY, LOST])
@pytest.mark.parametrize("max_retries, attempt", [(5, 6), (5, 60), (0, 1), (1, 2)])
def test_exhausted_attempts_archive_with_max_retries_in_the_reason(kind, max_retries, attempt):
    decided = _decide(Outcome(kind, "builtins.ValueError: boom", delay_ms=10), attempt=attempt,
                      max_retries=max_retries)
    assert decided.action == "archive"
    assert f"max_retries={max_retries}" in decided.reason
    assert f"after {attempt} attempts" in decided.reason
    assert "builtins.ValueError: boom" in decided.reason


def test_last_allowed_retry_still_retries():
    assert _decide(Outcome(FAILED), attempt=5, max_retries=5).action == "retry"
    assert _decide(Outcome(FAILED), attempt=6, max_retries=5).action == "archive"


@pytest.mark.parametrize("delay_ms", [0, 1, 2500, 3_600_000])
def test_retry_with_an_explicit_delay_ignores_the_backoff(delay_ms):
    decided = _decide(Outcome(RETRY, "retry in 2.5 s", delay_ms=delay_ms), attempt=2)
    assert decided == Decision("retry", delay_ms=delay_ms, reason="retry in 2.5 s")


def test_retry_without_a_delay_uses_the_backoff():
    assert _decide(Outcome(RETRY, "retry"), attempt=4).delay_ms == 8000


def test_lost_retries_after_the_lost_delay():
    decided = _decide(Outcome(LOST, "pool process lost"), attempt=2, backoff=Constant(every_ms=99_999))
    assert decided == Decision("retry", delay_ms=LOST_DELAY_MS, reason="pool process lost")


@pytest.mark.parametrize(("outcome", "expected_ms"), [
    (Outcome(RETRY, delay_ms=2500), 2500),  # Retry(delay=...) wins over the backoff
    (Outcome(LOST), 1000),  # a lost pool process: the lost delay, not the backoff
    (Outcome(FAILED), 4000),  # any other failure: the backoff for this attempt
    (Outcome(RETRY), 4000),  # Retry() without a delay: the backoff too
])
def test_retry_delay_ms_is_the_one_place_a_retrys_delay_is_chosen(outcome, expected_ms):
    assert retry_delay_ms(outcome, attempt=3, backoff=BACKOFF, lost_delay_ms=LOST_DELAY_MS) == expected_ms
    assert _decide(outcome, attempt=3).delay_ms == expected_ms, "decide() retries after exactly that delay"


@pytest.mark.parametrize(
    "outcome, kwargs",
    [
        (Outcome(RETRY, delay_ms=15_001), {}),
        (Outcome(RETRY, delay_ms=float("inf")), {}),
        (Outcome(FAILED), {"backoff": Constant(every_ms=20_000)}),
        (Outcome(LOST), {"lost_delay_ms": 16_000}),
    ],
)
def test_delay_beyond_the_ladder_archives(outcome, kwargs):
    decided = _decide(outcome, max_delay_ms=15_000, **kwargs)
    assert decided.action == "archive"
    assert "exceeds the ladder's 15000 ms" in decided.reason


@pytest.mark.parametrize("delay_ms", [float("nan"), -1])
def test_a_delay_the_ladder_cannot_express_archives(delay_ms):
    decided = _decide(Outcome(RETRY, delay_ms=delay_ms), max_delay_ms=15_000)
    assert decided.action == "archive"
    assert "15000 ms" in decided.reason


outcomes = st.builds(
    Outcome,
    kind=st.sampled_from([OK, FAILED, RETRY, ARCHIVE, UNDECODABLE, LOST]),
    reason=st.text(max_size=20),
    delay_ms=st.one_of(st.none(), st.floats(min_value=0, max_value=1e12)),
)


@settings(max_examples=500, deadline=None)
@given(outcomes, st.integers(min_value=0, max_value=10_000), st.integers(min_value=1, max_value=10**6),
       st.floats(min_value=0, max_value=1, exclude_max=True))
def test_never_retries_past_max_retries(outcome, max_retries, attempt, r):
    decided = _decide(outcome, attempt=attempt, max_retries=max_retries, rand=lambda: r,
                      backoff=Exponential(jitter=0.5, max_delay_ms=60_000))
    assert decided.action in ("ack", "retry", "archive")
    if attempt > max_retries:
        assert decided.action != "retry"
    if decided.action == "retry":
        assert 0 <= decided.delay_ms <= MAX_DELAY_MS
        assert outcome.kind in (FAILED, RETRY, LOST)
    if outcome.kind == OK:
        assert decided.action == "ack"
    if outcome.kind in (ARCHIVE, UNDECODABLE):
        assert decided.action == "archive"


def _decide_redelivered(*, redeliveries, max_retries=2, attempt=1):
    return decide(Outcome(REDELIVERED, "redelivered"), attempt=attempt, max_retries=max_retries,
                  backoff=Constant(every_ms=1000), max_delay_ms=10_000, lost_delay_ms=100,
                  redeliveries=redeliveries)


@pytest.mark.parametrize("redeliveries", [1, 2, 3])
def test_a_redelivered_message_is_requeued_without_spending_an_attempt(redeliveries):
    decided = _decide_redelivered(redeliveries=redeliveries, max_retries=2, attempt=3)
    assert decided.action == "requeue"
    assert decided.delay_ms == 0


@pytest.mark.parametrize("max_retries", [0, 1, 5])
def test_a_message_redelivered_too_often_is_archived_as_a_worker_killer(max_retries):
    assert _decide_redelivered(redeliveries=max_retries + 1, max_retries=max_retries).action == "requeue"
    decided = _decide_redelivered(redeliveries=max_retries + 2, max_retries=max_retries)
    assert decided.action == "archive"
    assert "kill its worker" in decided.reason and f"max_retries={max_retries}" in decided.reason


@pytest.mark.parametrize("kind, final, action", [
    (FAILED, False, "retry"), (RETRY, False, "retry"), (LOST, False, "retry"),
    (FAILED, True, "archive"), (RETRY, True, "archive"),
    (ARCHIVE, False, "archive"), (UNDECODABLE, False, "archive"),
])
def test_likely_action_after_a_failed_attempt(kind, final, action):
    assert likely_action(Outcome(kind, "why"), final=final) == action
