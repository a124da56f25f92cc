"""The console's audit trail: who did what, when, to how many archived messages, kept as JSON Lines.

Every replay, purge and cancel appends one line to the audit file (never rewritten) and
the console shows the latest ones; a replayed copy carries the same facts in its headers
(:func:`stamp`), so a handler that sees it again can tell who sent it back.
"""
from __future__ import annotations

__all__ = ["AuditLog", "stamp", "BY_HEADER", "AT_HEADER", "JOB_HEADER"]

import json
import logging
import threading
from collections import deque
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..core.logs import escape_controls

logger = logging.getLogger(__name__)

BY_HEADER = "kombu-events-replayed-by"
AT_HEADER = "kombu-events-replayed-at"
JOB_HEADER = "kombu-events-replay-job"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def stamp(actor: str, job: str) -> dict[str, str]:
    """The headers a replayed copy carries: who replayed it, when, in which console job."""
    return {BY_HEADER: actor, AT_HEADER: _now(), JOB_HEADER: job}


class AuditLog:
    """Appends entries to ``path`` (None: kept in memory only) and remembers the last ``keep``."""

    def __init__(self, path: Path | None, keep: int = 200) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep)
        if path is not None and path.exists():
            for line in path.read_text(encoding="utf-8").splitlines()[-keep:]:
                try:
                    self._recent.append(json.loads(line))
                except ValueError:
                    logger.warning("audit file %s: a line is not JSON, not shown", path)

    def record(self, actor: str, role: str, action: str, count: int, **detail: Any) -> dict[str, Any]:
        """Append one entry (``action``: replay, purge, cancel, ...) and return it."""
        entry = {"at": _now(), "actor": actor, "role": role, "action": action, "count": count, **detail}
        with self._lock:
            self._recent.append(entry)
            if self.path is not None:
                with self.path.open("a", encoding="utf-8") as fh:
                    fh.write(json.dumps(entry) + "\n")
        logger.info("console audit: %s %s %d message(s) %s", escape_controls(actor), action, count, detail)
        return entry

    def recent(self) -> list[dict[str, Any]]:
        """The latest entries, newest first."""
        with self._lock:
            return list(reversed(self._recent))
