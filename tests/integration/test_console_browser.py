"""The console where users use it: `kombu-events console` served by uvicorn, a real `celery worker
--with-events-step` whose handler fails for events sent by the Node publisher, and Debian's headless
Chromium (driven over the DevTools pipe, as docs/_tools/check_site.py does; no browser is downloaded).

The test finds the failure group, replays it from the page (keyboard only), and counts by id that the
handler received each event exactly once and that no copy is left in the archive (read by offset: a read
changes nothing). On the way: axe-core (from
npm, tests/node) finds no serious violation on any page, light or dark; at 390 px nothing overflows
the page. ``KOMBU_EVENTS_SCREENSHOTS=1`` saves the screenshots of docs/console.md.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kombu import Connection

from kombu_events.ops.archive import read

from .harness import NODE_DIR, ROOT, node_message, unique, wait_for

pytestmark = pytest.mark.integration

N = 5
SCREENSHOTS = ROOT / "docs" / "_static" / "console"
APP = """
FLAG = RECORDS + ".fail"

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4)

@events.handler("orders.#", bind=True, max_retries=0)
def orders(event):
    record(message_id=event.message_id, routing_key=event.routing_key, replayed_by=event.headers.get(
        "kombu-events-replayed-by"))
    if os.path.exists(FLAG):
        raise LookupError(f"order {event.payload['order']} not found in the ledger")

@events.handler("users.#", bind=True, max_retries=0)
def users(event):
    record(message_id=event.message_id, routing_key=event.routing_key, replayed_by=None)
"""


def _archived(broker_url: str, service: str) -> list[Any]:
    """The copies still in ``service``'s archive (neither replayed nor purged), read by offset."""
    with Connection(broker_url) as conn:
        return read(conn, SimpleNamespace(archive_exchange=f"{service}.archive"), bodies=False)  # type: ignore[arg-type]


def _check_site() -> Any:
    spec = importlib.util.spec_from_file_location("check_site", ROOT / "docs" / "_tools" / "check_site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _needed(what: str, found: Any) -> Any:
    if not found:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{what} is missing (CI=true: must not skip)")
        pytest.skip(f"{what} is missing")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Page:
    """A Chromium tab on the console, with the helpers the test needs."""

    def __init__(self, tab: Any, base: str) -> None:
        self.tab, self.base = tab, base

    def open(self, path: str) -> None:
        self.tab.open(self.base + path)

    def js(self, expression: str) -> Any:
        return self.tab.evaluate(expression)

    def press(self, key: str, code: str, keycode: int) -> None:
        for kind in ("keyDown", "keyUp"):
            self.tab.call("Input.dispatchKeyEvent", {"type": kind, "key": key, "code": code,
                                                     "windowsVirtualKeyCode": keycode,
                                                     **({"text": "\r"} if key == "Enter" and kind == "keyDown"
                                                        else {})})

    def resize(self, width: int, height: int) -> None:
        """One tab for every width: a second tab would leave this one in the background (throttled timers)."""
        self.tab.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                             "deviceScaleFactor": 1, "mobile": width < 600})
        self.tab.width = width

    def dark(self, on: bool) -> None:
        self.tab.call("Emulation.setEmulatedMedia", {"features": [
            {"name": "prefers-color-scheme", "value": "dark" if on else "light"}]})

    def axe(self, source: str) -> list[str]:
        """Serious and critical axe-core violations of the page (the script injected over DevTools)."""
        self.js(source)
        found = self.js("axe.run(document, {resultTypes: ['violations']}).then(r => r.violations"
                        ".filter(v => ['serious', 'critical'].includes(v.impact))"
                        ".map(v => v.id + ': ' + v.nodes.map(n => n.target.join(' ')).join(', ')))")
        return list(found)

    def shoot(self, name: str) -> None:
        if os.environ.get("KOMBU_EVENTS_SCREENSHOTS"):
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            self.tab.screenshots(SCREENSHOTS / name, tile=4000)


