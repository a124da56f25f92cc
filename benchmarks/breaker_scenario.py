"""Issue 19 in a loop: ``python -m benchmarks.breaker_scenario --runs 20 [--pool solo] [--pythonpath DIR]``.

Each run: a service of its own (``kebreak-<hex>``, exchange ``<service>.events``) with a
flaky handler behind a circuit breaker and a healthy one (``benchmarks/apps/breaker_app.py``),
a fresh ``celery -A breaker_app worker --with-events-step`` with its own log, and
``--outages`` outages of the flaky handler's dependency. In each, events for both handlers
are published by the Node.js client (``tests/node/publish.js``) while the dependency is
down; once the circuit has opened, the dependency comes back and the run waits until every
event is handled and the circuit has closed (then the next outage), the worker exits, or
``--timeout``. Then the worker is stopped, the events still in the broker are counted by
message id, and every queue and exchange of the run is deleted.

Printed per run: whether the worker exited on its own (and its exit code), whether its
log says ``Unrecoverable error``, events handled / expected, duplicates, events still in a
queue, events lost (neither handled nor in a queue), and how often the circuit opened.
The last line sums the runs; the exit status is 1 if any run failed. ``--pythonpath DIR``
makes the worker import ``kombu_events`` from ``DIR`` (e.g. a ``git worktree`` of an older
commit); the worker logs which file it imported, and the header shows it.

The crash needs the broker to confirm the republish that trips the circuit together with
the next one (one ``basic.ack`` with ``multiple``), which depends on timing. Here the
report's scenario (``--events 30 --outages 1 --no-burst``) crashed the old code in 2 to 5
runs out of 20; the defaults (100 events per outage, 3 outages, the worker stopped while
they are published) in 15 and 19 of 20. A run that does not crash takes about 11 s.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kombu import Connection

from .procs import stop_group

ROOT = Path(__file__).resolve().parents[1]
APPS = ROOT / "benchmarks" / "apps"
NODE_DIR = ROOT / "tests" / "node"
DEFAULT_URL = os.environ.get("KEB_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
PREFIX = "kebreak-"
UNRECOVERABLE = "Unrecoverable error"


@dataclass
class Result:
    """What one run saw."""

    seconds: float
    exit_code: int | None  # None: still running when the run ended (it was stopped)
    unrecoverable: str  # the error after "Unrecoverable error: ", with the library frame it came from; "" if none
    trips: int
    handled: int
    expected: int
    duplicates: int
    waiting: int
    lost: int
    log: Path

    @property
    def failed(self) -> bool:
        return (self.exit_code is not None or bool(self.unrecoverable) or self.handled < self.expected
                or self.duplicates > 0 or self.lost > 0 or self.trips == 0)

    def line(self) -> str:
        exited = "no" if self.exit_code is None else f"yes ({self.exit_code})"
        return (f"{self.seconds:5.1f} s  worker exited: {exited:<8} unrecoverable: "
                f"{('yes ' + self.unrecoverable) if self.unrecoverable else 'no':<37} handled {self.handled}/"
                f"{self.expected}  duplicates {self.duplicates}  in queues {self.waiting}  lost {self.lost}  "
                f"breaker opened: {f'yes ({self.trips}x)' if self.trips else 'no'}")


# -- the worker ----------------------------------------------------------------------------------

class Worker:
    """``celery -A breaker_app worker`` in ``run_dir``, its output in ``worker.log``."""

    def __init__(self, a: argparse.Namespace, run_dir: Path, env: dict[str, str]) -> None:
        self.log_path = run_dir / "worker.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 -- the worker writes it until stop() closes it
        cmd = [sys.executable, "-m", "celery", "-A", "breaker_app", "worker", "--with-events-step",
               f"--pool={a.pool}", f"--concurrency={a.concurrency}", "--loglevel=INFO", "--without-mingle",
               "--without-gossip", "--without-heartbeat", f"--hostname={env['KEB_BRK_SERVICE']}@%h"]
        # cwd is the run's directory: `python -m` puts it first on sys.path, so not the repository's kombu_events.
        self.proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while " ready." not in self.log:
            if self.exited():
                raise RuntimeError(f"worker exited with {self.proc.returncode} before ready:\n{self.log[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker not ready after {timeout_s:g} s:\n{self.log[-3000:]}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Warm shutdown (SIGTERM), SIGKILL after ``timeout_s``; then whatever is left of its process group.

        The run has seen what it needs by then; a solo worker's warm shutdown often takes ~10 s.
        """
        stop_group(self.proc, timeout_s, alive=not self.exited())
        self._log.close()


