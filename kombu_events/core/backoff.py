"""Backoff policies: how long to wait before retry number ``n``; pure, never sleep."""
from __future__ import annotations

__all__ = ["Backoff", "Exponential", "Constant"]

import math
import random
from dataclasses import dataclass
from typing import Callable, Protocol

from ..errors import ConfigurationError


class Backoff(Protocol):
    """A backoff policy: ``delay_ms(retry=n)`` for the n-th retry (1-based)."""

    # Read-only, so that frozen dataclasses (and properties) satisfy the protocol under mypy.
    @property
    def max_delay_ms(self) -> float:
        """The longest delay the policy ever returns."""

    def delay_ms(self, *, retry: int, rand: Callable[[], float] = random.random) -> float:
        """Delay before retry ``retry``."""


def _check(name: str, value: float, *, low: float = 0, high: float = math.inf) -> None:
    """Raise unless ``value`` is a finite number within ``low .. high``: NaN and inf would make NaN delays."""
    try:
        valid = (isinstance(value, (int, float)) and not isinstance(value, bool)
                 and math.isfinite(value) and low <= value <= high)
    except OverflowError:  # an int too large for a float
        valid = False
    if not valid:
        bounds = f">= {low:g}" if high == math.inf else f"within {low:g} .. {high:g}"
        raise ConfigurationError(f"backoff {name} must be a finite number {bounds}, got {value!r}")


@dataclass(frozen=True)
class Exponential:
    """``base_ms * factor**(retry-1)``, capped at ``max_delay_ms``, minus up to ``jitter`` of it.

    ``jitter=0.25`` draws each delay uniformly from ``[0.75 d, d]`` so that retries of
    messages which failed together spread out; the cap still holds.
    """

    base_ms: float = 1000
    factor: float = 2
    max_delay_ms: float = 3_600_000
    jitter: float = 0

    def __post_init__(self) -> None:
        _check("base_ms", self.base_ms)
        _check("factor", self.factor, low=1)
        _check("max_delay_ms", self.max_delay_ms)
        _check("jitter", self.jitter, high=1)

    def delay_ms(self, *, retry: int, rand: Callable[[], float] = random.random) -> float:
        """Delay before retry ``retry`` (1-based)."""
        if retry < 1:
            raise ValueError(f"retry numbers start at 1, got {retry!r}")
        try:
            raw = self.base_ms * float(self.factor) ** (retry - 1)
        except OverflowError:
            raw = float("inf") if self.base_ms else 0.0  # 0 * anything is still no delay
        delay = min(raw, self.max_delay_ms)
        return float(delay * (1 - self.jitter * rand()))


@dataclass(frozen=True)
class Constant:
    """The same delay before every retry."""

    every_ms: float = 1000

    def __post_init__(self) -> None:
        _check("every_ms", self.every_ms)

    @property
    def max_delay_ms(self) -> float:
        """The one delay this policy ever returns."""
        return self.every_ms

    def delay_ms(self, *, retry: int, rand: Callable[[], float] = random.random) -> float:
        """Always ``every_ms``."""
        return float(self.every_ms)

