#!/usr/bin/env python3
"""Open every page of the built documentation site in headless Chromium and fail on what a reader would trip over.

``tox -e docs`` runs it after ``sphinx-build``::

    python docs/_tools/check_site.py docs/_build/html

Each ``.html`` file of the build (the Markdown pages, the API reference, the highlighted
source pages, the index and search pages) is served over HTTP from 127.0.0.1 and loaded at
1280 px (desktop) and at 390 px (a phone: mobile viewport, ``<meta name=viewport>`` honoured).
A page fails on:

- **horizontal overflow**: the document is wider than the viewport, or an element of the main
  content reaches outside it. A ``pre`` block, a table or a picture that scrolls inside a box
  of its own (``overflow-x`` other than ``visible``) is fine: its box is measured, not its content;
- **code cut inside a word** in a table cell (one word of a literal on two lines);
- **a broken image**: an ``<img>`` with ``naturalWidth`` 0, or an ``<object>`` (Graphviz's SVG)
  whose document did not load;
- **illegible graph labels**: a Graphviz picture drawn so small that its smallest text is under
  11 px on screen;
- **a dead internal link**: an ``href`` to a file that is not in the build, or to an ``#anchor``
  that no element of the target page has (read from the loaded page, after its scripts ran).

Chromium is Debian's ``chromium`` package, driven over the DevTools protocol through a pipe
(``--remote-debugging-pipe``): no chromedriver, no Python package beyond the standard library,
nothing downloaded. Without Chromium the check is skipped with a message, except under
``CI=true``, where that fails. ``CHROMIUM=/path/to/chromium`` picks another binary.

``--screenshots DIR`` also writes PNGs of the pages named by ``--pages`` (default: all), one per
width, cut into tiles of ``--tile`` px (default 1600) so that each can be viewed at full size.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

WIDTHS = {1280: 900, 390: 844}  # width: height of the window
MIN_LABEL_PX = 11.0
MAX_SHOWN = 8  # problems of one kind shown per page and width; the rest counted

# Runs in each page once it has loaded; returns what the Python side judges.
PAGE_SCRIPT = r"""
(async () => {
  await document.fonts.ready;
  const waitFor = (el) => new Promise((done) => {
    el.addEventListener('load', done, {once: true});
    el.addEventListener('error', done, {once: true});
    setTimeout(done, 5000);
  });
  for (const img of document.images) img.loading = 'eager';
  await Promise.all([...document.images].filter((img) => !img.complete).map(waitFor));

  const describe = (el) => {
    let text = el.tagName.toLowerCase();
    if (el.id) text += '#' + el.id;
    if (el.classList.length) text += '.' + [...el.classList].join('.');
    const section = el.closest('section[id]');
    if (section) text += ' in section #' + section.id;
    const words = (el.textContent || '').trim().replace(/\s+/g, ' ');
    if (words) text += ' "' + words.slice(0, 60) + (words.length > 60 ? '…' : '') + '"';
    return text;
  };
  const root = document.documentElement;
  const viewport = root.clientWidth;
  const overflow = [];
  if (root.scrollWidth > viewport + 1) {
    overflow.push(`the page is ${root.scrollWidth} px wide, the viewport ${viewport} px`);
  }
  const main = document.querySelector('article[role=main]') || document.body;
  const box = main.getBoundingClientRect();
  // Furo draws headings and signatures 0.5 rem (8 px) beyond the text column on purpose; +1 for rounding.
  const slack = 8 + 1;
  if (box.right > viewport + 1) {
    overflow.push(`the main content reaches ${Math.round(box.right)} px, the viewport is ${viewport} px`);
  }
  const scrollsInside = (el) => {  // an ancestor (below main) clips or scrolls it horizontally
    for (let up = el.parentElement; up && up !== main; up = up.parentElement) {
      if (getComputedStyle(up).overflowX !== 'visible') return true;
    }
    return false;
  };
  const offenders = [];
  for (const el of main.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) continue;
    // Its own box, or the text it lets spill out (overflow visible: scrollWidth counts what spills).
    const spills = getComputedStyle(el).overflowX === 'visible' && el.clientWidth > 0
      ? r.left + el.clientLeft + el.scrollWidth : r.right;
    const right = Math.max(r.right, spills);
    if (right <= box.right + slack && r.left >= box.left - slack) continue;
    if (!scrollsInside(el)) offenders.push([el, r.left, right]);
  }
  for (const [el, left, right] of offenders) {  // the innermost only: an ancestor spills because of it
    if (offenders.some(([other]) => other !== el && el.contains(other))) continue;
    overflow.push(`${describe(el)} spans ${Math.round(left)}..${Math.round(right)} px,`
                  + ` the content ${Math.round(box.left)}..${Math.round(box.right)} px`);
  }

  // The reported break: code in a table cell cut inside a word (`S.deliver` + `y`).
  const cut = [];
  for (const word of main.querySelectorAll('td code span.pre, th code span.pre')) {
    if (word.getClientRects().length > 1) cut.push(`${describe(word)} is on two lines`);
  }

  const broken = [];
  for (const img of document.images) {
    if (img.naturalWidth === 0) broken.push(`<img src="${img.getAttribute('src')}">`);
  }
  const graphs = [];
  for (const obj of document.querySelectorAll('object')) {
    const doc = obj.contentDocument;
    const svg = doc && doc.documentElement;
    if (!svg || (obj.type === 'image/svg+xml' && svg.nodeName.toLowerCase() !== 'svg')) {
      broken.push(`<object data="${obj.getAttribute('data')}">`);
      continue;
    }
    let smallest = Infinity;
    for (const text of svg.querySelectorAll('text')) {
      const ctm = text.getScreenCTM();
      if (!ctm || !text.getBBox().width) continue;
      const size = parseFloat(getComputedStyle(text).fontSize) * Math.hypot(ctm.a, ctm.b);
      smallest = Math.min(smallest, size);
    }
    const r = obj.getBoundingClientRect();
    if (smallest !== Infinity) {
      graphs.push({what: describe(obj), smallest: smallest, width: r.width, natural: svg.viewBox.baseVal.width});
    }
  }

  const links = [...document.querySelectorAll('a[href]')].map((a) => [a.href, a.getAttribute('href'), describe(a)]);
  const ids = [...document.querySelectorAll('[id]')].map((el) => el.id)
    .concat([...document.querySelectorAll('a[name]')].map((a) => a.name));
  return {overflow, cut, broken, graphs, links, ids};
})()
"""


class BrowserError(RuntimeError):
    pass


class Chromium:
    """A headless Chromium, spoken to over the DevTools protocol on file descriptors 3 and 4."""

    FLAGS = ("--headless", "--remote-debugging-pipe", "--no-first-run", "--no-default-browser-check",
             "--disable-gpu", "--disable-extensions", "--disable-background-networking", "--disable-sync",
             "--disable-component-update", "--disable-default-apps", "--mute-audio", "--hide-scrollbars",
             "--force-color-profile=srgb", "--font-render-hinting=none")

    def __init__(self, executable: str) -> None:
        self._profile = tempfile.mkdtemp(prefix="check-site-")
        to_chrome, self._write_fd = os.pipe()
        self._read_fd, from_chrome = os.pipe()

        def child() -> None:  # the pipes on the descriptors Chromium reads (3) and writes (4)
            read, write = os.dup(to_chrome), os.dup(from_chrome)
            os.dup2(read, 3)
            os.dup2(write, 4)

        flags = [*self.FLAGS, f"--user-data-dir={self._profile}"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium's sandbox refuses to run as root (CI containers)
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 -- Chromium's stderr for its lifetime: read if it dies, never a full pipe
        self.process = subprocess.Popen(
            [executable, *flags, "about:blank"], preexec_fn=child, pass_fds=(3, 4),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
        os.close(to_chrome)
        os.close(from_chrome)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (BrowserError, OSError):
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    def _send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._write_fd, data):]

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read_fd], [], [], left)[0]:
                raise BrowserError("Chromium did not answer in time")
            chunk = os.read(self._read_fd, 1 << 20)
            if not chunk:
                self._log.seek(0)
                stderr = self._log.read().decode(errors="replace")
                raise BrowserError(f"Chromium exited ({self.process.wait(5)}):\n{stderr[-2000:]}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)  # type: ignore[no-any-return]

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 30) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self._send(message)
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})  # type: ignore[no-any-return]
            if "method" in reply:
                self._events.append(reply)

    def wait_for(self, method: str, session: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for event in self._events:
                if event["method"] == method and event.get("sessionId") == session:
                    self._events.remove(event)
                    return event
            event = self._receive(deadline)
            if "method" in event:
                self._events.append(event)

    def tab(self, width: int, height: int) -> Tab:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=session)
        self.call("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600,
        }, session=session)
        return Tab(self, session, width)


class Tab:
    def __init__(self, browser: Chromium, session: str, width: int) -> None:
        self.browser, self.session, self.width = browser, session, width

    def call(self, method: str, params: dict[str, Any] | None = None, timeout: float = 30) -> dict[str, Any]:
        return self.browser.call(method, params, session=self.session, timeout=timeout)

    def open(self, url: str) -> None:
        self.browser._events = [e for e in self.browser._events if e.get("sessionId") != self.session]
        result = self.call("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"{url}: {result['errorText']}")
        self.browser.wait_for("Page.loadEventFired", self.session)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshots(self, stem: Path, tile: int) -> list[Path]:
        import base64

        height = int(self.evaluate("document.documentElement.scrollHeight"))
        paths = []
        for number, top in enumerate(range(0, height, tile), start=1):
            clip = {"x": 0, "y": top, "width": self.width, "height": min(tile, height - top), "scale": 1}
            data = self.call("Page.captureScreenshot", {"format": "png", "clip": clip,
                                                        "captureBeyondViewport": True})["data"]
            path = stem.with_name(f"{stem.name}-{number:02d}.png") if height > tile else stem.with_suffix(".png")
            path.write_bytes(base64.b64decode(data))
            paths.append(path)
        return paths


def find_chromium() -> str | None:
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # the base class's signature
        pass


def serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def dead_links(root: Path, base: str, found: dict[str, dict[str, Any]]) -> list[str]:
    ids = {page: set(result["ids"]) for page, result in found.items()}
    problems = []
    for page, result in sorted(found.items()):
        for absolute, written, what in result["links"]:
            parts = urlsplit(absolute)
            if not absolute.startswith(base) or parts.scheme not in ("http", "https"):
                continue  # another site, mailto:, javascript:
            path = unquote(parts.path).lstrip("/")
            if not path or path.endswith("/"):
                path += "index.html"
            if not (root / path).is_file():
                problems.append(f"{page}: {what} links to {written!r}: no such file in the build")
            elif parts.fragment and path.endswith(".html") and unquote(parts.fragment) not in ids.get(path, ()):
                problems.append(f"{page}: {what} links to {written!r}: {path} has no #{unquote(parts.fragment)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", nargs="?", default="docs/_build/html", type=Path, help="the HTML build directory")
    parser.add_argument("--screenshots", type=Path, metavar="DIR", help="write PNGs of the pages into DIR")
    parser.add_argument("--pages", help="with --screenshots: the pages, comma-separated (e.g. topology,api)")
    parser.add_argument("--tile", type=int, default=1600, help="with --screenshots: the height of one PNG")
    args = parser.parse_args(argv)

    root = args.build.resolve()
    if not (root / "index.html").is_file():
        print(f"check_site: {root} has no index.html: build the site first", file=sys.stderr)
        return 2
    executable = find_chromium()
    if executable is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            print("check_site: FAILED: no Chromium on PATH (Debian: apt-get install chromium); CI=true never skips",
                  file=sys.stderr)
            return 2
        print("check_site: SKIPPED: no Chromium on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 0

    pages = sorted(path.relative_to(root).as_posix() for path in root.rglob("*.html"))
    shoot: set[str] = set()
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
        wanted = [name.strip().removesuffix(".html") for name in (args.pages or "").split(",") if name.strip()]
        shoot = {f"{name}.html" for name in wanted} if wanted else set(pages)
        unknown = shoot - set(pages)
        if unknown:
            print(f"check_site: no such pages: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2

    started = time.monotonic()
    server, base = serve(root)
    browser = Chromium(executable)
    problems: list[str] = []  # the lines to print
    hidden = 0  # problems counted, not printed
    found: dict[str, dict[str, Any]] = {}
    try:
        for width, height in WIDTHS.items():
            tab = browser.tab(width, height)
            for page in pages:
                tab.open(base + page)
                result = tab.evaluate(PAGE_SCRIPT)
                for kind, key in (("overflow", "overflow"), ("code cut inside a word", "cut"),
                                  ("broken image", "broken")):
                    found_here = result[key]
                    problems += [f"{page} at {width} px: {kind}: {text}" for text in found_here[:MAX_SHOWN]]
                    if len(found_here) > MAX_SHOWN:
                        hidden += len(found_here) - MAX_SHOWN - 1
                        problems.append(f"{page} at {width} px: {kind}: … and {len(found_here) - MAX_SHOWN} more")
                for graph in result["graphs"]:
                    if graph["smallest"] < MIN_LABEL_PX:
                        problems.append(
                            f"{page} at {width} px: {graph['what']}: its smallest text is {graph['smallest']:.1f} px"
                            f" on screen (under {MIN_LABEL_PX:g}): drawn {graph['width']:.0f} px wide for a"
                            f" {graph['natural']:.0f} pt picture")
                found.setdefault(page, result)
                if page in shoot:
                    for path in tab.screenshots(args.screenshots / f"{page.removesuffix('.html').replace('/', '-')}"
                                                f"-{width}", args.tile):
                        print(f"check_site: wrote {path}")
    except BrowserError as error:
        print(f"check_site: FAILED: {error}", file=sys.stderr)
        return 2
    finally:
        browser.close()
        server.shutdown()
    problems += [f"dead link: {text}" for text in dead_links(root, base, found)]

    took = time.monotonic() - started
    for problem in problems:
        print(problem, file=sys.stderr)
    verdict = f"{len(problems) + hidden} problem(s)" if problems else "no problems"
    print(f"check_site: {len(pages)} pages at {', '.join(f'{w} px' for w in WIDTHS)} in {took:.1f} s: {verdict}",
          file=sys.stderr if problems else sys.stdout)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
