"""The console's JSON API under ``/api``: the operations of ``kombu-events archive``, answering with the
documents of its ``--json`` (the JSON Schemas in ``kombu_events/cli/schemas/``), and a replay job's progress.

A request body is a JSON object sent with ``Content-Type: application/json``, checked field by field
before anything is read or changed (:mod:`.api_requests`): a 400 names what is wrong.
"""
from __future__ import annotations

__all__ = ["routes"]

from datetime import datetime, timezone
from typing import Any, Callable, Mapping

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..ops.archive import ArchivedMessage
from .api_requests import PURGE_FIELDS, REPLAY_FIELDS, checked_body, whole_number
from .audit import stamp
from .common import guarded, id_route, selection, service_of
from .reading import Service


def _entry(message: ArchivedMessage, outcome: str, why: str | None = None) -> dict[str, Any]:
    return {"id": message.id, "queue": message.queue, "routing_key": message.routing_key,
            "archived_at": message.archived_at, "reason": message.reason, "outcome": outcome, "why": why}


@guarded
async def api_list(request: Request) -> Response:
    """Archived messages that match ``q`` (at most ``limit``): each one an ``archive-list`` object."""
    limit = whole_number("limit", request.query_params.get("limit"), 50)
    snapshot = await run_in_threadpool(service_of(request).snapshot, fresh=bool(request.query_params.get("fresh")))
    found = selection(snapshot, request.query_params.get("q", ""), None)[:limit]
    return JSONResponse([m.summary() for m in found])


@guarded
async def api_show(request: Request) -> Response:
    """One archived message: the ``archive-show`` document."""
    message_id = request.path_params["message_id"]
    found = (await run_in_threadpool(service_of(request).snapshot, fresh=True)).by_id(message_id)
    if found is None:
        return JSONResponse({"error": f"no archived message with id {message_id!r}"}, 404)
    return JSONResponse(found.summary())


async def _body(request: Request, fields: Mapping[str, Callable[[str, Any], Any]]) -> dict[str, Any]:
    """The request's JSON object, every field checked (a 400 that names the bad one: :mod:`.api_requests`)."""
    return checked_body(await request.body(), request.headers.get("content-type"), fields)


def _not_found(body: dict[str, Any], chosen: list[ArchivedMessage]) -> list[dict[str, Any]]:
    """An ``archive-replay`` entry (outcome ``not_found``) for each of the body's ``ids`` that ``chosen`` lacks."""
    found = {m.id for m in chosen}
    return [{"id": i, "queue": "", "routing_key": "", "archived_at": "", "reason": "", "outcome": "not_found",
             "why": "no archived message has this id (replayed or purged since, or mistyped)"}
            for i in dict.fromkeys(body.get("ids") or ()) if i not in found]


def _api_selection(service: Service, body: dict[str, Any]) -> list[ArchivedMessage]:
    ids = body.get("ids")
    chosen = selection(service.snapshot(fresh=True), body.get("q", ""), body.get("before"), ids)
    limit = body.get("limit")
    return chosen[:limit] if limit is not None else chosen


@guarded
async def api_replay(request: Request) -> Response:
    """Replay (POST ``{"q", "ids", "limit", "dry_run", "to_queue"}``): the ``archive-replay`` document."""
    body, service, principal = await _body(request, REPLAY_FIELDS), service_of(request), request.state.principal
    chosen = await run_in_threadpool(_api_selection, service, body)
    missing = _not_found(body, chosen)
    if body.get("dry_run"):
        return JSONResponse({"dry_run": True, "matched": len(chosen), "replayed": 0, "kept": 0,
                             "messages": [_entry(m, "would_replay") for m in chosen] + missing})
    ids = {m.id for m in chosen}
    job_id = "api-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")

    replayed, kept = await run_in_threadpool(lambda: service.replay(
        lambda m: m.id in ids, to_queue=body.get("to_queue"), stamp=stamp(principal.name, job_id)))
    request.app.state.audit.record(principal.name, principal.role, "replay", len(replayed), job=job_id,
                                   query=body.get("q", ""), kept=len(kept), via="api")
    return JSONResponse({"dry_run": False, "matched": len(replayed) + len(kept), "replayed": len(replayed),
                         "kept": len(kept), "messages": [_entry(m, "replayed") for m in replayed]
                         + [_entry(m, "kept", why) for m, why in kept] + missing},
                        200 if not (kept or missing) else 207)


@guarded
async def api_purge(request: Request) -> Response:
    """Purge (POST ``{"q", "ids", "limit", "dry_run", "yes"}``): the ``archive-purge`` document."""
    body, service, principal = await _body(request, PURGE_FIELDS), service_of(request), request.state.principal
    if not (body.get("yes") or body.get("dry_run")):
        return JSONResponse({"error": "purge deletes archived messages for good: send \"yes\": true "
                                      "(or \"dry_run\": true to see what would go)"}, 400)
    chosen = await run_in_threadpool(_api_selection, service, body)
    if body.get("dry_run"):
        return JSONResponse({"dry_run": True, "matched": len(chosen), "purged": 0,
                             "messages": [_entry(m, "would_purge") for m in chosen]})
    removed = await run_in_threadpool(service.purge, {m.id for m in chosen})
    request.app.state.audit.record(principal.name, principal.role, "purge", len(removed),
                                   query=body.get("q", ""), via="api")
    return JSONResponse({"dry_run": False, "matched": len(removed), "purged": len(removed),
                         "messages": [_entry(m, "purged") for m in removed]})


async def api_job(request: Request) -> Response:
    """A replay job's progress as JSON."""
    found = request.app.state.jobs.get(request.path_params["job_id"])
    return JSONResponse(found.as_dict() if found else {"error": "no such job"}, 200 if found else 404)



def routes() -> list[Route]:
    """The routes of the JSON API."""
    return [
        Route("/api/archive", api_list, name="api_list"),
        id_route("/api/archive/{message_id:path}", api_show, name="api_show"),
        Route("/api/replay", api_replay, methods=["POST"], name="api_replay"),
        Route("/api/purge", api_purge, methods=["POST"], name="api_purge"),
        Route("/api/jobs/{job_id}", api_job, name="api_job"),
    ]
