"""Cost as the work grows: declare time and broker memory per service, and workers on a 3-node cluster.

    python -m benchmarks.scaling declare [--handlers 1 50 500] [--levels 4 16 32] [--queue-type classic]
    python -m benchmarks.scaling cluster [-n 20000] [--workers 1 2 4] [--queues 4]

``declare``: for each (handlers, delay levels), a service declared in a vhost of its
own on the local node (``$KEB_BROKER_URL`` or amqp://guest:guest@127.0.0.1:5672//):
the declare's wall time and the node's memory before and after
(``rabbitmq-diagnostics memory_breakdown``: total, and queue processes), then the
vhost is deleted. Needs the management plugin (vhosts) and ``rabbitmq-diagnostics``.

``cluster``: a quorum service with ``--queues`` handler queues; N events published with
confirms, then consumed by 1 solo worker on the local node (baseline), and by 1, 2 and 4
solo workers on a 3-node cluster started by ``scripts/rabbitmq-cluster`` on ports of
its own (each worker gets every node's URL, rotated so the workers connect to different
nodes). Every id must be handled exactly once (the benchmark probe), every queue empty
afterwards. Rate = N / (first handler start -> last handler end, over all workers).
The cluster is stopped at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kombu import Connection

from benchmarks import broker
from benchmarks.apps.events_app import build, make_app, routing_key
from benchmarks.procs import Consumer
from kombu_events import Events
from kombu_events.broker.declare import declare
from kombu_events.testing import temporary_vhost

ROOT = Path(__file__).resolve().parent.parent
LOCAL = os.environ.get("KEB_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
CLUSTER_ENV = {"KE_CLUSTER_DIR": "/tmp/ke-bench-cluster", "KE_CLUSTER_NAME": "kb",
               "KE_CLUSTER_AMQP_PORT": "5801", "KE_CLUSTER_DIST_PORT": "25801"}


# -- declare time and memory --------------------------------------------------------------------

def memory() -> dict[str, int]:
    """The local node's memory by category, in bytes (live, not a stats sample); ``total``: what is in use
    (without the allocator's unused and reserved memory)."""
    out = subprocess.run(["rabbitmq-diagnostics", "-q", "memory_breakdown", "--unit", "bytes",
                          "--formatter", "json"], capture_output=True, text=True, check=True).stdout
    data = {key: int(value["bytes"]) for key, value in json.loads(out).items()}
    data["total"] = sum(v for k, v in data.items() if k not in ("allocated_unused", "reserved_unallocated"))
    return data


def declare_cost(handlers: int, levels: int, queue_type: str) -> dict[str, Any]:
    with temporary_vhost(LOCAL) as url:
        app = make_app("kebench-declare", url, "unused")
        events = Events(app, service="svc", exchange="events", delay_levels=levels, queue_type=queue_type)
        for k in range(handlers):
            events.handler(routing_key(k), name=f"h{k}")(lambda payload: None)
        topology = events.topology()
        before = memory()
        started = time.perf_counter()
        _declare(url, topology)
        took = time.perf_counter() - started
        time.sleep(1.0)  # queue processes settle
        after = memory()
        again = time.perf_counter()
        _declare(url, topology)  # a worker's restart: everything exists already
        redeclare = time.perf_counter() - again
    procs = "quorum_queue_procs" if queue_type == "quorum" else "queue_procs"
    return {"handlers": handlers, "levels": levels, "queues": len(topology.queues),
            "exchanges": len(topology.exchanges), "declare_s": took, "redeclare_s": redeclare,
            "memory_total_mib": (after["total"] - before["total"]) / 2**20,
            "queue_procs_mib": (after.get(procs, 0) - before.get(procs, 0)) / 2**20}


def _declare(url: str, topology: Any) -> None:
    # A node busy starting hundreds of quorum queues answers a new connection slowly: more than
    # kombu's default connect timeout (4 s) with 500 of them on this machine.
    with Connection(url, connect_timeout=60) as conn:
        declare(topology, conn)


def run_declare(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    print("| handlers | levels | queues | exchanges | declare | re-declare | memory growth | queue processes |")
    print("|---|---|---|---|---|---|---|---|")
    for handlers in args.handlers:
        for levels in args.levels:
            row = declare_cost(handlers, levels, args.queue_type)
            rows.append(row)
            print(f"| {row['handlers']} | {row['levels']} | {row['queues']} | {row['exchanges']} | "
                  f"{row['declare_s']:.2f} s | {row['redeclare_s']:.2f} s | {row['memory_total_mib']:.1f} MiB | "
                  f"{row['queue_procs_mib']:.1f} MiB |", flush=True)
    return rows


# -- workers on a cluster -----------------------------------------------------------------------

def cluster(*args: str) -> str:
    result = subprocess.run([str(ROOT / "scripts" / "rabbitmq-cluster"), *args], env={**os.environ, **CLUSTER_ENV},
                            capture_output=True, text=True, timeout=300)
    if result.returncode:
        raise RuntimeError(f"rabbitmq-cluster {' '.join(args)}: {result.stderr or result.stdout}")
    return result.stdout


def node_urls() -> list[str]:
    return cluster("url").strip().split(";")


def consume(urls: list[str], workers: int, n: int, queues: int, label: str) -> dict[str, Any]:
    """Declare a quorum service through ``urls[0]``, publish ``n``, consume with ``workers`` solo workers."""
    out_root = Path(tempfile.mkdtemp(prefix="kebench-scaling-"))
    service, exchange = broker.unique("kebsvc"), broker.unique("kebex")
    app = make_app("kebench-runner", ";".join(urls), f"{service}.tasks")
    events = build(app, service=service, exchange=exchange, queues=queues, queue_type="quorum")
    topology = events.topology()
    handler_queues = [q.name for q in topology.handler_queues]
    broker.declare_events(urls[0], events)
    started: list[Consumer] = []
    try:
        for w in range(workers):
            order = urls[w % len(urls):] + urls[:w % len(urls)]  # worker w connects to node w first
            out = out_root / f"w{w}"
            out.mkdir()
            env = {"KEB_OUT": str(out), "KEB_N": str(n), "KEB_ACKS": "", "KEB_SERVICE": service,
                   "KEB_EXCHANGE": exchange, "KEB_BROKER": ";".join(order), "KEB_TASKQ": f"{service}.tasks",
                   "KEB_MODE": "noop", "KEB_QUEUES": str(queues), "KEB_QUEUE_TYPE": "quorum"}
            started.append(Consumer.celery("benchmarks.apps.events_app", "solo", 1, env, out,
                                           "--with-events-step", "-Q", f"{service}.tasks"))
        for consumer in started:
            consumer.wait_file("ready", 120, "worker ready")
            consumer.pause()
        broker.publish(";".join(urls), broker.event_messages(exchange, [routing_key(k) for k in range(queues)], n))
        for consumer in started:
            consumer.resume()
        deadline = time.monotonic() + 60 + n / 200
        while any(broker.depths(";".join(urls), handler_queues).values()) or _unacked(urls, handler_queues):
            if time.monotonic() > deadline:
                raise RuntimeError("the queues did not empty in time")
            time.sleep(0.5)
    finally:
        for consumer in started:
            consumer.stop()
    ok = [0] * n
    firsts, lasts, per_worker = [], [], []
    for meta_path in out_root.glob("w*/proc-*.json"):
        meta = json.loads(meta_path.read_text())
        if meta["count"]:
            firsts.append(meta["first"])
            lasts.append(meta["last"])
            per_worker.append(meta["count"])
        for i, c in enumerate(meta_path.with_suffix(".ok").read_bytes()):
            ok[i] += c
    missing, extra = sum(1 for c in ok if c == 0), sum(c - 1 for c in ok if c > 1)
    left = sum(d or 0 for d in broker.depths(";".join(urls), handler_queues).values())
    broker.delete(";".join(urls), queues=[q.name for q in topology.queues] + [f"{service}.tasks"],
                  exchanges=[e.name for e in topology.exchanges])
    shutil.rmtree(out_root, ignore_errors=True)
    error = None
    if missing or extra or left:
        error = f"{missing} missing, {extra} duplicates, {left} left in the queues"
    rate = n / (max(lasts) - min(firsts)) if firsts and not error else None
    return {"label": label, "workers": workers, "n": n, "rate": rate, "per_worker": sorted(per_worker),
            "error": error}


def _unacked(urls: list[str], queues: list[str]) -> int:
    """Unacknowledged messages of ``queues`` (rabbitmqctl: AMQP does not report them)."""
    if urls[0].endswith(":5672//"):
        out = subprocess.run(["rabbitmqctl", "-q", "list_queues", "--no-table-headers", "name",
                              "messages_unacknowledged"], capture_output=True, text=True, check=True).stdout
    else:
        out = cluster("ctl", "1", "list_queues", "--no-table-headers", "name", "messages_unacknowledged")
    counts = dict(line.rsplit(None, 1) for line in out.splitlines() if line.strip())
    return sum(int(counts.get(q, 0)) for q in queues)


def run_cluster(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = [consume([LOCAL], 1, args.n, args.queues, "1 worker, one node (5672)")]
    _print(rows[-1], rows[0])
    cluster("start", "--nodes", "3")
    try:
        urls = node_urls()
        for workers in args.workers:
            rows.append(consume(urls, workers, args.n, args.queues, f"{workers} worker(s), 3-node cluster"))
            _print(rows[-1], rows[0])
    finally:
        cluster("stop")
    return rows


def _print(row: dict[str, Any], base: dict[str, Any]) -> None:
    if row["error"]:
        print(f"| {row['label']} | FAILED: {row['error']} |", flush=True)
        return
    ratio = row["rate"] / base["rate"] if base["rate"] else float("nan")
    print(f"| {row['label']} | {row['rate']:,.0f} msgs/s | {ratio:.2f}x | {row['per_worker']} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    d = sub.add_parser("declare", help="declare time and broker memory per service")
    d.add_argument("--handlers", type=int, nargs="+", default=[1, 50, 500])
    d.add_argument("--levels", type=int, nargs="+", default=[4, 16, 23])
    d.add_argument("--queue-type", choices=["classic", "quorum"], default="classic")
    c = sub.add_parser("cluster", help="1 worker on one node vs 1, 2, 4 workers on a 3-node cluster")
    c.add_argument("-n", type=int, default=20_000)
    c.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    c.add_argument("--queues", type=int, default=4, help="handler queues of the service (events round-robin)")
    args = parser.parse_args(argv)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}; {os.cpu_count()} CPUs; load average {os.getloadavg()}",
          flush=True)
    if args.what == "declare":
        run_declare(args)
    else:
        print("| run | rate | vs 1 worker on one node | messages per worker |\n|---|---|---|---|")
        rows = run_cluster(args)
        return 1 if any(r["error"] for r in rows) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
