"""The everything-on service of the fault tests and the soak: every feature at once, each leaving a trace.

``celery -A tests.integration.everything_app worker --with-events-step`` imports it with
its configuration in ``EVERYTHING_*`` environment variables (see :func:`configure`);
imported without them (by the test or the soak), it defines the helpers only.

- handlers ``work`` (a contract: its payload is validated into a :class:`Work`), ``pay`` (circuit
  breaker; its dependency is down while the file ``down`` exists in the records directory), ``relay``
  (publishes ``later.<n>`` delayed, declared with ``events.publishes``), ``later``, ``audit``
  (publishes ``stored.<n>`` through a publisher with a local backlog) and ``stored``; a periodic
  schedule ``tick``;
- every attempt of an id chosen by :func:`fails_first` fails the first time; an event
  whose payload says ``poison`` is archived by design;
- middleware: :class:`HookCounter` (each hook call) and ``TracingMiddleware`` (spans to a
  file); Sentry initialised with a transport that writes each report to a file; the
  worker's metrics on ``--events-metrics-port``.

Everything is appended as JSON lines to ``<records>/<kind>.jsonl`` (``calls``, ``hooks``,
``spans``, ``sentry``, ``runs``, ``circuits``), one ``os.write`` each: processes of a pool share the files.
The worker consumes through ``EVERYTHING_BROKER`` (a proxy that can go silent); its
handlers publish to ``EVERYTHING_PUBLISH_URL``, the broker itself, so a silenced
connection is the worker's own and only its heartbeats can tell.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from celery import Celery
from pydantic import BaseModel

from kombu_events import Archive, Backlog, CircuitBreaker, Constant, Event, Events, Middleware, signals

#: Handler queues of the service (``<service>.<name>``), with the routing key prefix of each.
HANDLERS = ("work", "pay", "relay", "later", "audit", "stored")
#: Heartbeat of the worker's broker connection (s): a silent connection is noticed within ~2-3 of them.
HEARTBEAT_S = 4
#: The schedule's period (s).
TICK_S = 1.0
#: Delay of the events ``relay`` publishes (s).
LATER_DELAY_S = 0.5

DOWN_FLAG = "down"
BACKLOG_FILE = "backlog.sqlite3"


class Work(BaseModel):
    """The payload of every event the scenario publishes: ``work`` validates it, ``relay`` publishes it as one."""

    n: int
    kind: str
    poison: bool


def fails_first(seed: str, message_id: str, percent: int) -> bool:
    """Whether the first attempt of ``message_id`` fails by design (``percent`` % of ids, fixed by ``seed``)."""
    digest = hashlib.sha256(f"{seed}:{message_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


class Recorder:
    """Appends JSON lines to ``<directory>/<file>.jsonl``; each line is one ``os.write`` (O_APPEND)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._fds: dict[str, int] = {}

    def __call__(self, file: str, /, **fields: Any) -> None:
        fields.setdefault("pid", os.getpid())
        fields.setdefault("t", time.time())
        fd = self._fds.get(file)
        if fd is None:
            fd = os.open(self.directory / f"{file}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._fds[file] = fd
        os.write(fd, (json.dumps(fields, default=str) + "\n").encode())


class HookCounter(Middleware):
    """Writes every hook call: the test checks their counts against each other, the handlers and metrics."""

    def __init__(self, record: Recorder) -> None:
        self.record = record

    def started(self, control: Any) -> None:
        self.record("hooks", hook="started")

    def stopped(self, control: Any) -> None:
        self.record("hooks", hook="stopped")

    def received(self, delivery: Any) -> None:
        self.record("hooks", hook="received", id=delivery.message_id, queue=delivery.queue,
                    attempt=delivery.attempt)

    def settled(self, delivery: Any, outcome: Any, step: Any) -> None:
        self.record("hooks", hook="settled", id=delivery.message_id, queue=delivery.queue,
                    attempt=delivery.attempt, action=step.action, outcome=outcome.kind, delay_ms=step.delay_ms)

    def after_publish(self, exchange: str, routing_key: str, properties: Any, error: Exception | None) -> None:
        self.record("hooks", hook="after_publish", id=properties.get("message_id"),
                    error=None if error is None else repr(error))

    def after_store(self, exchange: str, routing_key: str, properties: Any) -> None:
        self.record("hooks", hook="after_store", id=properties.get("message_id"))

    @contextmanager
    def _handling(self, event: Any) -> Iterator[None]:
        self.record("hooks", hook="handling", id=event.message_id, queue=event.queue, attempt=event.attempt)
        try:
            yield
        finally:  # raised or returned: one "handled" per "handling"
            self.record("hooks", hook="handled", id=event.message_id, queue=event.queue, attempt=event.attempt)

    def handling(self, event: Any) -> Any:
        return self._handling(event)


def _tracing(record: Recorder) -> Middleware:
    """TracingMiddleware on the OpenTelemetry SDK, each finished span written to ``spans``."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from kombu_events.tracing import ATTEMPT, TracingMiddleware

    class FileExporter(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            for span in spans:
                record("spans", kind=span.kind.name, id=span.attributes.get("messaging.message.id"),
                       attempt=span.attributes.get(ATTEMPT), status=span.status.status_code.name)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter()))
    return TracingMiddleware(provider)


def _sentry(record: Recorder) -> None:
    """sentry_sdk initialised with a transport that writes each error event it would send."""
    import sentry_sdk
    from sentry_sdk.transport import Transport

    class Recorded(Transport):
        def capture_envelope(self, envelope: Any) -> None:
            for item in envelope.items:
                if item.type == "event":
                    event = item.payload.json
                    tags = event.get("tags", {})
                    record("sentry", id=event.get("contexts", {}).get("kombu_events", {}).get("message_id"),
                           attempt=int(tags.get("kombu_events.attempt", 0)), outcome=tags.get("kombu_events.outcome"),
                           exception=event["exception"]["values"][-1]["type"])

    sentry_sdk.init(dsn="https://public@sentry.example/1", transport=Recorded, default_integrations=False,
                    auto_enabling_integrations=False, enable_backpressure_handling=False)


def configure(app: Celery, *, service: str, exchange: str, publish_url: str, records: str, seed: str,
              fail_percent: int, queue_type: str = "classic") -> Events:
    """The service on ``app``: handlers, schedule, middleware, Sentry; a backlog publisher beside it."""
    record = Recorder(records)
    app.conf.broker_heartbeat = HEARTBEAT_S
    app.conf.broker_connection_retry_on_startup = True
    app.conf.broker_connection_max_retries = None  # a worker keeps trying: its exits are what is counted
    app.conf.task_default_queue = f"{service}.tasks"
    if queue_type == "quorum":
        app.conf.task_default_queue_type = "quorum"  # the library refuses quorum events beside classic task queues
    _sentry(record)
    counter = HookCounter(record)
    settings: dict[str, Any] = {"exchange": exchange, "broker": publish_url, "queue_type": queue_type,
                                "delay_unit_ms": 100, "delay_levels": 10, "publish_delay_unit_ms": 100,
                                "publish_delay_levels": 8}
    events = Events(app, service, middleware=[counter, _tracing(record)], max_retries=10,
                    backoff=Constant(every_ms=200), **settings)
    # Another app: Events registers its services per app, and this one consumes nothing.
    outbox = Events(Celery(f"{service}-outbox", broker=publish_url, set_as_current=False), f"{service}-outbox",
                    middleware=[counter], backlog=Backlog(Path(records) / BACKLOG_FILE, batch_size=50),
                    publisher_circuit=CircuitBreaker(max_failures=1, max_unhealthy=1, reset_s=0.2, max_reset_s=1.0),
                    **settings)
    down = Path(records) / DOWN_FLAG

    def recorded(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        """One ``calls`` line per call: ok, or why it raised; the seeded first-attempt failure comes first."""
        @functools.wraps(fn)
        def call(event: Any) -> None:
            fields = {"handler": fn.__name__, "id": event.message_id, "attempt": event.attempt}
            try:
                if event.attempt == 1 and fails_first(seed, event.message_id, fail_percent):
                    raise RuntimeError(f"first attempt of {event.message_id} fails by design")
                fn(event)  # a dependency that is down fails fast: a burst of failures, retries and confirms
                time.sleep(0.003)  # the work done once it answered
            except Exception as exc:
                record("calls", ok=False, why=type(exc).__name__, **fields)
                raise
            record("calls", ok=True, **fields)
        return call

    @events.handler("work.#", bind=True)
    @recorded
    def work(event: Event[Work]) -> None:  # a contract: the pool validates each payload into a Work
        if not isinstance(event.payload, Work):
            raise TypeError(f"work got a {type(event.payload).__name__}, not a validated Work")
        if event.payload.poison:
            raise Archive("poison by design")

    @events.handler("pay.#", bind=True,
                    circuit_breaker=CircuitBreaker(max_failures=3, window_s=10, reset_s=1.0, max_reset_s=2.0))
    @recorded
    def pay(event: Any) -> None:
        if down.exists():
            raise ConnectionError("payment API: connection refused")

    @events.handler("relay.#", bind=True)
    @recorded
    def relay(event: Any) -> None:
        n = event.routing_key.split(".", 1)[1]
        events.publish(f"later.{n}", event.payload, message_id=f"later-{event.message_id}", delay=LATER_DELAY_S)

    events.publishes("later.#", Work)  # relay's publish is validated before it is sent

    @events.handler("audit.#", bind=True)
    @recorded
    def audit(event: Any) -> None:
        n = event.routing_key.split(".", 1)[1]
        outbox.publish(f"stored.{n}", event.payload, message_id=f"stored-{event.message_id}")

    @events.handler("later.#", bind=True)
    @recorded
    def later(event: Any) -> None:
        pass

    @events.handler("stored.#", bind=True)
    @recorded
    def stored(event: Any) -> None:
        pass

    @signals.circuit_changed.connect(weak=False)
    def circuit(sender: Any, queue: str, state: str, previous: str, reason: str, **kwargs: Any) -> None:
        record("circuits", queue=queue, state=state, previous=previous, reason=reason)

    @events.periodic("tick", every=TICK_S, retire_after=120)
    def tick(event: Any) -> None:
        record("runs", id=event.message_id, attempt=event.attempt, **event.payload)

    return events


if "EVERYTHING_SERVICE" in os.environ:  # imported by the worker
    app = Celery(os.environ["EVERYTHING_SERVICE"], broker=os.environ["EVERYTHING_BROKER"])
    events = configure(app, service=os.environ["EVERYTHING_SERVICE"], exchange=os.environ["EVERYTHING_EXCHANGE"],
                       publish_url=os.environ["EVERYTHING_PUBLISH_URL"], records=os.environ["EVERYTHING_RECORDS"],
                       seed=os.environ["EVERYTHING_SEED"], fail_percent=int(os.environ["EVERYTHING_FAIL_PERCENT"]),
                       queue_type=os.environ.get("EVERYTHING_QUEUE_TYPE", "classic"))
