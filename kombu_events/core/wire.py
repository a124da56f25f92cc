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
    "requeue_headers", "archive_headers", "replay_headers", "republish_properties", "UNREADABLE_HEADERS",
    "DROPPED_HEADERS", "DELIVERY_COUNT", "ARCHIVE_KEY", "REPLAY_OF", "SETTLEMENT", "PACKED_HEADERS", "ORDER_KEY",
    "new_archive_key", "as_sent", "Undecoded",
]

import uuid
from collections import abc  # isinstance() against abc.Mapping, not typing.Mapping: faster, for every message
from datetime import datetime, timezone
from typing import Any, Mapping

from ..errors import HeaderError

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
UNREADABLE_HEADERS = PREFIX + "unreadable-headers"  # the raw bytes of a header table py-amqp could not decode
DROPPED_HEADERS = PREFIX + "dropped-headers"  # why an archived copy lost the publisher's headers
ARCHIVE_KEY = PREFIX + "archive-key"  # unique per archived copy: what replay and purge act on
REPLAY_OF = PREFIX + "replay-of"  # on a replayed copy: the archive key it was replayed from
SETTLEMENT = PREFIX + "settlement"  # on an archive record that settles archived copies (replayed, purged)
PACKED_HEADERS = PREFIX + "amqp-headers"  # an archived copy's whole header table, packed (a stream drops some)
ORDER_KEY = PREFIX + "key"  # the key an ordered handler (ordered_by="key") orders by; publish(..., key=) sets it

#: The basic properties a republished copy carries over (a decoder may add other keys).
_PROPERTIES = ("content_type", "content_encoding", "delivery_mode", "priority", "correlation_id", "reply_to",
               "message_id", "timestamp", "type", "user_id", "app_id", "cluster_id")

#: Largest attempt or redelivery count read from a header (a signed 32-bit field; max_retries is far lower).
MAX_COUNT = 2**31 - 1

_FAILURE_HEADERS = (ATTEMPTS, QUEUE, FIRST_FAILURE_AT, LAST_ERROR, REASON, EXCEPTION, TRACEBACK, ARCHIVED_AT,
                    REDELIVERIES, ARCHIVE_KEY)
_ERROR_LIMIT = 500


#: Set by a quorum queue on a redelivered message: how often it was delivered before.
DELIVERY_COUNT = "x-delivery-count"


def _is_dead_letter_header(name: object) -> bool:
    """A header the broker sets on the copy it holds: never carried over to a republished copy."""
    return isinstance(name, str) and (name in ("x-death", DELIVERY_COUNT)
                                      or name.startswith(("x-first-death-", "x-last-death-")))


def _count(headers: Mapping[str, Any], name: str) -> int:
    """A non-negative integer counter header (0 when absent); HeaderError for anything else."""
    value: object = headers.get(name)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise HeaderError(name, f"must be an integer within 0 .. {MAX_COUNT}, got {_show(value)}")
    return value


def _deaths(headers: Mapping[str, Any], queue: str) -> list[Mapping[str, Any]]:
    """The broker's ``x-death`` entries for ``queue``; HeaderError if the header is not a list of tables."""
    deaths = headers.get("x-death")
    if deaths is None:
        return []
    if not isinstance(deaths, list):
        raise HeaderError("x-death", f"must be an array of tables, got {_show(deaths)}")
    if not all(isinstance(death, abc.Mapping) for death in deaths):
        raise HeaderError("x-death", "must be an array of tables, found an entry that is not a table")
    return [death for death in deaths if death.get("queue") == queue]


def rejected_count(headers: Mapping[str, Any], queue: str) -> int:
    """How often the broker dead-lettered this message out of ``queue`` on reject."""
    total = 0
    for death in _deaths(headers, queue):
        if death.get("reason") != "rejected":
            continue
        count = death.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_COUNT:
            raise HeaderError("x-death", f"count of queue {queue!r} must be an integer within 0 .. {MAX_COUNT}, "
                                         f"got {_show(count)}")
        total += count
    return total


def attempt_of(headers: Mapping[str, Any] | None, queue: str) -> int:
    """1-based number of the attempt this delivery is; HeaderError if a counter cannot be read."""
    if not headers:
        return 1
    return _count(headers, ATTEMPTS) + rejected_count(headers, queue) + 1


