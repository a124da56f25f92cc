"""One everything-on service under faults: the scenario shared by test_everything_on.py and benchmarks/soak.py.

A :class:`Scenario` owns a vhost on a private RabbitMQ node (one it may restart), a
:class:`~.silent_proxy.SilentProxy` between that node and the worker, and the worker
(``celery worker --with-events-step`` on ``everything_app``, restarted after a kill -9).
:meth:`Scenario.cycle` publishes events with the Node.js publisher, in chunks, with a
fault after each chunk but the last; :meth:`Scenario.finish` waits for every event and
returns the accounting (``everything_accounting``). A watcher polls the worker's pid:
an exit the scenario did not cause is counted (and the worker started again, so that
the run goes on and shows what else fails).
"""
from __future__ import annotations

__all__ = ["Scenario", "Records", "FAULTS", "faults_for"]

import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from itertools import zip_longest
from pathlib import Path
from typing import Any, Callable

import amqp.exceptions
from kombu import Connection

from kombu_events import Backlog

from .everything_accounting import Ledger, Report, account, dead_lettered_at_a_stop
from .everything_app import BACKLOG_FILE, DOWN_FLAG, HANDLERS, LATER_DELAY_S
from .everything_faults import DEPENDENCY_DOWN, FAULTS, Faults, children, faults_for
from .harness import ROOT, Worker, archived_copies, node_message, node_publish, unique, wait_for
from .private_broker import PrivateBroker, free_port
from .silent_proxy import SilentProxy

#: Share of the published events per kind (%); ``work`` events are poison (archived by design) at 1 %.
KINDS = {"work": 55, "pay": 20, "relay": 10, "audit": 15}
POISON_PERCENT = 1
#: Ids whose first attempt fails by design (%, chosen by a hash of seed and message id).
FAIL_PERCENT = 10
#: Worker restarts after exits of its own, at most (then the run goes on without a worker, and fails).
MAX_RESTARTS = 10


