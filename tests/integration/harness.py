"""Integration harness: unique services, real `celery worker` subprocesses, broker inspection.

A service's archive (``<service>.archive``) is a RabbitMQ stream: the helpers that read a
queue read it by offset, never changing it, and count and return its *pending* archived
copies (those no replay or purge settled), as ``archive list`` does.
"""
from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping
from urllib.parse import quote, unquote, urlsplit

from amqp.exceptions import ConsumerCancelled, NotFound
from kombu import Connection

from kombu_events.core.config import Settings
from kombu_events.core.topology import build_topology
from kombu_events.ops import archive

from ..brokers import MANAGEMENT_URL, PORT, RABBITMQCTL, rabbitmqctl

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "tests" / "node"


def unique(prefix: str = "t") -> str:
    """A name no other test uses."""
    return f"{prefix}{uuid.uuid4().hex[:10]}"


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll ``predicate`` until truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


HEADER = '''
import json, os, time
from celery import Celery
from kombu_events import *

app = Celery({service!r}, broker={broker!r})
app.conf.broker_connection_retry_on_startup = True
# Tasks go to a queue of this service only: workers of other tests never take them.
app.conf.task_default_queue = {service!r} + ".tasks"
RECORDS = {records!r}

def record(**fields):
    fields.setdefault("pid", os.getpid())
    fields.setdefault("time", time.time())
    with open(RECORDS, "a") as fh:
        fh.write(json.dumps(fields) + "\\n")
'''


