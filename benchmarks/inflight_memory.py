"""Peak memory of a worker while large bodies are in flight, with the ``inflight_max_bytes`` budget and without.

``python -m benchmarks.inflight_memory [--n 12] [--body-mib 15] [--budget-mib 48] [--pools solo prefork]``

For each pool and each budget (the one given, and 0: none), a real ``celery worker --with-events-step`` starts
idle; then ``n`` bodies of ``body-mib`` MiB are published at once (confirmed) to its one handler, which sleeps
0.5 s each. Printed per run: the peak RSS (``VmHWM`` of ``/proc/PID/status``) of the main process and of each
pool process, once the worker is ready (before) and once every body is handled (after), the most messages
the broker had unacknowledged (``rabbitmqctl``, sampled) and how long the bodies took. Figures, not a test.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from celery import Celery

from kombu_events import Events
from kombu_events.publishing.publisher import Publisher, build_message

from .broker import declare_events, delete, leftovers, unique
from .procs import ROOT, stop_group, tree

MIB = 1024 * 1024
URL = os.environ.get("KEB_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")

APP = '''
import os, time
from celery import Celery
from kombu_events import Events

app = Celery({service!r}, broker={url!r})
app.conf.task_default_queue = {service!r} + ".tasks"
events = Events(app, service={service!r}, exchange={exchange!r}, inflight_max_bytes={budget})

@events.handler("big.#")
def handle(payload):
    time.sleep(0.5)
    with open({records!r}, "a") as fh:
        fh.write("%d\\n" % payload["id"])
'''


def peak_rss(pid: int) -> dict[int, int]:
    """{pid: VmHWM in bytes} of ``pid`` and its descendants."""
    found = {}
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        found[p] = int(line.split()[1]) * 1024
        except OSError:
            continue
    return found


def most_unacked(queue: str, done: threading.Event, seen: list[int]) -> None:
    while not done.is_set():
        out = subprocess.run(["rabbitmqctl", "-q", "list_queues", "--no-table-headers", "name",
                              "messages_unacknowledged"], capture_output=True, text=True, timeout=60).stdout
        seen.extend(int(line.rsplit("\t", 1)[1]) for line in out.splitlines() if line.split("\t")[0] == queue)


def run(pool: str, budget: int, n: int, body: int, workdir: Path) -> dict[str, object]:
    """One worker, ``n`` bodies: peak RSS before and after, most unacknowledged, seconds."""
    service, exchange = unique("kebmem"), unique("kebmemx")
    module, records = f"mem_{service}", workdir / f"{service}.records"
    (workdir / f"{module}.py").write_text(APP.format(service=service, url=URL, exchange=exchange, budget=budget,
                                                     records=str(records)))
    events = Events(Celery(service, broker=URL), service=service, exchange=exchange)
    events.handler("big.#", name="handle")(lambda payload: None)
    declare_events(URL, events)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(workdir), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    log = open(workdir / f"{service}.log", "w")  # noqa: SIM115 -- closed below
    cmd = [sys.executable, "-m", "celery", "-A", module, "worker", f"--pool={pool}",
           f"--concurrency={2 if pool == 'prefork' else 1}", "--without-mingle", "--without-gossip",
           "--without-heartbeat", "-l", "INFO", "--with-events-step"]
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    done, seen = threading.Event(), []
    try:
        deadline = time.monotonic() + 60
        while " ready." not in (workdir / f"{service}.log").read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{(workdir / f'{service}.log').read_text()[-3000:]}")
            time.sleep(0.1)
        time.sleep(1.0)
        before = peak_rss(proc.pid)
        watcher = threading.Thread(target=most_unacked, args=(f"{service}.handle", done, seen), daemon=True)
        watcher.start()
        started = time.monotonic()
        publisher = Publisher(URL)
        try:
            items = [(exchange, f"big.{i}", build_message({"id": i, "pad": "x" * (body - 40)})) for i in range(n)]
            assert publisher.send_many(items) == [None] * n
        finally:
            publisher.close()
        deadline = time.monotonic() + 300
        while not records.exists() or len(records.read_text().split()) < n:
            if time.monotonic() > deadline:
                raise RuntimeError("the bodies were not all handled in 300 s")
            time.sleep(0.1)
        seconds = time.monotonic() - started
        after = peak_rss(proc.pid)
    finally:
        done.set()
        stop_group(proc, 20)
        log.close()
        queues, exchanges = leftovers(service)
        ladder_queues, ladder_exchanges = leftovers(exchange)  # the exchange's delayed-publishing ladder
        delete(URL, queues + ladder_queues, exchanges + ladder_exchanges)
    return {"before": before, "after": after, "main": proc.pid, "unacked": max(seen, default=0),
            "seconds": seconds}


def _mib(value: int) -> str:
    return f"{value / MIB:6.0f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=12)
    parser.add_argument("--body-mib", type=int, default=15)
    parser.add_argument("--budget-mib", type=int, default=48)
    parser.add_argument("--pools", nargs="+", default=["solo", "prefork"])
    args = parser.parse_args(argv)
    print(f"{args.n} bodies of {args.body_mib} MiB at once; peak RSS (VmHWM, MiB) before -> after\n")
    print(f"{'pool':8} {'budget':>10} {'main':>17} {'pool processes':>34} {'unacked max':>12} {'seconds':>8}")
    with tempfile.TemporaryDirectory(prefix="keb-inflight-") as tmp:
        for pool in args.pools:
            for budget in (args.budget_mib * MIB, 0):
                found = run(pool, budget, args.n, args.body_mib * MIB, Path(tmp))
                before, after, main_pid = found["before"], found["after"], found["main"]
                assert isinstance(before, dict) and isinstance(after, dict) and isinstance(main_pid, int)
                children = "  ".join(f"{_mib(before.get(p, 0)).strip()} -> {_mib(after[p]).strip()}"
                                     for p in sorted(after) if p != main_pid) or "-"
                label = f"{args.budget_mib} MiB" if budget else "none"
                print(f"{pool:8} {label:>10} {_mib(before[main_pid])} -> {_mib(after[main_pid])} {children:>34} "
                      f"{found['unacked']:>12} {found['seconds']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
