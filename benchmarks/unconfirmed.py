"""What a publisher without confirms loses when its node dies: ``python -m benchmarks.unconfirmed [--runs 3]``.

A 3-node cluster of its own (``scripts/rabbitmq-cluster``, ports 5901..5903) and a quorum
queue declared through node 2. A py-amqp publisher connected to node 1 publishes
persistent messages with no confirms as fast as it can; node 1 is killed (``kill -9``)
after a second. Printed per run: how many ``basic_publish`` calls returned without an
error, how many messages the queue holds, the difference (lost without the publisher
knowing). The cluster is stopped at the end.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import amqp

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "rabbitmq-cluster"
ENV = {**os.environ, "KE_CLUSTER_DIR": "/tmp/ke-unconfirmed", "KE_CLUSTER_NAME": "ku",
       "KE_CLUSTER_AMQP_PORT": "5901", "KE_CLUSTER_DIST_PORT": "25901"}


def cluster(*args: str) -> str:
    return subprocess.run([str(SCRIPT), *args], env=ENV, capture_output=True, text=True, check=True).stdout


def one_run(kill_after_s: float) -> tuple[int, int, str]:
    queue = "unconfirmed-" + uuid.uuid4().hex[:8]
    admin = amqp.Connection("127.0.0.1:5902")
    admin.connect()
    channel = admin.channel()
    channel.queue_declare(queue, durable=True, auto_delete=False, arguments={"x-queue-type": "quorum"})
    publisher = amqp.Connection("127.0.0.1:5901")
    publisher.connect()
    out = publisher.channel()
    killer = threading.Timer(kill_after_s, cluster, args=("kill-node", "1"))
    killer.start()
    sent, error = 0, ""
    try:
        while True:
            out.basic_publish(amqp.Message(b"x" * 100, delivery_mode=2), exchange="", routing_key=queue)
            sent += 1
    except Exception as exc:  # the connection to the dead node
        error = type(exc).__name__
    killer.join()
    time.sleep(3)  # the survivors elect a leader; whatever was replicated is there
    _name, held, _consumers = channel.queue_declare(queue, passive=True)
    channel.queue_delete(queue)
    admin.close()
    cluster("start-node", "1")
    return sent, held, error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.unconfirmed", description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kill-after", type=float, default=1.0, help="seconds of publishing before the kill")
    args = parser.parse_args(argv)
    cluster("start", "--nodes", "3")
    try:
        for run in range(1, args.runs + 1):
            sent, held, error = one_run(args.kill_after)
            print(f"run {run}: basic_publish returned without error {sent:,} times; the queue holds {held:,}; "
                  f"lost without a word: {sent - held:,} (then {error})", flush=True)
    finally:
        cluster("stop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
