"""Baseline: a raw kombu consumer -- manual ack, prefetch 100, JSON decoded -- the practical Python ceiling.

``python -m benchmarks.raw_consumer URL QUEUE [latency]``; stops on SIGTERM and dumps its counters.
"""
from __future__ import annotations

import signal
import socket
import sys

from kombu import Connection, Consumer, Queue

from benchmarks import probe

PREFETCH = 100


def main(url: str, queue: str, mode: str = "noop") -> None:
    probe.install()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))

    if mode == "latency":
        def on_message(body, message):
            if not body.get("warm"):
                probe.latency(body["t"])
                probe.handled(body["i"])
            message.ack()
    else:
        def on_message(body, message):
            probe.handled(body["i"])
            message.ack()

    with Connection(url) as conn:
        channel = conn.channel()
        channel.basic_qos(0, PREFETCH, False)
        with Consumer(channel, queues=[Queue(queue, no_declare=True)], callbacks=[on_message],
                      accept=["json"], no_ack=False, auto_declare=False):
            (probe.OUT / "ready").write_text("0")
            while not stopping:
                try:
                    conn.drain_events(timeout=0.5)
                except socket.timeout:
                    pass
    probe.dump()


if __name__ == "__main__":
    main(*sys.argv[1:])
