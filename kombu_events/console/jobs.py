"""Replays run as jobs: in a thread of their own, with progress, a rate limit, and a cancel button.

A job replays the archive keys the operator confirmed when starting it, through
:func:`kombu_events.ops.archive.replay` (the ``archive replay`` command's function): a window of copies
is sent with publisher confirms, then settled by one ``replayed`` record, then the next window. Failures
archived while the job runs have other keys: they are shown, never mixed in. The job's rate limit and its
Cancel act between windows (a window is the copies of about half a second at the rate asked, at most 200):
what was settled stays settled, the rest stays in the archive.

A lost connection (the broker restarted) does not end a job: it connects again, a bounded number of
times (an archive not found meanwhile too: a broker just started takes a moment to bring its streams
back), and replays what is not settled yet. A window confirmed but not settled when the connection went is
sent again, under the same message ids, each copy with its archive key in ``kombu-events-replay-of``: a
``once=True`` handler's inbox drops the second (docs/console.md says what is guaranteed). One
:class:`~kombu_events.ops.archive.ReplayProgress` counts over every connection.
"""
from __future__ import annotations

__all__ = ["Job", "Jobs", "RECOVERABLE"]

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..core.logs import escape_controls, safe_text
from ..ops.archive import RECONNECTABLE, ArchivedMessage, ReplayProgress
from .audit import AuditLog, stamp
from .follower import RECOVERABLE
from .reading import Service

logger = logging.getLogger(__name__)

QUEUED, RUNNING, DONE, CANCELLED, FAILED = "queued", "running", "done", "cancelled", "failed"
#: What a job connects again after: a lost connection, and an archive not found (a broker just started again
#: takes a moment to bring its streams back: the job's copies were read from that archive moments before).
RETRIED = RECONNECTABLE
#: Copies a replay window holds at most (ops.archive.replay's own window).
MAX_WINDOW = 200


class _Cancelled(Exception):
    """Raised between two windows of a cancelled job: out of the replay, nothing unsettled left behind."""