def test_replay_a_failure_group_from_the_browser(make_project):
    chromium = _needed("Debian's chromium (apt install chromium)", _check_site().find_chromium())
    axe_source = (_needed("axe-core (npm ci in tests/node)", (NODE_DIR / "node_modules" / "axe-core" /
                                                              "axe.min.js").exists())
                  and (NODE_DIR / "node_modules" / "axe-core" / "axe.min.js").read_text())
    project = make_project(APP)
    flag = project.records_path.with_name(project.records_path.name + ".fail")
    flag.touch()
    worker = project.worker().wait_ready()
    ids = [unique("ord") for _ in range(N)]
    project.node_publish(*[node_message(f"orders.{n}.created", {"order": n}, messageId=i)
                           for n, i in enumerate(ids)])
    wait_for(lambda: len(_archived(project.broker_url, project.service)) == N, 30, what=f"{N} archived")
    flag.unlink()  # the bug is fixed: a replayed event now succeeds

    port = _free_port()
    console = subprocess.Popen(
        [str(Path(sys.executable).parent / "kombu-events"), "-A", project.module, "console", "--port", str(port),
         "--audit-file", str(project.dir / "audit.jsonl")],
        cwd=project.dir, env=project.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    browser = None
    try:
        wait_for(lambda: _answers(port) or console.poll() is not None, 20, what="console listening")
        assert console.poll() is None, console.stdout.read()
        browser = _check_site().Chromium(chromium)
        page = Page(browser.tab(1280, 900), f"http://127.0.0.1:{port}")

        page.open("/")
        assert "no consumer" not in page.js("document.body.innerText")
        assert "guest:guest" not in page.js("document.documentElement.outerHTML")
        assert page.axe(axe_source) == []
        page.shoot("overview-1280")

        page.open("/failures")
        text = page.js("document.body.innerText")
        assert f"{N} of {N} archived copies" in text and "LookupError: order <n> not found in the ledger" in text
        assert page.axe(axe_source) == []
        page.shoot("failures-1280")
        page.dark(True)
        assert page.js("getComputedStyle(document.body).backgroundColor") == "rgb(13, 17, 23)"
        assert page.axe(axe_source) == []
        page.shoot("failures-1280-dark")
        page.dark(False)
        page.resize(390, 844)
        page.open("/failures")
        assert page.js("document.documentElement.scrollWidth") <= 390
        assert page.axe(axe_source) == []
        page.shoot("failures-390")
        page.resize(1280, 900)
        page.open(f"/events/{ids[1]}")  # by message id: one copy has it, the page of its archive key
        assert "LookupError: order 1 not found" in page.js("document.body.innerText")
        assert page.js("location.pathname").startswith("/events/") and ids[1] not in page.js("location.pathname")
        assert page.axe(axe_source) == []
        page.shoot("event-1280")
        page.open("/failures")

        # keyboard: the skip link comes first; then the group, the dry-run box and the replay button
        page.press("Tab", "Tab", 9)
        assert page.js("document.activeElement.className") == "skip"
        href = page.js("[...document.querySelectorAll('table.groups a')].find(a => a.textContent"
                       ".includes('LookupError')).getAttribute('href')")
        page.open(href)
        assert f"{N} of {N} archived copies" in page.js("document.body.innerText")
        page.js("document.querySelector('input[name=dry_run]').focus()")
        page.press(" ", "Space", 32)  # untick "dry run" from the keyboard
        assert page.js("document.querySelector('input[name=dry_run]').checked") is False
        page.js("document.getElementById('replay-button').focus()")
        page.press("Enter", "Enter", 13)
        browser.wait_for("Page.loadEventFired", page.tab.session)
        wait_for(lambda: page.js("document.querySelector('.state')?.textContent") == "done", 30,
                 interval=0.3, what="replay job done")
        assert page.js("document.querySelectorAll('button.danger').length") == 0, "a done job offers no Cancel"
        assert page.axe(axe_source) == []
        page.shoot("job-1280")

        wait_for(lambda: len(project.records()) >= 2 * N, 30, what="each event handled again")
        page.open(f"/events/{ids[0]}")  # replayed: no copy has the id any more
        assert "no archived copy" in page.js("document.body.innerText")

        page.resize(390, 844)
        for path, name in (("/", "overview-390"), ("/failures", "failures-390-empty"), ("/audit", "audit-390")):
            page.open(path)
            assert page.js("document.documentElement.scrollWidth") <= 390, path
            if path == "/":  # each queue a block of its own: every column in sight, nothing to scroll sideways
                assert page.js("[...document.querySelectorAll('.scroll')].every(e => e.scrollWidth <= e.clientWidth)")
            assert page.axe(axe_source) == []
            if name != "failures-390-empty":
                page.shoot(name)
        assert "replay finished" in page.js("document.body.innerText")
    finally:
        if browser is not None:
            browser.close()
        console.terminate()
        console.wait(10)
        worker.stop()

    time.sleep(0.5)  # a duplicate, if any, would have been handled by now
    replays = [r for r in project.records() if r["replayed_by"] == "local"]
    assert sorted(r["message_id"] for r in replays) == sorted(ids)  # each exactly once
    assert _archived(project.broker_url, project.service) == []


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


# -- any message id, through the links and forms of a real browser ---------------------------------------

#: Ids a publisher may set that a link or a form could mangle: a browser resolves dot segments (encoded or
#: not), cuts a URL at ``?`` and ``#``, and rewrites the newlines of every form field it submits.
ODD_IDS = ["a/b", "what?x=1&y=2", "frag#ment", "100%", "%2e%2e%2f", "../../audit", "..", ".", "with space",
           "line\nbreak", "cr\ronly", "ünïcødé-✓-日本語", "a/edit"]


def _shown(message_id: str) -> str:
    """The id as a page's text holds it: the HTML parser made every CR an LF."""
    return message_id.replace("\r\n", "\n").replace("\r", "\n")


@pytest.fixture
def odd_ids_service(broker_url):
    """A service of its own whose archive holds one message for each of ODD_IDS."""
    from kombu import Connection

    from kombu_events.core import wire

    from .console_helpers import seeded

    for service in seeded(broker_url):
        with Connection(broker_url) as conn:
            producer = conn.Producer()
            for message_id in ODD_IDS:
                headers = wire.archive_headers({}, attempt=3, queue=service.queue("orders"), routing_key="orders.1",
                                               reason="gave up", exception="KeyError: x", traceback="")
                producer.publish(b'{"order": 1}', exchange=service.events.topology().archive_exchange,
                                 routing_key="", message_id=message_id, headers=headers,
                                 content_type="application/json", content_encoding="utf-8", delivery_mode=2)
        wait_for(lambda s=service: len(s.pending()) == len(ODD_IDS), 10, what="all archived")
        yield service


def test_any_message_id_round_trips_through_the_browser(odd_ids_service, tmp_path):
    """Each odd id's link on the failures page (by archive key) opens that event's page; its replay form, a dry
    run, then the dry run's confirmation, sends a copy with exactly that id (counted in the handler queue)."""
    import threading

    import uvicorn

    from kombu_events.console import ConsoleSettings, create_app

    chromium = _needed("Debian's chromium (apt install chromium)", _check_site().find_chromium())
    service, port = odd_ids_service, _free_port()
    app = create_app(service.events, ConsoleSettings(audit_path=tmp_path / "audit.jsonl"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    browser = None
    try:
        wait_for(lambda: _answers(port), 20, what="console listening")
        browser = _check_site().Chromium(chromium)
        page = Page(browser.tab(1280, 900), f"http://127.0.0.1:{port}")
        page.open("/failures")
        links = page.js("[...document.querySelectorAll('table.messages a')].map(a => a.href)")
        assert len(links) == len(ODD_IDS)
        opened = {}
        for href in links:
            page.tab.open(href)  # where a click goes: the href as the browser resolved it
            opened[page.js("document.querySelector('h1 code')?.textContent")] = href
        assert set(opened) == {_shown(i) for i in ODD_IDS}, opened

        for message_id in ODD_IDS:
            page.tab.open(opened[_shown(message_id)])
            page.js("document.querySelector('form.inline input[name=dry_run]').checked = true")
            _submit(browser, page, "form.inline")
            assert page.js("document.querySelector('table td:nth-child(2)')?.textContent") == _shown(message_id)
            _submit(browser, page, "#confirm-replay", click=True)
            wait_for(lambda: page.js("document.querySelector('.state')?.textContent") == "done", 30,
                     interval=0.2, what=f"the replay of {message_id!r}")
            assert "1 replayed" in page.js("document.body.innerText").replace("\n", " ")
    finally:
        if browser is not None:
            browser.close()
        server.should_exit = True
        thread.join(10)
    copies = service.take("orders")
    assert sorted(m.properties["message_id"] for m in copies) == sorted(ODD_IDS)  # each id exactly as it was
    assert service.pending() == []


def _submit(browser: Any, page: Page, selector: str, *, click: bool = False) -> None:
    """Submit a form (or click a button) and wait for the page it leads to."""
    browser._events = [e for e in browser._events if e.get("sessionId") != page.tab.session]
    page.js(f"document.querySelector({selector!r}).{'click' if click else 'requestSubmit'}()")
    browser.wait_for("Page.loadEventFired", page.tab.session)
