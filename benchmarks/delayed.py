"""Delayed publishing, measured: how late events arrive, and memory while many wait.

``python -m benchmarks.delayed [--n 1000] [--waiting 100000] [--unit-ms 100]`` runs a
real ``celery worker --with-events-step`` (solo) on a fresh service and

1. publishes ``--n`` events with ``events.publish(..., delay=d)``, ``d`` drawn from
   0.1 .. 5 s, each carrying its due time; the handler records arrival minus due
   time: never negative (never early), at most one unit plus the worker's latency;
2. with the worker idle, publishes ``--waiting`` events delayed 10 minutes (pipelined
   batches), checks that the exchange's ladder holds all of them, and reports the RSS
   of the publishing process and of the worker's process tree before and after.

Everything the run declared is deleted at the end (the waiting events with it).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import broker
from benchmarks.__main__ import DEFAULT_URL
from benchmarks.apps.events_app import routing_key
from benchmarks.procs import rss_bytes
from benchmarks.scenarios import Context, _env, _Service, read_probe

MiB = 1024 * 1024


def _publisher_events(service: _Service, unit_ms: int):
    from benchmarks.apps.events_app import make_app
    from kombu_events import Events

    app = make_app("kebench-delayed", service.ctx.url, service.task_queue)
    return Events(app, service=service.name + "-pub", exchange=service.ctx.exchange, publish_delay_unit_ms=unit_ms)


def accuracy(service: _Service, consumer, events, n: int, unit_ms: int, rand: random.Random) -> dict:
    """Publish n delayed events; arrival minus due time (ms) from the worker's probe."""
    delays = [round(rand.uniform(0.1, 5.0), 3) for _ in range(n)]
    for i, delay in enumerate(delays):
        events.publish(routing_key(0), {"i": i, "t": time.time() + delay}, delay=delay)
    consumer.wait_file(f"acks-{n}", 60 + max(delays), f"{n} acks")
    consumer.stop()
    probe = read_probe(consumer.out, n)
    late = sorted(x * 1000 for x in probe.latencies)
    if len(late) != n or any(c != 1 for c in probe.ok):
        raise SystemExit(f"expected {n} events handled once each, got {len(late)} latencies")
    return {"n": n, "unit_ms": unit_ms, "min": late[0], "p50": statistics.median(late),
            "p99": late[min(n - 1, int(n * 0.99))], "max": late[-1], "early": sum(1 for x in late if x < 0)}


def waiting(service: _Service, consumer, events, count: int) -> dict:
    """RSS of the publisher and the worker tree before and after ``count`` events wait 10 minutes."""
    ladder = [q for q in service.all_queues if q.startswith(f"{service.ctx.exchange}.deferred.")]
    worker_before, publisher_before = rss_bytes(consumer.proc.pid), rss_bytes_self()
    publisher_warm = 0
    for start in range(0, count, 1000):
        events.publish_many([(routing_key(0), {"i": i}) for i in range(start, min(count, start + 1000))],
                            delay=600)
        if start == 0:  # the first batch warms up the connection, the allocator and the JSON encoder
            publisher_warm = rss_bytes_self()
    held = sum(d or 0 for d in broker.depths(service.ctx.url, ladder).values())
    time.sleep(3)
    worker_after, publisher_after = rss_bytes(consumer.proc.pid), rss_bytes_self()
    return {"waiting": held, "worker_before_mib": worker_before / MiB, "worker_after_mib": worker_after / MiB,
            "publisher_before_mib": publisher_before / MiB, "publisher_warm_mib": publisher_warm / MiB,
            "publisher_after_mib": publisher_after / MiB}


def rss_bytes_self() -> int:
    return rss_bytes(os.getpid())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.delayed", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--waiting", type=int, default=100_000)
    parser.add_argument("--unit-ms", type=int, default=100)
    parser.add_argument("--broker", default=DEFAULT_URL)
    args = parser.parse_args(argv)
    ctx = Context(url=args.broker, out=Path(tempfile.mkdtemp(prefix="kebench-delayed-")))
    rand = random.Random(7)
    os.environ["KEB_PUBLISH_DELAY_UNIT_MS"] = str(args.unit_ms)  # the runner's copy of the service declares it
    try:
        result, mem = _run(ctx, args, rand)
    finally:
        broker.delete(ctx.url, exchanges=[ctx.exchange])
    sys.exit(0 if result["early"] == 0 and mem["waiting"] == args.waiting else 1)


def _run(ctx: Context, args: argparse.Namespace, rand: random.Random) -> tuple[dict, dict]:
    with _Service(ctx, mode="latency") as service:
        events = _publisher_events(service, args.unit_ms)
        env = _env(ctx.directory("accuracy"), args.n, args.n, KEB_PUBLISH_DELAY_UNIT_MS=str(args.unit_ms))
        consumer = service.worker("solo", 1, env, Path(env["KEB_OUT"]))
        consumer.wait_file("ready", 60, "worker ready")
        result = accuracy(service, consumer, events, args.n, args.unit_ms, rand)
        print(f"accuracy, arrival minus asked (ms), {result['n']} events, delays 0.1-5 s, unit {args.unit_ms} ms: "
              f"min {result['min']:.1f}, p50 {result['p50']:.1f}, p99 {result['p99']:.1f}, "
              f"max {result['max']:.1f}; early: {result['early']}")
        env = _env(ctx.directory("waiting"), 1, 1, KEB_PUBLISH_DELAY_UNIT_MS=str(args.unit_ms))
        consumer = service.worker("prefork", 2, env, Path(env["KEB_OUT"]))
        consumer.wait_file("ready", 60, "worker ready")
        time.sleep(2)
        try:
            mem = waiting(service, consumer, events, args.waiting)
        finally:
            consumer.stop()
            events.publishing.publisher.close()
        print(f"waiting: {mem['waiting']:,} events held by the broker's ladder; worker (prefork -c 2) RSS "
              f"{mem['worker_before_mib']:.1f} -> {mem['worker_after_mib']:.1f} MiB; publisher RSS "
              f"{mem['publisher_before_mib']:.1f} -> {mem['publisher_warm_mib']:.1f} after the first 1,000 -> "
              f"{mem['publisher_after_mib']:.1f} MiB")
    return result, mem


if __name__ == "__main__":
    main()