def redeliveries_of(headers: Mapping[str, Any] | None, *, redelivered: bool = False) -> int:
    """Broker redeliveries this message went through before this delivery; HeaderError if unreadable.

    Our own counter holds the redeliveries of earlier copies (each redelivered copy is
    sent back as a new one). A quorum queue also counts its own deliveries of this copy
    in ``x-delivery-count``: on a redelivery that says how many deliveries went before
    this one (a worker killed twice before it read the message makes it 2), where the
    ``redelivered`` flag alone says only "at least one". A value the broker cannot have
    set (not a positive integer) is ignored: the flag counts one.
    """
    earlier = _count(headers, REDELIVERIES) if headers else 0
    if redelivered and headers:
        count = headers.get(DELIVERY_COUNT)
        if isinstance(count, int) and not isinstance(count, bool) and count > 1:
            earlier = min(earlier + count - 1, MAX_COUNT)  # the delivery at hand is counted by the caller
    return earlier


def original_routing_key(headers: Mapping[str, Any] | None, routing_key: str, queue: str) -> str:
    """The event's own routing key, whether it came straight from publishers or back from the ladder."""
    if not headers:
        return routing_key
    if ROUTING_KEY in headers:
        value = headers[ROUTING_KEY]
        if not isinstance(value, str) or len(value.encode("utf-8", "surrogatepass")) > 255:
            raise HeaderError(ROUTING_KEY, f"must be a routing key (a string of at most 255 bytes), got {_show(value)}")
        return value
    for death in _deaths(headers, queue):
        keys = death.get("routing-keys")
        if not keys:
            continue
        if not isinstance(keys, list) or not isinstance(keys[0], str):
            raise HeaderError("x-death", f"routing-keys of queue {queue!r} must be an array of strings, "
                                         f"got {_show(keys)}")
        return keys[0]
    return routing_key


def _show(value: Any, limit: int = 60) -> str:
    """A short description of a header value for an error message (never raises)."""
    try:
        text = repr(value)
    except Exception:  # a value whose repr fails still gets named by its type
        text = "?"
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(value).__name__} {text}"


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
    """Headers of an archived message: why, where from, after how many attempts, and the key of this copy
    (unique: replay and purge act on it)."""
    new = _kept(headers)
    new.pop(SETTLEMENT, None)  # a publisher's own would make readers take the copy for a settlement record
    new.update({
        ARCHIVE_KEY: new_archive_key(),
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


def new_archive_key() -> str:
    """A fresh archive key: 20 hex digits (80 random bits)."""
    return uuid.uuid4().hex[:20]


def replay_headers(headers: Mapping[str, Any] | None, *, archive_key: str | None = None) -> dict[str, Any]:
    """Headers for a replayed message: failure details dropped, attempt counter reset, and the archive key
    of the copy it replays in :data:`REPLAY_OF` (an inbox drops the same copy replayed twice).

    The original routing key stays, so the handler still sees the event's own name.
    """
    new = {k: v for k, v in _kept(headers).items() if k not in _FAILURE_HEADERS and k != SETTLEMENT}
    if archive_key is not None:
        new[REPLAY_OF] = archive_key
    return new


def republish_properties(
    properties: Mapping[str, Any], headers: dict[str, Any], *, userid: str | None
) -> dict[str, Any]:
    """Properties of a republished copy: the publisher's own, with ``headers`` (which this may extend).

    A publisher's ``expiration`` governs the first delivery only: it would cut a ladder
    wait short or drop the copy from the archive, so it moves into a header. A
    ``user_id`` other than ``userid`` (the connection's user) becomes ``userid``: the
    broker refuses any other, and a handler's ``publishers=`` trusts its own service's
    copies (dropped when the user is not known). Strings that arrived as invalid UTF-8 go back as the bytes they were.
    """
    new: dict[str, Any] = {}
    for name in _PROPERTIES:
        value = properties.get(name)
        if value is not None:
            new[name] = as_sent(value)
    if new.get("user_id") not in (None, userid):
        if userid is None:
            del new["user_id"]
        else:
            new["user_id"] = userid
    expiration = properties.get("expiration")
    if expiration is not None:
        headers[EXPIRATION] = as_sent(expiration if isinstance(expiration, str) else str(expiration))
    new["application_headers"] = headers
    return new


class Undecoded(str):
    """Text decoded from bytes that are not UTF-8, with surrogate escapes.

    See :mod:`kombu_events.broker.lenient_amqp`.
    """

    @classmethod
    def of(cls, raw: bytes) -> str:
        """``raw`` as text: a plain str when it is UTF-8 (as py-amqp reads it), else Undecoded."""
        try:
            return raw.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return cls(raw.decode("utf-8", "surrogateescape"))


def as_sent(value: Any) -> Any:
    """``value``, or its original bytes if it is :class:`Undecoded` text.

    Any other str goes back as py-amqp reads and writes it (``surrogatepass``), so
    it too is sent as the bytes that arrived.
    """
    if isinstance(value, Undecoded):
        return value.encode("utf-8", "surrogateescape")
    return value