class Records:
    """The service's JSON-lines files, read incrementally (a line still being written waits for the next read)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._rows: dict[str, list[dict[str, Any]]] = {}
        self._offsets: dict[str, int] = {}
        self.handled: set[str] = set()
        self._calls_seen = 0
        #: Lines no JSON could be read from: a process killed in the middle of writing one.
        self.torn = 0

    def __call__(self, kind: str) -> list[dict[str, Any]]:
        rows = self._rows.setdefault(kind, [])
        offset = self._offsets.get(kind, 0)
        try:
            with open(self.directory / f"{kind}.jsonl", "rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except FileNotFoundError:
            return rows
        end = data.rfind(b"\n") + 1
        for line in filter(bytes.strip, data[:end].splitlines()):
            try:
                rows.append(json.loads(line))
            except ValueError:  # a record torn by a process killed (-9) while writing it: its event comes again
                self.torn += 1
        self._offsets[kind] = offset + end
        return rows

    def handled_ids(self) -> set[str]:
        """Ids whose handler ran to success so far."""
        calls = self("calls")
        self.handled.update(c["id"] for c in calls[self._calls_seen:] if c["ok"])
        self._calls_seen = len(calls)
        return self.handled

    def all(self) -> dict[str, list[dict[str, Any]]]:
        return {kind: list(self(kind)) for kind in ("calls", "hooks", "spans", "sentry", "runs", "circuits")}


class Scenario(Faults):
    """The everything-on service on ``broker`` (in a vhost of its own), its worker, its faults and its ledger."""

    def __init__(self, broker: PrivateBroker, directory: Path, *, pool: str, seed: str, events: int = 2000,
                 queue_type: str = "classic", log: Callable[[str], None] = print) -> None:
        self.broker, self.dir, self.pool, self.seed, self.events = broker, directory, pool, seed, events
        self.concurrency = 2 if pool == "prefork" else 1
        self.vhost, self.service, self.exchange = unique("everything"), unique("svc"), unique("ex")
        self.records_dir = directory / "records"
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.records = Records(self.records_dir)
        self.ledger = Ledger(handler_queues={f"{self.service}.{h}" for h in HANDLERS}, queue_type=queue_type,
                             publish_delays={"later-": LATER_DELAY_S})
        self.workers: list[Worker] = []  # harness.Worker numbers its log after this list
        self.worker: Worker | None = None
        self.metrics_port = 0
        self.started = time.monotonic()
        self._log = log
        self._lock = threading.RLock()  # held while a worker is started, killed or stopped
        self._children: list[int] = []
        self._down_since = 0.0
        self._restarts = 0
        self._watching = threading.Event()
        self._watcher: threading.Thread | None = None
        self.direct_url = f"amqp://guest:guest@127.0.0.1:{broker.ports[0]}/{self.vhost}"
        self.proxy: SilentProxy | None = None
        self._vhost_added = False

    # -- set-up and tear-down ---------------------------------------------------------------------

    def start(self) -> Scenario:
        """Create the vhost, the proxy and the worker; watch the worker from now on."""
        self.broker.ctl(1, "add_vhost", self.vhost)
        self._vhost_added = True
        self.broker.ctl(1, "set_permissions", "-p", self.vhost, "guest", ".*", ".*", ".*")
        self.proxy = SilentProxy(("127.0.0.1", self.broker.ports[0]))
        self.note(f"vhost {self.vhost}, service {self.service}, pool {self.pool}, {self.ledger.queue_type} queues, "
                  f"proxy port {self.proxy.port}")
        with self._lock:
            self._start_worker()
        self._watching.set()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="everything-watch")
        self._watcher.start()
        return self

    def close(self) -> None:
        """Kill what is left, close the proxy, delete the vhost (with everything in it)."""
        self._watching.clear()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        for worker in self.workers:
            worker.kill()
        if self.proxy is not None:
            self.proxy.close()
        if not self.broker.app_running:
            self.broker.start_app()
        if self._vhost_added:
            self.broker.ctl(1, "delete_vhost", self.vhost)

    def env(self) -> dict[str, str]:
        """The worker's environment (harness.Worker calls it)."""
        env = dict(os.environ)
        env.pop("RABBIT_URL", None)
        # A PYTHONPATH given by the caller comes first (e.g. another checkout of kombu_events to compare with).
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
        assert self.proxy is not None
        env.update(EVERYTHING_SERVICE=self.service, EVERYTHING_EXCHANGE=self.exchange,
                   EVERYTHING_BROKER=self.proxy.url(self.direct_url), EVERYTHING_PUBLISH_URL=self.direct_url,
                   EVERYTHING_RECORDS=str(self.records_dir), EVERYTHING_SEED=self.seed,
                   EVERYTHING_FAIL_PERCENT=str(FAIL_PERCENT), EVERYTHING_QUEUE_TYPE=self.ledger.queue_type)
        return env

    def note(self, what: str) -> None:
        """One line of the timeline: seconds since the start, and the clock (to find it in the worker logs)."""
        now = time.time()
        clock = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        self._log(f"[{self.pool} +{time.monotonic() - self.started:6.1f}s {clock}] {what}")

    # -- the worker ---------------------------------------------------------------------------------

    def _start_worker(self) -> None:
        self.metrics_port = free_port()
        cmd = [sys.executable, "-m", "celery", "-A", "tests.integration.everything_app", "worker",
               f"--pool={self.pool}", f"--concurrency={self.concurrency}", "--without-mingle", "--without-gossip",
               "--without-heartbeat", "--loglevel=INFO", f"--hostname={unique('w')}@%h", "--with-events-step",
               "--events-metrics-port", str(self.metrics_port)]
        worker = Worker(cmd, self)
        self.workers.append(worker)
        self.worker = worker
        self._children = []
        worker.wait_ready(timeout=60)
        pid = worker.proc.pid
        wait_for(lambda: self._started_since(pid, 0.0), timeout=30, interval=0.1, what=f"worker {pid} consuming")
        self.note(f"worker {pid} consuming ({worker.log_path.name})")

    def _watch(self) -> None:
        """Poll the worker's pid: an exit nobody asked for is counted, and the worker started again."""
        while self._watching.is_set():
            time.sleep(0.2)
            with self._lock:
                worker = self.worker
                if worker is None or not self._watching.is_set():
                    continue
                if worker.proc.poll() is None:
                    self._children = children(worker.proc.pid) or self._children
                    continue
                pid, code = worker.proc.pid, worker.proc.returncode
                tail = "\n".join(worker.log.splitlines()[-15:])
                self.ledger.exited[pid] = f"exit code {code} ({worker.log_path}); log ends:\n{tail}"
                self.ledger.exited_children.update(self._children)
                self.note(f"worker {pid} EXITED ON ITS OWN with code {code}")
                worker.kill()
                self.worker = None
                if self._restarts < MAX_RESTARTS:
                    self._restarts += 1
                    try:
                        self._start_worker()
                    except AssertionError as exc:  # it exited again: counted on the next turn
                        self.note(f"starting the worker again failed: {exc}")

    # -- publishing ----------------------------------------------------------------------------------

    def plan(self, cycle: int) -> list[tuple[str, str, int, bool]]:
        """The events of ``cycle``: (message id, kind, n, poison), fixed by the seed."""
        rng = random.Random(f"{self.seed}:{cycle}")
        kinds, weights = list(KINDS), list(KINDS.values())
        planned = []
        for n in range(self.events):
            kind = rng.choices(kinds, weights)[0]
            poison = kind == "work" and rng.random() * 100 < POISON_PERCENT
            planned.append((f"c{cycle}-{n}", kind, n, poison))
        return planned

    def publish(self, events: list[tuple[str, str, int, bool]]) -> None:
        """Publish with the Node.js client, straight to the broker; the ledger expects each (and what it derives)."""
        messages = [node_message(f"{kind}.{n}", {"n": n, "kind": kind, "poison": poison}, messageId=message_id)
                    for message_id, kind, n, poison in events]
        for message_id, kind, _n, poison in events:
            if poison:
                self.ledger.poison.add(message_id)
            else:
                self.ledger.expected.add(message_id)
            if kind == "relay":
                self.ledger.expected.add(f"later-{message_id}")
            if kind == "audit":
                self.ledger.expected.add(f"stored-{message_id}")
        for tries in range(4):
            try:
                node_publish(self.direct_url, self.exchange, messages)
                break
            except subprocess.CalledProcessError as exc:
                if tries == 3:
                    raise
                self.ledger.republished_chunks += 1  # some of it may have gone through: duplicates, never losses
                self.note(f"publishing a chunk failed ({exc.stderr.strip()[-200:]}); again in 1 s")
                time.sleep(1)
        self.ledger.sent += len(messages)

    # -- one cycle: chunks of events with a fault after each but the last -----------------------------

    def cycle(self, index: int) -> None:
        """Publish the cycle's events in chunks; after each chunk but the last, once a quarter of it is
        handled, inject the next fault."""
        planned = self.plan(index)
        faults = faults_for(self.pool)
        size = -(-len(planned) // (len(faults) + 1))
        chunks = [planned[i:i + size] for i in range(0, len(planned), size)]
        for chunk, fault in zip_longest(chunks, faults):
            if fault in DEPENDENCY_DOWN:
                self._down_since = time.time()
                (self.records_dir / DOWN_FLAG).touch()  # the payment API goes down as the chunk arrives
            self.publish(chunk or [])
            self.note(f"published {len(chunk or [])} events")
            if fault is None:
                continue
            wanted = {mid for mid, _k, _n, poison in chunk or [] if not poison}
            try:
                wait_for(lambda wanted=wanted: len(wanted & self.records.handled_ids()) >= len(wanted) // 4,
                         timeout=30, interval=0.1, what="a quarter of the chunk handled")
            except AssertionError as exc:
                self.note(f"{exc}; injecting {fault} anyway")
            self.inject(fault)

    # -- the end ---------------------------------------------------------------------------------------

    def wait_handled(self, timeout: float) -> bool:
        """Wait until every expected id was handled; False on timeout."""
        try:
            wait_for(lambda: self.ledger.expected <= self.records.handled_ids(), timeout=timeout, interval=0.5,
                     what="every event handled")
            return True
        except AssertionError:
            return False

    def finish(self, timeout: float = 90.0) -> Report:
        """Wait for every event, check the queues are settled, stop the worker warmly; the accounting."""
        done = self.wait_handled(timeout)
        self.note("every event handled" if done else f"NOT every event handled within {timeout:.0f} s")
        archived = self._archived(self.ledger.poison, timeout=15)
        unsettled = self._settled(timeout=20)
        problems = [f"queues not settled: {unsettled}"] if unsettled else []
        depth = Backlog(self.records_dir / BACKLOG_FILE).status().depth
        if depth:
            problems.append(f"{depth} events still in the publisher's backlog")
        metrics, status = self._scrape()
        if status != 200:
            problems.append(f"/healthz of the final worker answered {status}")
        self._watching.clear()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        with self._lock:
            if self.worker is not None and self.worker.proc.poll() is None:
                pid = self.worker.proc.pid
                self.worker.stop(timeout=30)
                if self.worker.proc.returncode in (0, None):
                    self.ledger.final_pid = pid
                else:
                    problems.append(f"the final worker {pid} stopped with {self.worker.proc.returncode}")
        records = self.records.all()
        missing = self.ledger.expected - self.records.handled_ids()
        # what the broker itself may drop is counted apart by account(), not a problem here either
        missing -= set(dead_lettered_at_a_stop(self.ledger, records.get("hooks", []), missing))
        if missing:
            problems.append(f"where the events never handled are now: {self._locate(missing)}")
        logs = {str(w.log_path): w.log for w in self.workers}
        report = account(self.ledger, records, archived, metrics, logs)
        report.problems += problems
        report.figures["wall time (s)"] = round(time.monotonic() - self.started, 1)
        return report

    def _locate(self, ids: set[str]) -> dict[str, str]:
        """Which queue of the vhost holds each of ``ids`` (taken out), or "nowhere in the broker"."""
        found = dict.fromkeys(sorted(ids), "nowhere in the broker")
        out = self.broker.ctl(1, "list_queues", "-p", self.vhost, "--no-table-headers", "name", "type", "messages")
        with Connection(self.direct_url) as conn:
            channel = conn.channel()
            for line in out.splitlines():
                queue, kind, count = line.rsplit("\t", 2)
                if "stream" in kind:  # the archive: a basic_get would close the connection; read, not taken
                    for message in archived_copies(self.direct_url, queue) or ():
                        if message.properties.get("message_id") in found:
                            found[message.properties["message_id"]] = queue
                    continue
                try:
                    for _ in range(int(count)):
                        message = channel.basic_get(queue, no_ack=True)
                        if message is None:
                            break
                        if message.properties.get("message_id") in found:
                            found[message.properties["message_id"]] = queue
                except amqp.exceptions.ChannelError as exc:  # e.g. a single-active-consumer quorum queue
                    self.note(f"cannot look into {queue}: {exc}")
                    channel = conn.channel()
        return found

    def _archived(self, wanted: set[str], timeout: float) -> list[str]:
        """Message ids of the copies in the service's archive (until ``wanted`` are all there, or ``timeout``); the
        archive is a stream: read, never changed, each copy once."""
        deadline = time.monotonic() + timeout
        while True:
            copies = archived_copies(self.direct_url, f"{self.service}.archive") or ()
            found = [m.properties.get("message_id") for m in copies]
            if wanted <= set(found) or time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    def _settled(self, timeout: float) -> dict[str, tuple[int, int]]:
        """Handler queues holding something (ready, unacked) after ``timeout``; {} once all are empty."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.broker.ctl(1, "list_queues", "-p", self.vhost, "--no-table-headers", "name",
                                  "messages_ready", "messages_unacknowledged")
            busy = {}
            for line in out.splitlines():
                name, ready, unacked = line.rsplit("\t", 2)
                if name in {f"{self.service}.{h}" for h in HANDLERS} | {f"{self.exchange}.unrouted"} and \
                        (int(ready) or int(unacked)):
                    busy[name] = (int(ready), int(unacked))
            if not busy or time.monotonic() > deadline:
                return busy
            time.sleep(1)

    def _scrape(self) -> tuple[dict[tuple[str, str], float] | None, int]:
        """{(queue, action): kombu_events_messages_total} of the handler queues, and /healthz's status."""
        from prometheus_client.parser import text_string_to_metric_families

        base = f"http://127.0.0.1:{self.metrics_port}"
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=5) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError:
            return None, 0
        with urllib.request.urlopen(base + "/metrics", timeout=5) as response:
            text = response.read().decode()
        queues = {f"{self.service}.{h}" for h in HANDLERS}
        found = {(s.labels["queue"], s.labels["action"]): s.value
                 for family in text_string_to_metric_families(text) for s in family.samples
                 if s.name == "kombu_events_messages_total" and s.labels.get("queue") in queues}
        return found, status

