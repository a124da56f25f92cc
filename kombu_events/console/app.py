"""The console as an ASGI application: :func:`create_app` for an Events service, to serve with uvicorn
(``kombu-events console``) or to mount inside another Starlette/FastAPI application.

The application follows the service's archive into its index from its start (the first page that needs
the index starts it too, for an application mounted in another one, whose lifespan it does not see).

Every request goes through :class:`Guard` first: it authenticates (:mod:`.auth`), slows down a
client after failed logins (:mod:`.logins`), refuses a state change that is not a POST from the
console's own pages (or a script with a valid bearer token), from a viewer, or while the console is
read-only, and adds the security headers (the content security policy among them) to every answer,
errors included.
"""
from __future__ import annotations

__all__ = ["ConsoleSettings", "create_app"]

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Receive, Scope, Send

from ..core.logs import escape_controls
from ..registry import EventsService
from .audit import AuditLog
from .auth import SECURITY_HEADERS, AuthSettings, Principal, authenticate, claimed_login, cross_site_refusal
from .jobs import Jobs
from .logins import FailedLogins, LoginLimits, retry_after
from .query import SEARCH_BUDGET_S
from .reading import Service
from .routes import routes

logger = logging.getLogger(__name__)

_SAFE_METHODS = frozenset({"GET", "HEAD"})


@dataclass(frozen=True)
class ConsoleSettings:
    """What the console allows: authentication, a read-only switch, edit-and-replay, where the audit goes.

    ``page_size``: copies listed on the failures page (the groups count them all).
    ``search_budget_s``: how long a search of a page or of the API's list may take before it stops and says
    "partial results" (:func:`.query.search`).
    ``logins``: how failed logins slow down the client that makes them (:class:`.logins.LoginLimits`).
    ``max_age_s`` is ignored (the console keeps an index of the archive, no snapshot to age): it stays so that
    code passing it still starts.
    """

    auth: AuthSettings = field(default_factory=AuthSettings)
    read_only: bool = False
    allow_edit: bool = False
    audit_path: Path | None = None
    max_age_s: float = 10.0
    management_url: str | None = None
    page_size: int = 100
    search_budget_s: float = SEARCH_BUDGET_S
    logins: LoginLimits = field(default_factory=LoginLimits)


class Guard:
    """ASGI middleware: authentication, failed logins, roles, the read-only switch, the cross-site check,
    and the security headers on every answer (a refusal, a 404 or a server error as well)."""

    def __init__(self, app: ASGIApp, settings: ConsoleSettings, logins: FailedLogins | None = None) -> None:
        self.app, self.settings = app, settings
        self.logins = logins if logins is not None else FailedLogins(settings.logins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sender(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                names = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items() if k.encode() not in names]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self._guarded(scope, receive, sender)
        except Exception:
            if not started:  # Starlette's own 500 would come from outside this middleware, without the headers
                await _server_error(scope["path"])(scope, receive, sender)
            raise  # the server logs it, as before

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope)
        headers = {k.lower(): v for k, v in request.headers.items()}
        client = request.client.host if request.client else None
        claimed = claimed_login(headers)
        wait_s = self.logins.wait_s(client) if claimed is not None else 0.0
        if wait_s:
            await PlainTextResponse(f"too many failed logins from {client}: try again in {retry_after(wait_s)} s\n",
                                    429, headers={"retry-after": retry_after(wait_s)})(scope, receive, send)
            return
        principal = authenticate(headers, client, self.settings.auth)
        if claimed is not None:
            self._count_login(claimed, client, principal)
        refusal = self._refusal(request, headers, principal)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)

    def _count_login(self, claimed: str, client: str | None, principal: Principal | None) -> None:
        """Credentials were presented: a failure is counted and logged (who they claimed to be, from
        where; never the secret), a success forgets the client's failures."""
        if principal is not None:
            self.logins.succeeded(client)
            return
        failures, next_s = self.logins.failed(client)
        logger.warning("console: failed login as %s from %s (%d in a row; next try allowed in %g s)",
                       escape_controls(claimed), client, failures, next_s)

    def _refusal(self, request: Request, headers: dict[str, str], principal: Any) -> Response | None:
        if principal is None:
            challenge = {"www-authenticate": 'Basic realm="kombu-events console", charset="UTF-8"'} \
                if self.settings.auth.passwords else {}
            return PlainTextResponse("authentication required\n", 401, headers=challenge)
        if request.method in _SAFE_METHODS:
            return None
        if request.method != "POST":
            return PlainTextResponse("method not allowed\n", 405)
        why = cross_site_refusal(headers, request.url.scheme, by_token=principal.how == "token")
        if why is not None:
            logger.warning("console: %s from %s", escape_controls(why), escape_controls(principal.name))
            return PlainTextResponse(why + "\n", 403)
        if not principal.can_act:
            return PlainTextResponse(f"{principal.name} is a viewer: replay and purge need the operator role\n", 403)
        if self.settings.read_only:
            return PlainTextResponse("the console is read-only (started with --read-only)\n", 403)
        return None


def _server_error(path: str) -> Response:
    """What a request that broke the console gets: no detail (the server's log has the traceback)."""
    what = "the console failed to answer this request (an internal error: the server's log says which)"
    if "/api/" in path:
        return JSONResponse({"error": what}, 500)
    return PlainTextResponse(what + "\n", 500)


def _folder(name: str) -> str:
    return str(resources.files("kombu_events.console").joinpath(name))


@asynccontextmanager
async def _following(app: Starlette) -> AsyncIterator[None]:
    """The application's lifespan: the index follows the archive while it runs."""
    service: Service = app.state.service
    service.start()
    try:
        yield
    finally:
        await run_in_threadpool(service.stop)


def create_app(events: EventsService, settings: ConsoleSettings | None = None, *,
               broker_url: str | None = None) -> Starlette:
    """The console of ``events`` (a :class:`kombu_events.Events`) as an ASGI application.

    Mount it under a prefix of your own application (``Mount("/events-console", app=...)``):
    every link it makes is relative to where it is mounted. Its own authentication applies
    there too (give ``settings.auth`` a proxy header when your application authenticates).
    """
    settings = settings or ConsoleSettings()
    service = Service(events, broker_url=broker_url, management_url=settings.management_url)
    audit = AuditLog(settings.audit_path)
    templates = Jinja2Templates(directory=_folder("templates"))
    logins = FailedLogins(settings.logins)
    app = Starlette(routes=[*routes(), Mount("/static", StaticFiles(directory=_folder("static")), name="static")],
                    middleware=[Middleware(Guard, settings=settings, logins=logins)], lifespan=_following)
    app.state.service, app.state.settings, app.state.audit = service, settings, audit
    app.state.logins = logins
    app.state.jobs, app.state.templates = Jobs(service, audit), templates
    return app
