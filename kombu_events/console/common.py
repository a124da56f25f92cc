"""What the console's views share: the service of a request, a rendered page, the error page for a broker
that cannot be reached or bad input (:func:`guarded`), the selection of archived messages, and the link to
an event and the route that reads its id (any id: :mod:`.links`)."""
from __future__ import annotations

__all__ = ["service_of", "page", "guarded", "selection", "event_url", "id_route", "may_act"]

import re
from typing import Any, Callable, Iterable
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import KombuEventsError
from ..ops.archive import ArchivedMessage
from . import links, query as search
from .reading import Service, Snapshot


def service_of(request: Request) -> Service:
    """The console's view of the service (set by :func:`kombu_events.console.create_app`)."""
    service: Service = request.app.state.service
    return service


def may_act(request: Request) -> bool:
    """Whoever makes ``request`` may replay, purge, cancel and edit here: an operator, and not read-only."""
    return bool(request.state.principal.can_act and not request.app.state.settings.read_only)


def event_url(request: Request, message_id: str) -> str:
    """The path of the page of the archived message ``message_id``, whatever the id holds."""
    segment = links.id_segment(message_id)
    if segment is None:
        return f"{request.url_for('event_by_query').path}?id={quote(message_id, safe='')}"
    return request.url_for("event", message_id=segment).path


def page(request: Request, template: str, status: int = 200, **context: Any) -> Response:
    """``template`` rendered with ``context`` and what every page shows (who, the service, the settings,
    whether they may act, how an id goes in a link or a form)."""
    context.update(request=request, principal=request.state.principal, service=service_of(request),
                   settings=request.app.state.settings, may_act=may_act(request),
                   event_url=lambda message_id: event_url(request, message_id), id_field=links.to_field)
    response: Response = request.app.state.templates.TemplateResponse(request, template, context, status_code=status)
    return response


def trouble(request: Request, exc: Exception) -> Response:
    """A broker that cannot be reached, or bad input: one clear line (no password: safe_url'd by the raiser),
    as JSON to the API."""
    status = 503 if not isinstance(exc, ValueError) else 400
    if "/api/" in request.url.path:
        return JSONResponse({"error": str(exc)}, status)
    return page(request, "error.html", status, error=str(exc))


def guarded(view: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Turn a broker error into an error page instead of a 500."""
    async def wrapper(request: Request) -> Any:
        try:
            return await view(request)
        except (KombuEventsError, OSError, ValueError) as exc:
            return trouble(request, exc)
    wrapper.__name__ = view.__name__
    return wrapper


def selection(snapshot: Snapshot, text: str, before: str | None, ids: Iterable[str] | None = None
               ) -> list[ArchivedMessage]:
    """The snapshot's messages the search ``text`` asks for (only ``ids`` if given), archived by ``before``."""
    query, wanted = search.parse(text), set(ids) if ids is not None else None
    return [m for m in snapshot.messages if search.matches(query, m)
            and (wanted is None or m.id in wanted) and (not before or m.archived_at <= before)]


def id_route(path: str, endpoint: Callable[..., Any], **options: Any) -> Route:
    """A Route whose ``{message_id:path}`` takes any id, newlines included.

    Starlette's ``path`` convertor is ``.*`` under ``^...$``: it stops at a newline, and ``$`` also
    matches before a final one, so ``/events/abc%0A`` would show ``abc``. The route's pattern is
    compiled again with ``.`` matching newlines and ``\\Z`` for the very end.
    """
    route = Route(path, endpoint, **options)
    pattern = route.path_regex.pattern
    route.path_regex = re.compile((pattern[:-1] if pattern.endswith("$") else pattern) + r"\Z", re.DOTALL)
    return route
