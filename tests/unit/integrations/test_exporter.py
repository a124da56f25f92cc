"""integrations/exporter.py: the WSGI app behind /metrics and /healthz (called directly: no socket),
multiprocess mode, wiring.
"""
from __future__ import annotations

import logging
import os

import celery
import pytest
from prometheus_client import CollectorRegistry, values
from prometheus_client.parser import text_string_to_metric_families

from kombu_events import Events
from kombu_events.core.config import MetricsSettings
from kombu_events.core.decision import OK, Outcome
from kombu_events.core.delivery import Delivery
from kombu_events.core.settlement import ACK
from kombu_events.errors import ConfigurationError
from kombu_events.integrations import exporter
from kombu_events.integrations.liveness import Liveness
from kombu_events.integrations.metrics import PrometheusMetrics
from kombu_events.testing.stub import StubEvents
from kombu_events.worker import bootstep


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def get(app, path: str) -> tuple[str, dict[str, str], bytes]:
    """One GET through the WSGI app: (status, headers, body)."""
    seen: dict = {}

    def start_response(status, headers, exc_info=None):
        seen["status"], seen["headers"] = status, dict(headers)

    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": "", "wsgi.url_scheme": "http",
               "SERVER_NAME": "test", "SERVER_PORT": "80"}
    body = b"".join(app(environ, start_response))
    return seen["status"], seen["headers"], body


def samples(body: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


@pytest.fixture
def events():
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, service="billing")
    events.handler("orders.#")(lambda payload: None)
    return events


def test_metrics_are_served_in_the_prometheus_text_format(events):
    metrics = PrometheusMetrics(CollectorRegistry())
    for _ in range(3):
        metrics.settled(Delivery("billing.<lambda>", "orders.1.created"), Outcome(OK, duration_ms=2), ACK)
    status, headers, body = get(exporter.make_app(metrics.registry, Liveness()), "/metrics")
    assert status == "200 OK" and headers["Content-Type"].startswith("text/plain")
    key = ("kombu_events_messages_total", (("action", "ack"), ("handler", "<lambda>"), ("outcome", "ack"),
                                           ("queue", "billing.<lambda>"), ("service", "billing")))
    assert samples(body)[key] == 3


def test_healthz_answers_200_while_the_loop_beats_and_503_once_it_stops():
    clock = Clock()
    liveness = Liveness(max_age_s=5, clock=clock)
    app = exporter.make_app(CollectorRegistry(), liveness)
    status, _h, body = get(app, "/healthz")
    assert status.startswith("503") and b"starting" in body
    liveness.beat()
    clock.now += 4.9
    assert get(app, "/healthz")[0] == "200 OK"
    clock.now += 0.2
    status, _h, body = get(app, "/healthz")
    assert status == "503 Service Unavailable" and b"last turned 5.1 s ago" in body


def test_other_paths_are_not_found():
    assert get(exporter.make_app(CollectorRegistry(), Liveness()), "/favicon.ico")[0] == "404 Not Found"


@pytest.fixture
def multiproc(tmp_path, monkeypatch):
    """PROMETHEUS_MULTIPROC_DIR set before the metrics exist, as in a worker started with it."""
    monkeypatch.setenv(exporter.MULTIPROC_ENV, str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    return tmp_path


def test_multiprocess_mode_sums_publishes_of_every_process_and_serves_the_workers_counts_from_memory(
        events, multiproc, monkeypatch):
    main = PrometheusMetrics(CollectorRegistry())
    delivery = Delivery("billing.<lambda>", "orders.1.created")
    main.received(delivery)
    main.settled(delivery, Outcome(OK), ACK)
    main.after_publish("events", "k", {}, None)
    # A pool process (another pid) publishes from a handler: its count is in a file of its own.
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda: 424242))
    child = PrometheusMetrics(CollectorRegistry())
    child.after_publish("events", "k", {}, None)
    child.after_publish("events", "k", {}, None)
    child.received(delivery)  # counted in that process's memory: never served by the worker
    assert {p.name.rsplit("_", 1)[-1] for p in multiproc.iterdir()} == {f"{os.getpid()}.db", "424242.db"}

    served = samples(get(exporter.make_app(exporter.serving_registry(main.registry), Liveness()), "/metrics")[2])
    assert served[("kombu_events_published_total", (("exchange", "events"), ("status", "ok")))] == 3
    labels = (("handler", "<lambda>"), ("queue", "billing.<lambda>"), ("service", "billing"))
    key = ("kombu_events_messages_total", (("action", "ack"), *labels[:1], ("outcome", "ack"), *labels[1:]))
    assert served[key] == 1
    in_flight = [v for (name, lab), v in served.items() if name == "kombu_events_in_flight"]
    assert in_flight == [0], "the main process's count, once, without a pid label"
    assert {p.name.split("_")[0] for p in multiproc.iterdir()} == {"counter"}, "only publishes are in files"


