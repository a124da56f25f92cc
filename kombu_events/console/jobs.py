"""Replays run as jobs: in a thread of their own, with progress, a rate limit, and a cancel button.

A job replays the ids the operator selected when starting it, through
:func:`kombu_events.ops.archive.replay` (the ``archive replay`` command's function): copies
are sent, and their archived originals acked, in AMQP transactions, so both take effect at
a commit or neither does. Failures archived while the job runs have other ids: they are
shown, never mixed in. Cancelling stops the selection; what was already sent is committed,
the rest stays in the archive.

A lost connection (the broker restarted) does not end a job: it connects again, a bounded
number of times, and reads the archive again; what it finds there is exactly what was not
committed, so nothing is sent twice (docs/console.md says what is guaranteed). One
:class:`~kombu_events.ops.archive.ReplayProgress` counts over every connection.
"""
from __future__ import annotations

__all__ = ["Job", "Jobs"]

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from amqp import exceptions as amqp_errors

from ..core.logs import escape_controls, safe_text
from ..errors import BrokerUnavailableError
from ..ops.archive import ArchivedMessage, ReplayProgress
from .audit import AuditLog, stamp
from .reading import Service

logger = logging.getLogger(__name__)

#: What a lost or refused connection raises (py-amqp, sockets, the console's own "cannot reach").
RECOVERABLE = (amqp_errors.ConnectionError, amqp_errors.RecoverableConnectionError, OSError, BrokerUnavailableError)

QUEUED, RUNNING, DONE, CANCELLED, FAILED = "queued", "running", "done", "cancelled", "failed"


@dataclass
class Job:
    """One replay: what it was asked to do, by whom, and how far it got."""

    id: str
    actor: str
    ids: frozenset[str]
    query: str
    role: str = "operator"
    to_queue: str | None = None
    rate_per_s: float | None = None
    #: Ids the operator selected that no archived message had when the job started: never sent, reported.
    missing: tuple[str, ...] = ()
    state: str = QUEUED
    sent: int = 0
    kept: list[tuple[str, str]] = field(default_factory=list)
    reconnects: int = 0
    progress: ReplayProgress = field(default_factory=ReplayProgress, repr=False)
    error: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def total(self) -> int:
        """How many messages the job was asked to replay."""
        return len(self.ids)

    @property
    def replayed(self) -> int:
        """Copies committed so far (their originals removed from the archive with them), over every connection."""
        return self.progress.copies_confirmed

    @property
    def finished(self) -> bool:
        """The job has ended (done, cancelled or failed)."""
        return self.state in (DONE, CANCELLED, FAILED)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly progress."""
        return {"id": self.id, "actor": self.actor, "state": self.state, "total": self.total, "sent": self.sent,
                "replayed": self.replayed, "kept": [{"id": i, "why": w} for i, w in self.kept],
                "reconnects": self.reconnects, "commits": self.progress.commits,
                "to_queue": self.to_queue, "rate_per_s": self.rate_per_s, "query": self.query,
                "missing": list(self.missing), "error": self.error}


class _Throttle:
    """At most ``rate_per_s`` messages a second (None: as fast as the broker confirms)."""

    def __init__(self, rate_per_s: float | None) -> None:
        self.interval = 1.0 / rate_per_s if rate_per_s else 0.0
        self.next_at = time.monotonic()

    def wait(self, cancel: threading.Event) -> None:
        if self.interval:
            delay = self.next_at - time.monotonic()
            if delay > 0:
                cancel.wait(delay)
            self.next_at = max(self.next_at, time.monotonic()) + self.interval


class Jobs:
    """The console's replay jobs, kept in memory (the audit file keeps what they did)."""

    #: Connections a job may open again after losing one, and the wait before each (times its number).
    max_reconnects = 30
    reconnect_delay_s = 0.5

    def __init__(self, service: Service, audit: AuditLog) -> None:
        self.service, self.audit = service, audit
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def get(self, job_id: str) -> Job | None:
        """The job with this id, or None."""
        return self._jobs.get(job_id)

    def all(self) -> list[Job]:
        """Every job, the newest first."""
        return sorted(self._jobs.values(), key=lambda j: j.started_at, reverse=True)

    def start(self, actor: str, role: str, ids: frozenset[str], query: str, *, to_queue: str | None = None,
              rate_per_s: float | None = None, missing: tuple[str, ...] = ()) -> Job:
        """Start replaying ``ids`` in a thread; the audit trail records it at once. ``missing``: ids asked for
        that the archive did not have, shown with the job's progress."""
        job = Job(uuid.uuid4().hex[:12], actor, ids, query, role, to_queue, rate_per_s, missing,
                  started_at=time.time())
        with self._lock:
            self._jobs[job.id] = job
        self.audit.record(actor, role, "replay", job.total, job=job.id, query=query, to_queue=to_queue,
                          rate_per_s=rate_per_s, **({"not_found": len(missing)} if missing else {}))
        threading.Thread(target=self._run, args=(job,), name=f"console-replay-{job.id}", daemon=True).start()
        return job

    def cancel(self, job: Job, actor: str, role: str) -> None:
        """Stop selecting more messages; those already sent are committed (copies and acks together)."""
        if not job.finished:
            job.cancel.set()
            self.audit.record(actor, role, "cancel", job.total - job.sent, job=job.id)

    def _run(self, job: Job) -> None:
        job.state = RUNNING
        throttle = _Throttle(job.rate_per_s)
        done: set[str] = set()  # ids sent at least once (``sent`` counts each once)

        def chosen(message: ArchivedMessage) -> bool:
            if job.cancel.is_set() or message.id not in job.ids:
                return False
            throttle.wait(job.cancel)
            if job.cancel.is_set():
                return False
            if message.id not in done:
                done.add(message.id)
                job.sent += 1
            return True

        kept: dict[str, str] = {}
        try:
            while True:
                try:
                    _, kept_now = self.service.replay(chosen, to_queue=job.to_queue, stamp=stamp(job.actor, job.id),
                                                      progress=job.progress)
                    kept.update((m.id, why) for m, why in kept_now)
                    break
                except RECOVERABLE as exc:
                    if job.reconnects >= self.max_reconnects or job.cancel.is_set():
                        raise
                    job.reconnects += 1
                    job.error = safe_text(f"connection lost ({type(exc).__name__}: {exc}); "
                                          f"connecting again ({job.reconnects} of {self.max_reconnects})")
                    logger.warning("console replay job %s: %s", job.id, escape_controls(job.error))
                    job.cancel.wait(min(self.reconnect_delay_s * job.reconnects, 5.0))
            job.kept = list(kept.items())
            job.error = ""
            job.state = CANCELLED if job.cancel.is_set() else DONE
        except Exception as exc:  # a thread's exception would vanish: the job shows it instead
            job.error = safe_text(f"{type(exc).__name__}: {exc}")
            job.state = FAILED
            logger.warning("console replay job %s failed: %s", job.id, escape_controls(job.error))
        finally:
            job.finished_at = time.time()
            self.service.forget()
            self.audit.record(job.actor, job.role, "replay finished", job.replayed, job=job.id, state=job.state,
                              kept=len(job.kept), reconnects=job.reconnects, commits=job.progress.commits,
                              error=job.error or None)
