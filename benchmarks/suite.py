"""The rows of the table: what each measures, against which baseline, and the target it must meet."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from benchmarks import peers, scenarios as s
from benchmarks.procs import Consumer


@dataclass(frozen=True)
class Row:
    """One line of the table.

    ``unit`` is ``msgs/s`` (higher is better, target is a minimum ratio to the baseline),
    ``ms`` (latency p50, target an absolute maximum) or ``MiB`` (RSS growth, target an
    absolute maximum; the ratio to the baseline is shown for comparison).
    """

    key: str
    group: str
    label: str
    unit: str
    run: Callable[[s.Context], s.Run]
    baseline: str | None = None
    target: float | None = None

    def attempt(self, ctx: s.Context) -> s.Run:
        """Run the row once; a broken run is a failed Run (its workers stopped), never a crashed suite."""
        try:
            return self.run(ctx)
        except Exception as exc:
            Consumer.stop_all()
            return s.Run(None, 0, error=f"{type(exc).__name__}: {exc}")


ROWS: tuple[Row, ...] = (
    Row("raw", "1 baselines", "raw kombu consumer, prefetch 100, manual ack", "msgs/s", s.raw_consumer),
    Row("raw-pika", "1 baselines", "raw pika consumer, prefetch 100, manual ack (needs pika)", "msgs/s",
        partial(s.raw_consumer, module="raw_pika"), "raw"),
    Row("celery-solo", "1 baselines", "Celery no-op tasks, acks_late, solo", "msgs/s", s.celery_tasks("solo", 1)),
    Row("celery-prefork", "1 baselines", "Celery no-op tasks, acks_late, prefork -c 2", "msgs/s",
        s.celery_tasks("prefork", 2)),
    Row("events-solo", "2 success", "events no-op handler, solo, prefetch 100", "msgs/s",
        s.events_consumer("solo", 1, prefetch=100), "raw", 1.3),
    Row("events-prefork", "2 success", "events no-op handler, prefork -c 2 (batched hand-off)", "msgs/s",
        s.events_consumer("prefork", 2), "raw", 1.0),
    Row("traced-solo", "2 success", "events no-op handler, solo, with TracingMiddleware (SDK, batched)", "msgs/s",
        s.events_consumer("solo", 1, tracing=1), "events-solo", 0.9),
    Row("events-metrics", "2 success", "events no-op handler, solo, with metrics (--events-metrics-port)",
        "msgs/s", s.events_consumer("solo", 1, metrics=True), "events-solo", 0.9),
    Row("observed-solo", "2 success", "events no-op handler, solo, with metrics and TracingMiddleware", "msgs/s",
        s.events_consumer("solo", 1, tracing=1, metrics=True), "events-solo", 0.9),
    Row("observed-sampled", "2 success", "events no-op handler, solo, with metrics, tracing 10 % of traces",
        "msgs/s", s.events_consumer("solo", 1, tracing=0.1, metrics=True), "events-solo", 0.9),
    Row("events-threads", "2 success", "events no-op handler, threads -c 2", "msgs/s",
        s.events_consumer("threads", 2), "raw", 0.8),
    Row("events-gevent", "2 success", "events no-op handler, gevent -c 100", "msgs/s",
        s.events_consumer("gevent", 100), "raw"),
    Row("pub-kombu", "3 publish", "raw kombu publish, confirm_publish, one by one", "msgs/s", s.publisher("kombu")),
    Row("pub-events", "3 publish", "events.publish (confirmed, mandatory), one by one", "msgs/s",
        s.publisher("events"), "pub-kombu", 0.9),
    Row("pub-batch", "3 publish", "events.publish_many, batches of {batch}", "msgs/s", s.publisher("batch"),
        "pub-events", 5.0),
    Row("retry-solo", "4 retry", "events fail once then succeed, solo", "msgs/s",
        s.events_consumer("solo", 1, mode="fail_once"), "events-solo", 0.4),
    Row("retry-prefork", "4 retry", "events fail once then succeed, prefork -c 2", "msgs/s",
        s.events_consumer("prefork", 2, mode="fail_once"), "events-prefork", 0.4),
    Row("retry-inplace-solo", "4 retry", "events fail once then succeed, retried in the worker (retry_in_place_ms), "
        "solo, prefetch 100", "msgs/s", s.events_consumer("solo", 1, mode="fail_once", prefetch=100, in_place_ms=100),
        "events-solo", 0.4),
    Row("retry-inplace-prefork", "4 retry", "events fail once then succeed, retried in the worker "
        "(retry_in_place_ms), prefork -c 2, prefetch 100", "msgs/s",
        s.events_consumer("prefork", 2, mode="fail_once", prefetch=100, in_place_ms=100), "events-prefork", 0.4),
    Row("events-solo-400", "4 retry", "events no-op handler, solo, prefetch 400 (the next row's success path)",
        "msgs/s", s.events_consumer("solo", 1, prefetch=400), "raw"),
    Row("retry-inplace-solo-400", "4 retry", "events fail once then succeed, retried in the worker "
        "(retry_in_place_ms), solo, prefetch 400", "msgs/s",
        s.events_consumer("solo", 1, mode="fail_once", prefetch=400, in_place_ms=100), "events-solo-400", 0.4),
    Row("events-prefork-400", "4 retry", "events no-op handler, prefork -c 2, prefetch 400 (the next row's "
        "success path)", "msgs/s", s.events_consumer("prefork", 2, prefetch=400), "raw"),
    Row("retry-inplace-prefork-400", "4 retry", "events fail once then succeed, retried in the worker "
        "(retry_in_place_ms), prefork -c 2, prefetch 400", "msgs/s",
        s.events_consumer("prefork", 2, mode="fail_once", prefetch=400, in_place_ms=100), "events-prefork-400", 0.4),
    Row("reader-solo", "10 logs", "events of a log read by a no-op reader (@events.reader, in order, one at a time), "
        "solo", "msgs/s", s.events_consumer("solo", 1, mode="reader"), "events-solo"),
    Row("reader-prefork", "10 logs", "events of a log read by a no-op reader, prefork -c 2", "msgs/s",
        s.events_consumer("prefork", 2, mode="reader"), "events-prefork"),
    Row("rss-celery", "4 retry", "Celery self.retry(countdown), RSS growth, {n_wait} waiting, prefork -c 2", "MiB",
        s.celery_countdown_rss()),
    Row("rss-events", "4 retry", "events Retry(delay), RSS growth, {n_wait} waiting in the ladder, prefork -c 2",
        "MiB", s.events_waiting_rss(), "rss-celery", 5.0),
    Row("scale-50", "5 scale", "events 50 handler queues, solo (vs 1 queue: events-solo)", "msgs/s",
        s.events_consumer("solo", 1, queues=50), "events-solo", 0.9),
    Row("scale-500", "5 scale", "events 500 handler queues, solo (vs 1 queue: events-solo)", "msgs/s",
        s.events_consumer("solo", 1, queues=500), "events-solo", 0.7),
    Row("scale-50-p100", "5 scale", "events 50 handler queues, prefetch_count 100 (before auto), solo", "msgs/s",
        s.events_consumer("solo", 1, queues=50, prefetch=100), "events-solo"),
    Row("scale-500-p100", "5 scale", "events 500 handler queues, prefetch_count 100 (before auto), solo",
        "msgs/s", s.events_consumer("solo", 1, queues=500, prefetch=100), "events-solo"),
    Row("lat-raw", "6 latency", "raw kombu consumer, publish -> handler start, {rate:g}/s", "ms",
        s.latency("raw")),
    Row("lat-events-solo", "6 latency", "events handler, solo, publish -> handler start, {rate:g}/s", "ms",
        s.latency("events", "solo", 1), "lat-raw", 5.0),
    Row("lat-events-prefork", "6 latency", "events handler, prefork -c 2, publish -> handler start, {rate:g}/s",
        "ms", s.latency("events", "prefork", 2), "lat-raw", 5.0),
    Row("lat-events-threads", "6 latency", "events handler, threads -c 2, publish -> handler start, {rate:g}/s",
        "ms", s.latency("events", "threads", 2), "lat-raw", 5.0),
    Row("untyped5-solo", "7 contracts", "events no-op handler, unannotated, 5-field payload, solo", "msgs/s",
        s.events_consumer("solo", 1, fields=5)),
    Row("typed5-solo", "7 contracts", "events no-op handler, 5-field pydantic model validated, solo", "msgs/s",
        s.events_consumer("solo", 1, mode="typed", fields=5), "untyped5-solo", 0.8),
    Row("untyped5-prefork", "7 contracts", "events no-op handler, unannotated, 5-field payload, prefork -c 2",
        "msgs/s", s.events_consumer("prefork", 2, fields=5)),
    Row("typed5-prefork", "7 contracts", "events no-op handler, 5-field pydantic model validated, prefork -c 2",
        "msgs/s", s.events_consumer("prefork", 2, mode="typed", fields=5), "untyped5-prefork", 0.8),
    Row("sleep-gevent", "8 async", "events sync handler in time.sleep(50 ms), gevent -c 100, N/10", "msgs/s",
        s.events_consumer("gevent", 100, mode="sleep", share=0.1)),
    Row("await-prefork", "8 async", "events async def handler awaiting 50 ms, prefork -c 2, N/10", "msgs/s",
        s.events_consumer("prefork", 2, mode="await", share=0.1), "sleep-gevent", 0.8),
    Row("await-threads", "8 async", "events async def handler awaiting 50 ms, threads -c 2, N/10", "msgs/s",
        s.events_consumer("threads", 2, mode="await", share=0.1), "sleep-gevent"),
    # Peer libraries, each in its own venv (benchmarks/.peers/, created on first use; benchmarks/peers.py).
    Row("faststream", "9 peers", "faststream RabbitBroker (aio-pika), one process, prefetch 100", "msgs/s",
        peers.faststream, "events-solo"),
    Row("celery-message-consumer", "9 peers", "celery-message-consumer step, solo worker, PREFETCH_COUNT 100",
        "msgs/s", peers.message_consumer, "events-solo"),
    Row("celery-amqp-events", "9 peers", "celery-amqp-events handler (Celery task messages), solo, prefetch 100",
        "msgs/s", peers.amqp_events, "events-solo"),
)


def select(only: list[str] | None) -> list[Row]:
    """Rows whose key or group starts with one of ``only`` (all if empty), plus their baselines."""
    if not only:
        return list(ROWS)
    wanted = {r.key for r in ROWS if any(r.key.startswith(o) or r.group.split()[-1].startswith(o) for o in only)}
    by_key = {r.key: r for r in ROWS}
    for key in list(wanted):
        while by_key[key].baseline:
            key = by_key[key].baseline
            wanted.add(key)
    return [r for r in ROWS if r.key in wanted]
