"""The console's pages and its JSON API: one function per view, each reading the index of the archive or
acting through the functions the ``kombu-events`` CLI uses (:mod:`kombu_events.ops.archive`,
:mod:`kombu_events.ops.status`). Every search and every read of the broker runs off the event loop.

Pages: ``/`` (overview), ``/failures`` (grouped, searchable), ``/events/{key}`` (one archived copy, by its
archive key; ``/events?key=`` for the keys ``.`` and ``..``, :mod:`.links`; a message id held by one copy
leads to it), ``/download?key=`` (its whole body, downloaded), ``/replay`` (POST; a dry run answers
with what would be sent where), ``/jobs/{id}``, ``/purge`` (GET: the confirmation with scope and count;
POST: the purge), ``/audit``; the actions are in :mod:`.actions`, the JSON API in :mod:`.api`.
"""
from __future__ import annotations

__all__ = ["routes"]

import logging
import re
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from ..ops.archive import PREVIEW_BYTES, ArchivedMessage
from . import api, query as search
from .actions import cancel, edit, job, purge_page, replay
from .common import event_url, guarded, id_route, page, selection, service_of
from .entries import Entry
from .reading import Service
from .views import event_view, overview_rows

logger = logging.getLogger(__name__)

def _iso(epoch_s: float | None = None) -> str:
    """A time as the archive writes ``archived-at`` (ISO 8601, UTC, milliseconds): comparable as text."""
    when = datetime.now(timezone.utc) if epoch_s is None else datetime.fromtimestamp(epoch_s, timezone.utc)
    return when.isoformat(timespec="milliseconds")


# -- pages -----------------------------------------------------------------------------------------------

@guarded
async def overview(request: Request) -> Response:
    """Every queue of the service: depth, unacked, consumers, state; the archive's copies and retention."""
    service = service_of(request)
    rows = overview_rows(await run_in_threadpool(service.status), service.topology.settings)
    template = "_overview_table.html" if request.query_params.get("fragment") else "overview.html"
    return page(request, template, rows=rows, read_at=_iso())


def _failures(service: Service, text: str, by: str, budget_s: float) -> tuple[Any, search.Found, list[search.Group]]:
    view = service.view()
    with service.search_turn(text):
        found = selection(view, text, budget_s=budget_s)
    return view, found, search.group(found.matched, by)


@guarded
async def failures(request: Request) -> Response:
    """The archive grouped (by handler and exception, routing key or hour) and searched."""
    service, settings = service_of(request), request.app.state.settings
    text, by = request.query_params.get("q", ""), request.query_params.get("by", "exception")
    if by not in search.GROUPINGS:
        by = "exception"
    search.parse(text)  # a search too long is a 400 at once
    view, found, groups = await run_in_threadpool(_failures, service, text, by, settings.search_budget_s)
    return page(request, "failures.html", q=text, by=by, groups=groups, found=found,
                shown=found.matched[:settings.page_size], index=view, total=len(view.entries),
                handler_queues=[q.name for q in service.topology.handler_queues], jobs=request.app.state.jobs.all())


async def _not_archived(request: Request, key: str) -> Response:
    """The page of a key the index does not hold: settled (how, by whom), a message id (its copies), or not
    read yet (the index is catching up), or unknown."""
    service = service_of(request)
    settled = service.index.settlement(key)
    if settled is not None:
        return page(request, "error.html", 404, error=f"no archived copy with key {key!r} any more: it was "
                                                      f"{settled.action} by {settled.by or '?'} at {settled.at}")
    copies = await run_in_threadpool(service.with_id, key)
    if len(copies) == 1:
        return RedirectResponse(event_url(request, copies[0].key), status_code=303)
    if copies:
        return page(request, "error.html", 300, copies=copies,
                    error=f"{len(copies)} archived copies have the message id {key!r}: each has a page of its own")
    view = service.index.view()
    if not view.caught_up:
        return page(request, "error.html", 503, error=f"no archived copy with key {key!r} read yet: the console "
                                                      f"is still reading the archive ({view.records:,} records "
                                                      "so far); try again in a moment")
    return page(request, "error.html", 404, error=f"no archived copy with key {key!r} (replayed or purged "
                                                  "since, or mistyped)")


def _key_of(request: Request) -> str:
    key = request.path_params.get("key", request.query_params.get("key", request.query_params.get("id")))
    if key is None:
        raise ValueError("which event? /events/KEY, or /events?key=KEY")
    return str(key)


async def _copy(request: Request, body_limit: int | None) -> tuple[Entry, ArchivedMessage] | Response:
    """The indexed entry of the request's key and its copy read at its offset (``body_limit``: the body's first
    bytes), or the page that says why there is none."""
    service, key = service_of(request), _key_of(request)
    entry = await run_in_threadpool(service.entry, key)
    if entry is None:
        return await _not_archived(request, key)
    message = await run_in_threadpool(lambda: service.read(entry, body_limit=body_limit))
    if message is None:
        return page(request, "error.html", 404, error=f"the copy {key!r} left the archive stream (retention)")
    return entry, message


@guarded
async def event(request: Request) -> Response:
    """One archived copy: the failure, traceback, properties, headers, a preview of its body (read at its
    offset), and a link to download the whole body."""
    found = await _copy(request, PREVIEW_BYTES)
    if isinstance(found, Response):
        return found
    entry, message = found
    return page(request, "event.html", m=message, entry=entry, view=event_view(message))


def _filename(entry: Entry) -> str:
    kind = "json" if entry.content_type.endswith("json") else "txt" if entry.content_type.startswith("text/") \
        else "bin"
    return f"{re.sub(r'[^A-Za-z0-9@_-]', '_', entry.key)[:64]}.{kind}"


@guarded
async def body(request: Request) -> Response:
    """The whole body of one archived copy, as a download (read at its offset when asked, never kept)."""
    found = await _copy(request, None)
    if isinstance(found, Response):
        return found
    entry, message = found
    return Response(message.body, media_type="application/octet-stream",
                    headers={"content-disposition": f'attachment; filename="{_filename(entry)}"'})


async def audit(request: Request) -> Response:
    """The audit trail: who did what, when, to how many archived copies."""
    return page(request, "audit.html", entries=request.app.state.audit.recent())


def routes() -> list[Route]:
    """Every route of the console (static files apart)."""
    return [
        Route("/", overview, name="overview"),
        Route("/failures", failures, name="failures"),
        id_route("/events/{key:path}/edit", edit, methods=["POST"], name="edit"),
        Route("/edit", edit, methods=["POST"], name="edit_form"),
        Route("/download", body, name="download"),
        id_route("/events/{key:path}", event, name="event"),
        Route("/events", event, name="event_by_query"),
        Route("/replay", replay, methods=["POST"], name="replay"),
        Route("/jobs/{job_id}", job, name="job"),
        Route("/jobs/{job_id}/cancel", cancel, methods=["POST"], name="cancel"),
        Route("/purge", purge_page, methods=["GET", "POST"], name="purge"),
        Route("/audit", audit, name="audit"),
        *api.routes(),
    ]
