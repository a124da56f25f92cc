"""No secret ever shown (issue 26, item 5): a canary password in the broker URL appears in no output, at DEBUG.

A user of the test's own with a unique canary password (``canary-<hex>`` plus characters a URL must
encode) on a vhost of the test's own, both deleted at the end; then, everything at DEBUG:

- a worker (``--loglevel=DEBUG``, solo pool, ``--events-metrics-port``) handling events: one
  acked (its handler publishes), one failing then retried, one archived (its handler's publish is
  unroutable), a periodic schedule; Sentry initialised with its logging integration at DEBUG
  and a transport that records every envelope it would send (exceptions, frame locals, breadcrumbs);
  ``TracingMiddleware`` with an exporter that records each span whole (``span.to_json()``);
- the worker's ``/metrics`` and ``/healthz`` bodies;
- every command of ``kombu-events`` (the test fails if ``--help`` lists one it did not run), plain
  and ``--json`` where it has it, and the ``--help`` texts, run as the console script is but with the
  root logger at DEBUG (the command has no ``-v``), the URL taken from the app, from ``--broker`` and
  from ``RABBIT_URL``;
- the publisher in-process at DEBUG (``events.publish`` confirmed, unroutable, to a missing exchange,
  with a broker that refuses the connection into a local backlog), ``repr`` of events, settings, the
  publishing service and the exceptions, and their chained tracebacks;
- a failed login (the password wrong): a worker, the CLI and the publisher; neither the canary nor
  the wrong password may appear;
- a broker restart under a running worker at DEBUG (a private node with a canary user of its own):
  it reconnects and handles the next event; ``health`` while the node is down.

Every text is searched, case-insensitively, for the password as typed, URL-encoded (``quote`` with
and without ``safe="/"``, ``quote_plus``), its unique hex core alone, and base64 of ``user:password``
(HTTP Basic). Run with ``-s`` to see the list of outputs checked.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest

from ..brokers import PORT, rabbitmqctl
from .harness import Project, http_get, wait_for
from .private_broker import free_port

pytestmark = pytest.mark.integration

#: Characters a URL must encode, so that the encoded forms are searched for too.
AWKWARD = "/+:@!"

APP = """
import logging
from pathlib import Path

import sentry_sdk
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from sentry_sdk.integrations.logging import LoggingIntegration
from sentry_sdk.transport import Transport

from kombu_events.tracing import TracingMiddleware

OUT = Path(RECORDS).parent


class Recorded(Transport):
    '''Every envelope Sentry would send, whole, one per line.'''

    def capture_envelope(self, envelope):
        with open(OUT / "sentry.out", "ab") as fh:
            fh.write(envelope.serialize() + b"\\n")


class SpanFile(SpanExporter):
    def export(self, spans):
        with open(OUT / "spans.out", "a") as fh:
            for span in spans:
                fh.write(span.to_json(indent=None) + "\\n")
        return SpanExportResult.SUCCESS


sentry_sdk.init(dsn="https://public@sentry.example/1", transport=Recorded, auto_enabling_integrations=False,
                integrations=[LoggingIntegration(level=logging.DEBUG, event_level=logging.ERROR)],
                enable_backpressure_handling=False, include_local_variables=True)
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(SpanFile()))
events = Events(app, SERVICE, exchange=EXCHANGE, middleware=[TracingMiddleware(provider)], max_retries=3,
                backoff=Constant(every_ms=100), delay_unit_ms=100, delay_levels=3, publish_delay_unit_ms=100,
                publish_delay_levels=2)


@events.handler("ok.#", bind=True)
def ok(event):
    record(handler="ok", id=event.message_id, attempt=event.attempt)
    if not event.routing_key.startswith("ok.relayed"):
        events.publish("ok.relayed." + event.message_id, {"from": event.message_id})


@events.handler("flaky.#", bind=True)
def flaky(event):
    record(handler="flaky", id=event.message_id, attempt=event.attempt)
    if event.attempt == 1:
        raise ConnectionError("the dependency is briefly down")


