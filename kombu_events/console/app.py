"""The console as an ASGI application: :func:`create_app` for an Events service, to serve with uvicorn
(``kombu-events console``) or to mount inside another Starlette/FastAPI application.

Every request goes through :class:`Guard` first: it authenticates (:mod:`.auth`), refuses a
state change that is not a POST from the console's own pages, from a viewer, or while the
console is read-only, and adds the security headers (the content security policy among them)
to every answer.
"""
from __future__ import annotations

__all__ = ["ConsoleSettings", "create_app"]

import logging
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Receive, Scope, Send

from .audit import AuditLog
from .auth import SECURITY_HEADERS, AuthSettings, authenticate, cross_site_refusal
from .jobs import Jobs
from .reading import Service
from .routes import routes

logger = logging.getLogger(__name__)

_SAFE_METHODS = frozenset({"GET", "HEAD"})


@dataclass(frozen=True)
class ConsoleSettings:
    """What the console allows: authentication, a read-only switch, edit-and-replay, where the audit goes.

    ``max_age_s``: how old an archive snapshot may be before a page reads the archive again.
    """

    auth: AuthSettings = field(default_factory=AuthSettings)
    read_only: bool = False
    allow_edit: bool = False
    audit_path: Path | None = None
    max_age_s: float = 10.0
    management_url: str | None = None
    page_size: int = 100


class Guard:
    """ASGI middleware: authentication, roles, the read-only switch, the cross-site check, security headers."""

    def __init__(self, app: ASGIApp, settings: ConsoleSettings) -> None:
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        headers = {k.lower(): v for k, v in request.headers.items()}
        principal = authenticate(headers, request.client.host if request.client else None, self.settings.auth)
        refusal = self._refusal(request, headers, principal)
        if refusal is not None:
            await self._secured(refusal)(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, self._with_headers(send))

    def _refusal(self, request: Request, headers: dict[str, str], principal: Any) -> Response | None:
        if principal is None:
            challenge = {"www-authenticate": 'Basic realm="kombu-events console", charset="UTF-8"'} \
                if self.settings.auth.passwords else {}
            return PlainTextResponse("authentication required\n", 401, headers=challenge)
        if request.method in _SAFE_METHODS:
            return None
        if request.method != "POST":
            return PlainTextResponse("method not allowed\n", 405)
        why = cross_site_refusal(headers, request.url.scheme)
        if why is not None:
            logger.warning("console: %s from %s", why, principal.name)
            return PlainTextResponse(why + "\n", 403)
        if not principal.can_act:
            return PlainTextResponse(f"{principal.name} is a viewer: replay and purge need the operator role\n", 403)
        if self.settings.read_only:
            return PlainTextResponse("the console is read-only (started with --read-only)\n", 403)
        return None

    @staticmethod
    def _secured(response: Response) -> Response:
        response.headers.update(SECURITY_HEADERS)
        return response

    @staticmethod
    def _with_headers(send: Send) -> Send:
        async def sender(message: Any) -> None:
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items() if k.encode() not in names]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)
        return sender


def _folder(name: str) -> str:
    return str(resources.files("kombu_events.console").joinpath(name))


def create_app(events: Any, settings: ConsoleSettings | None = None, *, broker_url: str | None = None) -> Starlette:
    """The console of ``events`` (a :class:`kombu_events.Events`) as an ASGI application.

    Mount it under a prefix of your own application (``Mount("/events-console", app=...)``):
    every link it makes is relative to where it is mounted. Its own authentication applies
    there too (give ``settings.auth`` a proxy header when your application authenticates).
    """
    settings = settings or ConsoleSettings()
    service = Service(events, broker_url=broker_url, max_age_s=settings.max_age_s,
                      management_url=settings.management_url)
    audit = AuditLog(settings.audit_path)
    templates = Jinja2Templates(directory=_folder("templates"))
    app = Starlette(routes=[*routes(), Mount("/static", StaticFiles(directory=_folder("static")), name="static")],
                    middleware=[Middleware(Guard, settings=settings)])
    app.state.service, app.state.settings, app.state.audit = service, settings, audit
    app.state.jobs, app.state.templates = Jobs(service, audit), templates
    return app
