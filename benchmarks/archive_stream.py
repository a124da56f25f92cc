"""The archive as a stream at size: 100,000 archived copies, a few of them 15 MiB, read by the CLI and the console.

``python -m benchmarks.archive_stream [--n 100000] [--big 3] [--big-mib 15] [--reads 100] [--skip-console]``

One service on the broker (``KEB_BROKER_URL``, default the node on 5672), its archive filled with ``n`` copies as
the worker archives them (failure headers, packed header table, one archive key each; ``big`` of them with
bodies of ``big-mib`` MiB), then, each a figure printed:

1. what a CLI read costs: ``archive list --limit 50`` and ``status`` as subprocesses (wall time, peak RSS);
2. the console (``kombu-events console``, a subprocess): the time its index takes to read the whole archive
   the first time, then the failures page and the API's first page (``/api/archive?limit=100``), median and
   slowest of 20 each, the console's peak RSS, and a search of 1,500 words while another request is timed
   (how long that one waited);
3. the page of each big copy (a bounded preview) and its download (the whole body), timed;
4. ``reads`` reads of all kinds (the pages, the API, the big copies' pages and downloads), the console's peak
   RSS against ``--rss-bound-mib`` (default 400), and the stream compared record by record before and after:
   offsets, bodies' sizes and header tables the same, nothing moved.

Everything it made is deleted at the end. Figures, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from amqp import Message
from kombu import Connection

from kombu_events.broker import stream_headers, streams
from kombu_events.broker.confirms import Confirmer
from kombu_events.core import wire

from .broker import delete, leftovers, unique
from .procs import ROOT

MIB = 1024 * 1024
URL = os.environ.get("KEB_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
TOKEN = "t" * 40

APP = '''
from celery import Celery
from kombu_events import Events

app = Celery({service!r}, broker={url!r})
events = Events(app, service={service!r}, exchange={exchange!r}, archive_max_bytes=4 * 1024**3)

@events.handler("orders.#")
def orders(payload):
    pass
'''

REASONS = ["gave up after 6 attempts (max_retries=5): builtins.KeyError: 'order {n} not found'",
           "gave up after 6 attempts (max_retries=5): TimeoutError: ledger took {n}.5 s",
           "poisonous section failed: ValueError: bad amount {n}",
           "gave up after 6 attempts (max_retries=5): ConnectionError: payments down"]


def fill(url: str, service: str, n: int, big: int, big_mib: int) -> tuple[float, list[str]]:
    """Archive ``n`` copies as the worker does (``big`` of them of ``big_mib`` MiB): (seconds it took, the
    archive keys of the big ones)."""
    started = time.monotonic()
    big_at = {int(n * (i + 1) / (big + 1)) for i in range(big)}
    big_keys: list[str] = []
    failed: list[str] = []
    with Connection(url) as conn:
        channel = conn.channel()
        confirmer = Confirmer(channel)
        for i in range(n):
            headers = wire.archive_headers(
                {"x-request-id": f"r-{i}", "tags": ["a", i % 7]}, attempt=6, queue=f"{service}.orders",
                routing_key=f"orders.{i % 50}.created", reason=REASONS[i % len(REASONS)].format(n=i),
                exception="builtins.KeyError: 'order'", traceback="Traceback (most recent call last): ..." * 8)
            if i in big_at:
                big_keys.append(headers[wire.ARCHIVE_KEY])
            body = (b"x" * (big_mib * MIB)) if i in big_at else json.dumps(
                {"order": i, "note": f"item {i}", "lines": list(range(i % 20))}).encode()
            properties = stream_headers.pack({"application_headers": headers, "message_id": f"m-{i}",
                                              "content_type": "application/json", "delivery_mode": 2})
            confirmer.publish(Message(body, **properties), f"{service}.archive", "", lambda: None, failed.append)
            if confirmer.pending >= 1000:
                confirmer.wait(timeout_s=60)
        confirmer.wait(timeout_s=60)
        channel.close()
    assert not failed and not confirmer.pending, failed[:3]
    return time.monotonic() - started, big_keys


def raw(url: str, queue: str) -> list[tuple[int, int, str]]:
    """(offset, body size, header table as JSON) of every record of the stream."""
    with Connection(url) as conn:
        conn.connect()
        return [(offset, len(streams.body_of(m)), json.dumps(m.headers, sort_keys=True, default=str))
                for offset, m in streams.read(conn.connection, queue)]


def timed_cli(directory: Path, env: dict[str, str], *args: str) -> tuple[float, int, str]:
    """(seconds, peak RSS in MiB of this child, stdout) of ``kombu-events ARGS``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.monotonic()
    run = subprocess.run([str(Path(sys.executable).parent / "kombu-events"), *args], cwd=directory, env=env,
                         capture_output=True, text=True, timeout=900)
    took = time.monotonic() - started
    assert run.returncode in (0, 2), run.stderr[-2000:]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return took, max(peak, before) // 1024, run.stdout


