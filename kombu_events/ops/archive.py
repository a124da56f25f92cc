"""The archive on the broker: list, show, replay, purge -- and no read ever changes it.

The archive is a RabbitMQ stream (``<service>.archive``): append-only, read by offset
(:mod:`kombu_events.broker.streams`). A read counts no delivery, sets no ``redelivered``,
moves and reorders nothing, on RabbitMQ 3.10 and 4.x, whatever the service's queue type.
Every archived copy carries a unique *archive key* (stamped by the worker that archived
it; a copy written without one, by a worker of an earlier version, is keyed by its offset).

Replay and purge remove nothing: they append a *settlement* record naming the keys they
settled (:mod:`kombu_events.core.archive_records`), and every reader folds those in, so
a settled copy is no longer listed. Replay first has every copy confirmed by the broker
(publisher confirms, mandatory), and only then writes the record of those confirmed: a
crash or a lost connection in between leaves them listed, and a replay run again sends
them again, under the same message id (an edited copy's id is derived from its archive
key and its body), which a ``once=True`` handler's inbox drops. A purged copy stays in
the stream, hidden, until retention (``archive_ttl_ms``, ``archive_max_bytes``) removes
its segment; :func:`kombu_events.ops.archive_rewrite.rewrite` removes purged copies for
good (docs/failures.md).

This module settles (purge, and the records of both); the reading is in :mod:`.archive_read`, the
counting in :mod:`.archive_count`, the replay in :mod:`.archive_replay`. Import them all from here.
"""
from __future__ import annotations

__all__ = ["ArchivedMessage", "ReplayProgress", "LegacyArchiveError", "ArchiveMissingError", "PREVIEW_BYTES",
           "records", "parse_record", "view", "read", "selected", "ArchiveCounter", "archived_count", "browse",
           "replay", "replay_reconnecting", "RECONNECTABLE", "purge", "purge_all", "purge_note", "settle",
           "message_key", "ORIGINAL_ID", "KEY_PREFIX_UNSTAMPED"]

import logging
from typing import Any, Callable

from amqp import Message

from ..broker.confirms import Confirmer
from ..broker.declare import close_quietly
from ..core import archive_records as records_
from ..core.topology import Topology
from ..errors import KombuEventsError
from .archive_count import ArchiveCounter, archived_count
from .archive_read import (
    KEY_PREFIX_UNSTAMPED,
    PREVIEW_BYTES,
    ArchivedMessage,
    ArchiveMissingError,
    LegacyArchiveError,
    browse,
    message_key,
    parse_record,
    pending_matching,
    read,
    records,
    selected,
    view,
)
from .archive_replay import ORIGINAL_ID, RECONNECTABLE, ReplayProgress, replay, replay_reconnecting

logger = logging.getLogger(__name__)


def purge(connection: Any, topology: Topology, match: Callable[[ArchivedMessage], bool],
          limit: int | None = None, *, by: str | None = None, note: str = "", match_body: int = 0,
          start: int | str = "first") -> list[ArchivedMessage]:
    """Settle the archived copies that ``match`` (the first ``limit``) as purged; return them.

    They are no longer listed by any reader; they stay in the stream until retention removes their segment
    (:func:`kombu_events.ops.archive_rewrite.rewrite` removes them for good). The records are confirmed
    before this returns; each names its keys, who purged and when (the audit of the purge). ``match`` sees
    the first ``match_body`` bytes of each body (none by default); ``start``: as for :func:`replay`.
    """
    chosen = pending_matching(view(connection, topology, body_limit=match_body, full=False, start=start), match,
                              limit)
    settle(connection, topology, records_.PURGED, [m.key for m in chosen], by=by, note=note)
    return chosen


def purge_note(*, for_good: bool = False) -> str:
    """What a purge means, in one sentence for its report (the ``note`` of ``archive-purge``)."""
    if for_good:
        return ("purged copies are hidden from every reader at once, and the archive stream is rewritten without "
                "them: their bodies are gone from the broker")
    return ("purged copies are hidden from every reader at once but stay in the archive stream, bodies included, "
            "until retention removes their segment or a rewrite removes them (kombu-events archive purge "
            "--for-good, or archive rewrite)")


def purge_all(connection: Any, topology: Topology, *, by: str | None = None) -> int:
    """Settle every archived copy as purged; return how many."""
    return len(purge(connection, topology, lambda m: True, by=by, note="purge of the whole archive"))


def settle(connection: Any, topology: Topology, action: str, keys: list[str], *, by: str | None = None,
           note: str = "", timeout_s: float = 30.0) -> None:
    """Append settlement records for ``keys`` (at most :data:`MAX_KEYS_PER_RECORD` each), confirmed."""
    if not keys and action != records_.OPENED:
        return
    channel = connection.channel()
    try:
        confirmer = Confirmer(channel)
        failed: list[str] = []
        who = by or getattr(connection, "userid", None) or ""
        step = records_.MAX_KEYS_PER_RECORD
        for start in range(0, max(len(keys), 1), step):
            body, properties = records_.settlement_record(action, keys[start:start + step], by=who, note=note)
            confirmer.publish(Message(body, **properties), topology.archive_exchange, "", on_ok=lambda: None,
                              on_fail=failed.append)
        confirmer.wait(timeout_s=timeout_s)
        if failed or confirmer.pending:
            raise KombuEventsError(f"the broker did not take the {action} record(s) of {len(keys)} archived "
                                   f"cop{'y' if len(keys) == 1 else 'ies'}: {failed[0] if failed else 'no confirm'}; "
                                   "nothing was settled that the broker did not confirm")
    finally:
        close_quietly(channel)
    if keys:
        logger.info("kombu-events: %s %d archived cop%s of %s (by %s)%s", action, len(keys),
                    "y" if len(keys) == 1 else "ies", topology.settings.service, who or "?",
                    f": {note}" if note else "")
