"""Logs of events (``events.log(...)``, docs/logs.md) on the real broker: the stream is declared with its
retention, keeps every event of its keys in publish order whoever published it (Python and the Node.js
publisher), drops its oldest segments past ``max_bytes``, is shown by ``log status --json`` (valid against its
schema), and a worker declares it, starts, and never consumes it."""
from __future__ import annotations

import json
import re
import time

import amqp
import pytest
from kombu import Connection

from kombu_events.broker import streams
from kombu_events.broker.streams import read

from .harness import Project, management_queue, node_message, run_cli, unique, wait_for
from .json_schemas import one_document
from .test_asyncapi import check, node  # noqa: F401  (node: the fixture of the AsyncAPI parser)

pytestmark = pytest.mark.integration

APP = """
from datetime import timedelta

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=2)

@events.handler("orders.*.created")
def created(payload):
    record(handler="created", payload=payload)

events.log("orders.#", "payments.*", keep=timedelta(days=90))
events.log("audit.#", keep=timedelta(hours=36), max_bytes=10_000_000, name="audit")
"""


def cli(project: Project, *args: str, code: int = 0):
    result = run_cli(project, *args)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, f"exit {result.returncode} for {args}:\n{result.stdout}{result.stderr}"
    return result


def stream(project: Project, name: str) -> list[tuple[int, str, object, object]]:
    """(offset, routing key, payload, timestamp property) of every message of the log's stream, in order."""
    with Connection(project.broker_url) as conn:
        conn.connect()
        return [(offset, message.delivery_info["routing_key"], json.loads(message.body),
                 message.properties.get("timestamp"))
                for offset, message in read(conn.connection, f"{project.service}.log.{name}", tail_wait_s=5.0)]


def publish(project: Project, *events: tuple[str, dict]) -> None:
    """Publish ``events`` with the project's own ``events.publish`` (confirmed), in order."""
    result = project.run_python(f"""
        from {project.module} import events
        for key, payload in {list(events)!r}:
            events.publish(key, payload)
    """)
    assert result.returncode == 0, result.stderr


def arguments(project: Project, queue: str) -> dict:
    return wait_for(lambda: management_queue(project.broker_url, queue).get("arguments"), what=f"{queue} listed")


def test_a_log_keeps_every_event_of_its_keys_in_publish_order_whoever_published_it(make_project):
    project = make_project(APP)
    s = project.service
    plan = one_document("declare-dry-run", cli(project, "declare", "--dry-run", "--json").stdout)
    assert {q["name"]: q["role"] for q in plan["queues"] if q["role"] == "log"} == {
        f"{s}.log.orders": "log", f"{s}.log.audit": "log"}
    cli(project, "declare")
    assert arguments(project, f"{s}.log.orders") == {
        "x-queue-type": "stream", "x-max-age": "90D", "x-stream-max-segment-size-bytes": 16 * 2**20}
    assert arguments(project, f"{s}.log.audit") == {
        "x-queue-type": "stream", "x-max-age": "36h", "x-max-length-bytes": 10_000_000,
        "x-stream-max-segment-size-bytes": 2_500_000}
    empty = one_document("log-status", cli(project, "log", "status", "--json").stdout)
    assert [(r["name"], r["exists"], r["messages"], r["first"], r["last"]) for r in empty] == [
        ("orders", True, 0, None, None), ("audit", True, 0, None, None)]

    publish(project, ("orders.1.created", {"n": 1}), ("payments.2", {"n": 2}), ("orders.3.shipped", {"n": 3}))
    project.node_publish(node_message("orders.4.created", {"n": 4}), node_message("payments.5", {"n": 5}),
                         node_message("payments.6.refunded", {"n": 6}),  # payments.*: one word only
                         node_message("invoices.9", {"n": 9}))  # no log, no handler: the log takes only its keys
    publish(project, ("audit.x", {"n": 7}), ("orders.8", {"n": 8}))
    project.node_publish(node_message("orders.10.paid", {"n": 10}))

    orders = stream(project, "orders")
    assert [(offset, key, payload["n"]) for offset, key, payload, _ in orders] == [
        (0, "orders.1.created", 1), (1, "payments.2", 2), (2, "orders.3.shipped", 3), (3, "orders.4.created", 4),
        (4, "payments.5", 5), (5, "orders.8", 8), (6, "orders.10.paid", 10)]
    assert orders[0][3] is not None and orders[3][3] is None, "kombu-events sets a timestamp, this Node one none"
    assert [(key, payload) for _, key, payload, _ in stream(project, "audit")] == [("audit.x", {"n": 7})]

    rows = one_document("log-status", cli(project, "log", "status", "--json").stdout)
    by_name = {r["name"]: r for r in rows}
    orders_row = by_name["orders"]
    assert (orders_row["queue"], orders_row["binding_keys"], orders_row["max_age"], orders_row["max_bytes"]) == (
        f"{s}.log.orders", ["orders.#", "payments.*"], "90D", None)
    assert (orders_row["messages"], orders_row["first"]["offset"], orders_row["last"]["offset"]) == (7, 0, 6)
    assert orders_row["first"]["timestamp"].endswith("+00:00") and orders_row["last"]["timestamp"] is None
    assert (by_name["audit"]["messages"], by_name["audit"]["max_bytes"]) == (1, 10_000_000)

    text = cli(project, "log", "status").stdout
    assert f"log orders: stream {s}.log.orders, keys orders.#, payments.*" in text
    assert "messages: 7" in text and "last: offset 6, at unknown time (no timestamp property)" in text
    assert "retention: max-age 36h and max 10000000 bytes" in text


