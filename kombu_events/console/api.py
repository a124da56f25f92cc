"""The console's JSON API under ``/api``: the operations of ``kombu-events archive``, answering with the
documents of its ``--json`` (the JSON Schemas in ``kombu_events/cli/schemas/``), and a replay job's progress.
"""
from __future__ import annotations

__all__ = ["routes"]

import json
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..ops.archive import ArchivedMessage, replay as replay_now
from .audit import stamp
from .common import guarded, selection, service_of
from .reading import Service


def _entry(message: ArchivedMessage, outcome: str, why: str | None = None) -> dict[str, Any]:
    return {"id": message.id, "queue": message.queue, "routing_key": message.routing_key,
            "archived_at": message.archived_at, "reason": message.reason, "outcome": outcome, "why": why}


@guarded
async def api_list(request: Request) -> Response:
    """Archived messages that match ``q`` (at most ``limit``): each one an ``archive-list`` object."""
    limit = int(request.query_params.get("limit", "50"))
    snapshot = await run_in_threadpool(service_of(request).snapshot, fresh=bool(request.query_params.get("fresh")))
    found = selection(snapshot, request.query_params.get("q", ""), None)[:max(limit, 0)]
    return JSONResponse([m.summary() for m in found])


@guarded
async def api_show(request: Request) -> Response:
    """One archived message: the ``archive-show`` document."""
    message_id = request.path_params["message_id"]
    found = (await run_in_threadpool(service_of(request).snapshot, fresh=True)).by_id(message_id)
    if found is None:
        return JSONResponse({"error": f"no archived message with id {message_id!r}"}, 404)
    return JSONResponse(found.summary())


async def _body(request: Request) -> dict[str, Any]:
    try:
        document = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise ValueError(f"the request body is not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise ValueError("the request body must be a JSON object")
    return document


def _api_selection(service: Service, body: dict[str, Any]) -> list[ArchivedMessage]:
    ids = body.get("ids")
    chosen = selection(service.snapshot(fresh=True), str(body.get("q", "")), body.get("before"), ids)
    limit = body.get("limit")
    return chosen[:int(limit)] if limit is not None else chosen


@guarded
async def api_replay(request: Request) -> Response:
    """Replay (POST ``{"q", "ids", "limit", "dry_run", "to_queue"}``): the ``archive-replay`` document."""
    body, service, principal = await _body(request), service_of(request), request.state.principal
    chosen = await run_in_threadpool(_api_selection, service, body)
    if body.get("dry_run"):
        return JSONResponse({"dry_run": True, "matched": len(chosen), "replayed": 0, "kept": 0,
                             "messages": [_entry(m, "would_replay") for m in chosen]})
    ids = {m.id for m in chosen}
    job_id = "api-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")

    def run() -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
        with service.connection() as conn:
            return replay_now(conn, service.topology, lambda m: m.id in ids, to_queue=body.get("to_queue"),
                              stamp=stamp(principal.name, job_id))

    replayed, kept = await run_in_threadpool(run)
    service.forget()
    request.app.state.audit.record(principal.name, principal.role, "replay", len(replayed), job=job_id,
                                   query=body.get("q", ""), kept=len(kept), via="api")
    return JSONResponse({"dry_run": False, "matched": len(replayed) + len(kept), "replayed": len(replayed),
                         "kept": len(kept), "messages": [_entry(m, "replayed") for m in replayed]
                         + [_entry(m, "kept", why) for m, why in kept]}, 200 if not kept else 207)


@guarded
async def api_purge(request: Request) -> Response:
    """Purge (POST ``{"q", "ids", "limit", "dry_run", "yes"}``): the ``archive-purge`` document."""
    body, service, principal = await _body(request), service_of(request), request.state.principal
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
        Route("/api/archive/{message_id:path}", api_show, name="api_show"),
        Route("/api/replay", api_replay, methods=["POST"], name="api_replay"),
        Route("/api/purge", api_purge, methods=["POST"], name="api_purge"),
        Route("/api/jobs/{job_id}", api_job, name="api_job"),
    ]