@events.handler("poison.#", bind=True, max_retries=1)
def poison(event):
    record(handler="poison", id=event.message_id, attempt=event.attempt)
    events.publish("nobody.listens", {"from": event.message_id})  # unroutable: raises


@events.periodic("tick", every=1)
def tick(event):
    record(handler="tick")
"""

#: The in-process publisher, at DEBUG: what it prints and logs is searched.
PUBLISHER = """
import logging, sys, traceback
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
from celery import Celery
from kombu_events import Events
from {module} import events

def shown(what, call):
    try:
        result = call()
        print(what, "->", repr(result))
    except Exception as exc:
        print(what, "raised", repr(exc), str(exc))
        traceback.print_exc(file=sys.stdout)

print(repr(events), repr(events.settings), repr(events.publishing))
shown("publish", lambda: events.publish("ok.inproc", {{"n": 1}}))
shown("publish_many", lambda: events.publish_many([("ok.inproc", {{"n": 2}})]))
shown("unroutable", lambda: events.publish("nobody.listens", {{"n": 3}}))
missing = Events(Celery("missing", broker={good!r}, set_as_current=False), "{service}-missing",
                 exchange="{service}-no-such-exchange", publish_delay_levels=0)
shown("missing exchange", lambda: missing.publishing.publisher.send(
    "{service}-no-such-exchange", "k", b"{{}}", {{"content_type": "application/json"}}))
wrong = Events(Celery("wrong", broker={wrong!r}, set_as_current=False), "{service}-wrong", exchange={exchange!r},
               publish_delay_unit_ms=100, publish_delay_levels=2)
shown("wrong password", lambda: wrong.publish("ok.wrong", {{"n": 4}}))
down = Events(Celery("down", broker={down!r}, set_as_current=False), "{service}-down", exchange={exchange!r},
              publish_delay_unit_ms=100, publish_delay_levels=2, backlog={backlog!r})
