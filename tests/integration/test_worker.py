"""Real `celery worker --with-events-step` subprocesses against the real RabbitMQ.

Every test has its own service and its own events exchange; the ``make_project``
fixture (conftest.py) deletes both, and every queue/exchange of the service, even on failure.
Content types and undecodable bodies are in test_content.py.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from .harness import consumer_prefetch, get_messages, node_message as message, queue_counts, queue_depth, wait_for

pytestmark = pytest.mark.integration


# -- 1. a non-Python publisher ---------------------------------------------------------------

NODE_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("orders.*.created")
def on_created(payload):
    record(handler="on_created", payload=payload)

@events.handler("orders.#", bind=True)
def audit(event):
    record(handler="audit", payload=event.payload, routing_key=event.routing_key, queue=event.queue,
           message_id=event.message_id, correlation_id=event.correlation_id, headers=event.headers,
           attempt=event.attempt, content_type=event.content_type, app_id=event.properties.get("app_id"))
"""


def test_node_publisher_events_reach_the_right_handlers_with_their_properties(make_project):
    project = make_project(NODE_APP)
    project.worker().wait_ready()
    project.node_publish(
        message("orders.42.created", {"order_id": 42}, messageId="m-42", correlationId="c-42",
                appId="node-test", headers={"tenant": "acme", "n": 3}),
        message("orders.42.shipped", {"order_id": 42, "carrier": "ups"}, messageId="m-43"))

    wait_for(lambda: len(project.records()) >= 3, what="3 handler calls")
    time.sleep(0.3)  # nothing more may arrive
    assert [r["payload"] for r in project.records(handler="on_created")] == [{"order_id": 42}]
    audit = sorted(project.records(handler="audit"), key=lambda r: r["message_id"])
    assert len(audit) == 2
    created, shipped = audit
    assert created["payload"] == {"order_id": 42}
    assert created["routing_key"] == "orders.42.created"
    assert created["queue"] == f"{project.service}.audit"
    assert created["message_id"] == "m-42"
    assert created["correlation_id"] == "c-42"
    assert created["headers"] == {"tenant": "acme", "n": 3}
    assert created["attempt"] == 1
    assert created["content_type"] == "application/json"
    assert created["app_id"] == "node-test"
    assert (shipped["routing_key"], shipped["message_id"], shipped["correlation_id"], shipped["attempt"]) == (
        "orders.42.shipped", "m-43", None, 1)
    assert shipped["payload"] == {"order_id": 42, "carrier": "ups"}
    wait_for(lambda: project.settled("on_created", "audit"), timeout=5, what="events acked")


# -- 2. topic wildcards ----------------------------------------------------------------------

WILDCARD_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

def recorder(name):
    def handle(event):
        record(handler=name, routing_key=event.routing_key)
    handle.__name__ = name
    return handle

events.handler("orders.*.created", bind=True)(recorder("star_created"))
events.handler("orders.#", bind=True)(recorder("orders_hash"))
events.handler("#", bind=True)(recorder("everything"))
events.handler("*.x", bind=True)(recorder("star_x"))
"""

KEYS = ["orders.created", "orders.1.created", "orders.1.2.created", "orders", "orders.x", "a.x", "x",
        "a.b.x", "payments.1.created", "orders.1.created.extra"]

# RabbitMQ topic semantics: `*` is exactly one word, `#` zero or more.
EXPECTED = {
    "star_created": ["orders.1.created"],
    "orders_hash": ["orders", "orders.1.2.created", "orders.1.created", "orders.1.created.extra",
                    "orders.created", "orders.x"],
    "everything": sorted(KEYS),
    "star_x": ["a.x", "orders.x"],
}


def test_wildcard_bindings_follow_topic_semantics(make_project):
    project = make_project(WILDCARD_APP)
    project.worker().wait_ready()
    project.node_publish(*(message(key, {"key": key}) for key in KEYS))

    total = sum(len(keys) for keys in EXPECTED.values())
    wait_for(lambda: len(project.records()) >= total, what=f"{total} handler calls")
    time.sleep(0.3)  # nothing more may arrive
    got = {name: sorted(r["routing_key"] for r in project.records(handler=name)) for name in EXPECTED}
    assert got == EXPECTED
    wait_for(lambda: project.settled(*EXPECTED), timeout=5, what="events acked")


# -- 3. fan-out between services, competing consumers within one -----------------------------

SHARED_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("shared.thing")
def thing(payload):
    time.sleep(0.01)
    record(id=payload["id"])
"""

N = 50


