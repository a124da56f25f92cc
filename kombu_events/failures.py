"""What a handler raises to steer its message: ``Retry``, ``Archive``, ``poisonous()``."""
from __future__ import annotations

__all__ = ["Retry", "Archive", "Poisoned", "poisonous", "seconds_to_ms"]

from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from typing import Iterator


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
