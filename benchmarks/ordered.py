"""Ordered handlers, measured: ``python -m benchmarks.ordered [--n 4000] [--keys 64] [--partitions 16] [--work-ms 2]``.

One service, two handlers that each sleep ``--work-ms`` (a handler waiting on I/O), both keeping the
events of a key in publish order:

- ``sac``: one queue with ``single_active_consumer=True, prefetch=1`` (what kombu-events offered before
  ordered handlers): in order, one event at a time, on one worker of the fleet;
- ``ordered``: ``ordered_by="key", partitions=16``: in order per key, keys in parallel.

Same run: N events for ``--keys`` keys wait in each handler's queue(s), then two real ``celery worker
--with-events-step --pool=prefork -c 2`` drain them and stop; first ``sac``, then ``ordered``. Each call
appends its start time to a file; rate = (N - 1) / (last start - first start): worker start-up and
publishing are not measured. Prints events/s of each and the ratio. Every name it creates starts with
``kebench-``; all is deleted after.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

from kombu import Connection

from kombu_events import Events
from kombu_events.broker.declare import declare
from kombu_events.core.wire import ORDER_KEY
from kombu_events.publishing.publisher import Publisher, build_message

from .broker import delete_service

ROOT = Path(__file__).resolve().parents[1]

APP = '''
import os, time
from celery import Celery
from kombu_events import Events

app = Celery("kebench-ordered", broker={broker!r})
app.conf.task_default_queue = {service!r} + ".tasks"
events = Events(app, service={service!r}, exchange={exchange!r})
TIMES = {times!r}

def note(kind):
    started = time.time()
    fd = os.open(TIMES + "." + kind, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{{started}}\\n".encode())
    finally:
        os.close(fd)

@events.handler("bench.sac", single_active_consumer=True, prefetch=1)
def sac(payload):
    note("sac")
    time.sleep({work_s})

@events.handler("bench.ordered", ordered_by="key", partitions={partitions})
def ordered(payload):
    note("ordered")
    time.sleep({work_s})
'''


def drain(kind: str, args: argparse.Namespace, module: str, workdir: Path, exchange: str) -> float:
    """Publish N events for ``kind``, then let two fresh workers drain them; events/s of their calls."""
    publisher = Publisher(args.broker)
    try:
        for first in range(0, args.n, 1000):
            batch = [(exchange, f"bench.{kind}", build_message({"i": i}, headers={ORDER_KEY: f"k{i % args.keys}"}))
                     for i in range(first, min(args.n, first + 1000))]
            assert publisher.send_many(batch) == [None] * len(batch)
    finally:
        publisher.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(workdir), str(ROOT)])}
    workers = []
    for w in range(args.workers):
        log = open(workdir / f"{module}.{kind}.{w}.log", "w")  # noqa: SIM115 - closed with the worker below
        workers.append((log, subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", module, "worker", "--pool=prefork",
             f"--concurrency={args.concurrency}", "--without-mingle", "--without-gossip", "--without-heartbeat",
             "-l", "WARNING", "--with-events-step",
             f"--hostname={module}-{kind}-{w}@%h"], cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)))
    try:
        return _rate(workdir / f"times.{kind}", args.n, [p for _, p in workers])
    finally:
        for log, worker in workers:
            worker.terminate()
            worker.wait(30)
            log.close()


def _rate(times: Path, n: int, workers: list[subprocess.Popen[bytes]]) -> float:
    deadline = time.monotonic() + 600
    while True:
        starts = [float(line) for line in times.read_text().split()] if times.exists() else []
        if len(starts) >= n:
            break
        if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
            raise RuntimeError(f"{times.name}: {len(starts)} of {n} handled")
        time.sleep(0.2)
    starts.sort()
    return (n - 1) / (starts[-1] - starts[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--work-ms", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--broker", default=os.environ.get("KEB_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"))
    args = parser.parse_args(argv)
    service, exchange = f"kebench-{uuid.uuid4().hex[:8]}", f"kebench-{uuid.uuid4().hex[:8]}"
    module = f"ordered_app_{uuid.uuid4().hex[:8]}"
    rates: dict[str, float] = {}
    topologies: list[Any] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kebench-ordered-") as tmp:
            workdir = Path(tmp)
            (workdir / f"{module}.py").write_text(textwrap.dedent(APP.format(
                broker=args.broker, service=service, exchange=exchange, times=str(workdir / "times"),
                work_s=args.work_ms / 1000, partitions=args.partitions)))
            sys.path.insert(0, str(workdir))
            events: Events = __import__(module).events
            topologies.append(events.topology())
            with Connection(args.broker) as conn:
                declare(topologies[0], conn)
            for kind in ("sac", "ordered"):
                rates[kind] = drain(kind, args, module, workdir, exchange)
    finally:
        delete_service(args.broker, topologies, service)
    print(f"\nN = {args.n} events of {args.keys} keys per handler, a handler of {args.work_ms:g} ms, "
          f"{args.workers} workers --pool=prefork -c {args.concurrency}\n")
    print("| handler | events/s |\n|---|---|")
    print(f"| one queue, `single_active_consumer=True, prefetch=1` | {rates['sac']:,.0f} |")
    print(f"| `ordered_by=\"key\", partitions={args.partitions}` | {rates['ordered']:,.0f} |")
    print(f"\nratio: {rates['ordered'] / rates['sac']:.1f}x")


if __name__ == "__main__":
    main()
