"""The console's JSON API under ``/api``: the operations of ``kombu-events archive``, answering with the
documents of its ``--json`` (the JSON Schemas in ``kombu_events/cli/schemas/``), and a replay job's progress.

Every item names its copy by archive key; replay and purge act on archive keys (``"keys"``) or on what a
search matches, never on a message id, which several copies may share. A list is a page of at most
:data:`MAX_LIMIT` items from the console's index, each with the first KiB of its body (``truncated`` says
so; ``GET /api/archive/KEY`` has the rest of the document, ``/download?key=KEY`` the whole body). A list whose
search stopped at its time budget says so in the ``X-Search-Partial`` header; one made while the index is
still reading the archive, in ``X-Index-Catching-Up``.

A request body is a JSON object sent with ``Content-Type: application/json``, checked field by field
before anything is read or changed (:mod:`.api_requests`): a 400 names what is wrong.
"""
from __future__ import annotations

__all__ = ["routes", "MAX_LIMIT"]

from datetime import datetime, timezone
from typing import Any, Callable, Mapping

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..ops.archive import PREVIEW_BYTES, purge_note
from .api_requests import PURGE_FIELDS, REPLAY_FIELDS, checked_body, whole_number
from .audit import stamp
from .common import action_selection, guarded, id_route, selection, service_of
from .entries import Entry
from .index import IndexView
from .query import Found
from .reading import Service

#: Items a list answers with at most (``limit``), and without one.
MAX_LIMIT, DEFAULT_LIMIT = 500, 50
#: The keys of ``archive-replay`` and ``archive-purge`` the CLI's dry runs fill (``--through``, its command
#: line): the API acts on archive keys, which pin the set already.
_UNPINNED = {"through": None, "command": None}
#: What an API purge means, in every ``archive-purge`` it answers with: the copies stay in the stream, hidden,
#: until retention or a rewrite (``kombu-events archive purge --for-good``, which the API does not offer).
_PURGE_MEANS = {"hidden_until_retention": True, "note": purge_note()}


def _entry(message: Any, outcome: str, why: str | None = None) -> dict[str, Any]:
    return {"key": message.key, "id": message.id, "queue": message.queue, "routing_key": message.routing_key,
            "archived_at": message.archived_at, "reason": message.reason, "outcome": outcome, "why": why}


def _listed(service: Service, text: str, limit: int, budget_s: float) -> tuple[IndexView, Found]:
    view = service.view()
    with service.search_turn(text):
        return view, selection(view, text, limit=limit, budget_s=budget_s)


@guarded
async def api_list(request: Request) -> Response:
    """Archived copies that match ``q`` (at most ``limit``, oldest first), from the index."""
    limit = whole_number("limit", request.query_params.get("limit"), DEFAULT_LIMIT, at_most=MAX_LIMIT)
    view, found = await run_in_threadpool(_listed, service_of(request), request.query_params.get("q", ""), limit,
                                          request.app.state.settings.search_budget_s)
    headers = {}
    if found.partial:
        headers["x-search-partial"] = f"searched {found.searched} of {found.total} copies in {found.took_s:.2f} s"
    if not view.caught_up:
        headers["x-index-catching-up"] = f"{view.records} records read so far"
    return JSONResponse([e.summary() for e in found.matched], headers=headers)


def _show(service: Service, key: str) -> dict[str, Any] | tuple[int, str]:
    """The ``archive-show`` document of the copy ``key`` (a message id held by one copy will do), or why not."""
    entry = service.entry(key)
    if entry is None:
        copies = service.with_id(key)
        if len(copies) > 1:
            return 409, (f"{len(copies)} archived copies have the message id {key!r}: ask for one by its archive "
                         f"key ({', '.join(e.key for e in copies[:10])})")
        entry = copies[0] if copies else None
    message = service.read(entry, body_limit=PREVIEW_BYTES) if entry is not None else None
    if message is None:
        return 404, f"no archived copy with key {key!r}"
    return message.summary()


@guarded
async def api_show(request: Request) -> Response:
    """One archived copy: the ``archive-show`` document, its body cut to a preview (``truncated`` says so)."""
    found = await run_in_threadpool(_show, service_of(request), request.path_params["key"])
    if isinstance(found, tuple):
        return JSONResponse({"error": found[1]}, found[0])
    return JSONResponse(found)


async def _body(request: Request, fields: Mapping[str, Callable[[str, Any], Any]]) -> dict[str, Any]:
    """The request's JSON object, every field checked (a 400 that names the bad one: :mod:`.api_requests`)."""
    return checked_body(await request.body(), request.headers.get("content-type"), fields)


