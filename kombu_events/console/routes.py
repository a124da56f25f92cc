"""The console's pages and its JSON API: one function per view, each reading or acting through the
functions the ``kombu-events`` CLI uses (:mod:`kombu_events.ops.archive`, :mod:`kombu_events.ops.status`).

Pages: ``/`` (overview), ``/failures`` (grouped, searchable), ``/events/{id}`` (``/events?id=`` for the
ids ``.`` and ``..``; any id percent-encoded, :mod:`.links`), ``/replay``
(POST; a dry run answers with what would be sent where), ``/jobs/{id}``, ``/purge`` (GET: the
confirmation with scope and count; POST: the purge), ``/audit``; the JSON API is in :mod:`.api`.
"""
from __future__ import annotations

__all__ = ["routes"]

import logging
import math
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from . import api, links, query as search
from .audit import stamp
from .common import guarded, id_route, page, selection, service_of
from .views import event_view, overview_rows

logger = logging.getLogger(__name__)


def _iso(epoch_s: float | None = None) -> str:
    """A time as the archive writes ``archived-at`` (ISO 8601, UTC, milliseconds): comparable as text."""
    when = datetime.now(timezone.utc) if epoch_s is None else datetime.fromtimestamp(epoch_s, timezone.utc)
    return when.isoformat(timespec="milliseconds")


def _rate(text: str) -> float | None:
    """The replay form's rate limit: messages a second (empty or 0: no limit)."""
    if not text.strip() or text.strip() == "0":
        return None
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a number of messages a second above 0 (empty: no limit), got {text!r}")
    return rate


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
    service = service_of(request)
    message_id = request.path_params.get("message_id", request.query_params.get("id"))
    if message_id is None:
        raise ValueError("which event? /events/ID, or /events?id=ID")
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
    scope = form.get("scope")
    if scope not in ("matching", "selected"):
        raise ValueError(f"scope must be 'matching' (all the search matches) or 'selected' (the ids sent), "
                         f"got {scope!r}")
    ids = [links.from_field(str(i)) for i in form.getlist("id")] if scope == "selected" else None
    to_queue = str(form.get("to_queue", "")) or None
    rate = _rate(str(form.get("rate") or ""))
    service = service_of(request)
    if to_queue is not None and to_queue not in {q.name for q in service.topology.handler_queues}:
        raise ValueError(f"{to_queue!r} is not a handler queue of service {service.name}")
    chosen = selection(await run_in_threadpool(service.snapshot, fresh=True), text, before, ids)
    found = {m.id for m in chosen}
    missing = tuple(i for i in dict.fromkeys(ids or ()) if i not in found)  # selected ids the archive lacks
    if form.get("dry_run"):
        plan = [(m, to_queue or m.queue) for m in chosen]
        return page(request, "dry_run.html", plan=plan, q=text, to_queue=to_queue, rate=rate, missing=missing)
    principal = request.state.principal
    job = request.app.state.jobs.start(principal.name, principal.role, frozenset(found), text,
                                       to_queue=to_queue, rate_per_s=rate, missing=missing)
    return RedirectResponse(request.url_for("job", job_id=job.id).path, status_code=303)


@guarded
async def edit(request: Request) -> Response:
    """Edit-and-replay one event (POST; only when the console was started with it enabled): the
    edited body goes to the event's queue under a new message id, the original's in a header."""
    service, principal = service_of(request), request.state.principal
    if not request.app.state.settings.allow_edit:
        return page(request, "error.html", 403, error="edit-and-replay is off (start the console with "
                                                       "--allow-edit to turn it on)")
    form = await request.form()
    message_id = request.path_params.get("message_id")
    if message_id is None:
        if not form.get("id"):
            raise ValueError("which event? the form sends its id in the field 'id'")
        message_id = links.from_field(str(form.get("id")))
    body = str(form.get("body", "")).encode("utf-8")
    job_id = "edit-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    replayed, kept = await run_in_threadpool(lambda: service.replay(
        lambda m: m.id == message_id, 1, stamp=stamp(principal.name, job_id), edits={message_id: body}))
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
        id_route("/events/{message_id:path}/edit", edit, methods=["POST"], name="edit"),
        Route("/edit", edit, methods=["POST"], name="edit_form"),
        id_route("/events/{message_id:path}", event, name="event"),
        Route("/events", event, name="event_by_query"),
        Route("/replay", replay, methods=["POST"], name="replay"),
        Route("/jobs/{job_id}", job, name="job"),
        Route("/jobs/{job_id}/cancel", cancel, methods=["POST"], name="cancel"),
        Route("/purge", purge_page, methods=["GET", "POST"], name="purge"),
        Route("/audit", audit, name="audit"),
        *api.routes(),
    ]
