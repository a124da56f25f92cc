"""What the console's views share: the service of a request, a rendered page, the error page for a broker
that cannot be reached or bad input (:func:`guarded`), and the selection of archived messages."""
from __future__ import annotations

__all__ = ["service_of", "page", "guarded", "selection"]

from typing import Any, Callable, Iterable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import KombuEventsError
from ..ops.archive import ArchivedMessage
from . import query as search
from .reading import Service, Snapshot


def service_of(request: Request) -> Service:
    """The console's view of the service (set by :func:`kombu_events.console.create_app`)."""
    service: Service = request.app.state.service
    return service


def page(request: Request, template: str, status: int = 200, **context: Any) -> Response:
    """``template`` rendered with ``context`` and what every page shows (who, the service, the settings)."""
    context.update(request=request, principal=request.state.principal, service=service_of(request),
                   settings=request.app.state.settings)
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


