"""How the consumers' channels hand a delivery over: kombu's message with the body as published, and a message
id for a log line, whatever the message."""
from __future__ import annotations

__all__ = ["as_published", "message_id", "prepare"]

from functools import partial
from typing import Any


def prepare(channel: Any) -> Any:
    """Make ``channel`` give handlers the body bytes as published (never a str, never inflated by kombu)."""
    channel.auto_decode = False
    channel.message_to_python = partial(as_published, channel)
    return channel


def as_published(channel: Any, raw: Any) -> Any:
    """kombu's message for ``raw``, without kombu's own decompression: the body stays as published.

    kombu inflates a body whose ``compression`` header it knows, and raises from inside
    its consumer for one it does not; an event keeps its bytes (a retry republishes
    exactly what arrived), and the runner decompresses for the handler.
    """
    headers = raw.properties.get("application_headers")
    if not isinstance(headers, dict) or headers.get("compression") is None:
        return channel.Message(raw, channel=channel)
    items = list(headers.items())
    del headers["compression"]  # hidden from kombu while it builds its message, then put back in place
    try:
        return channel.Message(raw, channel=channel)
    finally:
        headers.clear()
        headers.update(items)


def message_id(message: Any) -> Any:
    """The message id of a message that may be broken in any way, for a log line."""
    try:
        return message.properties.get("message_id")
    except Exception:
        return None
