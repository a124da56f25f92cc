"""The console's search and grouping of archived messages, as pure functions over what was read.

A search is one line, kept in the URL (``?q=...``) so that it can be bookmarked:
``handler:billing.audit key:orders.*.created exception:ValueError since:2026-11-25T10:00 until:...``,
``group:<id>`` (one group of the failures page), and free words searched in the body, the
exception and the reason. Failures group by handler and exception (the message normalised:
numbers, quoted strings and ids become placeholders, so that "order 17 not found" and
"order 18 not found" are one group), by routing key, or by hour of archiving.
"""
from __future__ import annotations

__all__ = ["Query", "parse", "matches", "normalise", "Group", "group", "GROUPINGS", "group_id"]

import functools
import hashlib
import re
import shlex
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from ..core.topic import matches as topic_matches

#: How the failures page can group: handler + exception, routing key, hour of archiving.
GROUPINGS = ("exception", "key", "hour")
_QUALIFIERS = ("handler", "key", "exception", "since", "until", "group")


class Archived(Protocol):
    """What the console reads of an archived message (:class:`kombu_events.ops.archive.ArchivedMessage`)."""

    id: str
    queue: str
    routing_key: str
    reason: str
    archived_at: str
    exception: str
    body: bytes


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
    """The :class:`Query` of a search line; an unknown ``name:`` is searched as a word."""
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
        return (message.queue, normalise(message.exception or message.reason))
    if by == "key":
        return (message.routing_key,)
    if by == "hour":
        return (message.archived_at[:13] or "(unknown)",)
    raise ValueError(f"unknown grouping {by!r}; use one of {', '.join(GROUPINGS)}")


@functools.lru_cache(maxsize=65_536)
def group_id(by: str, key: tuple[str, ...]) -> str:
    """A short stable id for the group (``group:<id>`` in a search)."""
    return by[0] + hashlib.sha1("\0".join((by, *key)).encode()).hexdigest()[:11]


def _body_text(message: Archived) -> str:
    return message.body.decode("utf-8", "replace")


def matches(query: Query, message: Archived) -> bool:
    """``message`` is one that ``query`` asks for (free words: case-insensitive, all of them)."""
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
        haystack = " ".join((_body_text(message), message.exception, message.reason, message.id)).lower()
        return all(word.lower() in haystack for word in query.words)
    return True


@dataclass
class Group:
    """Archived messages that failed alike: their count, first and last archiving time, one example."""

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
