"""The pure decision: how an attempt ended (:class:`Outcome`) and what that means (:class:`Decision`).

:func:`classify` turns a handler's exception into an Outcome, :func:`lost` does the
same for a pool process that died, and :func:`decide` turns an Outcome into ack,
retry after a delay (:func:`retry_delay_ms` chooses it), requeue, or archive with a reason.
:mod:`kombu_events.core.settlement` turns the decision into the step the consumer carries out.
"""
from __future__ import annotations

__all__ = ["Outcome", "Decision", "decide", "retry_delay_ms", "classify", "lost", "is_final", "likely_action", "OK",
           "FAILED", "RETRY", "ARCHIVE", "UNDECODABLE", "INVALID", "REFUSED", "SKIPPED", "LOST", "REDELIVERED",
           "DEFERRED"]

import random
import traceback as tb
from typing import Any, Callable, NamedTuple

from ..errors import Archive, Retry
from .backoff import Backoff

OK = "ok"
FAILED = "failed"  # the handler raised an exception that may be retried
RETRY = "retry"  # the handler raised Retry
ARCHIVE = "archive"  # Archive, poisonous() section, dont_retry, not in retry_for
UNDECODABLE = "undecodable"  # body, content type, envelope or headers rejected before the handler ran
INVALID = "invalid"  # the payload does not fit the handler's contract: the handler did not run
REFUSED = "refused"  # its publisher (user_id) is not one of the handler's publishers=: the handler did not run
SKIPPED = "skipped"  # not for this handler (its type= names another message type): acked, not run
LOST = "lost"  # the pool process died while the handler ran
REDELIVERED = "redelivered"  # the broker redelivered it: the last delivery ended without an ack
DEFERRED = "deferred"  # not run (e.g. refused by a middleware): back after delay_ms, no attempt spent


class Outcome(NamedTuple):
    """How one attempt ended (small and picklable: it crosses the prefork pipe).

    ``duration_ms`` is the handler's own run time, measured where it ran (0 if it did not run).
    """

    kind: str
    reason: str = ""
    exception: str = ""
    traceback: str = ""
    delay_ms: float | None = None
    duration_ms: float = 0.0


class Decision(NamedTuple):
    """What to do with the message: ``ack``, ``retry`` after ``delay_ms``, ``requeue`` or ``archive``.

    ``requeue`` sends it back to its queue after ``delay_ms`` without counting an attempt.
    """

    action: str
    delay_ms: float = 0
    reason: str = ""


ACK = Decision("ack")
#: Outcomes archived after one attempt: no retry could change them.
_AT_ONCE = (ARCHIVE, UNDECODABLE, INVALID, REFUSED)


def is_final(attempt: int, max_retries: int) -> bool:
    """Whether attempt ``attempt`` (1-based) is the last one a handler with ``max_retries`` gets."""
    return attempt > max_retries


def likely_action(outcome: Outcome, *, final: bool) -> str:
    """``retry`` or ``archive``: what the worker will most likely do after a failed attempt.

    Told where the handler ran, before the worker decides: :func:`decide` may still
    archive a retry whose delay does not fit the ladder, or a refused republish.
    """
    if final or outcome.kind in _AT_ONCE:
        return "archive"
    return "retry"


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
    if kind in (OK, SKIPPED):
        return ACK
    if kind == REDELIVERED:
        if redeliveries > max_retries + 1:
            return Decision("archive", reason=f"redelivered {redeliveries} times without an ack "
                                              f"(max_retries={max_retries}): does the handler kill its worker?")
        return Decision("requeue", reason="redelivered after an unacknowledged delivery")
    if kind in _AT_ONCE:
        return Decision("archive", reason=outcome.reason or kind)
    if kind == DEFERRED:
        return _delayed("requeue", lost_delay_ms if outcome.delay_ms is None else outcome.delay_ms,
                        max_delay_ms, outcome.reason or kind)
    if is_final(attempt, max_retries):
        why = outcome.reason or kind
        return Decision("archive", reason=f"gave up after {attempt} attempts (max_retries={max_retries}): {why}")
    delay = retry_delay_ms(outcome, attempt=attempt, backoff=backoff, lost_delay_ms=lost_delay_ms, rand=rand)
    return _delayed("retry", delay, max_delay_ms, outcome.reason or kind)


