"""Prometheus metrics and /healthz of a real prefork worker started with --events-metrics-port: a fake scrape is an
HTTP GET."""
from __future__ import annotations

import socket

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .harness import http_get, wait_for

pytestmark = pytest.mark.integration

BODY = """
from kombu_events import CircuitBreaker, Constant, Middleware

class Blocker(Middleware):
    def received(self, delivery):
        if delivery.routing_key == "block.loop":
            time.sleep(4)  # on the worker's event loop: nothing else turns meanwhile

app.conf.kombu_events_metrics_liveness_s = 2
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=10, max_retries=1, middleware=[Blocker()])

@events.handler("ok.#")
def ok(payload):
    pass

@events.handler("bad.#", backoff=Constant(every_ms=10))
def bad(payload):
    raise ValueError("nope")

@events.handler("block.#")
def block(payload):
    pass

@events.handler("flaky.#", circuit_breaker=CircuitBreaker(max_failures=2, window_s=30, reset_s=300))
def flaky(payload):
    raise RuntimeError("its dependency is down")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])



def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    status, text = http_get(port, "/metrics")
    assert status == 200, text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float | None:
    if "action" in labels:  # kombu_events_messages: the deprecated outcome label carries the same value
        labels["outcome"] = labels["action"]
    return samples.get((name, frozenset(labels.items())))


def publish(project, *batches: tuple[str, int]) -> None:
    code = f"from {project.module} import events\n"
    for key, n in batches:
        code += f"events.publish_many([({key!r}, {{'i': i}}) for i in range({n})])\n"
    result = project.run_python(code)
    assert result.returncode == 0, result.stderr


def test_a_prefork_worker_counts_every_message_exactly_and_answers_healthz_while_its_loop_turns(make_project):
    project = make_project(BODY)
    port = free_port()
    worker = project.worker("--events-metrics-port", str(port), pool="prefork", concurrency=2).wait_ready()
    wait_for(lambda: http_get(port, "/healthz")[0] == 200, timeout=15, what="/healthz 200")
    s = project.service

    publish(project, ("ok.created", 1000), ("bad.created", 7))

    def done():
        m = scrape(port)
        return (sample(m, "kombu_events_messages_total", service=s, queue=f"{s}.ok", handler="ok", action="ack")
                == 1000 and sample(m, "kombu_events_messages_total", service=s, queue=f"{s}.bad", handler="bad",
                                   action="archive") == 7) and m
    m = wait_for(done, timeout=60, interval=0.3, what="1000 acks and 7 archived")

    def count(queue: str, action: str) -> float | None:
        return sample(m, "kombu_events_messages_total", service=s, queue=f"{s}.{queue}", handler=queue,
                      action=action)

    assert [count("ok", a) for a in ("ack", "retry", "requeue", "archive", "held")] == [1000, 0, 0, 0, 0]
    assert [count("bad", a) for a in ("ack", "retry", "requeue", "archive", "held")] == [0, 7, 0, 7, 0]
    bad = {"service": s, "queue": f"{s}.bad", "handler": "bad"}
    assert sample(m, "kombu_events_handler_exceptions_total", exception_type="builtins.ValueError", **bad) == 14
    ok = {"service": s, "queue": f"{s}.ok", "handler": "ok"}
    assert sample(m, "kombu_events_handler_duration_seconds_count", **ok) == 1000
    assert sample(m, "kombu_events_in_flight", **ok) == 0
    assert sample(m, "kombu_events_circuit_state", state="closed", **ok) == 1

    # Depths are read by a timer on the event loop (every 15 s), never by the scrape.
    m = wait_for(lambda: (lambda m: sample(m, "kombu_events_archive_depth", service=s) == 7 and m)(scrape(port)),
                 timeout=25, interval=0.5, what="the archive depth gauge at 7")
    assert sample(m, "kombu_events_queue_depth", **ok) == 0
    assert sum(v for (name, labels), v in m.items()
               if name == "kombu_events_ladder_depth" and ("service", s) in labels) == 0

    # The breaker of another handler trips: the gauge follows the circuit_changed signal.
    flaky = {"service": s, "queue": f"{s}.flaky", "handler": "flaky"}
    assert sample(m, "kombu_events_circuit_state", state="closed", **flaky) == 1
    publish(project, ("flaky.x", 3))
    m = wait_for(lambda: (lambda m: sample(m, "kombu_events_circuit_state", state="open", **flaky) == 1 and m)(
        scrape(port)), timeout=15, interval=0.3, what="the flaky handler's circuit open")
    assert [sample(m, "kombu_events_circuit_state", state=st, **flaky) for st in ("closed", "half_open")] == [0, 0]

    # A hook that blocks the event loop for 4 s: /healthz fails after 2 s, then recovers.
    publish(project, ("block.loop", 1))
    _status, text = wait_for(lambda: (lambda r: r[0] == 503 and r)(http_get(port, "/healthz")), timeout=10,
                            interval=0.2, what="/healthz 503 while the loop is blocked")
    assert "stalled: the event loop last turned" in text
    wait_for(lambda: http_get(port, "/healthz")[0] == 200, timeout=10, interval=0.2, what="/healthz 200 again")
    worker.stop()
    assert http_get(port, "/healthz")[0] == 0, "the endpoint closes with the worker"


RELAY = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("relay.#")
def relay(payload):
    events.publish("sink.x", payload)  # in a pool process

@events.handler("sink.#")
def sink(payload):
    pass
"""


def test_with_prometheus_multiproc_dir_events_published_by_pool_processes_are_counted(make_project, tmp_path,
                                                                                       monkeypatch):
    directory = tmp_path / "prom"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    project = make_project(RELAY)
    port = free_port()
    worker = project.worker("--events-metrics-port", str(port), pool="prefork", concurrency=2).wait_ready()
    s = project.service
    publish(project, ("relay.x", 20))

    def done():
        m = scrape(port)
        return (sample(m, "kombu_events_messages_total", service=s, queue=f"{s}.sink", handler="sink",
                       action="ack") == 20 and m)
    m = wait_for(done, timeout=30, interval=0.3, what="20 relayed events acked")
    assert sample(m, "kombu_events_messages_total", service=s, queue=f"{s}.relay", handler="relay",
                  action="ack") == 20
    assert sample(m, "kombu_events_published_total", exchange=project.exchange, status="ok") == 20, \
        "counted in the pool processes, summed from their files"
    in_flight = [labels for (name, labels), _v in m.items() if name == "kombu_events_in_flight"]
    assert in_flight and all(dict(labels).keys() == {"service", "queue", "handler"} for labels in in_flight), \
        "the worker's own counts come from its main process's memory: no pid label"
    assert {p.name.split("_")[0] for p in directory.iterdir()} == {"counter"}, "only publishes go to files"
    worker.stop()
