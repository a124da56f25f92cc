"""Publishing side of a run, in its own process: ``python -m benchmarks.publish MODE ...``; prints JSON.

Modes: ``kombu`` (raw kombu ``Producer.publish`` with ``confirm_publish``, one by one),
``events`` (``events.publish``, one by one), ``batch`` (``events.publish_many`` in batches),
``latency`` (``events.publish`` at a fixed rate, each payload carrying its send time).
Every mode first publishes ``WARMUP`` messages (connection set up, code paths warm),
which are not timed but are counted in the queue.
"""
from __future__ import annotations

import argparse
import json
import time

from kombu import Connection

from benchmarks.apps.events_app import make_app
from kombu_events import Events

WARMUP = 100
LATENCY_WARMUP = 20


def _events(url: str, exchange: str) -> Events:
    return Events(make_app("kebench-publisher", url, "unused"), service="kebench-publisher", exchange=exchange)


def kombu_confirmed(url: str, exchange: str, key: str, n: int) -> float:
    with Connection(url, transport_options={"confirm_publish": True}) as conn:
        producer = conn.Producer()
        publish = producer.publish
        for i in range(-WARMUP, 0):
            publish({"i": i}, exchange=exchange, routing_key=key, serializer="json", delivery_mode=2)
        start = time.perf_counter()
        for i in range(n):
            publish({"i": i}, exchange=exchange, routing_key=key, serializer="json", delivery_mode=2)
        return time.perf_counter() - start


def events_one_by_one(url: str, exchange: str, key: str, n: int) -> float:
    events = _events(url, exchange)
    for i in range(-WARMUP, 0):
        events.publish(key, {"i": i})
    start = time.perf_counter()
    for i in range(n):
        events.publish(key, {"i": i})
    return time.perf_counter() - start


def events_batch(url: str, exchange: str, key: str, n: int, batch: int) -> float:
    events = _events(url, exchange)
    events.publish_many([(key, {"i": i}) for i in range(-WARMUP, 0)])
    start = time.perf_counter()
    for first in range(0, n, batch):
        events.publish_many([(key, {"i": i}) for i in range(first, min(n, first + batch))])
    return time.perf_counter() - start


def events_paced(url: str, exchange: str, key: str, n: int, rate: float) -> float:
    """Publish at ``rate`` per second; warm-up messages say ``"warm": true`` and are not timed."""
    events = _events(url, exchange)
    for i in range(LATENCY_WARMUP):
        events.publish(key, {"i": i, "warm": True})
    start = time.perf_counter()
    for i in range(n):
        pause = start + i / rate - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        events.publish(key, {"i": i, "t": time.time()})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["kombu", "events", "batch", "latency"])
    parser.add_argument("url")
    parser.add_argument("exchange")
    parser.add_argument("key")
    parser.add_argument("n", type=int)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=100)
    a = parser.parse_args()
    if a.mode == "kombu":
        seconds = kombu_confirmed(a.url, a.exchange, a.key, a.n)
    elif a.mode == "events":
        seconds = events_one_by_one(a.url, a.exchange, a.key, a.n)
    elif a.mode == "batch":
        seconds = events_batch(a.url, a.exchange, a.key, a.n, a.batch)
    else:
        seconds = events_paced(a.url, a.exchange, a.key, a.n, a.rate)
    print(json.dumps({"seconds": seconds, "n": a.n}))


if __name__ == "__main__":
    main()