def test_two_services_each_get_every_event_two_workers_of_one_service_share_them(make_project):
    billing = make_project(SHARED_APP)
    audit = make_project(SHARED_APP, exchange=billing.exchange)
    workers = [billing.worker().wait_ready(), billing.worker().wait_ready()]
    audit.worker().wait_ready()
    wait_for(lambda: queue_depth(billing.broker_url, f"{billing.service}.thing")[1] == 2, what="2 consumers")
    result = billing.run_python(f"""
        from {billing.module} import events
        events.publish_many([("shared.thing", {{"id": i}}) for i in range({N})])
    """)
    assert result.returncode == 0, result.stderr

    wait_for(lambda: len(billing.records()) >= N and len(audit.records()) >= N, what=f"{N} events each")
    time.sleep(0.3)  # nothing more may arrive
    assert sorted(r["id"] for r in audit.records()) == list(range(N))
    billing_records = billing.records()
    assert sorted(r["id"] for r in billing_records) == list(range(N)), "each event exactly once"
    per_worker = Counter(r["pid"] for r in billing_records)
    assert set(per_worker) == {w.proc.pid for w in workers}, f"both workers take a share: {per_worker}"
    wait_for(lambda: billing.settled("thing") and audit.settled("thing"), timeout=5, what="events acked")


# -- 4. a slow handler does not block tasks --------------------------------------------------

SLOW_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@app.task
def ping():
    record(what="task")

@events.handler("slow.work")
def slow(payload):
    record(what="slow-start")
    time.sleep(5)
    record(what="slow-end")
"""


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_slow_handler_does_not_block_a_task_in_the_same_worker(make_project, pool):
    project = make_project(SLOW_APP)
    project.worker(pool=pool, concurrency=2).wait_ready()
    project.node_publish(message("slow.work", {}))
    wait_for(lambda: project.records(what="slow-start"), what="slow handler started")
    project.send_task("ping")

    wait_for(lambda: project.records(what="task"), timeout=4, what="task run while the handler sleeps")
    assert not project.records(what="slow-end"), "the task waited for the slow handler"
    wait_for(lambda: project.records(what="slow-end"), what="slow handler ended")
    times = {r["what"]: r["time"] for r in project.records()}
    assert times["slow-start"] < times["task"] < times["slow-end"]
    wait_for(lambda: project.settled("slow"), timeout=5, what="event acked")


# -- 5. without the flag, the worker leaves events alone -------------------------------------

PLAIN_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@app.task
def ping():
    record(what="task")

@events.handler("plain.thing")
def thing(payload):
    record(what="event")
"""


def test_worker_without_the_flag_consumes_no_events_but_runs_tasks(make_project):
    project = make_project(PLAIN_APP)
    project.declare()
    worker = project.worker(events=False).wait_ready()
    project.node_publish(*(message("plain.thing", {"i": i}) for i in range(3)))
    project.send_task("ping")

    wait_for(lambda: project.records(what="task"), what="task run")
    time.sleep(0.5)  # time enough for events, had they been consumed
    assert not project.records(what="event")
    assert queue_depth(project.broker_url, f"{project.service}.thing") == (3, 0)
    assert "kombu-events" not in worker.log


# -- 6. unroutable publishing ----------------------------------------------------------------

def test_publishing_an_event_no_queue_binds_raises_unroutable_error(make_project):
    project = make_project(PLAIN_APP)
    project.declare()
    result = project.run_python(f"""
        from kombu_events import UnroutableError
        from {project.module} import events
        try:
            events.publish("nobody.listens", {{"x": 1}})
        except UnroutableError as exc:
            print("UNROUTABLE", exc.exchange, exc.routing_key, "|", exc)
        else:
            print("PUBLISHED")
        try:
            events.publish_many([("plain.thing", {{"x": 2}}), ("nobody.either", {{"x": 3}})])
        except UnroutableError as exc:
            print("BATCH-UNROUTABLE", exc.routing_key)
        print("ROUTED", events.publish("plain.thing", {{"x": 4}}))
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"UNROUTABLE {project.exchange} nobody.listens |"), result.stdout
    assert "not routed to any queue" in lines[0]
    assert lines[1] == "BATCH-UNROUTABLE nobody.either", result.stdout
    assert lines[2].startswith("ROUTED "), result.stdout
    # The routable one of the batch and the last publish arrived; the publisher survived the returns.
    assert queue_depth(project.broker_url, f"{project.service}.thing") == (2, 0)


def test_publish_to_a_missing_exchange_is_a_clear_publish_error(make_project):
    project = make_project(PLAIN_APP)  # nothing declared: the per-test exchange does not exist
    result = project.run_python(f"""
        from kombu_events import BrokerUnavailableError, PublishError
        from {project.module} import events
        try:
            events.publish("plain.thing", {{"x": 1}})
        except BrokerUnavailableError as exc:
            print("WRONG", exc)
        except PublishError as exc:
            print("PUBLISH-ERROR", exc)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("PUBLISH-ERROR NOT_FOUND - no exchange"), result.stdout
    assert "kombu-events declare" in result.stdout


# -- 7. the same flow in every pool ----------------------------------------------------------

FLOW_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=8,
                max_retries=2, backoff=Constant(every_ms=200))

