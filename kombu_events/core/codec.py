"""Decoding of message bodies by content type, with an accept list (pickle only if asked)."""
from __future__ import annotations

__all__ = ["accept_set", "decode", "decompress", "JSON"]

import json
from typing import Any, Iterable

from kombu import compression as kombu_compression
from kombu.exceptions import ContentDisallowed
from kombu.serialization import loads, prepare_accept_content

from ..errors import ConfigurationError, DecodeError

JSON = "application/json"


def accept_set(accept: Iterable[str]) -> frozenset[str]:
    """Content types from names or MIME types (``json`` or ``application/json``), as Celery's."""
    try:
        return frozenset(prepare_accept_content(list(accept)))
    except Exception as exc:  # kombu raises a bare KeyError-like SerializerNotInstalled
        raise ConfigurationError(f"accept_content={list(accept)!r}: {exc}") from exc


def decode(body: bytes, content_type: str | None, content_encoding: str | None, accept: frozenset[str]) -> Any:
    """Decoded payload; a message without a content type is tried as JSON.

    Raises DecodeError when the type is not accepted or the body does not parse --
    and nothing else, whatever the body (a JSON document nested too deep for the
    parser is undecodable too).
    """
    if isinstance(body, str):  # a channel with auto_decode on: back to the bytes that were sent
        body = _bytes(body, content_encoding)
    # MIME types are case-insensitive and may carry parameters ("application/json; charset=utf-8").
    content_type = (content_type if isinstance(content_type, str) else "") or JSON
    content_type = content_type.split(";", 1)[0].strip().lower() or JSON
    if content_type == JSON and JSON in accept:
        try:
            # Decode by the label first: json.loads(bytes) would guess UTF-16/32 on its own and
            # take a body labelled utf-8 that is not. "binary" (kombu's word for raw) means no label.
            if content_encoding and content_encoding.lower() != "binary":
                return json.loads(body.decode(content_encoding))
            return json.loads(body)
        except Exception as exc:  # ValueError, UnicodeError, LookupError, RecursionError, ...
            raise DecodeError(f"body is not valid JSON in {content_encoding or 'utf-8'}: "
                              f"{type(exc).__name__}: {exc}") from exc
    if content_type not in accept:
        raise DecodeError(
            f"content type {content_type!r} is not accepted (accept_content: {', '.join(sorted(accept))})"
        )
    try:
        return loads(body, content_type, content_encoding or "utf-8", accept=accept)
    except ContentDisallowed as exc:
        raise DecodeError(str(exc)) from exc
    except Exception as exc:
        raise DecodeError(f"body does not decode as {content_type}: {type(exc).__name__}: {exc}") from exc


def _bytes(body: str, content_encoding: str | None) -> bytes:
    try:
        return body.encode(content_encoding or "utf-8")
    except Exception as exc:  # LookupError, UnicodeEncodeError
        raise DecodeError(f"body arrived as text that does not encode as {content_encoding!r}: {exc}") from exc


def decompress(body: bytes, compression: Any) -> bytes:
    """``body`` inflated as its ``compression`` header says (kombu's names); DecodeError otherwise."""
    try:
        return bytes(kombu_compression.decompress(body, compression))
    except Exception as exc:  # unknown method (KeyError), not compressed data (zlib.error), not a name
        raise DecodeError(f"body does not decompress as {compression!r}: {type(exc).__name__}: {exc}") from exc