def retry_delay_ms(outcome: Outcome, *, attempt: int, backoff: Backoff, lost_delay_ms: float,
                   rand: Callable[[], float] = random.random) -> float:
    """How long a retry waits before attempt ``attempt + 1``: the one place that chooses it.

    The handler's ``Retry(delay=...)`` wins; a lost pool process waits ``lost_delay_ms`` (the
    ladder's unit); any other failure waits what the handler's ``backoff`` (``kombu_events.core.backoff``)
    says for this attempt. :func:`decide` archives a delay the ladder cannot hold; the ladder
    rounds the rest to its unit (:meth:`kombu_events.core.topology.Topology.address`).
    """
    if outcome.kind == LOST:
        return lost_delay_ms
    if outcome.kind == RETRY and outcome.delay_ms is not None:
        return outcome.delay_ms
    return backoff.delay_ms(retry=attempt, rand=rand)


def _delayed(action: str, delay: float, max_delay_ms: float, reason: str) -> Decision:
    if delay > max_delay_ms:
        return Decision("archive", reason=f"{action} delay {delay!r} ms exceeds the ladder's {max_delay_ms:g} ms")
    if not delay >= 0:  # negative or NaN, e.g. from a custom Backoff: the ladder cannot express it
        return Decision("archive", reason=f"{action} delay {delay!r} ms is not within 0 .. {max_delay_ms:g} ms")
    return Decision(action, delay_ms=delay, reason=reason)


def classify(exc: BaseException, *, retry_for: tuple[type[BaseException], ...] = (Exception,),
             dont_retry: tuple[type[BaseException], ...] = (), traceback_limit: int = 2000,
             final: bool = True, duration_ms: float = 0.0) -> Outcome:
    """Outcome for an exception a handler raised (never raises itself).

    The traceback only goes into archive headers, and formatting one is costly
    (Python 3.11 parses source for its markers), so a failure that will be retried
    (not ``final``) carries none.
    """
    exception = describe(exc)

    def trace() -> str:
        if not traceback_limit:
            return ""
        try:
            return "".join(tb.format_exception(type(exc), exc, exc.__traceback__))[-traceback_limit:]
        except Exception:  # a traceback that cannot be formatted is not worth losing the message over
            return ""

    if isinstance(exc, Retry):
        return Outcome(RETRY, _text(exc, exception), exception, trace() if final else "", exc.delay_ms,
                       duration_ms)
    if isinstance(exc, Archive):
        return Outcome(ARCHIVE, _text(exc.reason, exception), exception, trace(), None, duration_ms)
    if dont_retry and isinstance(exc, dont_retry):
        return Outcome(ARCHIVE, f"dont_retry: {exception}", exception, trace(), None, duration_ms)
    if not isinstance(exc, retry_for):
        return Outcome(ARCHIVE, f"not in retry_for: {exception}", exception, trace(), None, duration_ms)
    return Outcome(FAILED, exception, exception, trace() if final else "", None, duration_ms)


def lost(result: Any, *, traceback_limit: int) -> Outcome:
    """Outcome for what a pool reports when its process died (billiard's ``ExceptionInfo``, or an exception)."""
    exc = getattr(result, "exception", result)
    exc = getattr(exc, "exc", exc)  # billiard wraps it in ExceptionWithTraceback
    what = describe(exc)
    trace = _text(getattr(result, "traceback", ""), "")[-traceback_limit:] if traceback_limit else ""
    return Outcome(LOST, f"pool process lost: {what}", what, trace)


def describe(exc: BaseException) -> str:
    """``module.Class: message`` for an exception, even one whose ``str()`` raises."""
    cls = type(exc)
    return f"{cls.__module__}.{cls.__qualname__}: {_text(exc, '<unprintable>')}"


def _text(value: Any, default: str) -> str:
    try:
        return str(value or "") or default
    except Exception:  # user exceptions may break __str__; the message must still settle
        return default
