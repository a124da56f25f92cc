"""The exceptions kombu-events raises: one root, one subclass per kind of failure."""
from __future__ import annotations

__all__ = [
    "KombuEventsError",
    "ConfigurationError",
    "DelayTooLongError",
    "TopologyConflictError",
    "PublishError",
    "UnroutableError",
    "ConfirmTimeoutError",
    "BrokerUnavailableError",
    "BacklogError",
    "BacklogFullError",
    "DecodeError",
    "HeaderError",
    "EncodeError",
]


class KombuEventsError(Exception):
    """Root of every error raised by kombu-events."""


class ConfigurationError(KombuEventsError, ValueError):
    """A setting, a name or a handler option is invalid; the message names it and what is valid."""


class DelayTooLongError(ConfigurationError):
    """A delay needs more levels of the delay ladder than the service has."""


class TopologyConflictError(KombuEventsError):
    """An exchange or queue already exists on the broker with other arguments."""

    def __init__(self, message: str, *, entity: str, argument: str | None = None) -> None:
        super().__init__(message)
        self.entity = entity
        self.argument = argument


class PublishError(KombuEventsError):
    """The broker did not confirm a published message."""


class UnroutableError(PublishError):
    """The broker returned a mandatory message: no queue is bound for its routing key."""

    def __init__(self, message: str, *, exchange: str, routing_key: str) -> None:
        super().__init__(message)
        self.exchange = exchange
        self.routing_key = routing_key


class ConfirmTimeoutError(PublishError):
    """The broker did not confirm in time: the message may or may not have arrived."""


class BrokerUnavailableError(KombuEventsError):
    """The broker could not be reached (the URL in the message has its password masked)."""


class BacklogError(KombuEventsError):
    """The local backlog file could not be read or written (SQLite's error is the cause)."""


class BacklogFullError(BacklogError, BrokerUnavailableError):
    """The broker is unavailable and the local backlog is at its size limit: the event was not kept."""


class DecodeError(KombuEventsError):
    """A message body could not be decoded, or its content type is not accepted."""


class HeaderError(DecodeError):
    """A header (or property) of a delivered message cannot be read; ``header`` names it."""

    def __init__(self, header: str, problem: str) -> None:
        super().__init__(f"header {header!r} {problem}")
        self.header = header


class EncodeError(KombuEventsError, TypeError):
    """A payload could not be serialised for publishing."""