@events.handler("flow.ok")
def ok(payload):
    record(handler="ok", id=payload["id"])

@events.handler("flow.flaky", bind=True)
def flaky(event):
    record(handler="flaky", id=event.payload["id"], attempt=event.attempt, routing_key=event.routing_key)
    if event.attempt == 1:
        raise RuntimeError("first attempt fails")

@events.handler("flow.refused")
def refused(payload):
    raise Archive("refused %d" % payload["id"])
"""


@pytest.mark.parametrize("pool", ["solo", "prefork", "threads"])
def test_event_flow_is_the_same_in_every_pool(make_project, pool):
    project = make_project(FLOW_APP)
    project.worker(pool=pool, concurrency=2).wait_ready()
    project.node_publish(*(message("flow.ok", {"id": i}) for i in range(10)),
                         *(message("flow.flaky", {"id": i}) for i in range(3)),
                         *(message("flow.refused", {"id": i}) for i in range(2)))

    wait_for(lambda: len(project.records(handler="ok")) >= 10
             and len(project.records(handler="flaky")) >= 6, what="ok and flaky events handled")
    archive = f"{project.service}.archive"
    wait_for(lambda: queue_depth(project.broker_url, archive)[0] >= 2, what="2 archived")
    time.sleep(0.2 + 0.5)  # a third flaky attempt or a retried refused event would follow the 200 ms backoff
    assert sorted(r["id"] for r in project.records(handler="ok")) == list(range(10))
    flaky = sorted((r["id"], r["attempt"], r["routing_key"]) for r in project.records(handler="flaky"))
    assert flaky == [(i, attempt, "flow.flaky") for i in range(3) for attempt in (1, 2)]
    reasons = sorted(m.headers["kombu-events-reason"] for m in get_messages(project.broker_url, archive))
    assert reasons == ["refused 0", "refused 1"]
    # Acks go out at once: no stall in the event loop (DESIGN.md section 7, solo pool).
    wait_for(lambda: project.settled("ok", "flaky", "refused"), timeout=3, what="events acked")


# -- 8. configuration errors at start-up -----------------------------------------------------

BAD_CONFIGS = {
    "max_retries": ("events = Events(app, service=SERVICE, exchange=EXCHANGE, max_retries=-1)\n",
                    ["max_retries", "0 .. 10000", "-1"]),
    "delay_levels": ("events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_levels=40)\n",
                     ["delay_levels", "1 .. 32", "40"]),
    "backoff": (("events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=4,\n"
                 "                backoff=Exponential(max_delay_ms=60000))\n"),
                ["max_delay_ms", "1500 ms", "delay_levels"]),
    "handler_max_retries": (("events = Events(app, service=SERVICE, exchange=EXCHANGE)\n"
                             "@events.handler('a.b', max_retries=-2, name='h2')\n"
                             "def h2(payload): pass\n"),
                            ["max_retries of handler 'h2'", "0 .. 10000", "-2"]),
    "queue_wildcard": (("events = Events(app, service=SERVICE, exchange=EXCHANGE)\n"
                        "@events.handler('a.b', queue=SERVICE + '.bad*queue')\n"
                        "def h3(payload): pass\n"),
                       ["queue=", "bad*queue", "wildcard"]),
    "quorum_events_classic_tasks": ("events = Events(app, service=SERVICE, exchange=EXCHANGE, queue_type='quorum')\n",
                                    ["use quorum queues", "classic task queue", "task_default_queue_type = 'quorum'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_configuration_error_stops_the_worker_at_start_up(make_project, case):
    body, expected = BAD_CONFIGS[case]
    body += "@events.handler('a.c')\ndef h(payload): pass\n"
    project = make_project(body)
    worker = project.worker()
    code = worker.wait_exit(timeout=30)
    log = worker.log
    assert code != 0, log
    assert " ready." not in log
    for text in expected:
        assert text in log, f"{text!r} not in log:\n{log[-3000:]}"


# -- 9. broker passwords never logged -------------------------------------------------------

SECRET_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=8,
                max_retries=1, backoff=Constant(every_ms=100))
elsewhere = Events(app, service=SERVICE + ".elsewhere", exchange=EXCHANGE,
                   broker="amqp://guest:guest@127.0.0.1:1//")

@events.handler("secret.fail")
def fail(payload):
    raise RuntimeError("always")

@events.handler("secret.forward", max_retries=0)
def forward(payload):
    elsewhere.publish("secret.forwarded", payload)  # that broker is down: BrokerUnavailableError

@events.handler("secret.ok")
def ok(payload):
    record(handler="ok")
"""