def test_retention_by_size_drops_the_oldest_segments(make_project):
    """max_bytes of 2 MiB makes segments of 1 MiB: 4 MiB of events leave the newest, and the first offset moves.

    Each event is confirmed before the next is sent, so each is a chunk of its own and a segment ends near 1 MiB: a
    burst (``publish_many``) may write one chunk past max_bytes, and retention then leaves none (docs/logs.md)."""
    project = make_project("""
        events = Events(app, service=SERVICE, exchange=EXCHANGE)
        events.log("bulk.#", max_bytes=2 * 2**20)
    """)
    cli(project, "declare")
    assert arguments(project, f"{project.service}.log.bulk")["x-stream-max-segment-size-bytes"] == 2**20
    result = project.run_python(f"""
        from {project.module} import events
        for n in range(64):
            events.publish("bulk.%d" % n, {{"n": n, "pad": "x" * 65536}})
    """)
    assert result.returncode == 0, result.stderr
    kept = stream(project, "bulk")
    numbers = [payload["n"] for _, _, payload, _ in kept]
    assert numbers and numbers[0] > 0, "the oldest are gone, the newest kept"
    assert numbers == list(range(numbers[0], 64)), "the rest in order"
    assert len(kept) * 65536 <= 3 * 2**20, "at most max_bytes and the segment being written"
    # The broker numbers a record of its own at the start of a segment: offsets may run ahead of the events.
    assert all(offset >= n for offset, _, payload, _ in kept for n in [payload["n"]])
    [row] = one_document("log-status", cli(project, "log", "status", "--json").stdout)
    assert (row["first"]["offset"], row["last"]["offset"]) == (kept[0][0], kept[-1][0])
    assert row["messages"] == kept[-1][0] - kept[0][0] + 1 >= len(kept)


@pytest.fixture
def stream_queue(broker_url):
    """A stream of a unique name on the broker, deleted afterwards."""
    name = unique("readstream")
    with Connection(broker_url) as conn:
        conn.connect()
        channel = conn.connection.channel()
        channel.queue_declare(name, durable=True, auto_delete=False, arguments={"x-queue-type": "stream"})
        yield conn.connection, channel, name
        channel.queue_delete(name)


def found_at_first(monkeypatch, offset: int) -> list[int | None]:
    """The read's first look for the last chunk finds ``offset``; later looks ask the broker (returned: each)."""
    looks: list[int | None] = []
    real = streams.last_chunk_offset

    def last_chunk_offset(*args, **kwargs):
        looks.append(offset if not looks else real(*args, **kwargs))
        return looks[-1]
    monkeypatch.setattr(streams, "last_chunk_offset", last_chunk_offset)
    return looks


def test_a_read_whose_records_retention_removed_meanwhile_ends_instead_of_stalling(stream_queue, monkeypatch):
    """Retention can empty a stream between the read finding its end and reaching it (a burst's chunk past
    max_bytes): the stream here holds nothing, as if its records up to offset 7 had gone."""
    connection, _, name = stream_queue
    looks = found_at_first(monkeypatch, 7)
    began = time.monotonic()
    assert list(streams.read(connection, name, stall_s=60.0)) == []
    took = time.monotonic() - began
    assert looks == [7, None, None] and took < 40, f"it asked again twice and ended, before stall_s ({took:.1f} s)"


