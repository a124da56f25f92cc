"""The console's own application over a stubbed archive (no broker, no socket), and a browser's reading of its
pages: the kit of test_console_guard.py and test_console_routes.py (it holds no test of its own).

The stub is the console's one seam to the broker, :class:`kombu_events.console.reading.Service`: its index is
the console's own :class:`~kombu_events.console.index.ArchiveIndex`, fed the records of an archive kept in
memory (archived copies, then the settlements its purges and replays append, as the stream would hold them);
its ``connection`` refuses, so any route that goes around the seam fails loudly.
"""
from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any, Callable, Iterable
from urllib.parse import unquote, urlencode, urljoin, urlsplit

from celery import Celery
from starlette.testclient import TestClient

from kombu_events import Events
from kombu_events.console import AuthSettings, ConsoleSettings, create_app
from kombu_events.console.entries import Entry
from kombu_events.console.index import IndexView
from kombu_events.console.jobs import Jobs
from kombu_events.console.reading import Service
from kombu_events.core.archive_records import PURGED, REPLAYED, Settlement
from kombu_events.ops.archive import ArchivedMessage, ReplayProgress
from kombu_events.ops.status import QueueStatus

OPERATOR_PW, VIEWER_PW = "operator-pw-0123456789", "viewer-pw-0123456789"
OPERATOR_TOKEN, VIEWER_TOKEN = "o" * 32, "v" * 32
AUTH = AuthSettings(passwords={"operator": OPERATOR_PW, "viewer": VIEWER_PW},
                    tokens={OPERATOR_TOKEN: ("ci-bot", "operator"), VIEWER_TOKEN: ("peek-bot", "viewer")})
SAME_ORIGIN = {"Sec-Fetch-Site": "same-origin"}
BROKER_URL = "amqp://guest:broker-secret-pw@rabbit.test:5672//"


def basic(user: str, password: str) -> dict[str, str]:
    """An ``Authorization: Basic`` header."""
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


OPERATOR, VIEWER = basic("alice", OPERATOR_PW), basic("bob", VIEWER_PW)
BEARER_OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
BEARER_VIEWER = {"Authorization": f"Bearer {VIEWER_TOKEN}"}
JSON = {"Content-Type": "application/json"}


def key_of(message_id: str, copy: int = 0) -> str:
    """The archive key the tests give the ``copy``-th archived copy of ``message_id`` (20 hex digits)."""
    return hashlib.sha1(f"{message_id}\0{copy}".encode()).hexdigest()[:20]


def archived(message_id: str, handler: str = "orders", exception: str = "KeyError: 'order 1 not found'",
             body: bytes = b'{"order": 1}', archived_at: str = "2026-11-25T10:15:00.000+00:00",
             key: str | None = None) -> ArchivedMessage:
    """One archived copy of service ``svc`` as the worker archives it (its offset: set by the stub)."""
    return ArchivedMessage(key=key or key_of(message_id), offset=-1, id=message_id, queue=f"svc.{handler}",
                           routing_key=f"{handler}.1.created", reason=f"gave up after 3 attempts: {exception}",
                           attempts=3, archived_at=archived_at, exception=exception,
                           traceback=f"Traceback ...\n{exception}\n", headers={},
                           properties={"message_id": message_id, "content_type": "application/json"},
                           body=body, size=len(body))


