"""The console where users use it: `kombu-events console` served by uvicorn, a real `celery worker
--with-events-step` whose handler fails for events sent by the Node publisher, and Debian's headless
Chromium (driven over the DevTools pipe, as docs/_tools/check_site.py does; no browser is downloaded).

The test finds the failure group, replays it from the page (keyboard only), and counts by id that the
handler received each event exactly once and that the archive ends empty. On the way: axe-core (from
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
from typing import Any

import pytest

from .harness import NODE_DIR, ROOT, node_message, queue_depth, unique, wait_for

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
    archive = f"{project.service}.archive"
    wait_for(lambda: queue_depth(project.broker_url, archive)[0] == N, 30, what=f"{N} archived")
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
        assert f"{N} of {N} archived" in text and "LookupError: order <n> not found in the ledger" in text
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
        page.open(f"/events/{ids[1]}")
        assert "LookupError: order 1 not found" in page.js("document.body.innerText")
        assert page.axe(axe_source) == []
        page.shoot("event-1280")
        page.open("/failures")

        # keyboard: the skip link comes first; then the group, the dry-run box and the replay button
        page.press("Tab", "Tab", 9)
        assert page.js("document.activeElement.className") == "skip"
        href = page.js("[...document.querySelectorAll('table.groups a')].find(a => a.textContent"
                       ".includes('LookupError')).getAttribute('href')")
        page.open(href)
        assert f"{N} of {N} archived" in page.js("document.body.innerText")
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
        page.open(f"/events/{ids[0]}")  # replayed: gone from the archive
        assert "no archived message" in page.js("document.body.innerText")

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
    assert queue_depth(project.broker_url, archive)[0] == 0


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