def test_a_read_that_must_see_every_record_waits_for_its_end_even_when_the_stream_looks_emptied(stream_queue,
                                                                                                   monkeypatch):
    """``end_if_emptied=False`` (a rewrite's copy, which deletes its source after): never taken for the end."""
    connection, _, name = stream_queue
    looks = found_at_first(monkeypatch, 7)
    with pytest.raises(streams.StreamStalledError, match=r"sent nothing for 3 s before its end \(offset 7\)"):
        list(streams.read(connection, name, stall_s=3.0, end_if_emptied=False))
    assert looks == [7], "it never asked again"


def test_a_read_with_records_left_before_its_end_still_stalls(stream_queue, monkeypatch):
    """The look again never ends a read early: with records in the stream, waiting for an end that never comes
    raises after stall_s."""
    connection, channel, name = stream_queue
    channel.confirm_select()
    for n in range(3):
        channel.basic_publish(amqp.Message(json.dumps({"n": n})), exchange="", routing_key=name)
    looks = found_at_first(monkeypatch, 10**9)
    got: list[int] = []
    with pytest.raises(streams.StreamStalledError, match=r"sent nothing for 3 s before its end \(offset 1000000000\)"):
        for offset, _ in streams.read(connection, name, stall_s=3.0):
            got.append(offset)
    assert got == [0, 1, 2] and looks[0] == 10**9
    assert looks[1:] and set(looks[1:]) <= {0, 1, 2}, "each look again found the last chunk (one or three)"


def test_a_worker_declares_a_log_starts_and_never_consumes_it(make_project, node, tmp_path):  # noqa: F811
    project = make_project(APP)
    s = project.service
    worker = project.worker().wait_ready()
    assert arguments(project, f"{s}.log.orders")["x-max-age"] == "90D", "the worker declared the stream"
    publish(project, ("orders.1.created", {"n": 1}))
    wait_for(lambda: project.records(handler="created"), what="the handler ran")
    assert [payload for _, _, payload, _ in stream(project, "orders")] == [{"n": 1}]
    assert _consumers(project, f"{s}.log.orders") == 0, "no worker consumes a log"

    healthy = one_document("health", cli(project, "health", "--json").stdout)
    assert healthy["healthy"] is True, healthy["problems"]
    rows = one_document("status", cli(project, "status", "--json").stdout)
    assert {r["queue"]: (r["role"], r["state"]) for r in rows if r["role"] == "log"} == {
        f"{s}.log.orders": ("log", None), f"{s}.log.audit": ("log", None)}
    granted = one_document("permissions", cli(project, "permissions", "--json").stdout)
    assert re.fullmatch(granted["runtime"]["read"], f"{s}.log.orders")
    assert not re.fullmatch(granted["runtime"]["write"], f"{s}.log.orders")

    worker.kill()
    wait_for(lambda: _consumers(project, f"{s}.created") == 0, what="the worker gone")
    plan = one_document("migrate", cli(project, "migrate", "--to", "quorum", "--dry-run", "--json").stdout)
    assert not [q for q in plan["queues"] if ".log." in q["queue"]], "migrate leaves the logs' streams alone"

    document = cli(project, "asyncapi", "--format", "json").stdout
    assert json.loads(document)["channels"][f"{s}.log.orders"]["x-kombu-events-log"]["maxAge"] == "90D"
    diagnostics = check(node, text=document)
    assert {d["code"] for d in diagnostics} <= {"asyncapi-latest-version"}, diagnostics


def _consumers(project: Project, queue: str) -> int:
    with Connection(project.broker_url) as conn:
        return conn.default_channel.queue_declare(queue, passive=True)[2]


def test_log_status_without_a_broker_exits_1_with_nothing_on_stdout(make_project):
    project = make_project(APP)
    started = time.monotonic()
    result = cli(project, "--broker", "amqp://guest:guest@127.0.0.1:1//", "log", "status", "--json", code=1)
    assert result.stdout == "" and result.stderr.startswith("Error: cannot reach the broker at amqp://guest:**@")
    assert time.monotonic() - started < 60


def test_a_changed_retention_is_refused_with_what_a_log_can_do(make_project):
    """The stream keeps the retention it was made with: declaring the log again with another one exits 1 and says
    to rename the log or delete its stream (a queue's fix, migrate --to quorum, moves no log)."""
    project = make_project(APP)
    cli(project, "declare")
    changed = make_project(APP.replace("keep=timedelta(days=90)", "keep=timedelta(days=30)"),
                           service=project.service, exchange=project.exchange)
    result = cli(changed, "declare", code=1)
    assert f"{project.service}.log.orders" in result.stderr and "x-max-age" in result.stderr
    assert "new `name=`" in result.stderr and "migrate" not in result.stderr
