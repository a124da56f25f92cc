"""The console's pages and its JSON API: one function per view, each reading or acting through the
functions the ``kombu-events`` CLI uses (:mod:`kombu_events.ops.archive`, :mod:`kombu_events.ops.status`).

Pages: ``/`` (overview), ``/failures`` (grouped, searchable), ``/events/{id}``, ``/replay``
(POST; a dry run answers with what would be sent where), ``/jobs/{id}``, ``/purge`` (GET: the
confirmation with scope and count; POST: the purge), ``/audit``; the JSON API is in :mod:`.api`.
"""
from __future__ import annotations

__all__ = ["routes"]

import logging
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from ..ops.archive import ArchivedMessage, replay as replay_now
from . import api, query as search
from .audit import stamp
from .common import guarded, page, selection, service_of
from .views import event_view, overview_rows

logger = logging.getLogger(__name__)


def _iso(epoch_s: float | None = None) -> str:
    """A time as the archive writes ``archived-at`` (ISO 8601, UTC, milliseconds): comparable as text."""
    when = datetime.now(timezone.utc) if epoch_s is None else datetime.fromtimestamp(epoch_s, timezone.utc)
    return when.isoformat(timespec="milliseconds")


# -- pages -----------------------------------------------------------------------------------------------

@guarded
async def overview(request: Request) -> Response:
    """Every queue of the service: depth, unacked, consumers, state; the archive against its bounds."""
    service = service_of(request)
    rows = overview_rows(await run_in_threadpool(service.status), service.topology.settings)
    template = "_overview_table.html" if request.query_params.get("fragment") else "overview.html"
    return page(request, template, rows=rows, read_at=_iso())


@guarded
async def failures(request: Request) -> Response:
    """The archive grouped (by handler and exception, routing key or hour) and searched."""
    service, settings = service_of(request), request.app.state.settings
    text, by = request.query_params.get("q", ""), request.query_params.get("by", "exception")
    if by not in search.GROUPINGS:
        by = "exception"
    snapshot = await run_in_threadpool(service.snapshot, fresh=bool(request.query_params.get("fresh")))
    found = selection(snapshot, text, None)
    return page(request, "failures.html", q=text, by=by, groups=search.group(found, by), found=found,
                 shown=found[:settings.page_size], snapshot=snapshot, total=len(snapshot.messages),
                 before=_iso(snapshot.taken_at),
                 handler_queues=[q.name for q in service.topology.handler_queues], jobs=request.app.state.jobs.all())


@guarded
async def event(request: Request) -> Response:
    """One archived message: properties, headers, body, traceback, attempts."""
    service, message_id = service_of(request), request.path_params["message_id"]
    message = (await run_in_threadpool(service.snapshot)).by_id(message_id) \
        or (await run_in_threadpool(service.snapshot, fresh=True)).by_id(message_id)
    if message is None:
        return page(request, "error.html", 404, error=f"no archived message with id {message_id!r} "
                                                       "(replayed or purged since?)")
    return page(request, "event.html", m=message, view=event_view(message))


@guarded
async def replay(request: Request) -> Response:
    """Replay the selected messages, a group or all matching: a dry run, or a job (POST)."""
    form = await request.form()
    text, before = str(form.get("q", "")), str(form.get("before", "")) or None
    ids = [str(i) for i in form.getlist("id")] if form.get("scope") == "selected" else None
    to_queue = str(form.get("to_queue", "")) or None
    rate = float(str(form.get("rate") or 0)) or None
    if rate is not None and rate < 0:
        raise ValueError(f"rate must be a positive number of messages a second, got {rate}")
    service = service_of(request)
    if to_queue is not None and to_queue not in {q.name for q in service.topology.handler_queues}:
        raise ValueError(f"{to_queue!r} is not a handler queue of service {service.name}")
    chosen = selection(await run_in_threadpool(service.snapshot, fresh=True), text, before, ids)
    if form.get("dry_run"):
        plan = [(m, to_queue or m.queue) for m in chosen]
        return page(request, "dry_run.html", plan=plan, q=text, to_queue=to_queue, rate=rate)
    principal = request.state.principal
    job = request.app.state.jobs.start(principal.name, principal.role, frozenset(m.id for m in chosen), text,
                                       to_queue=to_queue, rate_per_s=rate)
    return RedirectResponse(request.url_for("job", job_id=job.id).path, status_code=303)


