"""Each setting reaches the code that acts on it: a test per path, which fails when the wiring is cut.

A default value cannot show a path (a consumer passing a fixed 100 passes every test that leaves
``async_concurrency`` at 100), so each test sets a value of its own and watches it arrive where it acts:
``async_concurrency`` at the asyncio loop that awaits handlers, ``declare`` at the consumer's choice between
declaring and checking, ``broker_use_ssl`` in every connection the package opens, ``max_body_bytes`` in the
streamed inflation of a compressed body. No broker: connections are built, never connected (or refused).
"""
from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import uuid
import zlib
from types import SimpleNamespace
from typing import Any

import kombu
import pytest
from celery import Celery
from click.testing import CliRunner

from kombu_events import Constant, Events, registry
from kombu_events.core import decision
from kombu_events.errors import BrokerUnavailableError
from kombu_events.worker import bootstep, consumer as consumer_module, runner
from kombu_events.worker.consumer import ServiceConsumer

# -- async_concurrency: from the setting to the loop that awaits the handlers ----------------------------


class Pool:
    """Runs each job in this process, as a prefork child would (arguments pickled through; here passed)."""

    limit = 2

    def apply_async(self, fn: Any, args: tuple, callback: Any, error_callback: Any) -> None:
        callback(fn(*args))


class Message:
    def __init__(self, i: int) -> None:
        self.body = json.dumps({"i": i}).encode()
        self.properties = {"message_id": f"m{i}", "content_type": "application/json"}
        self.delivery_info = {"routing_key": "orders.created", "redelivered": False, "delivery_tag": i}

    def ack(self) -> None:
        pass


@pytest.fixture(autouse=True)
def fresh_registry():
    registry.reset()
    yield
    registry.reset()


@pytest.mark.parametrize("how", ["keyword", "celery conf"])
def test_async_concurrency_is_how_many_async_handlers_the_pool_awaits_at_once(how):
    app = Celery("t", broker="memory://")
    if how == "celery conf":
        app.conf.kombu_events_async_concurrency = 3
        events = Events(app, service="paths")
    else:
        events = Events(app, service="paths", async_concurrency=3)
    running, most = [0], [0]

    @events.handler("orders.#")
    async def handle(payload):
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.01)
        running[0] -= 1

    registry.resolve(app)
    consumer = ServiceConsumer(events)
    consumer.handoff.pool = Pool()
    consumer.handoff.batch.max_messages = 10
    consumer.handoff.more_to_read = lambda: True  # the read goes on: the batch fills up to its 10
    for i in range(10):
        consumer._receive(consumer.routes[0], Message(i))
    assert most[0] == 3, f"awaited {most[0]} at once; async_concurrency=3"


# -- retry_in_place_ms: from the setting to the settler's choice between the worker and the ladder ---------


class Acked(Message):
    def __init__(self, i: int) -> None:
        super().__init__(i)
        self.acks = 0

    def ack(self) -> None:
        self.acks += 1


@pytest.mark.parametrize("how, delays", [("keyword", [0.2]), ("celery conf", [0.2]), ("unset", [])])
def test_retry_in_place_ms_is_how_long_a_retry_may_wait_in_the_worker(how, delays):
    app = Celery("t", broker="memory://")
    if how == "celery conf":
        app.conf.kombu_events_retry_in_place_ms = 200
        events = Events(app, service="paths")
    else:
        events = Events(app, service="paths", **({"retry_in_place_ms": 200} if how == "keyword" else {}))
    attempts: list[int] = []

    @events.handler("orders.#", bind=True, backoff=Constant(every_ms=200))
    def handle(event):
        attempts.append(event.attempt)
        if event.attempt == 1:
            raise RuntimeError("fails once")

    registry.resolve(app)
    consumer = ServiceConsumer(events)
    consumer.handoff.pool = Pool()
    waited: list[float] = []
    now = [0.0]

    def call_later(delay: float, fn: Any) -> None:  # the hub: time passes, the timer fires
        waited.append(round(delay, 6))
        now[0] += delay
        fn()

    consumer.handoff.hub = SimpleNamespace(call_later=call_later)
    consumer.handoff.clock = lambda: now[0]
    message = Acked(1)
    consumer._receive(consumer.routes[0], message)
    assert waited == delays
    if delays:
        assert (attempts, message.acks) == ([1, 2], 1), "run again in the worker, then acked"
    else:  # through the ladder: no publisher channel here, so the original is left for the broker
        assert (attempts, message.acks) == ([1], 0)


