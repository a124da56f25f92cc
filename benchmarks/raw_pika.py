"""Baseline: a raw pika consumer -- manual ack, prefetch 100, JSON decoded -- what a Python client without
py-amqp's frame-by-frame reads does (needs ``pika``).

``python -m benchmarks.raw_pika URL QUEUE``; stops on SIGTERM and dumps its counters. Each message is
acked on its own, as in the raw kombu consumer (:mod:`benchmarks.raw_consumer`).
"""
from __future__ import annotations

import json
import signal
import sys

import pika

from benchmarks import probe

PREFETCH = 100


def main(url: str, queue: str) -> None:
    probe.install()
    if url.endswith("//"):  # kombu's spelling of the vhost "/"; pika's is %2F
        url = url[:-1] + "%2F"
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=PREFETCH)
    signal.signal(signal.SIGTERM, lambda *_: connection.add_callback_threadsafe(channel.stop_consuming))

    def on_message(ch, method, properties, body):
        probe.handled(json.loads(body)["i"])
        ch.basic_ack(method.delivery_tag)
        probe.acked(1)

    channel.basic_consume(queue, on_message, auto_ack=False)
    (probe.OUT / "ready").write_text("0")
    channel.start_consuming()
    connection.close()
    probe.dump()


if __name__ == "__main__":
    main(*sys.argv[1:])
