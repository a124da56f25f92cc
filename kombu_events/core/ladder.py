"""Pure arithmetic of the delay ladder: levels, TTLs and routing keys for a delay.

Level ``L`` holds a message for ``unit_ms * 2**L``; a delay of ``d`` units is the
binary decomposition of ``d``, so a message waits only in the levels whose bit is
set. The routing key spells the bits, most significant first, one word each, then
the target queue: ``0.1.1.billing.audit`` is a delay of 3 units with 3 levels.
"""
from __future__ import annotations

__all__ = [
    "max_delay_units",
    "ttl_ms",
    "units_for",
    "levels_for",
    "routing_key",
    "entry_level",
    "level_pattern",
    "pass_pattern",
    "delivery_pattern",
]

import math

from ..errors import DelayTooLongError


def max_delay_units(*, levels: int) -> int:
    """Longest delay, in units, that ``levels`` levels can hold."""
    return (1 << levels) - 1


def ttl_ms(*, level: int, unit_ms: int) -> int:
    """``x-message-ttl`` of the queue of ``level``."""
    return unit_ms << level


def units_for(*, delay_ms: float, unit_ms: int, levels: int) -> int:
    """Whole units for ``delay_ms`` (rounded up, never shorter than asked); raise if it won't fit."""
    if not delay_ms >= 0:  # also NaN
        raise DelayTooLongError(f"delay must be >= 0 ms, got {delay_ms!r}")
    most = max_delay_units(levels=levels)
    if delay_ms > most * unit_ms:  # exact comparison: also inf and ints too big for a float
        raise DelayTooLongError(
            f"a delay of {delay_ms!r} ms does not fit: {levels} delay levels of {unit_ms} ms "
            f"hold at most {most} units ({most * unit_ms} ms); raise delay_levels"
        )
    units = math.ceil(delay_ms / unit_ms)
    if units * unit_ms < delay_ms:  # the float quotient rounded down: never wait less than asked
        units += 1
    return units


def levels_for(*, delay_units: int, levels: int) -> list[int]:
    """The levels a message waits in for ``delay_units``, highest first."""
    if not 0 <= delay_units <= max_delay_units(levels=levels):
        raise DelayTooLongError(
            f"delay of {delay_units} units does not fit {levels} levels "
            f"(0 .. {max_delay_units(levels=levels)})"
        )
    return [level for level in range(levels - 1, -1, -1) if delay_units >> level & 1]


def routing_key(*, delay_units: int, levels: int, queue: str) -> str:
    """Routing key that sends a message through the ladder for ``delay_units`` to ``queue``."""
    if not 0 <= delay_units <= max_delay_units(levels=levels):
        raise DelayTooLongError(
            f"delay of {delay_units} units does not fit {levels} levels "
            f"(0 .. {max_delay_units(levels=levels)})"
        )
    bits = format(delay_units, f"0{levels}b") if levels else ""
    return ".".join([*bits, queue])


def entry_level(*, delay_units: int) -> int | None:
    """Level whose exchange a delay enters the ladder at: its highest set bit (None: no wait).

    Every level above it would only pass the message on, and each exchange-to-exchange
    hop costs the broker a topic match, so entering lower is the same route, cheaper.
    """
    if delay_units < 0:
        raise DelayTooLongError(f"delay must be >= 0 units, got {delay_units!r}")
    return delay_units.bit_length() - 1 if delay_units else None


def _pattern(*, level: int, levels: int, word: str) -> str:
    words = ["*"] * levels
    words[levels - 1 - level] = word
    return ".".join([*words, "#"])


def level_pattern(*, level: int, levels: int) -> str:
    """Binding key of the queue of ``level``: its bit is set."""
    return _pattern(level=level, levels=levels, word="1")


def pass_pattern(*, level: int, levels: int) -> str:
    """Binding key that lets a message skip ``level``: its bit is clear."""
    return _pattern(level=level, levels=levels, word="0")


def delivery_pattern(*, levels: int, queue: str) -> str:
    """Binding key of ``queue`` on the delivery exchange: exactly ``levels`` words, then its name."""
    return ".".join(["*"] * levels + [queue])
