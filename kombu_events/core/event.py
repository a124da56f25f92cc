"""The ``Event`` a ``bind=True`` handler receives."""
from __future__ import annotations

__all__ = ["Event"]

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    """One delivered event: decoded payload plus what the message said about itself."""

    payload: Any
    routing_key: str
    queue: str
    attempt: int
    headers: dict[str, Any] = field(default_factory=dict)
    properties: dict[str, Any] = field(default_factory=dict)
    body: bytes = b""

    @property
    def message_id(self) -> str | None:
        """The publisher's ``message_id`` property, if it set one."""
        return self.properties.get("message_id")

    @property
    def correlation_id(self) -> str | None:
        """The publisher's ``correlation_id`` property, if it set one."""
        return self.properties.get("correlation_id")

    @property
    def content_type(self) -> str | None:
        """The message's content type (``None`` when the publisher sent none)."""
        return self.properties.get("content_type")

    @property
    def timestamp(self) -> Any:
        """The publisher's ``timestamp`` property, if it set one."""
        return self.properties.get("timestamp")
