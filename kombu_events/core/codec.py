"""Decoding of message bodies by content type, with an accept list (pickle only if asked) and a closed
list of text encodings."""
from __future__ import annotations

__all__ = ["accept_set", "decode", "decompress", "text_encoding", "BINARY", "ENCODINGS", "JSON", "MAX_BODY_BYTES"]

import bz2
import json
import lzma
import sys
import zlib
from typing import Any, Callable, Iterable

from kombu import compression as kombu_compression
from kombu.exceptions import ContentDisallowed
from kombu.serialization import loads, prepare_accept_content

from ..errors import ConfigurationError, DecodeError

JSON = "application/json"
#: kombu's ``content_encoding`` for a body that is not text: it is never decoded.
BINARY = "binary"

#: The ``content_encoding`` labels a body may carry (compared lower-cased, ``_`` read as ``-``) and the
#: codec each names. Nothing else is decoded: Python's other codecs include punycode (time quadratic
#: in the body), zlib and bz2 (no bound on what they inflate to), rot13, base64, uu...
ENCODINGS = {
    **dict.fromkeys(("utf-8", "utf8"), "utf-8"),
    **dict.fromkeys(("utf-16", "utf16"), "utf-16"),
    **dict.fromkeys(("utf-16-be", "utf-16be"), "utf-16-be"),
    **dict.fromkeys(("utf-16-le", "utf-16le"), "utf-16-le"),
    **dict.fromkeys(("utf-32", "utf32"), "utf-32"),
    **dict.fromkeys(("utf-32-be", "utf-32be"), "utf-32-be"),
    **dict.fromkeys(("utf-32-le", "utf-32le"), "utf-32-le"),
    **dict.fromkeys(("latin-1", "latin1", "iso-8859-1", "iso8859-1"), "latin-1"),
    **dict.fromkeys(("ascii", "us-ascii"), "ascii"),
    **dict.fromkeys((BINARY, "ascii-8bit"), BINARY),  # Ruby's name for raw bytes, which kombu skips too
}
_NAMES = "utf-8, utf-16, utf-32 (each also -be or -le), latin-1 (iso-8859-1), ascii and binary"

#: Default of the ``max_body_bytes`` setting: 16 MiB, RabbitMQ 4's default ``max_message_size``.
MAX_BODY_BYTES = 16 * 1024 * 1024


def accept_set(accept: Iterable[str]) -> frozenset[str]:
    """Content types from names or MIME types (``json`` or ``application/json``), as Celery's."""
    try:
        return frozenset(prepare_accept_content(list(accept)))
    except Exception as exc:  # kombu raises a bare KeyError-like SerializerNotInstalled
        raise ConfigurationError(f"accept_content={list(accept)!r}: {exc}") from exc


def text_encoding(content_encoding: Any) -> str | None:
    """The codec a ``content_encoding`` label names, as :data:`ENCODINGS` maps it (``binary``: no decoding);
    None when there is no label (unset or empty).

    Raises DecodeError, naming the label (escaped), for any other value.
    """
    if content_encoding is None or content_encoding == "":
        return None
    codec = ENCODINGS.get(content_encoding.lower().replace("_", "-")) \
        if isinstance(content_encoding, str) and content_encoding.isascii() else None
    if codec is None:
        # repr() shows every control character escaped; an AMQP label is at most 255 bytes long.
        raise DecodeError(f"content encoding {content_encoding!r} is not accepted: only {_NAMES} are")
    return codec


