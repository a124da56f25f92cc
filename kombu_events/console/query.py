"""The console's search and grouping of archived copies, as pure functions over what the index holds.

A search is one line, kept in the URL (``?q=...``) so that it can be bookmarked:
``handler:billing.audit key:orders.*.created exception:ValueError since:2026-11-25T10:00 until:...``,
``group:<id>`` (one group of the failures page), and free words searched in what the index keeps of each
copy (:mod:`.entries`): the first KiB of the body, the exception, the reason, the message id and the
archive key. A search line is at most :data:`MAX_QUERY_CHARS` long, and :func:`search` stops after its
time budget, saying how far it got (partial results). Failures group by handler and exception (the
message normalised: numbers, quoted strings and ids become placeholders, so that "order 17 not found"
and "order 18 not found" are one group), by routing key, or by hour of archiving.
"""
from __future__ import annotations

__all__ = ["Query", "parse", "matches", "normalise", "Group", "group", "GROUPINGS", "group_id", "Found", "search",
           "MAX_QUERY_CHARS", "SEARCH_BUDGET_S", "QueryTooLong"]

import functools
import hashlib
import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterable, Protocol, Sequence, TypeVar

from ..core.topic import matches as topic_matches

#: How the failures page can group: handler + exception, routing key, hour of archiving.
GROUPINGS = ("exception", "key", "hour")
_QUALIFIERS = ("handler", "key", "exception", "since", "until", "group")
#: The longest search line read (a longer one is refused, with this limit named).
MAX_QUERY_CHARS = 1000
#: How long one search of the pages may take before it stops with partial results.
SEARCH_BUDGET_S = 0.5
#: Copies looked at between two looks at the clock.
_CLOCK_EVERY = 256


class QueryTooLong(ValueError):
    """A search line longer than :data:`MAX_QUERY_CHARS` (answered 400)."""