shown("broker down, into the backlog", lambda: down.publish("ok.backlog", {{"n": 5}}))
print(repr(down), repr(down.backlog))
"""


class Canary:
    """A user with a canary password, on a vhost of its own, on one node (``ctl`` runs rabbitmqctl there)."""

    def __init__(self, ctl, port: int) -> None:
        self.ctl = ctl
        self.core = uuid.uuid4().hex
        self.password = f"canary-{self.core}{AWKWARD}"
        self.wrong_core = uuid.uuid4().hex
        self.wrong = f"wrong-{self.wrong_core}{AWKWARD}"
        self.user = f"ke-user-{uuid.uuid4().hex[:8]}"
        self.vhost = f"ke-vhost-{uuid.uuid4().hex[:8]}"
        self.url = self._url(self.password, port)
        self.wrong_url = self._url(self.wrong, port)
        self.down_url = self._url(self.password, free_port())  # nothing listens there

    def _url(self, password: str, port: int) -> str:
        return f"amqp://{self.user}:{quote(password, safe='')}@127.0.0.1:{port}/{self.vhost}"

    def create(self) -> None:
        self.ctl("add_vhost", self.vhost)
        self.ctl("add_user", self.user, self.password)
        self.ctl("set_user_tags", self.user, "monitoring")  # status reads the management API as this user
        self.ctl("set_permissions", "-p", self.vhost, self.user, ".*", ".*", ".*")

    def delete(self) -> None:
        for args in (("delete_vhost", self.vhost), ("delete_user", self.user)):
            try:
                self.ctl(*args)
            except Exception as exc:  # the other one is deleted all the same
                print(f"cleanup: rabbitmqctl {' '.join(args)} failed: {exc}")

    def needles(self) -> dict[str, str]:
        found = {}
        for name, secret, core in (("canary", self.password, self.core),
                                   ("wrong password", self.wrong, self.wrong_core)):
            found.update({f"{name} as typed": secret, f"{name} URL-encoded": quote(secret, safe=""),
                          f"{name} URL-encoded (safe /)": quote(secret), f"{name} quote_plus": quote_plus(secret),
                          f"{name}'s hex core": core,
                          f"{name} as HTTP Basic": base64.b64encode(f"{self.user}:{secret}".encode()).decode()})
        return found


class Outputs:
    """Every text searched for the canary, by label; what was found where."""

    def __init__(self, canary: Canary) -> None:
        self.needles = {name: needle.lower() for name, needle in canary.needles().items()}
        self.checked: list[tuple[str, int]] = []
        self.found: list[str] = []

    def check(self, label: str, text: str | bytes) -> str:
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        self.checked.append((label, len(text)))
        lowered = text.lower()
        for name, needle in self.needles.items():
            at = lowered.find(needle)
            if at >= 0:
                self.found.append(f"{label}: {name} at {at}: ...{text[max(0, at - 200):at + 80]!r}...")
        return text

    def check_file(self, label: str, path: Path) -> str:
        assert path.exists(), f"{label}: {path} was never written"
        return self.check(label, path.read_bytes())

    def report(self) -> str:
        return "\n".join(f"  {label} ({size} chars)" for label, size in self.checked)


def shared_ctl(*args: str) -> str:
    return rabbitmqctl(*args, timeout=60).stdout


@pytest.fixture
def canary(broker_url):
    """The canary user and vhost on the shared node (set up before, deleted after, the test's projects)."""
    found = Canary(shared_ctl, PORT)
    found.create()
    yield found
    found.delete()


def cli_env(project: Project, **extra: str) -> dict[str, str]:
    return {**project.env(), **extra}


DEBUG_CLI = ("import logging, sys; logging.basicConfig(level=logging.DEBUG, "
             "format='%(levelname)s %(name)s: %(message)s'); from kombu_events.cli import main; main()")


def run_debug_cli(project: Project, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``kombu-events ARGS`` as the console script runs it, but with the root logger at DEBUG."""
    return subprocess.run([sys.executable, "-c", DEBUG_CLI, *args], cwd=project.dir, env=env or project.env(),
                          capture_output=True, text=True, timeout=60)


def check_cli(outputs: Outputs, project: Project, *args: str, env: dict[str, str] | None = None,
              codes: tuple[int, ...] = (0,), label: str = "") -> subprocess.CompletedProcess:
    """Run ``kombu-events ARGS`` at DEBUG; search its stdout and stderr; check its exit code."""
    return checked(outputs, project, args, run_debug_cli(project, *args, env=env), codes, label)


def check_cli_many(outputs: Outputs, project: Project, commands: list[tuple[str, ...]],
                   codes: tuple[int, ...] = (0,)) -> None:
    """:func:`check_cli` for commands that may run at the same time (each is a second or so of imports)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda args: run_debug_cli(project, *args), commands))
    for args, result in zip(commands, results):
        checked(outputs, project, args, result, codes, "")


def checked(outputs: Outputs, project: Project, args: tuple[str, ...], result: subprocess.CompletedProcess,
            codes: tuple[int, ...], label: str) -> subprocess.CompletedProcess:
    shown = label or (" ".join(a if "://" not in a else "<url>" for a in args).replace(project.module, "<app>")
                      .replace(str(project.dir.parent), "<tmp>"))
    outputs.check(f"kombu-events {shown}: stdout", result.stdout)
    outputs.check(f"kombu-events {shown}: stderr", result.stderr)
    assert result.returncode in codes, f"{shown}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def check_console(outputs: Outputs, project: Project, a: tuple[str, ...], archived_id: str) -> None:
    """``kombu-events console`` at DEBUG: every page and JSON answer it serves, then its own output, searched."""
    port = free_port()
    log = project.dir / "console.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", DEBUG_CLI, *a, "console", "--port", str(port)],
                                cwd=project.dir, env=project.env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: http_get(port, "/")[0] == 200 or proc.poll() is not None, 30, what="the console answers")
        assert proc.poll() is None, log.read_text()[-3000:]
        for path in ("/", "/failures", f"/events/{quote(archived_id)}", "/audit", "/api/archive",
                     f"/api/archive/{quote(archived_id)}", "/purge"):
            status, body = http_get(port, path)
            assert status == 200, (path, status, body[:500])
            outputs.check(f"-A <app> console: GET {path}", body)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    outputs.check_file("-A <app> console: its output at DEBUG", log)