def decode(body: bytes, content_type: str | None, content_encoding: str | None, accept: frozenset[str]) -> Any:
    """Decoded payload; a message without a content type is tried as JSON.

    Raises DecodeError when the text encoding or the type is not accepted or the body
    does not parse -- and nothing else, whatever the body (a JSON document nested too
    deep for the parser is undecodable too).
    """
    codec = text_encoding(content_encoding)
    if isinstance(body, str):  # a channel with auto_decode on: back to the bytes that were sent
        body = _bytes(body, codec)
    # MIME types are case-insensitive and may carry parameters ("application/json; charset=utf-8").
    content_type = (content_type if isinstance(content_type, str) else "") or JSON
    content_type = content_type.split(";", 1)[0].strip().lower() or JSON
    if content_type == JSON and JSON in accept:
        try:
            # Decode by the label first: json.loads(bytes) would guess UTF-16/32 on its own and
            # take a body labelled utf-8 that is not. "binary" (kombu's word for raw) means no label.
            if codec is not None and codec != BINARY:
                return json.loads(body.decode(codec))
            return json.loads(body)
        except Exception as exc:  # ValueError, UnicodeError, RecursionError, ...
            raise DecodeError(f"body is not valid JSON in {content_encoding or 'utf-8'}: "
                              f"{type(exc).__name__}: {exc}") from exc
    if content_type not in accept:
        raise DecodeError(
            f"content type {content_type!r} is not accepted (accept_content: {', '.join(sorted(accept))})"
        )
    try:
        return loads(body, content_type, codec or "utf-8", accept=accept)
    except ContentDisallowed as exc:
        raise DecodeError(str(exc)) from exc
    except Exception as exc:
        raise DecodeError(f"body does not decode as {content_type}: {type(exc).__name__}: {exc}") from exc


def _bytes(body: str, codec: str | None) -> bytes:
    try:
        return body.encode("utf-8" if codec is None or codec == BINARY else codec)
    except Exception as exc:  # UnicodeEncodeError
        raise DecodeError(f"body arrived as text that does not encode as {codec or 'utf-8'}: {exc}") from exc


def decompress(body: bytes, compression: Any, *, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """``body`` inflated as its ``compression`` header says (kombu's names); DecodeError otherwise.

    Inflated a piece at a time and stopped past ``max_bytes`` (the ``max_body_bytes``
    setting): a small bomb never grows into gigabytes. A method known to kombu that
    cannot be inflated a piece at a time (brotli, or one an application registered)
    is refused: its size could only be measured once it had all been inflated.
    """
    try:
        decoder = kombu_compression.get_decoder(compression)
    except Exception as exc:  # unknown method (KeyError), not a name (TypeError: unhashable)
        raise DecodeError(f"body does not decompress as {compression!r}: {type(exc).__name__}: {exc}") from exc
    stream = _streams().get(decoder)
    if stream is None:
        raise DecodeError(f"compression {compression!r} cannot be inflated within a bound (max_body_bytes="
                          f"{max_bytes}): only zlib/gzip, bzip2, lzma/xz and zstd bodies are accepted")
    try:
        inflated = _inflate(stream, body, max_bytes + 1) if body else bytes(decoder(body))
    except Exception as exc:  # not compressed data (zlib.error, OSError, LZMAError), a truncated stream
        raise DecodeError(f"body does not decompress as {compression!r}: {type(exc).__name__}: {exc}") from exc
    if len(inflated) > max_bytes:
        raise DecodeError(f"body of {len(body)} bytes inflates beyond max_body_bytes={max_bytes} "
                          f"(compression {compression!r})")
    return inflated


def _streams() -> dict[Any, Callable[[], Any]]:
    """kombu's decoder functions, each with the stream decompressor that does the same work a piece at a time."""
    table: dict[Any, Callable[[], Any]] = {
        zlib.decompress: zlib.decompressobj, bz2.decompress: bz2.BZ2Decompressor,
        lzma.decompress: lzma.LZMADecompressor}
    zstd = sys.modules.get("compression.zstd") or sys.modules.get("backports.zstd")  # kombu imported it, if any
    if zstd is not None:
        table[zstd.decompress] = zstd.ZstdDecompressor
    return table


def _inflate(stream: Callable[[], Any], body: bytes, limit: int) -> bytes:
    """``body`` inflated, but never more than ``limit`` bytes of it (then the caller refuses it).

    Like the one-shot functions it stands for, it reads concatenated streams one after the
    other (bzip2, lzma) and ignores what follows the last one that decodes.
    """
    out = bytearray()
    data = body
    while data:
        decompressor = stream()
        try:
            out += decompressor.decompress(data, limit - len(out))
        except Exception:
            if out:
                break  # trailing bytes that are not another stream: ignored, as bz2/lzma.decompress do
            raise
        if len(out) >= limit:
            break  # stopped at the bound: more would follow
        if not decompressor.eof:
            raise EOFError("compressed data ended before the end-of-stream marker was reached")
        data = decompressor.unused_data if stream is not zlib.decompressobj else b""
    return bytes(out)
