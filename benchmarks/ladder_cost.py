"""Diagnostic (not in the table): broker CPU per message for the ways into a handler queue.

``python -m benchmarks.ladder_cost [N]`` publishes N persistent messages, pipelined and
confirmed, directly to the events exchange, into the delay ladder at its top level (what
retries did before 0.1), at the level of the delay's highest bit (what a retry does), and
to the delivery exchange, and
reports the publish rate and the RabbitMQ process's CPU time per message (from /proc).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kombu import Connection

from benchmarks import broker
from benchmarks.__main__ import DEFAULT_URL
from benchmarks.scenarios import Context, _Service
from kombu_events.core import ladder, names
from kombu_events.publishing.publisher import build_message


def _broker_cpu_s(pid: str) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().split()
    return (int(fields[13]) + int(fields[14])) / 100  # utime + stime, in clock ticks of 10 ms


def main(n: int = 10_000, url: str = DEFAULT_URL) -> None:
    beam = subprocess.run(["pgrep", "-f", "beam.smp"], capture_output=True, text=True).stdout.split()[0]
    ctx = Context(url=url, out=Path(tempfile.mkdtemp(prefix="kebench-")))
    try:
        with _Service(ctx, mode="fail_once") as service:
            levels = service.events.settings.delay_levels
            queue = service.handler_queues[0]
            top = names.delay_name(service.name, levels - 1)
            ways = [
                ("events exchange -> handler queue", ctx.exchange, "bench.0"),
                ("ladder top level, delay 1 unit", top,
                 ladder.routing_key(delay_units=1, levels=levels, queue=queue)),
                ("ladder top level, delay 0", top,
                 ladder.routing_key(delay_units=0, levels=levels, queue=queue)),
                ("entry level (a retry), delay 1 unit", service.events.topology().entry_exchange(1),
                 ladder.routing_key(delay_units=1, levels=levels, queue=queue)),
                ("entry (delivery), delay 0", service.events.topology().entry_exchange(0),
                 ladder.routing_key(delay_units=0, levels=levels, queue=queue)),
            ]
            for label, exchange, key in ways:
                items = [(exchange, key, build_message({"i": i}, headers={"kombu-events-attempts": 1}))
                         for i in range(n)]
                cpu0, t0 = _broker_cpu_s(beam), time.perf_counter()
                broker.publish(url, items)
                published = time.perf_counter() - t0
                while (broker.depth(url, queue) or 0) < n:
                    time.sleep(0.05)
                arrived, cpu = time.perf_counter() - t0, _broker_cpu_s(beam) - cpu0
                print(f"{label:34s} {n / published:8,.0f} msgs/s published, all in the queue after {arrived:5.2f} s, "
                      f"broker CPU {cpu / n * 1e6:6,.0f} us/msg", flush=True)
                with Connection(url) as conn:
                    conn.default_channel.queue_purge(queue)
    finally:
        broker.delete(url, exchanges=[ctx.exchange])
        shutil.rmtree(ctx.out, ignore_errors=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