# -- declare: from the setting (and --events-no-declare) to the consumer's choice -------------------------


class Chosen(Exception):
    """Raised by the fake connection once the consumer has chosen: the rest of start() is not under test."""


class Connection:
    userid = "guest"

    def channel(self) -> Any:
        raise Chosen


@pytest.mark.parametrize("how, declares", [
    ("default", True), ("keyword", False), ("celery conf", False), ("never_declare", False)])
def test_declare_false_reaches_the_consumers_choice_between_declaring_and_checking(monkeypatch, how, declares):
    app = Celery("t", broker="memory://")
    if how == "celery conf":
        app.conf.kombu_events_declare = False
    events = Events(app, service="paths", **({"declare": False} if how == "keyword" else {}))
    if how == "never_declare":  # what --events-no-declare does, before the settings are resolved
        events.never_declare()
    events.handler("orders.#")(lambda payload: None)
    registry.resolve(app)
    calls: list[str] = []
    monkeypatch.setattr(consumer_module, "declare", lambda topology, connection: calls.append("declare"))
    monkeypatch.setattr(consumer_module.verify, "check",
                        lambda topology, connection, command: calls.append(f"check ({command})"))
    consumer = ServiceConsumer(events, declare_command="kombu-events -A proj declare")
    with pytest.raises(Chosen):
        consumer.start(Connection(), Pool(), None)
    assert calls == (["declare"] if declares else ["check (kombu-events -A proj declare)"])


def test_the_no_declare_flag_reaches_the_settings_the_consumer_reads(monkeypatch):
    app = Celery("t", broker="memory://")
    events = Events(app, service="paths")
    events.handler("orders.#")(lambda payload: None)
    bootstep.install(app)
    monkeypatch.setattr(bootstep.wire_guard, "install", lambda: None)  # the rest of the step's set-up is not
    monkeypatch.setattr(bootstep.sentry, "install", lambda: False)  # under test
    parent = type("Parent", (), {"app": app, "steps": []})()
    step = bootstep.EventsStep(parent, with_events_step=True, events_no_declare=True)
    assert [c.settings.declare for c in step.consumers] == [False]


# -- broker_use_ssl: in every connection the package opens -------------------------------------------------

TLS = {"ca_certs": "/etc/ssl/our-ca.pem", "certfile": "/etc/ssl/worker.pem", "keyfile": "/etc/ssl/worker.key"}
#: Nothing listens on port 1: a connection is refused at once.
URL = "amqps://guest:guest@127.0.0.1:1//"


@pytest.fixture
def built(monkeypatch) -> list[dict[str, Any]]:
    """The ``ssl`` option of every kombu Connection built from here on (lazy: built is not connected)."""
    found: list[dict[str, Any]] = []
    original = kombu.Connection.__init__

    def record(self, hostname: Any = "localhost", *args: Any, **kwargs: Any) -> None:
        original(self, hostname, *args, **kwargs)
        found.append({"url": hostname, "ssl": self.ssl})

    monkeypatch.setattr(kombu.Connection, "__init__", record)
    return found


def tls_app() -> Celery:
    app = Celery("t", broker=URL)
    app.conf.broker_use_ssl = dict(TLS)
    app.conf.broker_connection_timeout = 0.5
    return app


def carries_our_tls(connection: dict[str, Any]) -> bool:
    ssl = connection["ssl"]
    return isinstance(ssl, dict) and all(ssl.get(k) == v for k, v in TLS.items()) and ssl.get("server_hostname")


