"""What the test stub records (published messages, settled deliveries, what waits), and what it re-raises."""
from __future__ import annotations

__all__ = ["SentMessage", "Settled", "Pending", "ArchivedCopy", "fails_fast"]

from typing import Any, Callable, Mapping, NamedTuple

from ..core import wire
from ..core.codec import JSON, decode
from ..core.decision import Outcome
from ..core.handlers import Handler
from ..errors import Archive, InvalidPayload, Retry


def _payload(body: bytes, properties: Mapping[str, Any]) -> Any:
    return decode(body, properties.get("content_type"), properties.get("content_encoding"), frozenset({JSON}))


class SentMessage(NamedTuple):
    """A message published to the stub: by ``stub.publish`` or by an ``Events.publish`` it stands in for."""

    exchange: str
    routing_key: str
    body: bytes
    properties: Mapping[str, Any]
    queues: tuple[str, ...]  #: the handler queues it was routed to (none: unroutable)
    delay_ms: float = 0  #: how long it waits before it is delivered (``publish(..., delay=...)``)

    @property
    def headers(self) -> Mapping[str, Any]:
        """The message's application headers."""
        return self.properties.get("application_headers") or {}

    @property
    def message_id(self) -> Any:
        """The ``message_id`` property."""
        return self.properties.get("message_id")

    @property
    def payload(self) -> Any:
        """The body decoded as JSON (DecodeError if it is not)."""
        return _payload(self.body, self.properties)


class Settled(NamedTuple):
    """How one delivery to one handler queue was settled: what the worker would have done with it."""

    action: str  #: ack, retry, requeue, archive or held
    queue: str
    routing_key: str  #: the event's own routing key
    attempt: int  #: 1-based
    handler: Callable[..., Any]
    reason: str  #: why it was retried, archived or held ('' for an ack)
    delay_ms: float  #: retry and requeue: how long the ladder holds the copy (whole units)
    headers: Mapping[str, Any]  #: the copy's headers (retry, requeue, archive), else the delivery's
    body: bytes
    properties: Mapping[str, Any]  #: the copy's properties (retry, requeue, archive), else the delivery's
    outcome: Outcome  #: how the attempt ended
    at: float  #: the virtual time it was settled, in seconds

    @property
    def message_id(self) -> Any:
        """The publisher's ``message_id`` property."""
        return self.properties.get("message_id")

    @property
    def payload(self) -> Any:
        """The body decoded as JSON (DecodeError if it is not)."""
        return _payload(self.body, self.properties)


class Pending(NamedTuple):
    """A message waiting in a handler queue: due at virtual time ``due`` (seconds)."""

    due: float
    queue: str
    routing_key: str  #: the event's own routing key
    body: bytes
    properties: Mapping[str, Any]


class ArchivedCopy(NamedTuple):
    """A copy in a service's archive stream, under its archive key (what replay and purge act on)."""

    key: str
    offset: int  #: its place in the archive stream
    routing_key: str  #: the event's own routing key
    body: bytes
    properties: Mapping[str, Any]  #: as archived (``kombu-events-reason``, ... in its headers)
    at: float  #: the virtual time it was archived, in seconds

    @property
    def headers(self) -> Mapping[str, Any]:
        """The archived copy's application headers."""
        return self.properties.get("application_headers") or {}

    @property
    def queue(self) -> str:
        """The handler queue it was archived from."""
        return str(self.headers.get(wire.QUEUE, ""))

    @property
    def reason(self) -> str:
        """Why it was archived."""
        return str(self.headers.get(wire.REASON, ""))

    @property
    def message_id(self) -> Any:
        """The publisher's ``message_id`` property (not unique: the archive key is)."""
        return self.properties.get("message_id")

    @property
    def payload(self) -> Any:
        """The body decoded as JSON (DecodeError if it is not)."""
        return _payload(self.body, self.properties)


def fails_fast(exc: BaseException, handler: Handler) -> bool:
    """Whether ``join(fail_fast=True)`` re-raises ``exc`` from ``handler``: an exception nobody declared.

    ``Retry``, ``Archive`` (and ``Poisoned``, from ``poisonous()``) and the handler's
    ``dont_retry`` classes are a handler's deliberate answers: they are settled, not raised;
    so is ``InvalidPayload``, a payload that does not fit the handler's contract (archived).
    """
    if isinstance(exc, (Retry, Archive, InvalidPayload)):
        return False
    return not (handler.dont_retry and isinstance(exc, handler.dont_retry))
