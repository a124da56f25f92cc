"""What the console's views share: the service of a request, a rendered page, the error page for a broker
that cannot be reached or bad input (:func:`guarded`), the selection of archived copies from the index, and
the link to an event's page and the route that reads its archive key (any key: :mod:`.links`)."""
from __future__ import annotations

__all__ = ["service_of", "page", "guarded", "selection", "action_selection", "event_url", "id_route", "may_act",
           "ACTION_BUDGET_S"]

import re
from typing import Any, Callable, Collection

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import KombuEventsError
from . import links, query as search
from .entries import Entry
from .index import IndexView
from .reading import Busy, Service

#: How long the search that selects what a replay or a purge acts on may take: it must look at every copy.
ACTION_BUDGET_S = 10.0


def service_of(request: Request) -> Service:
    """The console's view of the service (set by :func:`kombu_events.console.create_app`)."""
    service: Service = request.app.state.service
    return service


def may_act(request: Request) -> bool:
    """Whoever makes ``request`` may replay, purge, cancel and edit here: an operator, and not read-only."""
    return bool(request.state.principal.can_act and not request.app.state.settings.read_only)


def event_url(request: Request, key: str) -> str:
    """The path of the page of the archived copy ``key``, whatever the key holds."""
    segment = links.id_segment(key)
    if segment is None:
        return f"{request.url_for('event_by_query').path}?key={links.to_field(key)}"
    return request.url_for("event", key=segment).path


def page(request: Request, template: str, status: int = 200, **context: Any) -> Response:
    """``template`` rendered with ``context`` and what every page shows (who, the service, the settings,
    whether they may act, how a key goes in a link or a form)."""
    context.update(request=request, principal=request.state.principal, service=service_of(request),
                   settings=request.app.state.settings, may_act=may_act(request),
                   event_url=lambda key: event_url(request, key), id_field=links.to_field,
                   download_url=lambda key: f"{request.url_for('download').path}?key={links.to_field(key)}")
    response: Response = request.app.state.templates.TemplateResponse(request, template, context, status_code=status)
    return response


def trouble(request: Request, exc: Exception) -> Response:
    """A broker that cannot be reached, or bad input: one clear line (no password: safe_url'd by the raiser),
    as JSON to the API."""
    status = 503 if not isinstance(exc, ValueError) else 400
    headers = {"retry-after": "2"} if isinstance(exc, Busy) else None
    if "/api/" in request.url.path:
        return JSONResponse({"error": str(exc)}, status, headers=headers)
    response = page(request, "error.html", status, error=str(exc))
    response.headers.update(headers or {})
    return response


def guarded(view: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Turn a broker error into an error page instead of a 500."""
    async def wrapper(request: Request) -> Any:
        try:
            return await view(request)
        except (KombuEventsError, OSError, ValueError) as exc:
            return trouble(request, exc)
    wrapper.__name__ = view.__name__
    return wrapper


def selection(view: IndexView, text: str, *, through: int | None = None, keys: Collection[str] | None = None,
              before: str | None = None, budget_s: float | None,
              limit: int | None = None) -> search.Found:
    """The index's copies that the search ``text`` asks for: only ``keys`` if given, at or before offset
    ``through``, archived by ``before`` (at most ``limit``, within ``budget_s``)."""
    query = search.parse(text)
    copies: tuple[Entry, ...] | list[Entry] = view.entries
    if keys is not None or through is not None or before:
        wanted = set(keys) if keys is not None else None
        copies = [e for e in view.entries if (wanted is None or e.key in wanted)
                  and (through is None or e.offset <= through) and (not before or e.archived_at <= before)]
    return search.search(copies, query, budget_s=budget_s, limit=limit)


def action_selection(view: IndexView, text: str, **options: Any) -> list[Entry]:
    """What a replay or a purge of the search ``text`` acts on (see :func:`selection`): every copy it asks
    for, or a ValueError when the search could not look at them all in :data:`ACTION_BUDGET_S`."""
    found = selection(view, text, budget_s=ACTION_BUDGET_S, **options)
    if found.partial:
        raise ValueError(f"the search looked at {found.searched:,} of {found.total:,} archived copies in "
                         f"{ACTION_BUDGET_S:g} s and stopped: nothing was done. Narrow it (handler:, key:, "
                         "exception:, group:, since:)")
    return found.matched


def id_route(path: str, endpoint: Callable[..., Any], **options: Any) -> Route:
    """A Route whose ``{key:path}`` takes any key, newlines included.

    Starlette's ``path`` convertor is ``.*`` under ``^...$``: it stops at a newline, and ``$`` also
    matches before a final one, so ``/events/abc%0A`` would show ``abc``. The route's pattern is
    compiled again with ``.`` matching newlines and ``\\Z`` for the very end.
    """
    route = Route(path, endpoint, **options)
    pattern = route.path_regex.pattern
    route.path_regex = re.compile((pattern[:-1] if pattern.endswith("$") else pattern) + r"\Z", re.DOTALL)
    return route
