"""broker/version.py: the broker's version read from its server properties (odd ones included), the one line
that names it, and ``require``, which refuses a feature the broker is too old for; the worker's use of both."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import celery
import pytest
from kombu import Connection

from kombu_events import Events, KombuEventsError
from kombu_events.broker import version
from kombu_events.broker.version import QUORUM_QUEUES, broker_name, broker_version, describe, reported_version, require
from kombu_events.errors import BrokerTooOldError
from kombu_events.worker import consumer as consumer_module
from kombu_events.worker.bootstep import EventsStep
from kombu_events.worker.consumer import ServiceConsumer

URL = "amqp://guest:s3cret@rabbit.example:5672//"


class KombuLike:
    """What a connected kombu Connection offers: ``connected``, the transport's ``connection``, ``as_uri()``.

    ``as_uri`` returns the password on purpose: what names the broker must mask it itself.
    """

    def __init__(self, properties: object, url: str = URL) -> None:
        self.connected = True
        self.connection = SimpleNamespace(server_properties=properties)
        self.url = url

    def as_uri(self) -> str:
        return self.url


def amqp_like(**properties: object) -> SimpleNamespace:
    """A py-amqp connection: ``server_properties`` and ``host``."""
    return SimpleNamespace(server_properties=properties, host="rabbit.example:5672")


@pytest.mark.parametrize("properties, reported, parsed", [
    ({"product": "RabbitMQ", "version": "4.0.5"}, "4.0.5", (4, 0, 5)),
    ({"version": "3.13.7"}, "3.13.7", (3, 13, 7)),
    ({"version": b"3.10.8"}, "3.10.8", (3, 10, 8)),  # older py-amqp: bytes
    ({"version": bytearray(b"3.12.0")}, "3.12.0", (3, 12, 0)),
    ({"version": "4.0.5+1.g123"}, "4.0.5+1.g123", (4, 0, 5)),  # a build of a commit after 4.0.5
    ({"version": "4.1.0-beta.1"}, "4.1.0-beta.1", (4, 1, 0)),
    ({"version": " 3.8 "}, "3.8", (3, 8)),
    ({"version": "v3.9.1"}, "v3.9.1", (3, 9, 1)),
    ({"version": "unknown"}, "unknown", None),
    ({"version": b"\xff\xfe"}, "\ufffd\ufffd", None),  # not UTF-8: replaced, not an exception
    ({"version": ""}, None, None),
    ({"version": None}, None, None),
    ({"version": 405}, None, None),  # not a string at all
    ({"product": "RabbitMQ"}, None, None),  # no version
    ({}, None, None),
])
def test_the_version_is_read_from_the_server_properties_whatever_their_shape(properties, reported, parsed):
    for connection in (amqp_like(**properties), KombuLike(properties)):
        assert reported_version(connection) == reported
        assert broker_version(connection) == parsed


@pytest.mark.parametrize("connection", [
    SimpleNamespace(),  # no server_properties at all
    SimpleNamespace(server_properties=None),
    SimpleNamespace(server_properties="4.0.5"),  # not a mapping
    None,
])
def test_a_connection_without_server_properties_has_no_version(connection):
    assert broker_version(connection) is None and reported_version(connection) is None
    assert broker_name(connection) == "broker (version unknown)"


def test_an_unconnected_kombu_connection_is_not_connected_to_read_it():
    connection = Connection(URL)  # the unit tests' conftest fails any socket: reading must not connect
    assert broker_version(connection) is None
    assert describe(connection) == "broker (version unknown) at amqp://guest:**@rabbit.example:5672//"


def test_the_broker_is_described_by_product_version_and_its_url_with_the_password_masked():
    connection = KombuLike({"product": "RabbitMQ", "version": "4.0.5"}, url="amqp://guest:s3cret@127.0.0.1:5680//")
    assert broker_name(connection) == "RabbitMQ 4.0.5"
    assert describe(connection) == "RabbitMQ 4.0.5 at amqp://guest:**@127.0.0.1:5680//"
    assert broker_name(KombuLike({"product": b"LavinMQ", "version": b"2.1.0"})) == "LavinMQ 2.1.0"
    assert broker_name(KombuLike({"version": "3.13.7"})) == "broker 3.13.7"


# -- require -------------------------------------------------------------------------------------------------

def test_require_names_the_feature_the_version_it_needs_the_broker_and_the_version_it_runs():
    old = KombuLike({"product": "RabbitMQ", "version": "3.7.28"})
    with pytest.raises(BrokerTooOldError) as info:
        require(old, *QUORUM_QUEUES)
    assert str(info.value) == ("quorum queues (queue_type='quorum') needs RabbitMQ >= 3.8; the broker at "
                               "amqp://guest:**@rabbit.example:5672// runs 3.7.28")
    assert isinstance(info.value, KombuEventsError) and "s3cret" not in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_require_shows_the_version_as_reported_and_the_given_url_masked():
    with pytest.raises(BrokerTooOldError, match=r"^streams needs RabbitMQ >= 3\.9\.0; the broker at "
                                                r"amqps://u:\*\*@h:5671/v runs 3\.8\.9\+rc\.1$"):
        require(amqp_like(product="RabbitMQ", version=b"3.8.9+rc.1"), "streams", (3, 9, 0),
                url="amqps://u:pw@h:5671/v")
    with pytest.raises(BrokerTooOldError, match=r"the broker at rabbit\.example:5672 runs 3\.7\.0$"):
        require(amqp_like(version="3.7.0"), "quorum queues", (3, 8))  # py-amqp: its host


@pytest.mark.parametrize("properties", [
    {"product": "RabbitMQ", "version": "3.8.0"},  # exactly the minimum
    {"product": "RabbitMQ", "version": "3.8"},
    {"product": "RabbitMQ", "version": "3.10.8"},
    {"product": "RabbitMQ", "version": "4.0.5+1.g123"},
    {"product": "RabbitMQ", "version": "unknown"},  # cannot tell: the broker refuses what it cannot do
    {"product": "RabbitMQ"},
    {},
    {"product": "LavinMQ", "version": "1.2.0"},  # not RabbitMQ: its numbers are not RabbitMQ's
])
def test_require_lets_a_new_enough_or_unknown_broker_through(properties):
    require(KombuLike(properties), *QUORUM_QUEUES)


def test_a_missing_minor_part_counts_as_older():
    with pytest.raises(BrokerTooOldError):
        require(KombuLike({"version": "3"}), *QUORUM_QUEUES)  # (3,) < (3, 8)


# -- the worker ----------------------------------------------------------------------------------------------

def _consumer(queue_type: str) -> ServiceConsumer:
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, service="billing", queue_type=queue_type, delay_levels=2, publish_delay_levels=0)
    events.handler("orders.#", name="orders")(lambda payload: None)
    return ServiceConsumer(events)


def test_a_quorum_service_refuses_to_declare_on_a_broker_older_than_3_8(monkeypatch):
    declared = []
    monkeypatch.setattr(consumer_module, "declare", lambda topology, connection: declared.append(topology))
    with pytest.raises(BrokerTooOldError, match=r"quorum queues .* needs RabbitMQ >= 3\.8; .* runs 3\.7\.28"):
        _consumer("quorum").start(KombuLike({"product": "RabbitMQ", "version": "3.7.28"}), None, None)
    assert declared == [], "refused before declaring anything"


def test_a_classic_service_does_not_ask_the_version(monkeypatch):
    monkeypatch.setattr(version, "require", lambda *a, **k: pytest.fail("classic queues need no version"))
    monkeypatch.setattr(consumer_module, "require", lambda *a, **k: pytest.fail("classic queues need no version"))

    class Declared(Exception):
        pass

    def declare(topology, connection):
        raise Declared  # far enough: the check would have come before

    monkeypatch.setattr(consumer_module, "declare", declare)
    with pytest.raises(Declared):
        _consumer("classic").start(KombuLike({"product": "RabbitMQ", "version": "3.7.28"}), None, None)


class StepConsumer:
    def __init__(self, error: Exception | None = None) -> None:
        self.settings = SimpleNamespace(service="billing")
        self.started, self.error = 0, error
        self.declare_command = "kombu-events -A proj declare"

    def start(self, connection, pool, hub, call_soon=None):
        self.started += 1
        if self.error is not None:
            raise self.error


def _step(*consumers: StepConsumer, url: str = "amqp://guest:s3cret@127.0.0.1:5680//") -> tuple[EventsStep, object]:
    connection = KombuLike({"product": "RabbitMQ", "version": "4.0.5"}, url=url)
    parent = SimpleNamespace(app=celery.Celery("proj", broker="memory://", set_as_current=False),
                             connection=connection, pool=None, hub=None)
    step = EventsStep(parent)
    step.consumers = list(consumers)  # type: ignore[arg-type]
    return step, parent


def test_the_worker_logs_the_broker_and_its_version_once_per_connection(caplog):
    step, parent = _step(StepConsumer(), StepConsumer())
    with caplog.at_level(logging.INFO, logger="kombu_events.worker.bootstep"):
        step.start(parent)
        step.start(parent)  # Celery starts the step again on a reconnect: one line each time
    lines = [r.getMessage() for r in caplog.records if "connected to" in r.getMessage()]
    assert lines == ["kombu-events: connected to RabbitMQ 4.0.5 at amqp://guest:**@127.0.0.1:5680//"] * 2
    assert all(r.levelno == logging.INFO for r in caplog.records if "connected to" in r.getMessage())
    assert "s3cret" not in caplog.text


def test_a_worker_without_services_says_nothing_of_the_broker(caplog):
    step, parent = _step()
    with caplog.at_level(logging.INFO, logger="kombu_events.worker.bootstep"):
        step.start(parent)
    assert "connected to" not in caplog.text


def test_a_broker_too_old_stops_the_worker_with_one_error_line(caplog):
    from celery.exceptions import WorkerShutdown

    too_old = BrokerTooOldError("quorum queues needs RabbitMQ >= 3.8; the broker at amqp://guest:**@h// runs 3.7.0")
    step, parent = _step(StepConsumer(too_old))
    with caplog.at_level(logging.ERROR, logger="kombu_events.worker.bootstep"), pytest.raises(WorkerShutdown):
        step.start(parent)
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "service billing failed: BrokerTooOldError: quorum queues needs RabbitMQ >= 3.8" in line