def test_a_multiprocess_directory_that_does_not_exist_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigurationError, match=r"PROMETHEUS_MULTIPROC_DIR=.*is not a directory"):
        exporter.serving_registry(CollectorRegistry(), {exporter.MULTIPROC_ENV: str(tmp_path / "nope")})


def test_without_multiprocess_mode_the_registry_is_served_as_it_is():
    registry = CollectorRegistry()
    assert exporter.serving_registry(registry, {}) is registry


def test_serve_worker_adds_metrics_and_a_heartbeat_to_every_service(events, monkeypatch):
    served = {}

    class FakeExporter:
        port = 9808

        def __init__(self, host, port, app):
            served.update(host=host, port=port, app=app)

    monkeypatch.setattr(exporter, "Exporter", FakeExporter)
    exporter.serve_worker([events], MetricsSettings(port=9808, host="0.0.0.0", liveness_s=3))
    kinds = [type(m).__name__ for m in events.hooks.middleware]
    assert kinds == ["PrometheusMetrics", "Liveness"]
    assert events.hooks.on_settled and events.hooks.on_started, "the hooks see the added middleware"
    assert events.hooks.middleware[1].max_age_s == 3
    assert served["host"] == "0.0.0.0" and served["port"] == 9808
    assert get(served["app"], "/healthz")[0].startswith("503"), "503 until the event loop turns"


def test_the_step_serves_nothing_without_a_port(events):
    assert bootstep._serve_metrics(events.app, [events], None) is None
    assert events.hooks.middleware == ()


def test_the_step_takes_the_port_from_the_flag_before_the_setting(events, monkeypatch):
    seen = []
    monkeypatch.setattr(exporter, "serve_worker", lambda services, settings: seen.append(settings))
    events.app.conf.kombu_events_metrics_port = 9100
    events.app.conf.kombu_events_metrics_host = "0.0.0.0"
    bootstep._serve_metrics(events.app, [events], None)
    bootstep._serve_metrics(events.app, [events], 9200)
    assert [(s.host, s.port) for s in seen] == [("0.0.0.0", 9100), ("0.0.0.0", 9200)]


def test_install_registers_the_metrics_port_option():
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    bootstep.install(app)
    bootstep.install(app)
    options = [o for o in app.user_options["worker"] if bootstep.METRICS_OPTION in o.opts]
    assert len(options) == 1 and options[0].name == "events_metrics_port"


def test_a_port_without_prometheus_client_says_which_extra_to_install(events, monkeypatch):
    monkeypatch.setattr(bootstep, "exporter", None)
    monkeypatch.setattr(bootstep, "_no_exporter", "No module named 'prometheus_client'")
    with pytest.raises(ConfigurationError, match=r"pip install 'kombu-events\[prometheus\]'"):
        bootstep._serve_metrics(events.app, [events], 9100)


def test_with_circuit_breakers_the_workers_metrics_see_settles_and_publishes_and_the_breakers_stay(monkeypatch):
    from kombu_events import CircuitBreaker

    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, service="billing")
    events.handler("orders.#", circuit_breaker=CircuitBreaker(max_failures=2))(lambda payload: None)
    hooks = events.hooks  # resolved before the step adds anything, as registry.resolve does
    breakers = hooks.middleware[-1]
    monkeypatch.setattr(exporter, "Exporter", lambda host, port, app: type("Fake", (), {"port": port})())
    exporter.serve_worker([events], MetricsSettings(port=9808))
    assert events.hooks is hooks and hooks.middleware[0] is breakers, "the same Hooks, the same breakers"
    metrics = hooks.middleware[1]
    assert isinstance(metrics, PrometheusMetrics) and metrics in hooks.on_settled
    with StubEvents(events):
        events.publish("orders.1.created", {})
    assert metrics.registry.get_sample_value("kombu_events_published_total",
                                             {"exchange": "events", "status": "ok"}) == 1, "publishing hooks too"


class Broken:
    """A collector that raises at scrape time."""

    def collect(self):
        raise RuntimeError("collector broke")


def test_a_scrape_that_fails_answers_500_and_is_logged_with_its_path(caplog):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Broken())
    with caplog.at_level(logging.ERROR, logger="kombu_events.integrations.exporter"):
        status, _headers, body = get(exporter.make_app(registry, Liveness()), "/metrics")
    assert status == "500 Internal Server Error" and body == b"serving /metrics failed: see the worker's log\n"
    (record,) = caplog.records
    assert record.getMessage() == "kombu-events: serving /metrics failed"
    assert record.exc_info[1].args == ("collector broke",)
