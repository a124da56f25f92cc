"""Log helpers: broker URLs with the password masked, one structured line per outcome."""
from __future__ import annotations

__all__ = ["safe_url", "log_outcome"]

import logging
from typing import Any

from kombu.utils.url import maybe_sanitize_url

logger = logging.getLogger("kombu_events.outcome")


def safe_url(url: Any) -> str:
    """``url`` with any password replaced by ``**``; safe to log or print."""
    return maybe_sanitize_url(str(url)) if url else str(url)


_LEVELS = {"ack": logging.INFO, "requeue": logging.WARNING, "retry": logging.INFO, "archive": logging.ERROR, "held": logging.ERROR}


def log_outcome(
    outcome: str, *, queue: str, routing_key: str, message_id: Any, attempt: int,
    duration_ms: float, delay_ms: float = 0, reason: str = "",
) -> None:
    """One ``key=value`` line per message outcome; the same fields are in ``record.kombu_events``."""
    level = _LEVELS.get(outcome, logging.INFO)
    if not logger.isEnabledFor(level):
        return
    fields = {
        "outcome": outcome, "queue": queue, "routing_key": routing_key, "message_id": message_id,
        "attempt": attempt, "duration_ms": round(duration_ms, 3), "delay_ms": round(delay_ms),
    }
    if reason:
        fields["reason"] = reason
    logger.log(level, "event %s", " ".join(f"{k}={v!r}" if k == "reason" else f"{k}={v}" for k, v in fields.items()),
               extra={"kombu_events": fields})