def test_the_worker_connection_celery_opens_carries_the_tls_options_and_verifies_the_broker(built, monkeypatch):
    app = tls_app()
    Events(app, service="paths").handler("orders.#")(lambda payload: None)
    bootstep.install(app)
    monkeypatch.setattr(bootstep.wire_guard, "install", lambda: None)
    monkeypatch.setattr(bootstep.sentry, "install", lambda: False)
    bootstep.EventsStep(type("Parent", (), {"app": app, "steps": []})(), with_events_step=True)
    app.connection_for_read()  # Celery's worker consumer: the events step's channels ride on it
    app.connection_for_write()
    assert len(built) == 2 and all(carries_our_tls(c) for c in built), built


def test_the_publisher_connection_carries_the_tls_options(built):
    events = Events(tls_app(), service="paths")
    with pytest.raises(BrokerUnavailableError):  # refused: nothing listens
        events.publish("orders.created", {"i": 1})
    assert built and all(carries_our_tls(c) for c in built), built


def test_the_publishers_broker_health_check_connection_carries_the_tls_options(built, tmp_path):
    events = Events(tls_app(), service="paths", backlog=tmp_path / "backlog")
    backlog_publisher = events.publishing.backlog_publisher
    assert backlog_publisher is not None
    health = backlog_publisher.breakers.checks["broker"].fn()
    assert type(health).__name__ == "Unhealthy", health  # refused: nothing listens
    assert built and all(carries_our_tls(c) for c in built), built


CLI_APP = """
from celery import Celery
from kombu_events import Events

app = Celery("t", broker={url!r})
app.conf.broker_use_ssl = {tls!r}
app.conf.broker_connection_timeout = 0.5
events = Events(app, service="paths")

@events.handler("orders.#")
def handle(payload):
    pass
"""


@pytest.fixture
def cli_app(tmp_path, monkeypatch):
    name = f"paths_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(CLI_APP.format(url=URL, tls=TLS)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the group callback puts "." on it
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("command", [
    ["status"], ["health"], ["declare"], ["archive", "list"], ["publish", "orders.created", "{}"]])
def test_every_cli_command_that_talks_to_the_broker_connects_with_the_tls_options(built, cli_app, command):
    from kombu_events.cli import cli

    result = CliRunner().invoke(cli, ["-A", cli_app, *command], prog_name="kombu-events")
    assert result.exit_code != 0, result.output  # refused: nothing listens
    opened = [c for c in built if str(c["url"]).startswith("amqps://")]
    assert opened and all(carries_our_tls(c) for c in opened), (command, built, result.output)


# -- max_body_bytes: into the streamed inflation of a compressed body ---------------------------------------


@pytest.mark.parametrize("how", ["keyword", "celery conf"])
def test_max_body_bytes_bounds_the_inflation_of_a_compressed_body(how):
    app = Celery("t", broker="memory://")
    if how == "celery conf":
        app.conf.kombu_events_max_body_bytes = 4096
        events = Events(app, service="paths")
    else:
        events = Events(app, service="paths", max_body_bytes=4096)
    events.handler("orders.#")(lambda payload: None)
    registry.resolve(app)
    queue = events.handlers[0].queue
    small = zlib.compress(json.dumps({"pad": "x" * 3000}).encode())
    bomb = zlib.compress(json.dumps({"pad": "x" * (64 * 1024 * 1024)}).encode())  # 64 MiB in ~64 KiB
    assert len(bomb) < 4096 * 32

    def run(body: bytes) -> decision.Outcome:
        meta = ("orders.created", 1, {"compression": "application/x-gzip"}, {})
        return runner.run(queue, body, "application/json", None, meta)

    assert run(small).kind == decision.OK
    outcome = run(bomb)
    assert outcome.kind == decision.UNDECODABLE and "max_body_bytes=4096" in outcome.reason, outcome


def test_the_consoles_connection_carries_the_tls_options(built):
    from kombu_events.console.reading import Service

    events = Events(tls_app(), service="paths")
    events.handler("orders.#")(lambda payload: None)
    with pytest.raises(BrokerUnavailableError), Service(events).connection():  # refused: nothing listens
        pass
    assert built and all(carries_our_tls(c) for c in built), built
