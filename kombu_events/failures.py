"""What a handler raises to steer its message: ``Retry``, ``Archive``, ``poisonous()``."""
from __future__ import annotations

__all__ = ["Retry", "Archive", "Poisoned", "poisonous"]

from contextlib import contextmanager
from typing import Iterator


class Retry(Exception):
    """Retry this message after ``delay`` seconds (default: the handler's backoff).

    Still counts as an attempt: a message is never retried past ``max_retries``.
    """

    def __init__(self, delay: float | None = None, reason: str = "") -> None:
        if delay is not None and (isinstance(delay, bool) or not isinstance(delay, (int, float)) or not delay >= 0):
            raise ValueError(f"Retry(delay=...) takes seconds >= 0 or None, got {delay!r}")
        super().__init__(reason or (f"retry in {delay:g} s" if delay is not None else "retry"))
        self.delay = delay
        self.reason = reason


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