def listed_commands(outputs: Outputs, project: Project) -> list[str]:
    """Every command ``kombu-events --help`` lists (``archive list``, ... for the groups); their --help searched too."""
    def listed(*group: str) -> list[str]:
        help_text = check_cli(outputs, project, *group, "--help").stdout
        section = help_text.split("Commands:", 1)[1].split("Examples:", 1)[0]
        return [line.split()[0] for line in section.splitlines() if line.startswith("  ") and line.split()]

    commands = []
    for command in listed():
        sub = listed(command) if command in ("archive", "backlog", "outbox") else []
        commands += [f"{command} {s}" for s in sub] or [command]
    return commands


def test_the_canary_password_appears_in_no_output_of_worker_cli_publisher_metrics_sentry_tracing(
        canary, tmp_path):
    started = time.monotonic()
    outputs = Outputs(canary)
    projects = []

    def make(name: str, url: str, **kwargs) -> Project:
        (tmp_path / name).mkdir()
        projects.append(Project(tmp_path / name, url, APP, **kwargs))
        return projects[-1]

    try:
        scenario(outputs, canary, make, tmp_path)
    finally:
        for made in projects:  # their queues and exchanges go with the canary's vhost
            for worker in made.workers:
                worker.kill()
    print(f"\nchecked in {time.monotonic() - started:.0f} s:\n{outputs.report()}")
    assert not outputs.found, "a secret was shown:\n" + "\n".join(outputs.found)


