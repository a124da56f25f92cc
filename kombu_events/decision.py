"""The pure decision: what to do with a message given how its handler ended.

The pool reports an :class:`Outcome`; :func:`decide` turns it into a
:class:`Decision` (ack, retry after a delay, or archive with a reason); the
consumer carries the decision out.
"""
from __future__ import annotations

__all__ = ["Outcome", "Decision", "decide", "OK", "FAILED", "RETRY", "ARCHIVE", "UNDECODABLE", "LOST",
           "REDELIVERED"]

import random
from typing import Callable, NamedTuple

from .backoff import Backoff

OK = "ok"
FAILED = "failed"  # the handler raised an exception that may be retried
RETRY = "retry"  # the handler raised Retry
ARCHIVE = "archive"  # Archive, poisonous() section, dont_retry, not in retry_for
UNDECODABLE = "undecodable"  # body or content type rejected before the handler ran
LOST = "lost"  # the pool process died while the handler ran
REDELIVERED = "redelivered"  # the broker redelivered it: the last delivery ended without an ack


class Outcome(NamedTuple):
    """How one attempt ended (small and picklable: it crosses the prefork pipe)."""

    kind: str
    reason: str = ""
    exception: str = ""
    traceback: str = ""
    delay_ms: float | None = None


class Decision(NamedTuple):
    """What to do with the message: ``ack``, ``retry`` after ``delay_ms``, ``requeue`` or ``archive``.

    ``requeue`` sends it back to its queue at once without counting an attempt (only
    a redelivery, counted apart).
    """

    action: str
    delay_ms: float = 0
    reason: str = ""


ACK = Decision("ack")


def decide(
    outcome: Outcome,
    *,
    attempt: int,
    max_retries: int,
    backoff: Backoff,
    max_delay_ms: float,
    lost_delay_ms: float,
    redeliveries: int = 0,
    rand: Callable[[], float] = random.random,
) -> Decision:
    """Decide the fate of a message after attempt ``attempt`` (1-based) ended with ``outcome``.

    ``redeliveries`` counts broker redeliveries including this one. A redelivered
    message may never have reached its handler (it was only prefetched), so it is
    requeued without spending an attempt -- but a message redelivered more than
    ``max_retries + 1`` times is taken for one that kills its worker, and archived.
    """
    kind = outcome.kind
    if kind == OK:
        return ACK
    if kind == REDELIVERED:
        if redeliveries > max_retries + 1:
            return Decision("archive", reason=f"redelivered {redeliveries} times without an ack "
                                              f"(max_retries={max_retries}): does the handler kill its worker?")
        return Decision("requeue", reason="redelivered after an unacknowledged delivery")
    if kind in (ARCHIVE, UNDECODABLE):
        return Decision("archive", reason=outcome.reason or kind)
    if attempt > max_retries:
        why = outcome.reason or kind
        return Decision("archive", reason=f"gave up after {attempt} attempts (max_retries={max_retries}): {why}")
    if kind == LOST:
        delay = lost_delay_ms
    elif kind == RETRY and outcome.delay_ms is not None:
        delay = outcome.delay_ms
    else:
        delay = backoff.delay_ms(retry=attempt, rand=rand)
    if delay > max_delay_ms:
        return Decision("archive", reason=f"retry delay {delay:g} ms exceeds the ladder's {max_delay_ms:g} ms")
    if not delay >= 0:  # negative or NaN, e.g. from a custom Backoff: the ladder cannot express it
        return Decision("archive", reason=f"retry delay {delay!r} ms is not within 0 .. {max_delay_ms:g} ms")
    return Decision("retry", delay_ms=delay, reason=outcome.reason or kind)
