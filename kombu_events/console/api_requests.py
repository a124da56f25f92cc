"""What the console's JSON API accepts: a request body read and checked field by field before anything is
read or changed, and a 400 that names the bad field, its value and what would be valid. Pure.

``POST /api/replay`` and ``POST /api/purge`` take a JSON object (``Content-Type: application/json``)
with the fields of :data:`REPLAY_FIELDS` and :data:`PURGE_FIELDS`; ``null`` is the same as leaving a
field out. An unknown field is refused too: ``"dryrun": true`` must not replay for real, and ``"ids"``
(message ids, which several archived copies may share) is refused with what to send instead (``"keys"``).
"""
from __future__ import annotations

__all__ = ["BadRequest", "REPLAY_FIELDS", "PURGE_FIELDS", "checked_body", "whole_number"]

import json
from typing import Any, Callable, Mapping

from ..errors import KombuEventsError


class BadRequest(KombuEventsError, ValueError):
    """A request the API cannot read: answered 400 with this message."""


def _kind(value: Any) -> str:
    return "null" if value is None else {bool: "a boolean", int: "a number", float: "a number", str: "a string",
                                         list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return f"{_kind(value)}, {text[:60]}{'...' if len(text) > 60 else ''}"


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise BadRequest(f'"{name}" must be a string, got {_shown(value)}')
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f'"{name}" must be true or false, got {_shown(value)}')
    return value


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f'"{name}" must be a whole number, 0 or more, got {_shown(value)}')
    return int(value)


def _keys(name: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(i, str) for i in value):
        raise BadRequest(f'"{name}" must be a list of archive keys (strings), got {_shown(value)}')
    return value


Check = Callable[[str, Any], Any]
_COMMON: dict[str, Check] = {"q": _text, "keys": _keys, "limit": _count, "dry_run": _flag, "before": _text}
#: Fields of an earlier version, refused with what to send instead.
_RETIRED = {"ids": '"ids" (message ids) is not taken: several archived copies may share a message id. Send '
                   '"keys", the archive keys of the copies (GET /api/archive lists them), or search the id with "q"'}
#: The fields of ``POST /api/replay``, each with its check.
REPLAY_FIELDS: Mapping[str, Check] = {**_COMMON, "to_queue": _text}
#: The fields of ``POST /api/purge``, each with its check.
PURGE_FIELDS: Mapping[str, Check] = {**_COMMON, "yes": _flag}


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def checked_body(raw: bytes, content_type: str | None, fields: Mapping[str, Check]) -> dict[str, Any]:
    """The JSON object in ``raw``, each field checked by ``fields``; the fields given (not null) only.

    Raises :class:`BadRequest` for another content type, a body that is not a JSON object in UTF-8,
    an unknown field, or a field of the wrong type.
    """
    if not _is_json(content_type):
        raise BadRequest(f"send the request body as JSON, with Content-Type: application/json "
                         f"(got {content_type or 'no Content-Type'!r})")
    try:
        document = json.loads(raw.decode("utf-8") or "{}")
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the request body is not JSON in UTF-8: {exc}") from exc
    if not isinstance(document, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_shown(document)}")
    unknown = sorted(set(document) - set(fields))
    retired = [_RETIRED[name] for name in unknown if name in _RETIRED]
    if retired:
        raise BadRequest(retired[0])
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(map(repr, unknown))}; the fields are: "
                         f"{', '.join(sorted(fields))}")
    return {name: fields[name](name, value) for name, value in document.items() if value is not None}


def whole_number(name: str, text: str | None, default: int, *, at_most: int | None = None) -> int:
    """A query parameter that must be a whole number, 0 or more, at most ``at_most`` (``default`` when absent)."""
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()):
        raise BadRequest(f"{name} must be a whole number, 0 or more, got {text!r}")
    if at_most is not None and int(text) > at_most:
        raise BadRequest(f"{name} must be at most {at_most:,} (the API's pages are bounded), got {text}")
    return int(text)
