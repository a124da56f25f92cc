"""Chunked reads (broker/chunked_reads.py) against the real RabbitMQ, on kombu's hub and in `celery worker`.

Two ways it could go wrong, each tested: a read that leaves whole frames in py-amqp's buffer
stalls (bytes there are invisible to epoll, and the broker may send nothing more); a
synchronous call that read past its reply would hand ``basic.consume-ok``'s deliveries over
before py-amqp registered the consumer's callback, and py-amqp would reject them (redelivered).
"""
from __future__ import annotations

import json
import select
import time

import amqp
import pytest
from amqp import spec
from kombu import Connection
from kombu.asynchronous import Hub

from kombu_events.broker.chunked_reads import install

from .harness import unique, wait_for

pytestmark = pytest.mark.integration

HANDLERS = ("alpha", "beta", "gamma")

APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

def recorder(name):
    def handle(event):
        record(handler=name, n=event.payload["n"])
    handle.__name__ = name
    return handle

for name in ("alpha", "beta", "gamma"):
    events.handler(name + ".x", bind=True)(recorder(name))

@app.task
def ping():
    record(task="ping")
"""


def test_the_hubs_reader_hands_over_every_frame_of_a_read_and_a_synchronous_call_reads_only_its_reply(broker_url):
    """On kombu's hub: ``basic.qos-ok`` and five deliveries behind it wait on the socket together.

    The synchronous call reads up to its reply and no further, so the deliveries stay where
    epoll sees them; the hub's reader then takes them in one read and must hand over all five
    at once, since the broker sends nothing more (a reader that left frames in the buffer stalls).
    """
    queue, hub, got = unique("chunked"), Hub(), []
    with Connection(broker_url) as conn:
        conn.connect()
        raw = conn.connection
        setup = raw.channel()
        setup.queue_declare(queue)
        try:
            for n in range(5):
                setup.basic_publish(amqp.Message(b"event %d" % n), routing_key=queue)
            wait_for(lambda: setup.queue_declare(queue, passive=True).message_count == 5, what="5 messages")
            assert install(conn, hub)
            channel = raw.channel()
            channel.send_method(spec.Basic.Qos, "lBb", (0, 10, False))  # its reply is read below, late
            channel.basic_consume(queue, consumer_tag="chunked", nowait=True, callback=got.append)
            time.sleep(0.5)  # the reply and the deliveries behind it wait on the socket
            channel.wait(spec.Basic.QosOk, timeout=5)
            assert got == [] and raw.transport._read_buffer == b""
            assert select.select([raw.sock], [], [], 0)[0] == [raw.sock]  # left on the socket, for epoll
            conn.transport.register_with_event_loop(raw, hub)  # as Celery does: kombu adds its reader
            loop, deadline = hub.create_loop(), time.monotonic() + 3
            while len(got) < 5 and time.monotonic() < deadline:
                next(loop)
            assert [m.body for m in got] == [b"event %d" % n for n in range(5)]
            assert not any(m.delivery_info["redelivered"] for m in got)
            channel.close()  # the deliveries go back to the queue, deleted below
        finally:
            setup.queue_delete(queue)
            hub.close()


def _publish(project, count: int, first: int = 0) -> None:
    """``count`` events to each handler, mandatory and confirmed, on one connection (one each took 214 s for
    1,800 on RabbitMQ 4.0, whose connections open slower)."""
    with Connection(project.broker_url) as conn:
        channel = conn.channel()
        channel.confirm_select()
        for n in range(first, first + count):
            for name in HANDLERS:
                channel.basic_publish(amqp.Message(json.dumps({"n": n}).encode(), content_type="application/json",
                                                   message_id=f"{name}-{n}"),
                                      exchange=project.exchange, routing_key=f"{name}.x", mandatory=True)
        channel.close()


def _handled(project) -> set[tuple[str, int]]:
    return {(r["handler"], r["n"]) for r in project.records() if "handler" in r}


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_a_backlog_read_with_the_consumers_replies_is_handled_without_more_bytes(make_project, pool):
    """Deliveries that came in with a ``basic.consume-ok``, and nothing after them, are handled at once."""
    project = make_project(APP)
    project.declare()
    _publish(project, 5)
    worker = project.worker(pool=pool).wait_ready()
    wanted = {(name, n) for name in HANDLERS for n in range(5)}
    wait_for(lambda: _handled(project) >= wanted, timeout=15, what="the 15 events waiting before the worker started")
    wait_for(lambda: project.settled(*HANDLERS), timeout=10, what="every event acked")
    assert "having no callbacks" not in worker.log  # py-amqp rejects a delivery read before its consumer is


def test_a_stream_of_events_and_tasks_on_the_same_connection_are_all_handled_once(make_project):
    """Many frames a read: every event is handled once and acked, and Celery's tasks on the same socket still run."""
    project = make_project(APP)
    project.declare()
    worker = project.worker().wait_ready()
    _publish(project, 300)
    project.send_task("ping")
    _publish(project, 300, first=300)
    wanted = {(name, n) for name in HANDLERS for n in range(600)}
    wait_for(lambda: _handled(project) >= wanted and project.records(task="ping"), timeout=60,
             what="1,800 events and a task")
    wait_for(lambda: project.settled(*HANDLERS), timeout=10, what="every event acked")
    calls = [(r["handler"], r["n"]) for r in project.records() if "handler" in r]
    assert len(calls) == len(wanted)  # none twice: nothing was redelivered
    assert "could not dispatch frames" not in worker.log