class Archived(Protocol):
    """What the console searches and groups of an archived copy (:class:`.entries.Entry`)."""

    @property
    def key(self) -> str: ...
    @property
    def id(self) -> str: ...
    @property
    def queue(self) -> str: ...
    @property
    def routing_key(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def archived_at(self) -> str: ...
    @property
    def exception(self) -> str: ...
    @property
    def prefix(self) -> bytes: ...
    @property
    def failure(self) -> str: ...


@dataclass(frozen=True)
class Query:
    """A parsed search: every qualifier given (None when absent) and the free words."""

    handler: str | None = None
    key: str | None = None
    exception: str | None = None
    since: str | None = None
    until: str | None = None
    group: str | None = None
    words: tuple[str, ...] = field(default_factory=tuple)

    @property
    def empty(self) -> bool:
        """Nothing asked: every archived message matches."""
        return self == Query()


def parse(text: str) -> Query:
    """The :class:`Query` of a search line; an unknown ``name:`` is searched as a word.

    Raises :class:`QueryTooLong` for a line longer than :data:`MAX_QUERY_CHARS`.
    """
    if len(text) > MAX_QUERY_CHARS:
        raise QueryTooLong(f"the search is {len(text):,} characters long; the console reads at most "
                           f"{MAX_QUERY_CHARS:,}: search with fewer words, or a qualifier (handler:, key:, "
                           "exception:, group:)")
    try:
        tokens = shlex.split(text)
    except ValueError:  # an unbalanced quote: take the words as they are
        tokens = text.split()
    found: dict[str, str] = {}
    words = []
    for token in tokens:
        name, colon, value = token.partition(":")
        if colon and name in _QUALIFIERS and value:
            found[name] = value
        else:
            words.append(token)
    return Query(**found, words=tuple(words))


_PLACEHOLDERS = (
    (re.compile(r"'[^']*'|\"[^\"]*\""), "<str>"),
    (re.compile(r"\b[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}\b", re.I), "<uuid>"),
    (re.compile(r"\b0x[0-9a-f]+\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{6,}\b", re.I), "<hex>"),
    (re.compile(r"\d+(\.\d+)?"), "<n>"),
)


@functools.lru_cache(maxsize=65_536)
def normalise(exception: str) -> str:
    """The exception's text with what varies from event to event replaced (first line, 200 characters)."""
    text = (exception.strip().splitlines() or [""])[0][:200]
    for pattern, placeholder in _PLACEHOLDERS:
        text = pattern.sub(placeholder, text)
    return text


def exception_type(exception: str) -> str:
    """``ValueError`` of ``ValueError: bad``; the reason's first word when there is no exception."""
    return exception.partition(":")[0].strip() or "(no exception)"


def group_key(message: Archived, by: str) -> tuple[str, ...]:
    """The group ``message`` belongs to when grouping ``by`` (one of :data:`GROUPINGS`)."""
    if by == "exception":
        return (message.queue, message.failure)
    if by == "key":
        return (message.routing_key,)
    if by == "hour":
        return (message.archived_at[:13] or "(unknown)",)
    raise ValueError(f"unknown grouping {by!r}; use one of {', '.join(GROUPINGS)}")


@functools.lru_cache(maxsize=65_536)
def group_id(by: str, key: tuple[str, ...]) -> str:
    """A short stable id for the group (``group:<id>`` in a search)."""
    return by[0] + hashlib.sha1("\0".join((by, *key)).encode()).hexdigest()[:11]


def _haystack(message: Archived) -> str:
    return " ".join((message.prefix.decode("utf-8", "replace"), message.exception, message.reason, message.id,
                     message.key)).lower()


def matches(query: Query, message: Archived) -> bool:
    """``message`` is one that ``query`` asks for (free words: case-insensitive, all of them, in the body's
    first bytes, the exception, the reason, the message id or the archive key)."""
    if query.handler is not None and message.queue != query.handler and not message.queue.endswith(
            "." + query.handler):
        return False
    if query.key is not None and not topic_matches(query.key, message.routing_key):
        return False
    if query.exception is not None and query.exception.lower() not in message.exception.lower():
        return False
    if query.since is not None and (not message.archived_at or message.archived_at < query.since):
        return False
    if query.until is not None and (not message.archived_at or message.archived_at >= query.until):
        return False
    if query.group is not None:
        by = {g[0]: g for g in GROUPINGS}.get(query.group[:1], "")
        if not by or group_id(by, group_key(message, by)) != query.group:
            return False
    if query.words:
        haystack = _haystack(message)
        return all(word.lower() in haystack for word in query.words)
    return True


_Copy = TypeVar("_Copy", bound=Archived)


@dataclass(frozen=True)
class Found(Generic[_Copy]):
    """What a search found: ``matched`` (in the order searched) among the first ``searched`` of ``total``
    copies, in ``took_s``; ``partial`` when it stopped at its time budget before the end."""

    matched: list[_Copy]
    searched: int
    total: int
    took_s: float
    partial: bool = False


def search(copies: Sequence[_Copy], query: Query, *, budget_s: float | None = SEARCH_BUDGET_S,
           limit: int | None = None, clock: Callable[[], float] = time.monotonic) -> Found[_Copy]:
    """The ``copies`` that ``query`` asks for, in order: at most ``limit`` of them, looking at copies until
    ``budget_s`` has passed (None: no limit; an action's selection must be whole, a page's need not)."""
    started = clock()
    if limit is not None and limit <= 0:
        return Found([], 0, len(copies), 0.0)
    if query.empty:
        matched: list[_Copy] = list(copies[:limit] if limit is not None else copies)
        return Found(matched, len(matched) if limit is not None else len(copies), len(copies), 0.0)
    matched = []
    searched, partial = 0, False
    for searched, message in enumerate(copies, start=1):
        if matches(query, message):
            matched.append(message)
            if limit is not None and len(matched) >= limit:
                break
        if searched % _CLOCK_EVERY == 0:
            time.sleep(0)  # let the event loop's thread have the GIL: a search never holds up another request
            if budget_s is not None and clock() - started > budget_s:
                partial = searched < len(copies)
                break
    return Found(matched, searched, len(copies), clock() - started, partial)


@dataclass
class Group:
    """Archived copies that failed alike: their count, first and last archiving time, one example."""

    id: str
    by: str
    key: tuple[str, ...]
    count: int
    first: str
    last: str
    example: str  # the exception (or reason) of the first one, as it was

    @property
    def label(self) -> str:
        """The group as shown: ``queue — normalised exception``, the routing key, or the hour."""
        return " — ".join(self.key) if self.by != "hour" else f"{self.key[0]}:00 UTC"


def group(messages: Iterable[Archived], by: str) -> list[Group]:
    """``messages`` grouped ``by`` one of :data:`GROUPINGS`, the largest group first."""
    groups: dict[tuple[str, ...], Group] = {}
    for m in messages:
        key = group_key(m, by)
        found = groups.get(key)
        if found is None:
            groups[key] = Group(group_id(by, key), by, key, 1, m.archived_at, m.archived_at,
                                m.exception or m.reason)
            continue
        found.count += 1
        found.first = min(found.first, m.archived_at)
        found.last = max(found.last, m.archived_at)
    order = (lambda g: g.key) if by == "hour" else (lambda g: (-g.count, g.key))
    return sorted(groups.values(), key=order)