@guarded
async def edit(request: Request) -> Response:
    """Edit-and-replay one event (POST; only when the console was started with it enabled): the
    edited body goes to the event's queue under a new message id, the original's in a header."""
    service, principal = service_of(request), request.state.principal
    if not request.app.state.settings.allow_edit:
        return page(request, "error.html", 403, error="edit-and-replay is off (start the console with "
                                                       "--allow-edit to turn it on)")
    message_id, form = request.path_params["message_id"], await request.form()
    body = str(form.get("body", "")).encode("utf-8")
    job_id = "edit-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")

    def run() -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
        with service.connection() as conn:
            return replay_now(conn, service.topology, lambda m: m.id == message_id, 1,
                              stamp=stamp(principal.name, job_id), edits={message_id: body})

    replayed, kept = await run_in_threadpool(run)
    service.forget()
    request.app.state.audit.record(principal.name, principal.role, "edit and replay", len(replayed),
                                   job=job_id, original=message_id, kept=len(kept))
    if not replayed:
        why = kept[0][1] if kept else "not in the archive any more"
        return page(request, "error.html", 409, error=f"{message_id}: nothing replayed ({why})")
    return page(request, "purged.html", count=1, q="", edited=message_id)


async def job(request: Request) -> Response:
    """A replay job's progress (``?fragment=1``: the part the page refreshes)."""
    found = request.app.state.jobs.get(request.path_params["job_id"])
    if found is None:
        return page(request, "error.html", 404, error="no such job (jobs are kept until the console restarts)")
    template = "_job_progress.html" if request.query_params.get("fragment") else "job.html"
    return page(request, template, job=found)


async def cancel(request: Request) -> Response:
    """Cancel a replay job (POST): nothing more is selected; what was sent is committed."""
    jobs = request.app.state.jobs
    found = jobs.get(request.path_params["job_id"])
    if found is not None:
        jobs.cancel(found, request.state.principal.name, request.state.principal.role)
    return RedirectResponse(request.url_for("job", job_id=request.path_params["job_id"]).path, status_code=303)


@guarded
async def purge_page(request: Request) -> Response:
    """GET: the confirmation, stating scope and count; POST: purge exactly what was confirmed."""
    service = service_of(request)
    params: Any = await request.form() if request.method == "POST" else request.query_params
    text, before = str(params.get("q", "")), str(params.get("before", "")) or _iso()
    chosen = selection(await run_in_threadpool(service.snapshot, fresh=True), text, before)
    changed = request.method == "POST" and str(params.get("count")) != str(len(chosen))
    if request.method == "GET" or changed:
        return page(request, "purge.html", q=text, before=before, count=len(chosen), changed=changed,
                     queues=sorted({m.queue for m in chosen}))
    removed = await run_in_threadpool(service.purge, {m.id for m in chosen})
    principal = request.state.principal
    request.app.state.audit.record(principal.name, principal.role, "purge", len(removed), query=text, before=before)
    return page(request, "purged.html", count=len(removed), q=text)


async def audit(request: Request) -> Response:
    """The audit trail: who did what, when, to how many messages."""
    return page(request, "audit.html", entries=request.app.state.audit.recent())


def routes() -> list[Route]:
    """Every route of the console (static files apart)."""
    return [
        Route("/", overview, name="overview"),
        Route("/failures", failures, name="failures"),
        Route("/events/{message_id:path}/edit", edit, methods=["POST"], name="edit"),
        Route("/events/{message_id:path}", event, name="event"),
        Route("/replay", replay, methods=["POST"], name="replay"),
        Route("/jobs/{job_id}", job, name="job"),
        Route("/jobs/{job_id}/cancel", cancel, methods=["POST"], name="cancel"),
        Route("/purge", purge_page, methods=["GET", "POST"], name="purge"),
        Route("/audit", audit, name="audit"),
        *api.routes(),
    ]