@dataclass
class Job:
    """One replay: what it was asked to do, by whom, and how far it got."""

    id: str
    actor: str
    keys: frozenset[str]
    query: str
    role: str = "operator"
    to_queue: str | None = None
    rate_per_s: float | None = None
    #: Keys asked for that no archived copy had when the job started (or when it ran): never sent, reported.
    missing: tuple[str, ...] = ()
    state: str = QUEUED
    #: (archive key, message id, why) of each copy kept in the archive.
    kept: list[tuple[str, str, str]] = field(default_factory=list)
    reconnects: int = 0
    progress: ReplayProgress = field(default_factory=ReplayProgress, repr=False)
    error: str = ""
    started_at: float = 0.0
    finished_at: float = 0.0
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def total(self) -> int:
        """How many copies the job was asked to replay."""
        return len(self.keys)

    @property
    def replayed(self) -> int:
        """Copies confirmed by the broker and settled so far, over every connection."""
        return len(self.progress.settled)

    @property
    def finished(self) -> bool:
        """The job has ended (done, cancelled or failed)."""
        return self.state in (DONE, CANCELLED, FAILED)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly progress."""
        return {"id": self.id, "actor": self.actor, "state": self.state, "total": self.total,
                "replayed": self.replayed, "kept": [{"key": k, "id": i, "why": w} for k, i, w in self.kept],
                "reconnects": self.reconnects, "commits": self.progress.commits, "to_queue": self.to_queue,
                "rate_per_s": self.rate_per_s, "query": self.query, "missing": list(self.missing),
                "error": self.error}


class _Pace:
    """Between two windows: at most ``rate_per_s`` copies a second on average, and a stop when cancelled."""

    def __init__(self, job: Job) -> None:
        self.job, self.began = job, time.monotonic()

    @property
    def window(self) -> int:
        """Copies per window: about half a second's worth at the rate asked (all 200 without a rate)."""
        rate = self.job.rate_per_s
        return MAX_WINDOW if not rate else max(1, min(MAX_WINDOW, int(rate / 2)))

    def __call__(self) -> None:
        job = self.job
        if job.rate_per_s and not job.cancel.is_set():
            due = self.began + job.replayed / job.rate_per_s
            job.cancel.wait(max(0.0, due - time.monotonic()))
        if job.cancel.is_set():
            raise _Cancelled


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

    def start(self, actor: str, role: str, keys: frozenset[str], query: str, *, to_queue: str | None = None,
              rate_per_s: float | None = None, missing: tuple[str, ...] = ()) -> Job:
        """Start replaying the copies of ``keys`` in a thread; the audit trail records it at once. ``missing``:
        keys asked for that the archive did not have, shown with the job's progress."""
        job = Job(uuid.uuid4().hex[:12], actor, keys, query, role, to_queue, rate_per_s, missing,
                  started_at=time.time())
        pace = _Pace(job)
        job.progress = ReplayProgress()
        with self._lock:
            self._jobs[job.id] = job
        self.audit.record(actor, role, "replay", job.total, job=job.id, query=query, to_queue=to_queue,
                          rate_per_s=rate_per_s, **({"not_found": len(missing)} if missing else {}))
        threading.Thread(target=self._run, args=(job, pace), name=f"console-replay-{job.id}", daemon=True).start()
        return job

    def cancel(self, job: Job, actor: str, role: str) -> None:
        """Stop after the window being sent: what was settled stays settled, the rest stays archived."""
        if not job.finished:
            job.cancel.set()
            self.audit.record(actor, role, "cancel", job.total - job.replayed, job=job.id)

    def _run(self, job: Job, pace: _Pace) -> None:
        job.state = RUNNING
        kept: dict[str, tuple[str, str]] = {}
        try:
            self._replay(job, pace, kept)
            job.state = DONE
        except _Cancelled:
            job.state = CANCELLED
        except Exception as exc:  # a thread's exception would vanish: the job shows it instead
            job.error = safe_text(f"{type(exc).__name__}: {exc}")
            job.state = FAILED
            logger.warning("console replay job %s failed: %s", job.id, escape_controls(job.error))
        finally:
            job.kept = [(key, message_id, why) for key, (message_id, why) in kept.items()]
            if job.state == DONE:
                gone = job.keys - job.progress.settled - kept.keys() - set(job.missing)
                job.missing += tuple(sorted(gone))  # settled by someone else meanwhile, or past retention
            job.finished_at = time.time()
            self.audit.record(job.actor, job.role, "replay finished", job.replayed, job=job.id, state=job.state,
                              kept=len(job.kept), reconnects=job.reconnects, commits=job.progress.commits,
                              error=job.error or None)

    def _replay(self, job: Job, pace: _Pace, kept: dict[str, tuple[str, str]]) -> None:
        """``ops.archive.replay`` of the job's keys, again after each lost connection (up to a bound)."""
        def chosen(message: ArchivedMessage) -> bool:
            return message.key in job.keys

        while True:
            try:
                _, kept_now = self.service.replay(chosen, to_queue=job.to_queue, stamp=stamp(job.actor, job.id),
                                                  progress=job.progress, window=pace.window,
                                                  start=self.service.first_offset(job.keys),
                                                  on_window=lambda _copies: pace())
                kept.update((m.key, (m.id, why)) for m, why in kept_now)
                job.error = ""
                return
            except RETRIED as exc:
                if job.cancel.is_set():
                    raise _Cancelled from exc
                if job.reconnects >= self.max_reconnects:
                    raise
                job.reconnects += 1
                job.error = safe_text(f"connection lost ({type(exc).__name__}: {exc}); "
                                      f"connecting again ({job.reconnects} of {self.max_reconnects})")
                logger.warning("console replay job %s: %s", job.id, escape_controls(job.error))
                job.cancel.wait(min(self.reconnect_delay_s * job.reconnects, 5.0))
