"""Publishing with a local backlog, decided: publish now or store locally; what a flush settled (pure).

What every publish returns, :class:`~kombu_events.Published`, is in ``kombu_events.publishing.published``.
"""
from __future__ import annotations

__all__ = ["PUBLISH", "STORE", "publish_or_store", "storable", "BatchResult", "settle_batch"]

from dataclasses import dataclass
from typing import Sequence

from ..errors import BacklogFullError, BrokerUnavailableError, ConfirmTimeoutError, UnroutableError

#: :func:`publish_or_store`'s answer: publish to the broker now.
PUBLISH = "publish"
#: :func:`publish_or_store`'s answer: store the event in the local backlog.
STORE = "store"


def publish_or_store(*, circuit_closed: bool, backlog_pending: bool) -> str:
    """:data:`PUBLISH` only while every circuit is closed and nothing waits in the backlog.

    An event never overtakes one stored before it: while the backlog holds events,
    new ones join its end (the flusher sends them in order).
    """
    return PUBLISH if circuit_closed and not backlog_pending else STORE


def storable(error: BaseException) -> bool:
    """Whether a failed publish goes to the backlog: the broker was unreachable or did not confirm in time.

    Everything else is the caller's to see: unroutable (no queue bound), nacked,
    a missing exchange, a full backlog.
    """
    if isinstance(error, BacklogFullError):
        return False
    return isinstance(error, (BrokerUnavailableError, ConfirmTimeoutError))


@dataclass(frozen=True)
class BatchResult:
    """What to do with the rows of one flushed batch, each named by its sequence number."""

    #: Confirmed by the broker: delete them.
    confirmed: tuple[int, ...] = ()
    #: Returned unroutable: set them aside with the reason (kept, never retried on their own).
    rejected: tuple[tuple[int, str], ...] = ()
    #: Not confirmed: they stay, and are sent again by a later flush.
    kept: tuple[int, ...] = ()
    #: The first failure that was not "unroutable": stop flushing for now.
    error: Exception | None = None


def settle_batch(seqs: Sequence[int], results: Sequence[Exception | None]) -> BatchResult:
    """Turn the broker's answer for each row of a batch (None: confirmed) into a :class:`BatchResult`."""
    if len(seqs) != len(results):
        raise ValueError(f"{len(seqs)} rows but {len(results)} results")
    confirmed: list[int] = []
    rejected: list[tuple[int, str]] = []
    kept: list[int] = []
    error: Exception | None = None
    for seq, result in zip(seqs, results):
        if result is None:
            confirmed.append(seq)
        elif isinstance(result, UnroutableError):
            rejected.append((seq, str(result)))
        else:
            kept.append(seq)
            error = error or result
    return BatchResult(tuple(confirmed), tuple(rejected), tuple(kept), error)