def _not_found(body: dict[str, Any], chosen: list[Entry]) -> list[dict[str, Any]]:
    """An entry (outcome ``not_found``) for each of the body's ``keys`` that ``chosen`` lacks."""
    found = {e.key for e in chosen}
    return [{"key": k, "id": "", "queue": "", "routing_key": "", "archived_at": "", "reason": "",
             "outcome": "not_found", "why": "no archived copy has this archive key (replayed or purged since, "
                                            "or mistyped)"}
            for k in dict.fromkeys(body.get("keys") or ()) if k not in found]


def _api_selection(service: Service, body: dict[str, Any]) -> list[Entry]:
    chosen = action_selection(service.view(), body.get("q", ""), keys=body.get("keys"), before=body.get("before"))
    limit = body.get("limit")
    return chosen[:limit] if limit is not None else chosen


@guarded
async def api_replay(request: Request) -> Response:
    """Replay (POST ``{"q", "keys", "limit", "dry_run", "to_queue", "before"}``): the ``archive-replay``
    document."""
    body, service, principal = await _body(request, REPLAY_FIELDS), service_of(request), request.state.principal
    chosen = await run_in_threadpool(_api_selection, service, body)
    missing = _not_found(body, chosen)
    if body.get("dry_run"):
        return JSONResponse({"dry_run": True, "matched": len(chosen), "replayed": 0, "kept": 0,
                             "messages": [_entry(e, "would_replay") for e in chosen] + missing, **_UNPINNED})
    keys = {e.key for e in chosen}
    job_id = "api-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    replayed, kept = await run_in_threadpool(lambda: service.replay(
        lambda m: m.key in keys, to_queue=body.get("to_queue"), stamp=stamp(principal.name, job_id),
        by=principal.name, start=service.first_offset(keys)))
    request.app.state.audit.record(principal.name, principal.role, "replay", len(replayed), job=job_id,
                                   query=body.get("q", ""), kept=len(kept), via="api")
    return JSONResponse({"dry_run": False, "matched": len(replayed) + len(kept), "replayed": len(replayed),
                         "kept": len(kept), "messages": [_entry(m, "replayed") for m in replayed]
                         + [_entry(m, "kept", why) for m, why in kept] + missing, **_UNPINNED},
                        200 if not (kept or missing) else 207)


@guarded
async def api_purge(request: Request) -> Response:
    """Purge (POST ``{"q", "keys", "limit", "dry_run", "yes", "before"}``): the ``archive-purge`` document.
    Purged copies are hidden from every reader at once; the stream keeps them until retention or a rewrite
    (``hidden_until_retention``: true, and a ``note`` that says so)."""
    body, service, principal = await _body(request, PURGE_FIELDS), service_of(request), request.state.principal
    if not (body.get("yes") or body.get("dry_run")):
        return JSONResponse({"error": "purge hides archived copies from every reader: send \"yes\": true "
                                      "(or \"dry_run\": true to see what it would hide)"}, 400)
    chosen = await run_in_threadpool(_api_selection, service, body)
    if body.get("dry_run"):
        return JSONResponse({"dry_run": True, "matched": len(chosen), "purged": 0, "erased": 0,
                             "messages": [_entry(e, "would_purge") for e in chosen], **_UNPINNED, **_PURGE_MEANS})
    purged = await run_in_threadpool(lambda: service.purge([e.key for e in chosen], by=principal.name,
                                                           note="console api"))
    request.app.state.audit.record(principal.name, principal.role, "purge", len(purged),
                                   query=body.get("q", ""), via="api", keys=[m.key for m in purged])
    return JSONResponse({"dry_run": False, "matched": len(chosen), "purged": len(purged), "erased": 0,
                         "messages": [_entry(m, "purged") for m in purged], **_UNPINNED, **_PURGE_MEANS})


async def api_job(request: Request) -> Response:
    """A replay job's progress as JSON."""
    found = request.app.state.jobs.get(request.path_params["job_id"])
    return JSONResponse(found.as_dict() if found else {"error": "no such job"}, 200 if found else 404)


def routes() -> list[Route]:
    """The routes of the JSON API."""
    return [
        Route("/api/archive", api_list, name="api_list"),
        id_route("/api/archive/{key:path}", api_show, name="api_show"),
        Route("/api/replay", api_replay, methods=["POST"], name="api_replay"),
        Route("/api/purge", api_purge, methods=["POST"], name="api_purge"),
        Route("/api/jobs/{job_id}", api_job, name="api_job"),
    ]