def scenario(outputs: Outputs, canary: Canary, make, tmp_path: Path) -> None:
    t0 = time.monotonic()

    def mark(what: str) -> None:  # the timeline, with -s
        print(f"{time.monotonic() - t0:5.1f} s  {what}")

    project = make("main", canary.url)
    port = free_port()
    worker = project.worker("--loglevel=DEBUG", "--events-metrics-port", str(port)).wait_ready()
    a = "-A", project.module

    # Events: one acked (its handler publishes), one retried, one archived (an unroutable publish).
    mark("worker ready; events")
    check_cli_many(outputs, project, [
        (*a, "publish", "ok.1", '{"n": 1}', "--message-id", "ok-1"),
        (*a, "publish", "--json", "flaky.1", '{"n": 2}', "--message-id", "flaky-1"),
        (*a, "publish", "poison.1", '{"n": 3}', "--message-id", "poison-1", "--header", "x-note=kept")])
    check_cli(outputs, project, "publish", "--exchange", project.exchange, "ok.2", '{"n": 4}',
              env=cli_env(project, RABBIT_URL=canary.url), label="publish (RABBIT_URL)")
    check_cli(outputs, project, *a, "--broker", canary.url, "publish", "--delay", "0.2", "ok.3", '{"n": 5}',
              label="-A <app> --broker <url> publish --delay 0.2")
    wait_for(lambda: project.records(handler="flaky", attempt=2), 30, what="the flaky event retried")
    wait_for(lambda: len(project.records(handler="poison")) >= 2, 30, what="the poison event's two attempts")
    wait_for(lambda: len(project.records(handler="ok")) >= 6, 30, what="the ok events and those they published")

    # The in-process publisher (and a backlog, filled while its broker refuses connections).
    mark("in-process publisher")
    backlog = tmp_path / "backlog.sqlite3"
    result = project.run_python(PUBLISHER.format(
        module=project.module, service=project.service, exchange=project.exchange, good=canary.url,
        wrong=canary.wrong_url, down=canary.down_url, backlog=str(backlog)))
    outputs.check("in-process publisher at DEBUG: stdout (reprs, results, exceptions, tracebacks)", result.stdout)
    outputs.check("in-process publisher at DEBUG: stderr (logs)", result.stderr)
    assert "DEBUG:" in result.stderr and ":**@" in result.stdout + result.stderr, "no DEBUG log, no masked URL"
    assert result.returncode == 0, result.stdout + result.stderr
    for expected in ("unroutable raised", "missing exchange raised", "wrong password raised",
                     "into the backlog -> "):
        assert expected in result.stdout, result.stdout
    wait_for(lambda: project.records(handler="tick"), 20, what="a periodic run")

    # The worker's HTTP endpoints.
    mark("/metrics, /healthz")
    for path in ("/metrics", "/healthz"):
        _status, body = wait_for(lambda path=path: (lambda r: r if r[0] == 200 else None)(http_get(port, path)),
                                10, what=path)
        outputs.check(f"worker GET {path} (HTTP body)", body)

    # Every command of the CLI, plain and --json where it has it.
    mark("every command")
    archived = wait_for(lambda: [json.loads(line) for line in check_cli(
        outputs, project, *a, "archive", "list", "--json", label="archive list --json (polled)").stdout.splitlines()
        if line.strip()], 20, what="the poison event in the archive")
    commands = []
    for args in (("declare", "--dry-run"), ("declare", "--dry-run", "--json"),
                 ("declare", "--dry-run", "--format", "dot"), ("declare",), ("declare", "--json"),
                 ("status",), ("status", "--json"), ("health",), ("health", "--json"),
                 ("schedules",), ("schedules", "--json"),
                 ("asyncapi",), ("asyncapi", "--format", "json"),
                 ("backlog", "status", "--path", str(backlog)),
                 ("backlog", "status", "--path", str(backlog), "--json"),
                 ("permissions", "--user", canary.user), ("permissions", "--json")):
        commands.append((*a, *args))
    check_cli_many(outputs, project, commands, codes=(0, 2))
    # One at a time: each takes the archive's messages and puts them back, so two at once miss each other's.
    for args in (("archive", "list"), ("archive", "show", archived[0]["id"]),
                 ("archive", "show", archived[0]["id"], "--json"), ("archive", "replay", "--dry-run"),
                 ("archive", "replay", "--dry-run", "--json"), ("archive", "purge", "--dry-run"),
                 ("archive", "purge", "--dry-run", "--json")):
        check_cli(outputs, project, *a, *args, codes=(0, 2))
    check_console(outputs, project, a, archived[0]["id"])
    # This app has no database: each outbox command ends with one line saying so (connection paths: test_inbox_crashes).
    check_cli_many(outputs, project, [(*a, "outbox", "status"), (*a, "outbox", "status", "--json"),
                                      (*a, "outbox", "relay"), (*a, "outbox", "create-tables")], codes=(1,))
    check_cli(outputs, project, *a, "--broker", canary.url, "status", "--json",
              label="-A <app> --broker <url> status --json")
    check_cli(outputs, project, "--broker", canary.wrong_url, "backlog", "flush", "--path", str(backlog), "--timeout",
              "3", codes=(1,), label="--broker <wrong password> backlog flush --path <file> --timeout 3")
    check_cli(outputs, project, *a, "backlog", "flush", "--path", str(backlog), "--timeout", "20", "--json",
              label="-A <app> backlog flush --path <file> --timeout 20 --json")
    check_cli(outputs, project, *a, "asyncapi", "-o", str(tmp_path / "asyncapi.yaml"))
    outputs.check_file("the AsyncAPI document written by asyncapi -o", tmp_path / "asyncapi.yaml")
    check_cli(outputs, project, *a, "archive", "replay", "--json", "--limit", "1")
    wait_for(lambda: len(project.records(handler="poison")) >= 4, 30, what="the replayed event's attempts")
    worker.stop()
    mark("worker stopped")
    outputs.check_file("worker log at DEBUG (stdout and stderr)", worker.log_path)
    assert "DEBUG/" in worker.log, "the worker did not log at DEBUG"
    # The worker is stopped: migrate refuses queues with consumers.
    mark("migrate")
    check_cli_many(outputs, project, [(*a, "migrate", "--to", "quorum", "--dry-run"),
                                      (*a, "migrate", "--to", "quorum", "--dry-run", "--json")])
    check_cli(outputs, project, *a, "archive", "purge", "--yes", "--json")
    check_cli(outputs, project, *a, "archive", "rewrite")  # the purged copies gone for good (worker stopped)
    outputs.check_file("Sentry: every envelope it would send (events, frame locals, breadcrumbs)",
                       project.dir / "sentry.out")
    outputs.check_file("OpenTelemetry: every span exported, whole", project.dir / "spans.out")
    sentry = (project.dir / "sentry.out").read_text()
    assert "UnroutableError" in sentry and '"vars"' in sentry, "Sentry recorded no handler error with its locals"

    # A failed login: the wrong password in the URL (a worker retrying its login meanwhile).
    mark("failed logins")
    login = make("wrong", canary.wrong_url, service=project.service, exchange=project.exchange).worker(
        "--loglevel=DEBUG")
    for args in ((*a, "status"), (*a, "health", "--json"), ("publish", "--exchange", project.exchange, "ok.x", "{}")):
        shown = " ".join(args).replace(project.module, "<app>")
        refused = check_cli(outputs, project, "--broker", canary.wrong_url, *args, codes=(1,),
                            label=f"--broker <wrong password> {shown}")
        assert "ACCESS_REFUSED" in refused.stdout + refused.stderr, refused.stderr
    check_cli(outputs, project, *a, "health", env=cli_env(project, RABBIT_URL=canary.wrong_url), codes=(1,),
              label="health (RABBIT_URL with the wrong password)")
    for command in listed_commands(outputs, project):
        assert any(f" {command}" in label for label, _size in outputs.checked), f"`{command}` was not run"
    wait_for(lambda: "ACCESS_REFUSED" in login.log or login.proc.poll() is not None, 20,
             what="the worker's failed login")
    time.sleep(1)  # a retry or two
    login.kill()
    assert "ACCESS_REFUSED" in login.log and ":**@" in login.log, login.log[-2000:]
    outputs.check_file("worker log at DEBUG, wrong password (a failed login, retried)", login.log_path)