def unrecoverable(log: str) -> str:
    """``KeyError(4) at confirms.py:88`` from a worker log with an ``Unrecoverable error``; "" without one."""
    found = re.search(rf"{UNRECOVERABLE}: (.*)", log)
    if not found:
        return ""
    frames = re.findall(r'File "[^"]*/kombu_events/([^"]+)", line (\d+)', log[found.start():])
    return found.group(1).strip() + (f" at {frames[-1][0]}:{frames[-1][1]}" if frames else "")


# -- the broker -----------------------------------------------------------------------------------

def _vhost(url: str) -> str:
    return unquote(urlsplit(url).path[1:]) or "/"


def names(url: str, kind: str, prefix: str) -> list[str]:
    """Queues or exchanges (``kind``) of the URL's vhost whose name starts with ``prefix``."""
    out = subprocess.run(["rabbitmqctl", "-q", f"list_{kind}", "-p", _vhost(url), "--no-table-headers", "name"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [n for n in out.split() if n.startswith(prefix)]


def consumers(url: str, queue: str) -> int:
    with Connection(url) as conn:
        return conn.default_channel.queue_declare(queue, passive=True)[2]


def ids_in_queues(url: str, queues: list[str]) -> Counter[str]:
    """Message ids of every message in ``queues``, left where they are (taken unacked, back on close).

    Handler queues are read last: a message still in a delay queue is held there, so it
    cannot expire into a handler queue already read and be missed.
    """
    handler_last = sorted(queues, key=lambda q: q.endswith((".flaky", ".healthy")))
    found: Counter[str] = Counter()
    with Connection(url) as conn:
        channel = conn.channel()
        for queue in handler_last:
            while (message := channel.basic_get(queue, no_ack=False)) is not None:
                found[message.properties.get("message_id")] += 1
        channel.close()
    return found


def delete(url: str, prefix: str) -> None:
    """Delete every queue and exchange whose name starts with ``prefix``."""
    queues, exchanges = names(url, "queues", prefix), names(url, "exchanges", prefix)
    with Connection(url) as conn:
        for name in queues:
            conn.default_channel.queue_delete(name)
        for name in exchanges:
            conn.default_channel.exchange_delete(name)


def node_publish(url: str, exchange: str, messages: list[dict]) -> None:
    """Publish with the Node.js amqplib client (confirmed, persistent)."""
    subprocess.run(["node", str(NODE_DIR / "publish.js"), url, exchange], input=json.dumps(messages), text=True,
                   check=True, capture_output=True, timeout=60, cwd=NODE_DIR)


# -- one run ------------------------------------------------------------------------------------------

def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # the line being written right now
            pass
    return records


def messages(service: str, a: argparse.Namespace, outage: int) -> list[dict]:
    """The flaky handler's events interleaved with the healthy one's, each with its own message id."""
    counts = {"flaky": a.events, "healthy": a.healthy_events}
    keys = sorted(((kind, i) for kind, n in counts.items() for i in range(n)),
                  key=lambda k: (k[1] + 0.5) / counts[k[0]])  # spread evenly over the sequence
    return [{"routing_key": f"{kind}.x", "body": json.dumps({"i": i}),
             "properties": {"messageId": f"{service}-{outage}-{kind}-{i}", "contentType": "application/json",
                            "persistent": not a.transient}}
            for kind, i in keys]


def until(predicate, timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms until true; raise after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def worker_env(a: argparse.Namespace, service: str, run_dir: Path) -> dict[str, str]:
    """The worker's environment: ``--pythonpath`` then ``benchmarks/apps`` only, the run's names and files."""
    env = {k: v for k, v in os.environ.items() if k != "RABBIT_URL"}
    env.update(PYTHONPATH=os.pathsep.join([*a.pythonpath, str(APPS)]), KEB_BROKER=a.broker,
               KEB_BRK_SERVICE=service, KEB_BRK_EXCHANGE=f"{service}.events",
               KEB_BRK_RECORDS=str(run_dir / "records.jsonl"), KEB_BRK_DOWN=str(run_dir / "dependency-down"),
               KEB_BRK_WORK_MS=str(a.work_ms))
    return env


def drive(worker: Worker, env: dict[str, str], expected: set[str], outage: int, timeout_s: float) -> bool:
    """Bring the dependency back once the circuit has opened for the ``outage``-th time (1-based); True once
    every event is handled and the circuit has closed again, False if the worker exited or after ``timeout_s``."""
    records, down = Path(env["KEB_BRK_RECORDS"]), Path(env["KEB_BRK_DOWN"])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not worker.exited():
        seen = read_records(records)
        states = Counter(r.get("circuit") for r in seen)
        if down.exists() and states["open"] >= outage:
            down.unlink()
        if states["closed"] >= outage and expected <= {r["id"] for r in seen if r.get("ok")}:
            return True
        time.sleep(0.05)
    return False


def outages(a: argparse.Namespace, worker: Worker, env: dict[str, str]) -> set[str]:
    """Each outage: the dependency goes down, the events are published, the circuit opens, the dependency
    comes back, every event is handled; the next outage only if all went well. The ids published."""
    expected: set[str] = set()
    for outage in range(1, a.outages + 1):
        Path(env["KEB_BRK_DOWN"]).touch()
        sent = messages(env["KEB_BRK_SERVICE"], a, outage)
        if a.burst:  # the worker finds every event waiting when it wakes up, as after a pause or a restart
            os.killpg(worker.proc.pid, signal.SIGSTOP)
        try:
            node_publish(a.broker, env["KEB_BRK_EXCHANGE"], sent)
        finally:
            if a.burst:
                os.killpg(worker.proc.pid, signal.SIGCONT)
        expected |= {m["properties"]["messageId"] for m in sent}
        if not drive(worker, env, expected, outage, a.timeout):
            break
    return expected


def one_run(a: argparse.Namespace, run_dir: Path, service: str) -> Result:
    """Start a worker, publish, drive the run, stop the worker; count by message id (queues deleted by the caller)."""
    env = worker_env(a, service, run_dir)
    start = time.monotonic()
    worker = Worker(a, run_dir, env)
    try:
        worker.wait_ready(timeout_s=30)
        until(lambda: min(consumers(a.broker, f"{service}.{h}") for h in ("flaky", "healthy")) > 0, 30,
              "the worker to consume both handler queues")
        expected = outages(a, worker, env)
        exit_code = worker.proc.returncode if worker.exited() else None
    finally:
        worker.stop()
    until(lambda: consumers(a.broker, f"{service}.flaky") == 0, 30, "the broker to take back unacked messages")
    left = set(ids_in_queues(a.broker, names(a.broker, "queues", service + ".")))
    seen = read_records(Path(env["KEB_BRK_RECORDS"]))
    ok = Counter(r["id"] for r in seen if r.get("ok"))
    handled = expected & set(ok)
    return Result(seconds=time.monotonic() - start, exit_code=exit_code, unrecoverable=unrecoverable(worker.log),
                  trips=sum(r.get("circuit") == "open" for r in seen), handled=len(handled), expected=len(expected),
                  duplicates=sum(n - 1 for n in ok.values()), waiting=len((expected - handled) & left),
                  lost=len(expected - handled - left), log=worker.log_path)


def delete_all(url: str, services: list[str], wait_s: float = 60.0) -> list[str]:
    """Delete the entities of ``services``, retrying while the broker is unavailable; those left over."""
    deadline = time.monotonic() + wait_s
    while services:
        try:
            delete(url, services[0])
            services = services[1:]
        except Exception as exc:  # e.g. another test stopped the broker's app for a while
            if time.monotonic() > deadline:
                print(f"WARNING: could not delete {', '.join(services)}: {exc}")
                return services
            time.sleep(2)
    return []


# -- the command ----------------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.breaker_scenario", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20, help="runs (default %(default)s)")
    p.add_argument("--pool", default="solo", help="worker pool (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=1, help="worker concurrency (default %(default)s)")
    p.add_argument("--events", type=int, default=100,
                   help="events for the flaky handler per outage (default %(default)s; the report had 30)")
    p.add_argument("--healthy-events", type=int, default=30,
                   help="events for the healthy handler, interleaved (default %(default)s)")
    p.add_argument("--transient", action="store_true",
                   help="publish transient events (amqplib's default; tests/node/publish.js's is persistent)")
    p.add_argument("--outages", type=int, default=3,
                   help="outages of the dependency per run, events published in each (default %(default)s; "
                        "the report had 1)")
    p.add_argument("--burst", action=argparse.BooleanOptionalAction, default=True,
                   help="stop the worker (SIGSTOP) while the events are published, then let it go on "
                        "(default: yes)")
    p.add_argument("--work-ms", type=float, default=0, help="each handler call sleeps this long (default 0)")
    p.add_argument("--timeout", type=float, default=20, help="seconds an outage may take after publishing "
                   "(default %(default)s)")
    p.add_argument("--pythonpath", action="append", default=[], metavar="DIR",
                   help="directory the worker imports kombu_events from (e.g. a git worktree); repeatable; "
                        "default: the installed package")
    p.add_argument("--broker", default=DEFAULT_URL, help="AMQP URL (default: $KEB_BROKER_URL or the local one)")
    p.add_argument("--keep", action="store_true", help="keep every run's directory (default: failed runs only)")
    a = p.parse_args(argv)
    a.pythonpath = [str(Path(d).resolve()) for d in a.pythonpath]
    return a


def code_under_test(log: str, pythonpath: list[str]) -> str:
    """Which ``kombu_events`` the worker imported (its own line in the log), with the commit it comes from."""
    found = re.search(r"breaker_app: kombu_events from (\S+)", log)
    where = found.group(1) if found else "? (the worker did not say)"
    for directory in pythonpath or [str(ROOT)]:
        if where.startswith(directory + os.sep):
            return where + _commit(directory)
    return where + (" -- WARNING: not from --pythonpath" if pythonpath else "")


def _commit(directory: str) -> str:
    """`` (commit abc1234 subject)``, noting uncommitted changes to kombu_events/; "" outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", directory, *args], capture_output=True, text=True).stdout.strip()

    head = git("log", "-1", "--format=%h %s")
    if not head:
        return ""
    head = head if len(head) <= 60 else head[:57] + "..."
    dirty = ", with uncommitted changes to kombu_events/" if git("status", "--porcelain", "--", "kombu_events") else ""
    return f" (commit {head}{dirty})"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = Path(tempfile.mkdtemp(prefix=PREFIX))
    print(f"issue 19 loop: {a.runs} runs, --pool={a.pool} -c {a.concurrency}, {a.events} flaky + "
          f"{a.healthy_events} healthy events (Node.js publisher), timeout {a.timeout:g} s; logs in {out}")
    results: list[Result] = []
    errors = 0
    for n in range(1, a.runs + 1):
        run_dir, service = out / f"run-{n:02d}", PREFIX + uuid.uuid4().hex[:10]
        run_dir.mkdir()
        try:
            result = one_run(a, run_dir, service)
        except Exception as exc:  # the run could not be carried out (broker unavailable, worker never ready)
            errors += 1
            print(f"run {n:2d}/{a.runs}  ERROR {type(exc).__name__}: {str(exc)[:500]}", flush=True)
            continue
        finally:
            delete_all(a.broker, [service])
        if not results:
            print(f"worker's kombu_events: {code_under_test(result.log.read_text(errors='replace'), a.pythonpath)}")
        results.append(result)
        print(f"run {n:2d}/{a.runs}  {result.line()}", flush=True)
        if not (result.failed or a.keep):
            shutil.rmtree(run_dir)
    failed = sum(r.failed for r in results) + errors
    print(f"runs {len(results)}: worker exits {sum(r.exit_code is not None for r in results)}, "
          f"unrecoverable {sum(bool(r.unrecoverable) for r in results)}, lost {sum(r.lost for r in results)}, "
          f"not all handled {sum(r.handled < r.expected for r in results)}, "
          f"duplicates {sum(r.duplicates for r in results)}, breaker never opened "
          f"{sum(r.trips == 0 for r in results)}, errors {errors}; failed {failed}; "
          f"{sum(r.seconds for r in results) / max(len(results), 1):.1f} s a run")
    if failed:
        print(f"logs of the failed runs: {out}/run-*/worker.log")
    elif not a.keep:
        shutil.rmtree(out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
