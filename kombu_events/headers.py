"""The header wire format: attempt counters and failure details, in the library's own headers.

``x-`` headers belong to the broker (``x-death`` is set only by dead-lettering), so
counters live under ``kombu-events-``; rejects the broker dead-lettered are read
from ``x-death`` and folded into our counter at the next republish.
"""
from __future__ import annotations

__all__ = [
    "ATTEMPTS", "ROUTING_KEY", "QUEUE", "FIRST_FAILURE_AT", "LAST_ERROR",
    "REASON", "EXCEPTION", "TRACEBACK", "ARCHIVED_AT",
    "REDELIVERIES", "EXPIRATION", "attempt_of", "redeliveries_of", "original_routing_key", "retry_headers",
    "requeue_headers", "archive_headers", "replay_headers",
]

from datetime import datetime, timezone
from typing import Any, Mapping

PREFIX = "kombu-events-"
ATTEMPTS = PREFIX + "attempts"  # failed attempts before this delivery
ROUTING_KEY = PREFIX + "routing-key"  # the event's own routing key, kept through the ladder
QUEUE = PREFIX + "queue"  # the queue the message failed in
FIRST_FAILURE_AT = PREFIX + "first-failure-at"
LAST_ERROR = PREFIX + "last-error"
REASON = PREFIX + "reason"
EXCEPTION = PREFIX + "exception"
TRACEBACK = PREFIX + "traceback"
ARCHIVED_AT = PREFIX + "archived-at"
REDELIVERIES = PREFIX + "redeliveries"  # broker redeliveries, counted apart from attempts
EXPIRATION = PREFIX + "expiration"  # the publisher's expiration property, dropped on republish

_FAILURE_HEADERS = (ATTEMPTS, QUEUE, FIRST_FAILURE_AT, LAST_ERROR, REASON, EXCEPTION, TRACEBACK, ARCHIVED_AT,
                    REDELIVERIES)
_ERROR_LIMIT = 500


def _is_dead_letter_header(name: str) -> bool:
    return name == "x-death" or name.startswith(("x-first-death-", "x-last-death-"))


def rejected_count(headers: Mapping[str, Any], queue: str) -> int:
    """How often the broker dead-lettered this message out of ``queue`` on reject."""
    total = 0
    for death in headers.get("x-death") or ():
        if isinstance(death, Mapping) and death.get("queue") == queue and death.get("reason") == "rejected":
            total += int(death.get("count") or 1)
    return total


def attempt_of(headers: Mapping[str, Any] | None, queue: str) -> int:
    """1-based number of the attempt this delivery is."""
    if not headers:
        return 1
    try:
        previous = max(0, int(headers.get(ATTEMPTS) or 0))  # any publisher may set it: never below 0
    except (TypeError, ValueError, OverflowError):
        previous = 0
    return previous + rejected_count(headers, queue) + 1


def redeliveries_of(headers: Mapping[str, Any] | None) -> int:
    """Broker redeliveries this message went through before this delivery."""
    try:
        return max(0, int((headers or {}).get(REDELIVERIES) or 0))
    except (TypeError, ValueError, OverflowError):
        return 0


def original_routing_key(headers: Mapping[str, Any] | None, routing_key: str, queue: str) -> str:
    """The event's own routing key, whether it came straight from publishers or back from the ladder."""
    if not headers:
        return routing_key
    if ROUTING_KEY in headers:
        return str(headers[ROUTING_KEY])
    for death in headers.get("x-death") or ():
        if isinstance(death, Mapping) and death.get("queue") == queue and death.get("routing-keys"):
            return str(death["routing-keys"][0])
    return routing_key


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _kept(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (headers or {}).items() if not _is_dead_letter_header(k)}


def retry_headers(
    headers: Mapping[str, Any] | None, *, attempt: int, routing_key: str, error: str
) -> dict[str, Any]:
    """Headers for the republish after failed attempt ``attempt``; user headers kept."""
    new = _kept(headers)
    new[ATTEMPTS] = attempt
    new[ROUTING_KEY] = routing_key
    new.setdefault(FIRST_FAILURE_AT, _now())
    new[LAST_ERROR] = error[:_ERROR_LIMIT]
    return new


def requeue_headers(
    headers: Mapping[str, Any] | None, *, attempt: int, redeliveries: int, routing_key: str
) -> dict[str, Any]:
    """Headers for sending a redelivered message back: attempts unchanged, one more redelivery."""
    new = _kept(headers)
    new[ATTEMPTS] = attempt - 1  # folds in rejects counted from x-death, which is dropped
    new[REDELIVERIES] = redeliveries
    new[ROUTING_KEY] = routing_key
    return new


def archive_headers(
    headers: Mapping[str, Any] | None,
    *,
    attempt: int,
    queue: str,
    routing_key: str,
    reason: str,
    exception: str,
    traceback: str,
) -> dict[str, Any]:
    """Headers of an archived message: why, where from, after how many attempts."""
    new = _kept(headers)
    new.update({
        ATTEMPTS: attempt,
        QUEUE: queue,
        ROUTING_KEY: routing_key,
        REASON: reason[:_ERROR_LIMIT],
        EXCEPTION: exception[:_ERROR_LIMIT],
        TRACEBACK: traceback,
        ARCHIVED_AT: _now(),
    })
    new.setdefault(FIRST_FAILURE_AT, new[ARCHIVED_AT])
    return new


def replay_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    """Headers for a replayed message: failure details dropped, attempt counter reset.

    The original routing key stays, so the handler still sees the event's own name.
    """
    return {k: v for k, v in _kept(headers).items() if k not in _FAILURE_HEADERS}
