"""The kombu-events service a benchmark worker runs: ``celery -A benchmarks.apps.events_app worker --with-events-step``.

:func:`build` is shared with the runner, which declares the same topology and
publishes to it. Handler ``h<k>`` consumes ``<service>.h<k>``, bound to ``bench.<k>``.
Modes: ``noop`` (count and return), ``latency`` (also record publish -> start),
``fail_once`` (raise on the first attempt), ``wait`` (first attempt: ``Retry(delay=KEB_WAIT_S)``),
``typed`` (a no-op whose parameter is annotated with a 5-field pydantic model, :mod:`benchmarks.apps.orders`:
the worker validates each payload into an instance; needs pydantic 2 and a ``kombu_events`` with contracts),
``await`` (an ``async def`` handler awaiting ``asyncio.sleep(KEB_AWAIT_MS)``: needs a ``kombu_events`` that
awaits them) and ``sleep`` (a sync handler in ``time.sleep(KEB_AWAIT_MS)``: I/O under gevent).
``KEB_TRACING=1`` adds :class:`~kombu_events.tracing.TracingMiddleware` (needs ``opentelemetry-sdk``);
``KEB_TRACING=0.1`` samples 10 % of traces.
Imports only names every version of the package has at its top level (``python -m benchmarks.compare``
runs it on older source trees too). The worker logs which ``kombu_events`` it imported, and refuses to
start if that is not from ``KEB_TREE`` when set (see ``procs.Consumer``).
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable

from celery import Celery

import kombu_events
from benchmarks import probe
from kombu_events import Constant, Events, Middleware, Retry

#: Delay unit and retry delay of ``fail_once``: short, so the run measures the ladder's
#: round trip (republish, confirm, ack, dead-letter back) rather than a wait.
FAIL_ONCE_UNIT_MS = 10
#: How long the ``await`` and ``sleep`` handlers wait (an I/O call).
AWAIT_S = float(os.environ.get("KEB_AWAIT_MS", "50")) / 1000


def routing_key(k: int) -> str:
    """Routing key that reaches handler ``k``."""
    return f"bench.{k}"


def _handler(mode: str, wait_s: float) -> tuple[Callable[..., Any], dict[str, Any]]:
    if mode == "noop":
        def noop(payload):
            probe.handled(payload["i"])
        return noop, {}
    if mode == "latency":
        def timed(payload):
            if payload.get("warm"):
                return
            probe.latency(payload["t"])
            probe.handled(payload["i"])
        return timed, {}
    if mode == "fail_once":
        def fail_once(event):
            i = event.payload["i"]
            if event.attempt == 1:
                probe.failed(i)
                raise RuntimeError("fails once, by design")
            probe.handled(i)
        return fail_once, {"bind": True, "backoff": Constant(every_ms=FAIL_ONCE_UNIT_MS)}
    if mode == "wait":
        def wait(event):
            payload = event.payload
            if payload.get("warm"):
                return
            if event.attempt == 1:
                probe.failed(payload["i"])
                raise Retry(delay=wait_s)
            probe.handled(payload["i"])
        return wait, {"bind": True}
    if mode == "typed":
        from benchmarks.apps.orders import typed5  # pydantic: only in this mode (older trees run the others)
        return typed5, {}
    if mode == "await":
        async def awaits(payload):
            await asyncio.sleep(AWAIT_S)
            probe.handled(payload["i"])
        return awaits, {}
    if mode == "sleep":
        def sleeps(payload):
            time.sleep(AWAIT_S)  # gevent: patched, so it waits cooperatively
            probe.handled(payload["i"])
        return sleeps, {}
    raise ValueError(f"unknown mode {mode!r}; use noop, latency, fail_once, wait, typed, await or sleep")


def _tracing(ratio: float) -> Middleware:
    """TracingMiddleware on the OpenTelemetry SDK, spans batched to an exporter that drops them.

    ``ratio`` < 1: the SDK's ``ParentBased(TraceIdRatioBased(ratio))`` sampler, as a busy service would run.

    What a traced service pays in the worker: a span per handler call, its attributes,
    the context read from the headers, and the batch processor's queue.
    """
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from kombu_events.tracing import TracingMiddleware

    class Dropped(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio))) if ratio < 1 else TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    return TracingMiddleware(provider)


def build(app: Celery, *, service: str, exchange: str, mode: str = "noop", queues: int = 1,
          wait_s: float = 120, tracing: float = 0, prefetch: int | None = None,
          queue_type: str = "classic") -> Events:
    """The benchmark service: ``queues`` handlers of ``mode`` on ``app``.

    ``tracing``: with TracingMiddleware, sampling that share of new traces (1: every one).
    ``prefetch``: the service's ``prefetch_count`` (messages in flight per handler queue; default:
    the library's, see config.auto_prefetch).
    ``queue_type="quorum"`` makes Celery's queues quorum too, as the events step requires.
    """
    if queue_type == "quorum":
        app.conf.task_default_queue_type = "quorum"
    settings: dict[str, Any] = {"delay_unit_ms": FAIL_ONCE_UNIT_MS} if mode == "fail_once" else {}
    if prefetch is not None:
        settings["prefetch_count"] = prefetch
    if os.environ.get("KEB_PUBLISH_DELAY_UNIT_MS"):  # benchmarks.delayed: its own ladder unit
        settings["publish_delay_unit_ms"] = int(os.environ["KEB_PUBLISH_DELAY_UNIT_MS"])
    middleware = [_tracing(tracing)] if tracing else []
    events = Events(app, service=service, exchange=exchange, middleware=middleware, queue_type=queue_type,
                    **settings)
    if mode == "reader":  # a log of the events and a no-op reader of it (from first), no handler queue
        fn, _ = _handler("noop", wait_s)
        events.reader(events.log(routing_key(0), keep=timedelta(hours=1)), name="r0")(fn)
        return events
    for k in range(queues):
        fn, options = _handler(mode, wait_s)
        events.handler(routing_key(k), name=f"h{k}", **options)(fn)
    return events


def make_app(name: str, broker: str, task_queue: str) -> Celery:
    """A Celery app with the defaults users get, on its own task queue."""
    app = Celery(name, broker=broker)
    app.conf.broker_connection_retry_on_startup = True
    app.conf.task_default_queue = task_queue
    if os.environ.get("KEB_INFLIGHT_MAX_BYTES"):  # a Celery setting: a tree from before it ignores it
        app.conf.kombu_events_inflight_max_bytes = int(os.environ["KEB_INFLIGHT_MAX_BYTES"])
    if os.environ.get("KEB_RETRY_IN_PLACE_MS"):  # retries in the worker (a tree from before it refuses it)
        app.conf.kombu_events_retry_in_place_ms = int(os.environ["KEB_RETRY_IN_PLACE_MS"])
    return app


def _check_code() -> None:
    """Log which ``kombu_events`` this worker runs; refuse any other than ``KEB_TREE``'s when it is set."""
    code, tree = os.path.realpath(kombu_events.__file__), os.environ.get("KEB_TREE")
    print(f"events_app: kombu_events from {code}", file=sys.stderr, flush=True)
    if tree and not code.startswith(os.path.join(os.path.realpath(tree), "")):
        raise ImportError(f"kombu_events imported from {code}, not from KEB_TREE={tree}")


def _profile(path: str) -> None:
    """``KEB_PROFILE=FILE``: profile the worker's main process (cProfile), written to FILE at its shutdown."""
    import cProfile

    from celery import signals

    profile = cProfile.Profile()
    profile.enable()
    signals.worker_shutdown.connect(lambda **_: profile.dump_stats(path), weak=False)


if "KEB_SERVICE" in os.environ:  # imported by the worker
    _check_code()
    probe.install()
    if os.environ.get("KEB_PROFILE"):
        _profile(os.environ["KEB_PROFILE"])
    app = make_app("kebench", os.environ["KEB_BROKER"], os.environ["KEB_TASKQ"])
    events = build(app, service=os.environ["KEB_SERVICE"], exchange=os.environ["KEB_EXCHANGE"],
                   mode=os.environ.get("KEB_MODE", "noop"), queues=int(os.environ.get("KEB_QUEUES", "1")),
                   wait_s=float(os.environ.get("KEB_WAIT_S", "120")), tracing=float(os.environ.get("KEB_TRACING") or 0),
                   prefetch=int(os.environ["KEB_PREFETCH"]) if os.environ.get("KEB_PREFETCH") else None,
                   queue_type=os.environ.get("KEB_QUEUE_TYPE", "classic"))