def test_broker_password_never_appears_in_the_worker_log(make_project, broker_url):
    assert ":guest@" in broker_url
    project = make_project(SECRET_APP)
    # prefork: pool processes log too, and a warm stop takes seconds instead of solo's ~10.
    worker = project.worker("--loglevel=DEBUG", pool="prefork", concurrency=2).wait_ready()
    project.node_publish(message("secret.fail", {}), message("secret.forward", {}), message("secret.ok", {}))

    archive = f"{project.service}.archive"
    wait_for(lambda: queue_depth(project.broker_url, archive)[0] >= 2, what="2 archived")
    wait_for(lambda: project.records(handler="ok"), what="ok handled")
    reasons = [m.headers["kombu-events-reason"] for m in get_messages(project.broker_url, archive)]
    assert any("127.0.0.1:1" in reason for reason in reasons), reasons  # the URL is there, masked
    worker.stop()  # warm shutdown: its log lines count too
    log = worker.log
    assert "guest:**@" in log  # URLs are logged, sanitised
    assert ":guest@" not in log
    for reason in reasons:
        assert ":guest@" not in reason


# -- 10. restarts: events in flight or prefetched are not lost, not charged an attempt ---------

RESTART_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=8, max_retries=0)

@events.handler("restart.work")
def work(payload):
    record(what="start", id=payload["id"])
    time.sleep(payload["sleep"])
    record(what="end", id=payload["id"])
"""


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_warm_shutdown_acks_the_handlers_it_lets_finish(make_project, pool):
    """Thread pools complete off the loop thread: their results must still be settled after it stops."""
    project = make_project(RESTART_APP)
    worker = project.worker(pool=pool, concurrency=2).wait_ready()
    project.node_publish(message("restart.work", {"id": 0, "sleep": 1.0}),
                         message("restart.work", {"id": 1, "sleep": 2.0}))
    wait_for(lambda: len(project.records(what="start")) == 2, what="both handlers started")
    worker.stop(timeout=30)

    assert sorted(r["id"] for r in project.records(what="end")) == [0, 1], "warm shutdown waits for handlers"
    assert queue_counts(project.broker_url)[f"{project.service}.work"][:2] == (0, 0), \
        "a handler that finished during warm shutdown was not acked: it will run again"


def test_events_prefetched_by_a_killed_worker_are_handled_by_the_next(make_project):
    """A redelivery is not an attempt: with max_retries=0, prefetched events must still run."""
    project = make_project(RESTART_APP)
    first = project.worker().wait_ready()
    project.node_publish(*(message("restart.work", {"id": i, "sleep": 0.2}) for i in range(20)))
    wait_for(lambda: project.records(what="start"), what="first handler started")
    first.kill()
    started = {r["id"] for r in project.records(what="start")}
    project.worker().wait_ready()
    wait_for(lambda: project.settled("work"), timeout=15, what="queue drained")

    archived = [json.loads(m.body)["id"] for m in get_messages(project.broker_url, f"{project.service}.archive")]
    assert set(archived) <= started, f"archived without ever being handled: {sorted(set(archived) - started)}"
    handled = {r["id"] for r in project.records(what="end")}
    assert handled | set(archived) == set(range(20))


# -- 11. prefetch: many handler queues share 500 in flight unless prefetch_count is set -------

MANY_QUEUES_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, **SETTINGS)

def handle(payload):
    record(payload=payload)

for k in range(60):
    events.handler(f"many.{k}", name=f"h{k}")(handle)
events.handler("few.one", name="own", prefetch=3)(handle)
"""


@pytest.mark.parametrize("settings, expected, own", [
    ({"max_body_bytes": 65_536}, 10, 3),  # bodies of 64 KiB: the in-flight budget (256 MiB) allows more
    ({"prefetch_count": 100, "inflight_max_bytes": 0}, 100, 3),  # no budget
    ({}, 1, 1),  # bodies of 16 MiB: 61 queues share 256 MiB, one body each
])
def test_each_of_many_handler_queues_is_consumed_with_its_share_of_the_prefetch(make_project, settings, expected,
                                                                               own):
    project = make_project(MANY_QUEUES_APP.replace("**SETTINGS", f"**{settings!r}"))
    project.worker().wait_ready()

    def consumers():
        found = consumer_prefetch(project.broker_url)
        mine = {q: p for q, p in found.items() if q.startswith(project.service + ".")}
        mine.pop(f"{project.service}.tasks", None)  # Celery's task queue of this test (see HEADER)
        return mine if len(mine) == 61 else None

    mine = wait_for(consumers, what="61 consumers")
    assert mine.pop(f"{project.service}.own") == [own]
    assert set(mine) == {f"{project.service}.h{k}" for k in range(60)}
    assert {q: p for q, p in mine.items() if p != [expected]} == {}
    project.node_publish(message("many.59", {"i": 1}), message("few.one", {"i": 2}))
    wait_for(lambda: len(project.records()) == 2, what="both events handled")
