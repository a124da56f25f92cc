"""What the console's pages show, computed from what was read: the overview's rows and one event's
sections (body as pretty JSON, text or hex; the failure's record). Pure: no broker, no web framework.
"""
from __future__ import annotations

__all__ = ["OverviewRow", "overview_rows", "EventView", "event_view", "body_view", "retention"]

import json
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from ..core import wire
from ..core.config import Settings


class _Counts(Protocol):
    queue: str
    role: str
    ready: int | None
    unacked: int | None
    consumers: int | None
    exists: bool
    state: str | None


@dataclass(frozen=True)
class OverviewRow:
    """One queue on the overview, with what should stand out (``alert``: empty when nothing)."""

    queue: str
    role: str
    ready: int | None
    unacked: int | None
    consumers: int | None
    state: str
    bound: str
    alert: str


def _size(n_bytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= size:
            return f"{n_bytes / size:g} {unit}"
    return f"{n_bytes} bytes"


def retention(settings: Settings) -> str:
    """How long the archive stream keeps a record, by age and by size (whole segments go, the oldest first)."""
    parts = []
    if settings.archive_ttl_ms:
        parts.append(f"{settings.archive_ttl_ms / 3_600_000:g} h (archive_ttl_ms)")
    if settings.archive_max_bytes:
        parts.append(f"{_size(settings.archive_max_bytes)} in all (archive_max_bytes)")
    return "kept at most " + " and ".join(parts) if parts else "kept for ever (no retention set)"


def _alert(row: _Counts) -> str:
    if not row.exists:
        return "missing: declare the topology (kombu-events declare)"
    if row.role == "handler" and not row.consumers:
        return "no consumer: no worker runs, or its circuit is open (the queue is paused)"
    return ""


def overview_rows(statuses: Iterable[_Counts], settings: Settings) -> list[OverviewRow]:
    """Handler queues, the archive (its copies still archived, and its retention) and the delay ladder (in
    that order), each with its alert."""
    order = {"handler": 0, "schedule": 0, "archive": 1, "delay": 2}
    rows = []
    for s in sorted(statuses, key=lambda s: order.get(s.role, 3)):
        state = s.state or ("missing" if not s.exists else "")
        rows.append(OverviewRow(s.queue, s.role, s.ready, s.unacked, s.consumers, state,
                                retention(settings) if s.role == "archive" else "", _alert(s)))
    return rows


def body_view(body: bytes, content_type: str | None) -> tuple[str, str]:
    """(kind, text) of a body: ``json`` pretty-printed, ``text`` as it is, else ``hex`` (16 bytes a line)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return "hex", "\n".join(body[i:i + 16].hex(" ") for i in range(0, min(len(body), 4096), 16))
    if (content_type or "").endswith("json") or text.lstrip()[:1] in ("{", "["):
        try:
            return "json", json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except ValueError:
            pass
    return "text", text


class _Message(Protocol):
    id: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    body: bytes
    attempts: Any
    reason: str
    archived_at: str
    exception: str
    traceback: str


@dataclass(frozen=True)
class EventView:
    """One archived message, sectioned for its page."""

    body_kind: str
    body: str
    properties: list[tuple[str, str]]
    headers: list[tuple[str, str]]
    failure: list[tuple[str, str]]
    deaths: list[dict[str, str]]


def _shown(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else json.dumps(value, default=str)


def event_view(message: _Message) -> EventView:
    """The sections of ``message``'s page: body, properties, headers, the failure's record, broker deaths."""
    kind, text = body_view(message.body, message.properties.get("content_type"))
    properties = [(k, _shown(v)) for k, v in sorted(message.properties.items()) if k != "application_headers"]
    headers = [(k, _shown(v)) for k, v in sorted(message.headers.items()) if k not in ("x-death", wire.TRACEBACK)]
    failure = [("attempts", _shown(message.attempts)),
               ("first failure at", _shown(message.headers.get(wire.FIRST_FAILURE_AT, ""))),
               ("last error", _shown(message.headers.get(wire.LAST_ERROR, ""))),
               ("archived at", message.archived_at), ("reason", message.reason), ("exception", message.exception)]
    raw = message.headers.get("x-death")
    deaths = [{str(k): _shown(v) for k, v in d.items()} for d in raw if isinstance(d, dict)] \
        if isinstance(raw, list) else []
    return EventView(kind, text, properties, headers, failure, deaths)