class ArchiveStub(Service):
    """A Service whose archive stream is a list in memory, read by the console's own index; what was purged
    and replayed is recorded (by archive key)."""

    catch_up_wait_s = 0.0  # nothing more will come: a page made while "catching up" answers at once

    def __init__(self, events: Events, messages: Iterable[ArchivedMessage] = ()) -> None:
        super().__init__(events, broker_url=BROKER_URL)
        self.stream: list[ArchivedMessage | Settlement] = []
        self.purged: list[str] = []
        self.replayed: list[tuple[str, str | None, bytes | None]] = []  # (key, to_queue, edited body)
        self.fail_with: BaseException | None = None
        for message in messages:
            self.add(message)
        self.index.reached(len(self.stream) - 1 if self.stream else None)

    def add(self, message: ArchivedMessage) -> ArchivedMessage:
        """Append ``message`` to the archive (as a worker does), read by the index at once."""
        message.offset = len(self.stream)
        self.stream.append(message)
        self.index.apply(message)
        return message

    def settle(self, action: str, keys: list[str], by: str = "someone") -> None:
        """Append a settlement of ``keys`` (as another console or the CLI does), read by the index at once."""
        record = Settlement(action, tuple(keys), by, "2026-11-25T12:00:00.000+00:00", offset=len(self.stream))
        self.stream.append(record)
        self.index.apply(record)

    @property
    def messages(self) -> list[ArchivedMessage]:
        """The copies still archived, in stream order."""
        return [m for m in self.stream if isinstance(m, ArchivedMessage) and self.index.get(m.key) is not None]

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def connection(self) -> Any:
        raise AssertionError("the archive stub has no broker: act through the Service's methods")

    def status(self) -> list[QueueStatus]:
        self._maybe_fail()
        return [QueueStatus(q.name, "handler", 0, 0, 1, state="consuming") for q in self.topology.handler_queues] \
            + [QueueStatus("svc.archive", "archive", len(self.messages), 0, 0)]

    def view(self) -> IndexView:
        self._maybe_fail()
        return super().view()

    def entry(self, key: str) -> Entry | None:
        self._maybe_fail()
        return super().entry(key)

    def read(self, entry: Entry, *, body_limit: int | None) -> ArchivedMessage | None:
        found = self.stream[entry.offset]
        assert isinstance(found, ArchivedMessage) and found.key == entry.key
        if body_limit is None:
            return found
        return ArchivedMessage(**{**found.__dict__, "body": found.body[:body_limit]})

    def purge(self, keys: Any, *, by: str, note: str = "") -> list[ArchivedMessage]:
        chosen = [m for m in self.messages if m.key in set(keys)]
        self.settle(PURGED, [m.key for m in chosen], by)
        self.purged += [m.key for m in chosen]
        return chosen

    def replay(self, match: Callable[[ArchivedMessage], bool], limit: int | None = None, *,
               to_queue: str | None = None, stamp: Any = None, edits: dict[str, bytes] | None = None,
               progress: ReplayProgress | None = None, window: int = 200,
               on_window: Callable[[list[ArchivedMessage]], Any] | None = None, **options: Any
               ) -> tuple[list[ArchivedMessage], list[tuple[ArchivedMessage, str]]]:
        chosen = [m for m in self.messages if match(m)][:limit]
        if progress is not None:
            chosen = [m for m in chosen if m.key not in progress.settled]
        for start in range(0, len(chosen), window):  # as ops.archive.replay: a window sent, then settled
            batch = chosen[start:start + window]
            self.settle(REPLAYED, [m.key for m in batch], "console")
            self.replayed += [(m.key, to_queue, (edits or {}).get(m.key)) for m in batch]
            if progress is not None:
                progress.copies_confirmed += len(batch)
                progress.commits += 1
                progress.settled.update(m.key for m in batch)
            if on_window is not None:
                on_window(batch)
        return chosen, []

    def _maybe_fail(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with


def events_of_svc() -> Events:
    """Service ``svc`` with two handlers, ``orders`` and ``users`` (nothing connects)."""
    events = Events(Celery("svc", broker=BROKER_URL), service="svc", delay_levels=2)
    for name in ("orders", "users"):
        events.handler(f"{name}.#", name=name)(lambda event: None)
    return events


@dataclass
class Console:
    """The application over a stub, and a client of it from 127.0.0.1 (500s answered, not raised)."""

    stub: ArchiveStub
    app: Any
    web: TestClient

    @property
    def audit(self) -> list[dict[str, Any]]:
        return self.app.state.audit.recent()


def console(messages: Iterable[ArchivedMessage] = (), *, client: str = "127.0.0.1",
            base_url: str = "http://127.0.0.1:8089", **settings: Any) -> Console:
    """The console of service ``svc`` over an ArchiveStub holding ``messages``."""
    settings.setdefault("auth", AUTH)
    events = events_of_svc()
    app = create_app(events, ConsoleSettings(**settings))
    stub = ArchiveStub(events, messages)
    app.state.service, app.state.jobs = stub, Jobs(stub, app.state.audit)
    app.state.jobs.max_reconnects, app.state.jobs.reconnect_delay_s = 0, 0.0
    web = TestClient(_decoded_once(app), base_url=base_url, client=(client, 50000), raise_server_exceptions=False,
                     follow_redirects=False)
    return Console(stub, app, web)


def _decoded_once(app: Any) -> Any:
    """``app`` given the path as a server gives it: percent-decoded once (uvicorn: ``unquote(raw_path)``).

    Starlette's TestClient decodes it twice (httpx's ``URL.path`` is decoded already), which would make
    ``/events/%252F`` (the key ``%2F``) reach the application as ``/events//``.
    """
    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("raw_path") is not None:
            scope = {**scope, "path": unquote(scope["raw_path"].decode("ascii"))}
        await app(scope, receive, send)
    return asgi


# -- a browser's reading of a page ----------------------------------------------------------------------

@dataclass
class Form:
    """A form as a browser would submit it: method, action, and the fields it holds (``form=`` included)."""

    method: str
    action: str
    id: str | None
    fields: list[tuple[str, str]] = field(default_factory=list)  # hidden, text, selected options, textareas
    boxes: list[tuple[str, str, bool]] = field(default_factory=list)  # checkboxes: name, value, checked
    radios: dict[str, list[tuple[str, bool]]] = field(default_factory=dict)  # name: [(value, checked)]
    buttons: list[str] = field(default_factory=list)


class Page(HTMLParser):
    """The links (``href``, ``src``, ``hx-get``) and forms of an HTML page, read as a browser reads them."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.forms: list[Form] = []
        self._open: Form | None = None
        self._owned: list[tuple[str, str, str, bool, str]] = []  # (form id, type, name, checked, value)
        self._select: tuple[Form | None, str] | None = None
        self._textarea: tuple[Form | None, str] | None = None
        self._text = ""
        # a browser's HTML parser turns every CR and CRLF into LF before it reads anything
        self.feed(html.replace("\r\n", "\n").replace("\r", "\n"))
        self.close()
        by_id = {f.id: f for f in self.forms if f.id}
        for form_id, kind, name, checked, value in self._owned:
            if form_id in by_id:
                self._field(by_id[form_id], kind, name, checked, value)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        for name in ("href", "src", "hx-get"):
            if name in a and tag != "form":
                self.links.append(a[name])
        if tag == "form":
            self._open = Form(a.get("method", "get").lower(), a.get("action", ""), a.get("id"))
            self.forms.append(self._open)
        elif tag == "input":
            owner = a.get("form")
            kind, checked = a.get("type", "text"), "checked" in a
            if owner:
                self._owned.append((owner, kind, a.get("name", ""), checked, a.get("value", "on")))
            elif self._open is not None:
                self._field(self._open, kind, a.get("name", ""), checked, a.get("value", ""))
        elif tag == "button" and self._open is not None:
            self._open.buttons.append(a.get("id", a.get("type", "submit")))
        elif tag == "select":
            self._select = (self._open, a.get("name", ""))
        elif tag == "option" and self._select and "selected" in a and self._select[0] is not None:
            self._select[0].fields.append((self._select[1], a.get("value", "")))
        elif tag == "textarea":
            self._textarea, self._text = (self._open, a.get("name", "")), ""

    def handle_data(self, data: str) -> None:
        if self._textarea is not None:
            self._text += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._open = None
        elif tag == "select":
            self._select = None
        elif tag == "textarea" and self._textarea is not None:
            form, name = self._textarea
            if form is not None and name:
                form.fields.append((name, self._text.removeprefix("\n")))
            self._textarea = None

    @staticmethod
    def _field(form: Form, kind: str, name: str, checked: bool, value: str) -> None:
        if not name:
            return
        if kind == "checkbox":
            form.boxes.append((name, value, checked))
        elif kind == "radio":
            form.radios.setdefault(name, []).append((value, checked))
        elif kind not in ("submit", "button", "reset"):
            form.fields.append((name, value))

    def post_forms(self) -> list[Form]:
        """The forms that change something (``method="post"``)."""
        return [f for f in self.forms if f.method == "post"]


def resolve(page_url: str, href: str) -> str:
    """The path and query a browser requests for ``href`` on ``page_url``: dot segments removed, the
    percent-encoded ones (``%2e``, ``.%2E``...) too, as the URL standard says."""
    absolute = urlsplit(urljoin(page_url, href))
    segments: list[str] = []
    for segment in absolute.path.split("/")[1:]:
        plain = segment.lower().replace("%2e", ".")
        if plain == "..":
            if segments:
                segments.pop()
        elif plain != ".":
            segments.append(segment)
    path = "/" + "/".join(segments)
    if absolute.path.split("/")[-1].lower().replace("%2e", ".") in (".", ".."):
        path += "/" if not path.endswith("/") else ""
    return path + (f"?{absolute.query}" if absolute.query else "")


def browser_value(value: str) -> str:
    """A field's value as a browser submits it: every newline made CRLF (the URL standard's form encoding)."""
    return value.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\r\n")


def submit(web: TestClient, page_url: str, form: Form, headers: dict[str, str], *,
           tick: Callable[[str, str], bool] | None = None, choose: dict[str, str] | None = None) -> Any:
    """Submit ``form`` as a browser would: values newline-normalised, from the same origin.

    ``tick``: which checkboxes are ticked (default: as the page has them); ``choose``: radio values.
    """
    fields = list(form.fields)
    fields += [(n, v) for n, v, checked in form.boxes if (tick(n, v) if tick else checked)]
    for name, options in form.radios.items():
        chosen = (choose or {}).get(name) or next((v for v, checked in options if checked), None)
        if chosen is not None:
            fields.append((name, chosen))
    data = [(n, browser_value(v)) for n, v in fields]
    target = resolve(page_url, form.action or page_url)
    if form.method == "get":
        return web.get(target, params=data, headers=headers)
    return web.post(target, content=urlencode(data).encode(), headers={
        **headers, **SAME_ORIGIN, "Content-Type": "application/x-www-form-urlencoded"})
