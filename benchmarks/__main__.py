"""``python -m benchmarks [--quick] [--only KEY ...]``: run the suite against the local RabbitMQ, print the table."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks import broker, report, suite
from benchmarks.procs import Consumer
from benchmarks.scenarios import Context, Run

HERE = Path(__file__).resolve().parent
DEFAULT_URL = os.environ.get("KEB_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true", help="smoke run: N=2000, 1 repetition")
    p.add_argument("-n", type=int, help="messages per throughput run (default 20000; quick 2000)")
    p.add_argument("--reps", type=int, help="repetitions, median reported (default 3; quick 1)")
    p.add_argument("--wait-n", type=int, help="messages waiting for the RSS rows (default 10000; quick 2000)")
    p.add_argument("--latency-n", type=int, help="messages per latency run (default 1000; quick 200)")
    p.add_argument("--rate", type=float, default=100.0, help="publish rate of the latency rows, msgs/s")
    p.add_argument("--batch", type=int, default=1000, help="batch size of events.publish_many")
    p.add_argument("--only", nargs="*", metavar="KEY", help="rows or groups to run (prefix match), "
                   f"baselines added: {', '.join(r.key for r in suite.ROWS)}")
    p.add_argument("--broker", default=DEFAULT_URL, help="AMQP URL (default: %(default)s)")
    p.add_argument("--output", type=Path, help="Markdown file to write (default benchmarks/results[-quick].md)")
    p.add_argument("--cold", action="store_true", help="publish before the consumer process starts, instead of "
                   "into a running consumer paused with SIGSTOP")
    p.add_argument("--keep", action="store_true", help="keep the per-run directories (logs, probe files)")
    a = p.parse_args(argv)
    a.n = a.n or (2_000 if a.quick else 20_000)
    a.reps = a.reps or (1 if a.quick else 3)
    a.wait_n = a.wait_n or (2_000 if a.quick else 10_000)
    a.latency_n = a.latency_n or (200 if a.quick else 1_000)
    a.output = a.output or HERE / ("results-quick.md" if a.quick else "results.md")
    return a


def environment(a: argparse.Namespace) -> str:
    import celery
    import kombu

    broker_version = subprocess.run(["rabbitmqctl", "-q", "version"], capture_output=True, text=True).stdout.strip()
    load = os.getloadavg()
    return (f"{time.strftime('%Y-%m-%d %H:%M')}; N={a.n:,} per throughput run, {a.reps} repetition(s); "
            f"Python {platform.python_version()}, Celery {celery.__version__}, kombu {kombu.__version__}, "
            f"RabbitMQ {broker_version or '?'}; {os.cpu_count()} CPUs, load average at start "
            f"{load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    rows = suite.select(a.only)
    workdir = Path(tempfile.mkdtemp(prefix="kebench-"))
    ctx = Context(url=a.broker, out=workdir, n=a.n, n_wait=a.wait_n, n_latency=a.latency_n, rate=a.rate,
                  batch=a.batch, cold=a.cold)
    fmt = {"batch": a.batch, "n_wait": f"{a.wait_n:,}", "rate": a.rate}
    header = environment(a)
    print(f"kombu-events benchmarks -- {header}\nnames start with {ctx.prefix}; files in {workdir}", flush=True)
    results: dict[str, list[Run]] = {r.key: [] for r in rows}
    try:
        for rep in range(1, a.reps + 1):
            for row in rows:  # repetitions interleave, so baselines and candidates share the machine's moods
                started = time.monotonic()
                run = row.attempt(ctx)
                results[row.key].append(run)
                shown = run.error or f"{run.value:,.2f} {row.unit}"
                print(f"[{rep}/{a.reps}] {row.key:<20} {shown}  ({time.monotonic() - started:.0f} s)", flush=True)
    except KeyboardInterrupt:
        print("interrupted: reporting what ran", file=sys.stderr)
    finally:
        Consumer.stop_all()
        clean(ctx)
    text = report.markdown(report.table(rows, results, fmt))
    print("\n" + text)
    a.output.write_text(f"# kombu-events benchmarks\n\n{header}\n\n{text}\n")
    (a.output.with_suffix(".json")).write_text(json.dumps(
        {"environment": header, "runs": {k: [asdict(r) for r in v] for k, v in results.items()}}, indent=1))
    print(f"\nwritten to {a.output}")
    if not a.keep:
        subprocess.run(["rm", "-rf", str(workdir)])
    failed = any(r.error for runs in results.values() for r in runs)
    return 1 if failed else 0


def clean(ctx: Context) -> None:
    """Delete the run's shared exchange and anything a crashed scenario left behind; say if anything remains."""
    queues, exchanges = broker.leftovers(ctx.prefix)
    broker.delete(ctx.url, queues=queues, exchanges=[*exchanges, ctx.exchange])
    queues, exchanges = broker.leftovers(ctx.prefix)
    if queues or exchanges:
        print(f"WARNING: left on the broker: {queues + exchanges}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

