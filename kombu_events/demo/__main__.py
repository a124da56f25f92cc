"""Run the demo: start ``celery worker --with-events-step``, publish events, print what was handled."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from kombu_events.demo import broker

ORDERS = 5
EXPECTED = ORDERS * 2  # each order reaches on_order_created and audit
_print_lock = threading.Lock()


def say(text: str) -> None:
    """Print one whole line (the worker's output and ours come from two threads)."""
    with _print_lock:
        print(text, flush=True)


def main() -> int:
    """Check the broker, start a worker, publish ``ORDERS`` events, wait until all are handled, stop the worker."""
    from kombu_events.demo.app import events

    if not broker.ready(events.broker_url, say):
        return 1  # it said what to do, in one line
    command = [sys.executable, "-m", "celery", "-A", "kombu_events.demo.app", "worker", "--with-events-step",
               "--pool=prefork", "--concurrency=2", "--loglevel=INFO", "--without-mingle",
               "--without-gossip", "--without-heartbeat", "--hostname=demo@%h"]
    say("$ " + " ".join(command[2:]))
    worker = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    handled: list[str] = []
    ready = threading.Event()
    threading.Thread(target=_follow, args=(worker, handled, ready), daemon=True).start()
    try:
        if not ready.wait(60):
            print("worker did not become ready in 60 s", file=sys.stderr)
            return 1
        _publish()
        deadline = time.monotonic() + 60
        while len(handled) < EXPECTED and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.1)
        say(f"\n{len(handled)} of {EXPECTED} deliveries handled (one after a broker-side retry)")
        return 0 if len(handled) >= EXPECTED else 1
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
        _delete_topology()


def _delete_topology() -> None:
    """A demo leaves nothing behind: delete the demo service's queues and exchanges, and its task queue and
    exchange. Celery's remote-control exchange (``celery.pidbox``) stays: every worker on the vhost shares it."""
    from kombu_events.broker.connections import broker_connection
    from kombu_events.demo.app import app, events

    topology = events.topology()
    queues = [queue.name for queue in topology.queues] + [app.conf.task_default_queue]
    exchanges = [exchange.name for exchange in topology.exchanges] + [app.conf.task_default_exchange
                                                                      or app.conf.task_default_queue]
    with broker_connection(events.broker_url, app) as conn:
        channel = conn.channel()
        for queue in queues:
            channel.queue_delete(queue)
        for exchange in exchanges:
            channel.exchange_delete(exchange)
    say(f"deleted the demo's {len(queues)} queues and {len(exchanges)} exchanges")


def _follow(worker: subprocess.Popen[str], handled: list[str], ready: threading.Event) -> None:
    assert worker.stdout is not None, "the worker is started with stdout=PIPE"
    for line in worker.stdout:
        if " ready." in line:
            ready.set()
        if "[demo]" in line or "event outcome=retry" in line or "ERROR" in line or "succeeded in" in line:
            say("worker | " + line.rstrip().split("] ", 1)[-1])
        if "[demo] handled" in line or "[demo] audited" in line:
            handled.append(line)


def _publish() -> None:
    from kombu_events.demo.app import add, events

    for order_id in range(1, ORDERS + 1):
        message_id = events.publish(f"orders.{order_id}.created", {"order_id": order_id})
        say(f"published orders.{order_id}.created ({message_id})")
    say(f"task add(2, 3) sent: {add.delay(2, 3).id}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
