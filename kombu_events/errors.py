"""The exceptions: what a handler raises to steer its message (``Retry``, ``Archive``, ``poisonous()``),
and what kombu-events raises (one root, one subclass per kind of failure)."""
from __future__ import annotations

__all__ = [
    "Retry",
    "Archive",
    "Poisoned",
    "poisonous",
    "BatchFailed",
    "seconds_to_ms",
    "KombuEventsError",
    "ConfigurationError",
    "PartitionsChangedError",
    "PluginMissingError",
    "DelayTooLongError",
    "TopologyConflictError",
    "TopologyMissingError",
    "PublishError",
    "UnroutableError",
    "ConfirmTimeoutError",
    "BrokerUnavailableError",
    "BrokerTooOldError",
    "BacklogError",
    "BacklogFullError",
    "DecodeError",
    "HeaderError",
    "EncodeError",
    "InvalidPayload",
]

from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from typing import Iterator, Mapping


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


class PluginMissingError(KombuEventsError):
    """The topology needs a RabbitMQ plugin the broker has not enabled (an ordered handler's consistent-hash
    exchange); the message names it and the command that enables it."""


class PartitionsChangedError(KombuEventsError):
    """An ordered handler's partitions on the broker are not the app's (its ``partitions=`` changed, or a
    change was left unfinished): nothing was declared; the message says to run ``kombu-events migrate
    --partitions``."""


class TopologyMissingError(KombuEventsError):
    """A worker that does not declare (``declare=False``) found its topology missing or different on the
    broker; the message names what and the command that creates it."""


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


class BrokerTooOldError(KombuEventsError):
    """A feature the service uses needs a newer RabbitMQ than the broker runs; the message names the feature,
    the version it needs, the broker (its URL's password masked) and the version it runs."""


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


class InvalidPayload(KombuEventsError, ValueError):
    """A payload does not fit its contract (a handler's annotation, a declared publication).

    ``contract`` names the type; ``errors`` lists each problem as (field path, message,
    the offending input's repr, cut short). ``str()`` says all of it on one line.
    """

    def __init__(self, contract: str, errors: list[tuple[str, str, str]], more: int = 0) -> None:
        listed = "; ".join(f"{path}: {message} (input: {given})" for path, message, given in errors)
        count = len(errors) + more
        tail = f"; and {more} more" if more else ""
        super().__init__(f"payload does not fit {contract}: {count} error{'s' if count != 1 else ''}: "
                         f"{listed}{tail}")
        self.contract = contract
        self.errors = errors
        self.more = more

    def __reduce__(self) -> tuple[type[InvalidPayload], tuple[str, list[tuple[str, str, str]], int]]:
        return type(self), (self.contract, self.errors, self.more)


# What a handler raises to steer its message.

class Retry(Exception):
    """Retry this message after ``delay`` seconds, or at the wall-clock time ``at`` (default: the handler's backoff).

    Still counts as an attempt: a message is never retried past ``max_retries``. ``at``
    is a ``datetime`` (a naive one is local time); a time already past retries at once.
    A delay beyond the ladder's reach archives the message, naming the delay.
    """

    def __init__(self, delay: float | None = None, reason: str = "", *, at: datetime | None = None) -> None:
        if at is not None:
            if delay is not None:
                raise ValueError("Retry takes delay= or at=, not both")
            delay = _seconds_until(at)
        if delay is not None and not _seconds(delay):
            raise ValueError(f"Retry(delay=...) takes seconds >= 0 or None, got {delay!r}")
        default = f"retry at {at.isoformat()}" if at is not None else \
            f"retry in {delay:g} s" if delay is not None else "retry"
        super().__init__(reason or default)
        self.delay = delay
        self.at = at
        self.reason = reason

    @property
    def delay_ms(self) -> float | None:
        """``delay`` in milliseconds, converted as the decimal it was written as (None: the backoff's).

        ``16.1 * 1000`` is ``16100.000000000002`` in floats, and the ladder rounds up: a
        whole unit more than asked. ``repr`` of a float is the shortest decimal that reads
        back as the same float, so ``16.1`` becomes exactly ``16100.0``.
        """
        if self.delay is None:
            return None
        return seconds_to_ms(self.delay)


def seconds_to_ms(seconds: float) -> float:
    """``seconds`` in milliseconds, converted as the decimal it was written as (``16.1`` is ``16100.0``)."""
    return float(Decimal(repr(float(seconds))) * 1000)


def _seconds_until(at: object) -> float:
    if not isinstance(at, datetime):
        raise ValueError(f"Retry(at=...) takes a datetime, got {at!r}")
    now = datetime.now(at.tzinfo) if at.tzinfo is not None else datetime.now()
    return max(0.0, (at - now).total_seconds())


def _seconds(delay: object) -> bool:
    """A number of seconds >= 0 that a float can hold (inf included: the ladder refuses it later)."""
    if isinstance(delay, bool) or not isinstance(delay, (int, float)):
        return False
    try:
        return float(delay) >= 0  # also False for NaN
    except OverflowError:
        return False


class Archive(Exception):
    """Give up on this message now: archive it with ``reason``, no more retries."""

    def __init__(self, reason: str = "archived by handler") -> None:
        super().__init__(reason)
        self.reason = reason


class Poisoned(Archive):
    """A ``poisonous()`` section raised: retrying would fail the same way."""


class BatchFailed(Exception):
    """Raised by a batch handler: the events at these indices (of the list it got) failed, the others succeeded.

    ``BatchFailed({3: ValueError("bad sku"), 7: Retry(60)})``: each failed event is settled by
    its own exception, as if a handler of one event had raised it (retried, or archived by
    ``Archive``, ``dont_retry``...). Any other exception from a batch handler fails every event.
    """

    def __init__(self, failures: Mapping[int, BaseException], reason: str = "") -> None:
        for index, failure in failures.items():
            if isinstance(index, bool) or not isinstance(index, int) or not isinstance(failure, BaseException):
                raise TypeError(f"BatchFailed takes {{index: exception}}, got {index!r}: {failure!r}")
        super().__init__(reason or f"{len(failures)} event(s) of the batch failed: indices {sorted(failures)}")
        self.failures = dict(failures)


@contextmanager
def poisonous() -> Iterator[None]:
    """Mark a section whose failure no retry can fix: if it raises, archive at once.

    ``Retry`` and ``Archive`` raised inside pass through unchanged.
    """
    try:
        yield
    except (Retry, Archive):
        raise
    except Exception as exc:
        raise Poisoned(f"poisonous section failed: {type(exc).__name__}: {exc}") from exc
