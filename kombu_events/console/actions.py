"""The console's actions, each a POST from its own pages (or its GET confirmation): replay (a dry run, or a
job), edit-and-replay, cancel a job, purge; and a job's progress. Each acts on archive keys, through the
functions the ``kombu-events archive`` commands use (:mod:`kombu_events.ops.archive`, by way of
:class:`.reading.Service` and :mod:`.jobs`), on exactly the selection the operator confirmed.
"""
from __future__ import annotations

__all__ = ["replay", "edit", "job", "cancel", "purge_page", "DRY_RUN_ROWS"]

import math
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from . import links
from .api_requests import whole_number
from .audit import stamp
from .common import action_selection, guarded, page, service_of
from .entries import Entry
from .reading import Service
from .views import retention

#: Rows of a dry run's table (the confirmation acts on them all: the count says how many).
DRY_RUN_ROWS = 200


def _rate(text: str) -> float | None:
    """The replay form's rate limit: copies a second (empty or 0: no limit)."""
    if not text.strip() or text.strip() == "0":
        return None
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a number of copies a second above 0 (empty: no limit), got {text!r}")
    return rate


def _through(params: Any) -> int | None:
    """The offset a page's selection was made at (absent: the index as it is now)."""
    text = str(params.get("through") or "") or None
    return whole_number("through", text, -1) if text is not None else None


def _chosen(service: Service, text: str, through: int | None, keys: list[str] | None
            ) -> tuple[list[Entry], tuple[str, ...], int]:
    """What a replay or a purge acts on, the keys asked for that are not archived, and the offset it was
    selected at."""
    view = service.view()
    through = view.through if through is None else through
    chosen = action_selection(view, text, through=through, keys=keys)
    found = {e.key for e in chosen}
    return chosen, tuple(k for k in dict.fromkeys(keys or ()) if k not in found), through


@guarded
async def replay(request: Request) -> Response:
    """Replay the selected copies, a group or all matching: a dry run, or a job (POST)."""
    form = await request.form()
    text, through = str(form.get("q", "")), _through(form)
    scope = form.get("scope")
    if scope not in ("matching", "selected"):
        raise ValueError(f"scope must be 'matching' (all the search matches) or 'selected' (the keys sent), "
                         f"got {scope!r}")
    keys = [links.from_field(str(k)) for k in form.getlist("key")] if scope == "selected" else None
    to_queue = str(form.get("to_queue", "")) or None
    rate = _rate(str(form.get("rate") or ""))
    service = service_of(request)
    if to_queue is not None and to_queue not in {q.name for q in service.topology.handler_queues}:
        raise ValueError(f"{to_queue!r} is not a handler queue of service {service.name}")
    chosen, missing, through = await run_in_threadpool(_chosen, service, text, through, keys)
    expected = form.get("count")
    changed = expected is not None and str(expected) != str(len(chosen))
    if form.get("dry_run") or changed:
        plan = [(e, to_queue or e.queue) for e in chosen]
        return page(request, "dry_run.html", plan=plan[:DRY_RUN_ROWS], count=len(plan), q=text, scope=scope,
                    through=through, keys=keys, to_queue=to_queue, rate=rate, missing=missing, changed=changed)
    principal = request.state.principal
    job = request.app.state.jobs.start(principal.name, principal.role, frozenset(e.key for e in chosen), text,
                                       to_queue=to_queue, rate_per_s=rate, missing=missing)
    return RedirectResponse(request.url_for("job", job_id=job.id).path, status_code=303)


@guarded
async def edit(request: Request) -> Response:
    """Edit-and-replay one copy (POST; only when the console was started with it enabled): the edited body
    goes to the copy's queue under a message id derived from its archive key and the body, the original's id
    in a header."""
    service, principal = service_of(request), request.state.principal
    if not request.app.state.settings.allow_edit:
        return page(request, "error.html", 403, error="edit-and-replay is off (start the console with "
                                                       "--allow-edit to turn it on)")
    form = await request.form()
    key = request.path_params.get("key")
    if key is None:
        if not form.get("key"):
            raise ValueError("which event? the form sends its archive key in the field 'key'")
        key = links.from_field(str(form.get("key")))
    edited = str(form.get("body", "")).encode("utf-8")
    job_id = "edit-" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    replayed, kept = await run_in_threadpool(lambda: service.replay(
        lambda m: m.key == key, 1, stamp=stamp(principal.name, job_id), edits={key: edited}, by=principal.name,
        start=service.first_offset([key])))
    request.app.state.audit.record(principal.name, principal.role, "edit and replay", len(replayed),
                                   job=job_id, original=key, kept=len(kept))
    if not replayed:
        why = kept[0][1] if kept else "not in the archive any more"
        return page(request, "error.html", 409, error=f"{key}: nothing replayed ({why})")
    return page(request, "purged.html", count=1, q="", edited=replayed[0])


async def job(request: Request) -> Response:
    """A replay job's progress (``?fragment=1``: the part the page refreshes)."""
    found = request.app.state.jobs.get(request.path_params["job_id"])
    if found is None:
        return page(request, "error.html", 404, error="no such job (jobs are kept until the console restarts)")
    template = "_job_progress.html" if request.query_params.get("fragment") else "job.html"
    return page(request, template, job=found)


async def cancel(request: Request) -> Response:
    """Cancel a replay job (POST): it stops after the window being sent; what was settled stays settled."""
    jobs = request.app.state.jobs
    found = jobs.get(request.path_params["job_id"])
    if found is not None:
        jobs.cancel(found, request.state.principal.name, request.state.principal.role)
    return RedirectResponse(request.url_for("job", job_id=request.path_params["job_id"]).path, status_code=303)


@guarded
async def purge_page(request: Request) -> Response:
    """GET: the confirmation, stating scope, count and what a purge means; POST: purge exactly what was
    confirmed (the same count, at or before the same offset), else ask again."""
    service, settings = service_of(request), service_of(request).topology.settings
    params: Any = await request.form() if request.method == "POST" else request.query_params
    text, through = str(params.get("q", "")), _through(params)
    chosen, _, through = await run_in_threadpool(_chosen, service, text, through, None)
    changed = request.method == "POST" and str(params.get("count")) != str(len(chosen))
    if request.method == "GET" or changed:
        return page(request, "purge.html", q=text, through=through, count=len(chosen), changed=changed,
                    queues=sorted({e.queue for e in chosen}), retention=retention(settings))
    principal = request.state.principal
    purged = await run_in_threadpool(lambda: service.purge([e.key for e in chosen], by=principal.name,
                                                           note=f"console: search {text!r}" if text else "console"))
    request.app.state.audit.record(principal.name, principal.role, "purge", len(purged), query=text,
                                   through=through, keys=[m.key for m in purged])
    return page(request, "purged.html", count=len(purged), q=text, retention=retention(settings))
