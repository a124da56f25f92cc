"""Events(backlog=...): what publish returns, what the hooks and signals see, configuration errors; the CLI."""
from __future__ import annotations

import json

import celery
import pytest
from click.testing import CliRunner

from kombu_events import (
    BacklogFullError,
    BrokerUnavailableError,
    Events,
    Healthy,
    Middleware,
    Published,
    UnroutableError,
    signals,
)
from kombu_events.cli import cli
from kombu_events.core.breaker import CircuitBreaker
from kombu_events.errors import ConfigurationError
from kombu_events.publishing.backlog import Backlog
from kombu_events.publishing.publisher import Publisher, build_message


class Broker(Publisher):
    """An in-memory publisher: ``up`` False fails like a stopped broker; ``nobody`` keys are unroutable."""

    def __init__(self) -> None:
        super().__init__("memory://")
        self.up, self.delivered = True, []

    def send_many(self, items):
        items = list(items)
        if not self.up:
            raise BrokerUnavailableError("cannot reach the broker: connection refused")
        self.delivered += [m.properties["message_id"] for _x, k, m in items if not k.startswith("nobody")]
        return [UnroutableError("unroutable", exchange=x, routing_key=k) if k.startswith("nobody") else None
                for x, k, _m in items]


class Recorder(Middleware):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []

    def after_publish(self, exchange, routing_key, properties, error):
        self.calls.append(("after_publish", properties["message_id"], error))

    def after_store(self, exchange, routing_key, properties):
        self.calls.append(("after_store", properties["message_id"], None))


@pytest.fixture
def broker():
    return Broker()


@pytest.fixture
def recorder():
    return Recorder()


@pytest.fixture
def events(tmp_path, broker, recorder, monkeypatch):
    monkeypatch.delenv("RABBIT_URL", raising=False)
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    made = Events(app, "billing", backlog=str(tmp_path / "backlog.sqlite3"), middleware=[recorder],
                  publisher_circuit=CircuitBreaker(max_failures=1, reset_s=60))
    made.publishing.publisher = broker
    yield made
    made.publishing.backlog_publisher.stop()


def test_without_a_backlog_publish_returns_a_published_id_as_before(broker, monkeypatch):
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, "billing")
    events.publishing.publisher = broker
    result = events.publish("billing.invoice.paid", {}, message_id="m-1")
    assert result == "m-1" and isinstance(result, Published) and not result.stored_locally
    assert events.publish_many([("a.b", {})])[0].stored_locally is False
    assert events.backlog is None and events.publishing.backlog_publisher is None
    broker.up = False
    with pytest.raises(BrokerUnavailableError):
        events.publish("billing.invoice.paid", {})


def test_with_the_broker_up_publish_is_confirmed_as_without_a_backlog(events, broker, recorder):
    result = events.publish("billing.invoice.paid", {"id": 7}, message_id="m-1")
    assert result == "m-1" and not result.stored_locally and broker.delivered == ["m-1"]
    assert recorder.calls == [("after_publish", "m-1", None)]


def test_with_the_broker_down_the_event_is_stored_locally_and_the_hooks_say_so(events, broker, recorder):
    stored_signals = []

    def on_stored(sender, **kwargs):
        stored_signals.append((sender, kwargs["message_id"], kwargs["routing_key"]))

    signals.event_stored.connect(on_stored)
    try:
        broker.up = False
        result = events.publish("billing.invoice.paid", {"id": 7}, message_id="m-1")
        many = events.publish_many([("billing.invoice.sent", {"id": 8}), ("billing.invoice.sent", {"id": 9})])
    finally:
        signals.event_stored.disconnect(on_stored)
    assert result == "m-1" and result.stored_locally and all(p.stored_locally for p in many)
    assert events.backlog.status().depth == 3
    assert recorder.calls == [("after_store", "m-1", None), ("after_store", many[0], None),
                              ("after_store", many[1], None)], "after_publish waits for the broker's confirm"
    assert stored_signals == [(events, "m-1", "billing.invoice.paid"), (events, many[0], "billing.invoice.sent"),
                              (events, many[1], "billing.invoice.sent")]
    broker.up = True
    assert events.publishing.backlog_publisher.flush().published == 3
    assert broker.delivered == ["m-1", *many]
    assert recorder.calls[3:] == [("after_publish", "m-1", None), ("after_publish", many[0], None),
                                  ("after_publish", many[1], None)], "the flusher's confirms reach after_publish"


def test_an_unroutable_event_still_raises_and_is_never_stored(events, recorder):
    with pytest.raises(UnroutableError):
        events.publish("nobody.listens", {}, message_id="m-1")
    assert not events.backlog.pending()
    assert recorder.calls[0][0] == "after_publish" and isinstance(recorder.calls[0][2], UnroutableError)


def test_a_full_backlog_raises(tmp_path, broker):
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, "billing", backlog=Backlog(tmp_path / "small.sqlite3", max_bytes=64 * 1024))
    events.publishing.publisher = broker
    broker.up = False
    try:
        with pytest.raises(BacklogFullError, match="full"):
            for _ in range(20):
                events.publish("a.b", {"blob": "x" * 10_000})
    finally:
        events.publishing.backlog_publisher.stop()


def test_an_unusable_backlog_path_fails_when_events_is_created(tmp_path):
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError, match="cannot be used"):
        Events(app, "billing", backlog=str(tmp_path / "no" / "such" / "dir" / "b.sqlite3"))


def test_health_checks_need_a_backlog(tmp_path):
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    def ledger_up():
        return Healthy

    with pytest.raises(ConfigurationError, match="need a backlog"):
        Events(app, "billing", health_checks=[ledger_up])
    events = Events(app, "shipping", backlog=tmp_path / "b.sqlite3", health_checks=[ledger_up])
    assert [c.name for c in events.publishing.backlog_publisher.breakers.checks.values()] == [
        "broker", "test_health_checks_need_a_backlog.<locals>.ledger_up"]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), prog_name="kombu-events")


def test_backlog_status_from_the_command_line(tmp_path):
    backlog = Backlog(tmp_path / "b.sqlite3")
    backlog.store([("events", "a.b", build_message({}, message_id=f"m-{n}")) for n in range(3)], now=0.0)
    result = invoke("backlog", "status", "--path", backlog.path)
    assert result.exit_code == 0, result.output
    assert f"{backlog.path}: 3 waiting, oldest" in result.output and "0 set aside" in result.output
    result = invoke("backlog", "status", "--path", backlog.path, "--json")
    data = json.loads(result.output)
    assert data["depth"] == 3 and data["oldest_age_s"] > 1_000_000 and data["rejected"] == 0
    result = invoke("backlog", "status", "--path", backlog.path, "--max-depth", "2")
    assert result.exit_code == 2 and "ALERT: backlog: 3 events wait (more than --max-depth 2)" in result.output
    result = invoke("backlog", "status", "--path", backlog.path, "--max-age", "60")
    assert result.exit_code == 2 and "more than --max-age 60" in result.output


def test_backlog_commands_need_a_backlog(tmp_path):
    result = invoke("backlog", "status", "--path", str(tmp_path / "missing.sqlite3"))
    assert result.exit_code == 1 and "no backlog at" in result.output
    result = invoke("backlog", "status")
    assert result.exit_code == 1 and "no app given" in result.output  # a usage error: exit 1 (docs/cli.md)