RESTART_APP = """
events = Events(app, SERVICE, exchange=EXCHANGE)


@events.handler("ok.#", bind=True)
def ok(event):
    record(handler="ok", id=event.message_id)
"""


def test_the_canary_password_appears_in_no_output_of_a_worker_through_a_broker_restart(private_broker, tmp_path):
    started = time.monotonic()
    canary = Canary(lambda *args: private_broker.ctl(1, *args), private_broker.ports[0])
    canary.create()
    outputs = Outputs(canary)
    project = Project(tmp_path, canary.url, RESTART_APP)
    try:
        worker = project.worker("--loglevel=DEBUG").wait_ready()
        publish = ("-A", project.module, "publish", "--message-id")
        check_cli(outputs, project, *publish, "before", "ok.1", "{}")
        wait_for(lambda: project.records(id="before"), 20, what="the event before the restart")
        private_broker.stop_app()
        wait_for(lambda: "Connection to broker lost" in worker.log, 20, what="the worker to see the broker go")
        check_cli(outputs, project, "-A", project.module, "health", codes=(1,), label="-A <app> health (node down)")
        private_broker.start_app()
        check_cli(outputs, project, *publish, "after", "ok.2", "{}")
        wait_for(lambda: project.records(id="after"), 40, what="the event after the restart (the worker reconnected)")
    finally:
        project.cleanup() if private_broker.app_running else None
        for worker in project.workers:
            worker.kill()
        if private_broker.app_running:
            canary.delete()
    outputs.check_file("worker log at DEBUG through a broker restart (private node)", worker.log_path)
    assert "DEBUG/" in worker.log and "Connection to broker lost" in worker.log, worker.log[-2000:]
    assert worker.log.count("Connected to amqp://") >= 2, "the worker did not reconnect"
    print(f"\nchecked in {time.monotonic() - started:.0f} s:\n{outputs.report()}")
    assert not outputs.found, "a secret was shown:\n" + "\n".join(outputs.found)