class Console:
    """``kombu-events console`` as a subprocess, with a bearer token."""

    def __init__(self, directory: Path, env: dict[str, str], module: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        tokens = directory / "tokens"
        tokens.write_text(f"operator bench {TOKEN}\n")
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "kombu-events"), "-A", module, "console", "--port", str(self.port),
             "--token-file", str(tokens), "--audit-file", str(directory / "audit.jsonl")],
            cwd=directory, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def get(self, path: str, timeout: float = 120) -> tuple[float, int, bytes]:
        took, status, body, _ = self.answer(path, timeout)
        return took, status, body

    def answer(self, path: str, timeout: float = 120) -> tuple[float, int, bytes, Any]:
        """(seconds, status, body, headers) of a GET."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         headers={"Authorization": f"Bearer {TOKEN}", "Sec-Fetch-Site": "same-origin"})
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                body, status, headers = answer.read(), answer.status, answer.headers
        except urllib.error.HTTPError as exc:
            body, status, headers = exc.read(), exc.code, exc.headers
        return time.perf_counter() - started, status, body, headers

    def rss_mib(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) in MiB."""
        found = {}
        with open(f"/proc/{self.process.pid}/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    found[line.split(":")[0]] = int(line.split()[1]) // 1024
        return found["VmRSS"], found["VmHWM"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def big_pages(console: Console, big_keys: list[str]) -> list[str]:
    """Time the page of each big copy (a bounded preview) and its download (the whole body); their paths."""
    paths = []
    for key in big_keys:
        query = urllib.parse.urlencode({"key": key})
        for path in (f"/events?{query}", f"/download?{query}"):
            took, status, body = console.get(path)
            assert status == 200, body[:500]
            print(f"console: GET {path.split('?')[0]} of a big copy: {took * 1000:.0f} ms, "
                  f"{len(body) / 1024:,.0f} KiB")
            paths.append(path)
    return paths


def console_figures(console: Console, n: int, reads: int, big_keys: list[str], bound_mib: int) -> None:
    started = time.monotonic()
    deadline = started + 900
    while time.monotonic() < deadline:
        try:
            _, status, body, headers = console.answer("/api/archive?limit=1", timeout=5)
        except OSError:
            time.sleep(0.2)
            continue
        if status == 200 and not headers.get("X-Index-Catching-Up"):
            break
        time.sleep(0.2)
    first_index = time.monotonic() - started
    print(f"console: first index of {n} copies in {first_index:.1f} s (from start, uvicorn included); "
          f"RSS {console.rss_mib()[0]} MiB")
    for path in ("/failures", "/api/archive?limit=100"):
        times = []
        for _ in range(20):
            took, status, body = console.get(path)
            assert status == 200, body[:500]
            times.append(took)
        print(f"console: GET {path}: median {statistics.median(times) * 1000:.0f} ms, slowest "
              f"{max(times) * 1000:.0f} ms ({len(body) // 1024} KiB)")
    took, status, _ = console.get("/failures?" + urllib.parse.urlencode(
        {"q": " ".join(f"word{i}" for i in range(1500))}))
    print(f"console: a search of 1,500 words (13.5 KB) answered {status} in {took * 1000:.0f} ms")
    words = " ".join(f"w{i:03d}" for i in range(199))  # 995 characters: the longest search taken
    found: dict[str, Any] = {}

    def search() -> None:
        found["search"] = console.answer("/failures?" + urllib.parse.urlencode({"q": words}))

    threads = [threading.Thread(target=search) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    other = [console.get("/api/archive?limit=1")[0] for _ in range(10)]
    for thread in threads:
        thread.join()
    took, status, _, headers = found["search"]
    print(f"console: 4 searches of 199 words (995 characters) at once answered {status} in {took * 1000:.0f} ms"
          f"{' (partial: the time budget)' if headers.get('X-Search-Partial') else ''}; meanwhile 10 other "
          f"requests: slowest {max(other) * 1000:.0f} ms")
    took, status, body, headers = console.answer("/failures?" + urllib.parse.urlencode({"q": "payments down"}))
    print(f"console: a search of 2 words over {n} copies answered {status} in {took * 1000:.0f} ms"
          f"{' (partial: its time budget)' if headers.get('X-Search-Partial') else ''}")
    kinds = ["/failures", "/api/archive?limit=100", "/", *big_pages(console, big_keys)]
    for i in range(reads):
        console.get(kinds[i % len(kinds)])
    rss, peak = console.rss_mib()
    print(f"console: RSS {rss} MiB now, peak {peak} MiB, after {reads} more reads of {len(kinds)} kinds "
          f"(pages, the API, the big copies' pages and downloads): "
          f"{'within' if peak <= bound_mib else 'OVER'} the bound of {bound_mib} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--big", type=int, default=3)
    parser.add_argument("--big-mib", type=int, default=15)
    parser.add_argument("--reads", type=int, default=100)
    parser.add_argument("--skip-console", action="store_true")
    parser.add_argument("--rss-bound-mib", type=int, default=400,
                        help="the console's peak RSS this run reports itself within (docs/console.md)")
    parser.add_argument("--broker", default=URL)
    args = parser.parse_args(argv)
    service, exchange, module = unique("arch"), unique("archex"), unique("archapp")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / f"{module}.py").write_text(APP.format(service=service, url=args.broker, exchange=exchange))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(directory), str(ROOT)])}
        env.pop("RABBIT_URL", None)
        subprocess.run([str(Path(sys.executable).parent / "kombu-events"), "-A", module, "declare"], cwd=directory,
                       env=env, check=True, capture_output=True)
        try:
            took, big_keys = fill(args.broker, service, args.n, args.big, args.big_mib)
            print(f"filled the archive with {args.n} copies ({args.big} of {args.big_mib} MiB) in {took:.1f} s")
            before = raw(args.broker, f"{service}.archive")
            for what in (["archive", "list", "--limit", "50"], ["status"]):
                took, rss, _ = timed_cli(directory, env, "-A", module, *what)
                print(f"cli: {' '.join(what)}: {took:.1f} s, peak RSS {rss} MiB")
            if not args.skip_console:
                console = Console(directory, env, module)
                try:
                    console_figures(console, args.n, args.reads, big_keys, args.rss_bound_mib)
                finally:
                    console.stop()
            after = raw(args.broker, f"{service}.archive")
            print(f"the stream after every read: {len(after)} records, "
                  f"{'the same as before (offsets, body sizes, headers)' if after == before else 'CHANGED'}")
        finally:
            for prefix in (service, exchange):
                queues, exchanges = leftovers(prefix)
                delete(args.broker, queues, exchanges)
    left = [leftovers(service), leftovers(exchange)]
    if any(q or e for q, e in left):
        print(f"left on the broker: {left}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
