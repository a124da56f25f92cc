"""The ``Event`` a ``bind=True`` handler receives."""
from __future__ import annotations

__all__ = ["Event"]

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic

if TYPE_CHECKING:
    from typing_extensions import TypeVar  # a default (PEP 696): a bare ``Event`` is ``Event[Any]``

    from .envelopes import Envelope

    P = TypeVar("P", default=Any)
else:
    from typing import TypeVar

    P = TypeVar("P")


@dataclass(frozen=True)
class Event(Generic[P]):
    """One delivered event: decoded payload plus what the message said about itself.

    Annotate a bound handler's parameter ``Event[Model]`` and ``payload`` is a validated
    ``Model`` (docs/contracts.md). ``envelope`` says what a CloudEvents, MassTransit,
    NServiceBus or Spring envelope carried (kind, type, id, source, time, correlation id);
    None for a bare message.
    """

    payload: P
    routing_key: str
    queue: str
    attempt: int
    headers: dict[str, Any] = field(default_factory=dict)
    properties: dict[str, Any] = field(default_factory=dict)
    body: bytes = b""
    envelope: Envelope | None = None

    @property
    def message_id(self) -> str | None:
        """The publisher's ``message_id`` property, if it set one."""
        return self.properties.get("message_id")

    @property
    def correlation_id(self) -> str | None:
        """The publisher's ``correlation_id`` property, if it set one."""
        return self.properties.get("correlation_id")

    @property
    def user_id(self) -> str | None:
        """The RabbitMQ user that published it (the ``user_id`` property), if the publisher set it.

        RabbitMQ refuses a message whose ``user_id`` is not the user of the connection that
        publishes it (unless that user has the ``impersonator`` tag), so a ``user_id`` here
        is who published. A retry is republished by the worker: its copy carries the worker's
        own user. ``publishers={...}`` on the handler runs it only for the users named.
        """
        return self.properties.get("user_id")

    @property
    def app_id(self) -> str | None:
        """The publisher's ``app_id`` property, if it set one: what the publisher says it is, unchecked."""
        return self.properties.get("app_id")

    @property
    def content_type(self) -> str | None:
        """The message's content type (``None`` when the publisher sent none)."""
        return self.properties.get("content_type")

    @property
    def timestamp(self) -> Any:
        """The publisher's ``timestamp`` property, if it set one."""
        return self.properties.get("timestamp")