class Project:
    """A throw-away Celery project in ``tmp_path`` whose handlers append JSON lines to a file.

    In ``body``, ``SERVICE`` and ``EXCHANGE`` stand for the service name and the events
    exchange (unique unless given; pass the same ``exchange`` to projects that share it).
    ``cleanup()`` deletes both the service's entities and the exchange.
    """

    def __init__(self, tmp_path: Path, broker_url: str, body: str, service: str | None = None,
                 module: str | None = None, exchange: str | None = None) -> None:
        self.dir = tmp_path
        self.broker_url = broker_url
        self.service = service or unique("svc")
        self.exchange = exchange or unique("ex")
        self.module = module or unique("proj_")
        self.records_path = tmp_path / f"{self.module}.records"
        source = HEADER.format(service=self.service, broker=broker_url, records=str(self.records_path))
        source += (textwrap.dedent(body).replace("SERVICE", repr(self.service))
                   .replace("EXCHANGE", repr(self.exchange)))
        (tmp_path / f"{self.module}.py").write_text(source)
        self.workers: list[Worker] = []

    def records(self, **match: Any) -> list[dict[str, Any]]:
        """Everything the handlers recorded so far (only records with these field values, if given).

        A line without its newline is one a handler is still writing (a read can see part of a write): left for
        the next read. A line that is not JSON was torn by a process killed while writing it: its handler never
        finished, so it is no record (the event comes again)."""
        if not self.records_path.exists():
            return []
        text = self.records_path.read_text()
        records = []
        for line in text[:text.rfind("\n") + 1].splitlines():
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return [r for r in records if all(r.get(k) == v for k, v in match.items())]

    def node_publish(self, *messages: dict[str, Any]) -> None:
        """Publish :func:`node_message` messages to this project's exchange with the Node.js client."""
        node_publish(self.broker_url, self.exchange, list(messages))

    def send_task(self, name: str) -> None:
        """Send the project's task ``name`` to the project's own task queue."""
        from celery import Celery

        app = Celery(broker=self.broker_url)
        try:
            app.send_task(f"{self.module}.{name}", queue=f"{self.service}.tasks")
        finally:
            app.close()

    def declare(self) -> None:
        """Declare the topology of the project's ``events`` without starting a worker."""
        result = self.run_python(f"""
            from kombu import Connection
            from kombu_events.broker.declare import declare
            from {self.module} import events
            with Connection(events.broker_url) as conn:
                declare(events.topology(), conn)
        """)
        assert result.returncode == 0, result.stderr

    def settled(self, *names: str) -> bool:
        """Queues ``<service>.<name>`` hold nothing ready and nothing unacknowledged."""
        counts = queue_counts(self.broker_url)
        return all(counts[f"{self.service}.{name}"][:2] == (0, 0) for name in names)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.dir), str(ROOT), env.get("PYTHONPATH", "")])
        env.pop("RABBIT_URL", None)
        # The shared node's management API (4.0's is not on port 15672); a node of a test's own (its own
        # port: a cluster, a TLS node) keeps the default, the management API on its host's port 15672.
        if urlsplit(self.broker_url.split(";")[0]).port == PORT:
            env["KOMBU_EVENTS_MANAGEMENT_URL"] = MANAGEMENT_URL
        else:
            env.pop("KOMBU_EVENTS_MANAGEMENT_URL", None)
        return env

    def worker(self, *args: str, events: bool = True, pool: str = "solo", concurrency: int = 1) -> Worker:
        """Start ``celery worker`` for this project (with ``--with-events-step`` unless events=False)."""
        cmd = [sys.executable, "-m", "celery", "-A", self.module, "worker", f"--pool={pool}",
               f"--concurrency={concurrency}", "--without-mingle", "--without-gossip",
               "--without-heartbeat", "--loglevel=INFO", f"--hostname={unique('w')}@%h", *args]
        if events:
            cmd.append("--with-events-step")
        worker = Worker(cmd, self)
        self.workers.append(worker)
        return worker

    def run_python(self, code: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ``code`` with the project importable (e.g. to publish through ``events``)."""
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=self.dir, env=self.env(),
                              capture_output=True, text=True, timeout=timeout)

    def cleanup(self) -> None:
        """Kill workers (a warm stop waits up to 10 s for Celery's event loop), delete every entity."""
        for worker in self.workers:
            worker.kill()
        delete_service(self.broker_url, self.service, (self.exchange,))


class Worker:
    """A `celery worker` subprocess with its log in a file."""

    def __init__(self, cmd: list[str], project: Project) -> None:
        self.log_path = project.dir / f"worker-{len(project.workers)}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 -- the worker writes it until _reap() closes it
        self.proc = subprocess.Popen(cmd, cwd=project.dir, env=project.env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> Worker:
        """Wait until the worker says it is ready."""
        wait_for(lambda: " ready." in self.log or self.proc.poll() is not None, timeout, what="worker ready")
        if self.proc.poll() is not None:
            raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log[-4000:]}")
        return self

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the worker to exit on its own; its exit code."""
        return self.proc.wait(timeout=timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the main process (SIGKILL by default) and its pool children."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)
        if sig == signal.SIGKILL:
            self._reap()

    def _reap(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # orphaned pool children, if any
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM), then kill if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap()


def queue_depth(broker_url: str, queue: str) -> tuple[int, int]:
    """(ready messages, consumers) of ``queue``; unacknowledged messages are not counted. Of a stream (the
    archive): its pending archived copies."""
    with Connection(broker_url) as conn:
        _name, messages, consumers = conn.default_channel.queue_declare(queue, passive=True)
        if _is_archive(queue):
            copies = archived_copies(broker_url, queue)
            if copies is not None:
                return len(copies), consumers
        return messages, consumers


def queue_counts(broker_url: str) -> Mapping[str, tuple[int, int, int]]:
    """{queue: (ready, unacknowledged, consumers)} for every queue: exact, but ~0.4 s (rabbitmqctl). A stream
    counts its pending archived copies as ready (read when asked for) and nothing unacknowledged."""
    for _ in range(20):  # a queue another test is declaring or deleting right now may list empty counts
        out = subprocess.run([*RABBITMQCTL, "-q", "list_queues", "-p", _vhost(broker_url), "--no-table-headers",
                              "name", "type", "messages_ready", "messages_unacknowledged", "consumers"],
                             capture_output=True, text=True, check=True).stdout
        if all(field.strip() for line in out.splitlines() for field in line.rsplit("\t", 3)[1:]):
            break
        time.sleep(0.25)
    counts = {}
    stream_queues = set()
    for line in out.splitlines():
        name, kind, ready, unacked, consumers = line.rsplit("\t", 4)
        counts[name] = (int(ready), int(unacked), int(consumers))
        if kind == "stream" or kind.endswith("stream_queue"):
            stream_queues.add(name)
    return _Counts(broker_url, counts, stream_queues)


class _Counts(Mapping[str, tuple[int, int, int]]):
    """queue_counts' answer: a stream's entry is read when asked for (a vhost holds other tests' archives)."""

    def __init__(self, broker_url: str, counts: dict[str, tuple[int, int, int]], stream_queues: set[str]) -> None:
        self.broker_url, self.counts, self.stream_queues = broker_url, counts, stream_queues

    def __getitem__(self, name: str) -> tuple[int, int, int]:
        found = self.counts[name]
        if name in self.stream_queues and _is_archive(name):
            self.stream_queues.discard(name)
            try:
                copies = archived_copies(self.broker_url, name)
            except (NotFound, ConsumerCancelled):  # another test's, deleted before or while it was read
                return found
            found = self.counts[name] = (len(copies or ()), 0, found[2])
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self.counts)

    def __len__(self) -> int:
        return len(self.counts)


def consumer_prefetch(broker_url: str) -> dict[str, list[int]]:
    """{queue: [prefetch count of each of its consumers]} in the URL's vhost (rabbitmqctl)."""
    out = subprocess.run([*RABBITMQCTL, "-q", "list_consumers", "-p", _vhost(broker_url), "--no-table-headers",
                          "queue_name", "prefetch_count"], capture_output=True, text=True, check=True).stdout
    found: dict[str, list[int]] = {}
    for line in out.splitlines():
        if "\t" not in line:  # e.g. a consumer of another test's queue whose name has a line break in it
            continue
        name, prefetch = line.rsplit("\t", 1)
        found.setdefault(name, []).append(int(prefetch))
    return found


def _is_archive(queue: str) -> bool:
    return queue.endswith(".archive")


def _archive_topology(queue: str) -> Any:
    """The topology of the service whose archive is ``queue`` (no handler: the archive is all it names)."""
    topology = build_topology(Settings(service=queue[:-len(".archive")]), ())
    if topology.archive_exchange != queue:
        raise ValueError(f"{queue!r} is no service's archive")
    return topology


def archived_copies(broker_url: str, queue: str) -> list[Any] | None:
    """The pending archived copies of the archive stream ``queue``, oldest first, as ``archive list`` reads them
    (:func:`kombu_events.ops.archive.view`: ``.body`` whole, ``.headers`` as archived, ``.properties``, ``.key``),
    the stream left as it was. None when ``queue`` is no stream (an earlier version's archive)."""
    topology = _archive_topology(queue)
    with Connection(broker_url) as conn:
        try:
            return archive.view(conn, topology, body_limit=None).pending()
        except archive.LegacyArchiveError:
            return None
        except archive.ArchiveMissingError as exc:
            raise NotFound(str(exc)) from exc


def purge_archive(broker_url: str, queue: str) -> int:
    """Settle every copy of the archive stream ``queue`` as purged, as ``archive purge`` does; how many."""
    with Connection(broker_url) as conn:
        return archive.purge_all(conn, _archive_topology(queue), by="tests")


def get_messages(broker_url: str, queue: str) -> list[Any]:
    """Take every ready message out of ``queue`` (``.body`` as bytes, ``.headers``, ``.properties``). The archive
    (a stream) is only read: its pending copies (:func:`archived_copies`), left as they are."""
    if _is_archive(queue):
        copies = archived_copies(broker_url, queue)
        if copies is not None:
            return copies
    messages = []
    with Connection(broker_url) as conn:
        channel = conn.channel()
        channel.auto_decode = False  # py-amqp would turn the body into str when content_encoding is set
        while True:
            message = channel.basic_get(queue, no_ack=True)
            if message is None:
                return messages
            messages.append(message)


def _vhost(broker_url: str) -> str:
    return unquote(urlsplit(broker_url).path[1:]) or "/"


def _management(broker_url: str, path: str) -> Any:
    """GET ``/api/<path>`` of the management plugin, with the broker URL's credentials."""
    url = urlsplit(broker_url)
    request = urllib.request.Request(f"{MANAGEMENT_URL}/api/{path}")
    token = base64.b64encode(f"{unquote(url.username or 'guest')}:{unquote(url.password or 'guest')}".encode())
    request.add_header("Authorization", "Basic " + token.decode())
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response)


def _names(broker_url: str, kind: str) -> list[str]:
    """Names of every queue or exchange (``kind``) of the URL's vhost: management API, else rabbitmqctl."""
    vhost = _vhost(broker_url)
    try:  # ~10 ms; rabbitmqctl takes ~0.4 s
        return [entry["name"] for entry in _management(broker_url, f"{kind}/{quote(vhost, safe='')}?columns=name")]
    except OSError:
        out = subprocess.run([*RABBITMQCTL, "-q", f"list_{kind}", "-p", vhost, "--no-table-headers", "name"],
                             capture_output=True, text=True, check=True).stdout
        return out.split()


def delete_service(broker_url: str, service: str, exchanges: tuple[str, ...] = ()) -> None:
    """Delete every queue and exchange named ``<service>`` or ``<service>.*`` (and ``exchanges``, with the
    ``<exchange>.*`` entities of their delayed-publishing ladders)."""
    def mine(name: str) -> bool:
        return any(name == owner or name.startswith(owner + ".") for owner in (service, *exchanges))

    queues = [n for n in _names(broker_url, "queues") if mine(n)]
    names = sorted({n for n in _names(broker_url, "exchanges") if mine(n)} | set(exchanges))
    with Connection(broker_url) as conn:
        for name in queues:
            conn.default_channel.queue_delete(name)
        for name in names:
            conn.default_channel.exchange_delete(name)


def node_message(routing_key: str, body: Any, **properties: Any) -> dict[str, Any]:
    """A message for :func:`node_publish`: a non-str ``body`` is sent as JSON; ``properties`` in
    amqplib's spelling (``messageId``); ``contentType`` defaults to JSON, ``contentType=None`` sends none."""
    properties.setdefault("contentType", "application/json")
    if properties["contentType"] is None:
        del properties["contentType"]
    text = body if isinstance(body, str) else json.dumps(body)
    return {"routing_key": routing_key, "body": text, "properties": properties}


def node_publish(broker_url: str, exchange: str, messages: list[dict[str, Any]]) -> None:
    """Publish with the Node.js ``amqplib`` client: [{routing_key, body (str), properties}]."""
    subprocess.run(["node", str(NODE_DIR / "publish.js"), broker_url, exchange],
                   input=json.dumps(messages), text=True, check=True, capture_output=True, timeout=60,
                   cwd=NODE_DIR)


def publish_amqp(broker_url: str, exchange: str, routing_key: str, body: bytes, **properties: Any) -> None:
    """Publish ``body`` with exactly ``properties`` (py-amqp names: ``message_id``,
    ``application_headers``, ...), mandatory and confirmed."""
    import amqp

    with Connection(broker_url) as conn:
        channel = conn.channel()
        channel.confirm_select()
        channel.basic_publish(amqp.Message(body, **properties), exchange=exchange, routing_key=routing_key,
                              mandatory=True)
        channel.close()


def peek_messages(broker_url: str, queue: str) -> list[Any]:
    """Every ready message of ``queue``, left in the queue (got unacked, back when the channel closes); of the
    archive (a stream), its pending copies (:func:`archived_copies`)."""
    if _is_archive(queue):
        copies = archived_copies(broker_url, queue)
        if copies is not None:
            return copies
    messages = []
    with Connection(broker_url) as conn:
        channel = conn.channel()
        while True:
            message = channel.basic_get(queue, no_ack=False)
            if message is None:
                break
            messages.append(message)
        channel.close()
    return messages


def management_queue(broker_url: str, queue: str) -> dict[str, Any]:
    """The management API's view of ``queue`` (its counters refresh every ~5 s)."""
    return _management(broker_url, f"queues/{quote(_vhost(broker_url), safe='')}/{quote(queue, safe='')}")


def run_cli(project: Project, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``kombu-events -A <project module> ARGS`` as a user would, from the project's directory."""
    cli = Path(sys.executable).parent / "kombu-events"
    return subprocess.run([str(cli), "-A", project.module, *args], cwd=project.dir, env=project.env(),
                          capture_output=True, text=True, timeout=timeout)


def http_get(port: int, path: str) -> tuple[int, str]:
    """``GET http://127.0.0.1:<port><path>``: (status, body); (0, why) while nothing listens (yet, or any more)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def ctl(*args: str) -> subprocess.CompletedProcess:
    """``rabbitmqctl -q ARGS`` on the shared node; raises CalledProcessError if it fails."""
    return rabbitmqctl(*args)


@contextmanager
def own_vhost(prefix: str, **users: str) -> Iterator[dict[str, str]]:
    """A vhost of the test's own, guest admin on it, and ``users`` (role -> name prefix) with no permissions,
    each with the password ``password``; deleted after. Without rabbitmqctl the test skips, and fails under
    CI=true (a least-privilege test must never silently not run)."""
    tag = uuid.uuid4().hex[:8]
    found = {"name": f"{prefix}-{tag}", "password": f"secret-{tag}",
             **{role: f"{name}-{tag}" for role, name in users.items()}}
    try:
        ctl("add_vhost", found["name"])
    except (OSError, subprocess.CalledProcessError) as exc:
        import pytest

        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"rabbitmqctl cannot create a vhost (CI=true: must not skip): {exc}")
        pytest.skip(f"rabbitmqctl cannot create a vhost: {exc}")
    try:
        ctl("set_permissions", "-p", found["name"], "guest", ".*", ".*", ".*")
        for role in users:
            ctl("add_user", found[role], found["password"])
        yield found
    finally:
        for role in users:
            rabbitmqctl("delete_user", found[role], check=False)
        ctl("delete_vhost", found["name"])
