"""``events.log(...)`` on a service (events.py): registered and checked at once, part of the topology that
``declare --dry-run``, ``permissions``, the AsyncAPI document, ``status``/``health`` and the test stub read, and
never consumed by the worker."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from celery import Celery

from kombu_events import Events
from kombu_events.cli.topology import topology_document
from kombu_events.errors import ConfigurationError
from kombu_events.ops.asyncapi import document
from kombu_events.ops.health import problems
from kombu_events.ops.permissions import celery_entities, deploy_grant, runtime_grant
from kombu_events.ops.status import QueueStatus, queue_state
from kombu_events.testing.stub import StubEvents

DAY = timedelta(days=1)


@pytest.fixture
def events():
    app = Celery("t", broker="amqp://guest:guest@localhost//")
    found = Events(app, service="billing", exchange="ev")

    @found.handler("orders.*.created")
    def charge(payload):
        pass

    return found


def test_events_log_registers_it_and_refuses_a_second_of_the_same_name(events):
    log = events.log("orders.#", keep=DAY)
    assert events.logs == (log,) and events.topology().logs == (log,)
    with pytest.raises(ConfigurationError, match="two logs are named 'orders'"):
        events.log("orders.*", keep=DAY)
    with pytest.raises(ConfigurationError, match="no retention"):
        events.log("payments.#")
    assert events.logs == (log,)


def test_a_stream_named_as_another_queue_of_the_service_is_refused(events):
    events.handler("a.#", name="log.a")(lambda payload: None)  # queue billing.log.a
    events.log("a.#", keep=DAY)
    with pytest.raises(ConfigurationError, match=r"'billing\.log\.a' of log 'a' has the name of another queue"):
        events.topology()


def test_no_worker_consumes_a_log(events):
    events.log("orders.#", keep=DAY)
    topology = events.topology()
    assert [q.name for q in topology.handler_queues] == ["billing.charge"]
    assert [h.queue for h in events.handlers] == ["billing.charge"]


def test_the_dry_run_document_names_the_role_log(events):
    events.log("orders.#", keep=DAY)
    [entry] = [q for q in topology_document(events.topology())["queues"] if q["role"] == "log"]
    assert entry["name"] == "billing.log.orders" and entry["arguments"]["x-max-age"] == "1D"


def test_status_and_health_do_not_call_a_log_without_a_consumer_a_problem():
    row = QueueStatus("billing.log.orders", "log", 3, None, 0, state=queue_state("log", 0))
    assert row.state is None and problems([row]) == []


def test_the_runtime_user_reads_a_log_and_the_deploy_user_configures_it(events):
    events.log("orders.#", keep=DAY)
    topology = events.topology()
    runtime, deploy = runtime_grant(topology, celery_entities(events.app)), deploy_grant(topology)
    assert re.fullmatch(runtime.read, "billing.log.orders")
    assert not re.fullmatch(runtime.write, "billing.log.orders") and not re.fullmatch(runtime.configure,
                                                                                      "billing.log.orders")
    assert all(re.fullmatch(regex, "billing.log.orders") for regex in (deploy.configure, deploy.write, deploy.read))


def test_the_asyncapi_document_has_a_channel_per_log_and_no_operation_on_it(events):
    events.log("orders.#", "payments.*", keep=timedelta(days=90), max_bytes=2**30, name="money")
    doc = document(events)
    channel = doc["channels"]["billing.log.money"]
    assert channel["address"] == "billing.log.money" and channel["title"] == "log money"
    assert channel["x-kombu-events-log"] == {"name": "money", "maxAge": "90D", "maxBytes": 2**30,
                                             "segmentBytes": 100_000_000}
    assert [b["routingKey"] for b in channel["x-kombu-events-bindings"]] == ["orders.#", "payments.*"]
    assert channel["bindings"]["amqp"]["is"] == "queue" and "messages" not in channel
    assert "90 d and up to 1 GiB" in channel["description"]
    assert all(op["channel"]["$ref"] != "#/channels/billing.log.money" for op in doc["operations"].values())


def test_the_stub_keeps_what_is_appended_to_each_log_in_publish_order(events):
    events.log("orders.#", keep=DAY)
    events.log("payments.*", max_bytes=10**6, name="money")
    with StubEvents(events) as stub:
        events.publish("orders.1.created", {"n": 1})
        events.publish("payments.7", {"n": 2})  # only the log is bound: routed, not unroutable
        events.publish("orders.2.paid", {"n": 3})
        stub.join()
        assert stub.log("orders") == [{"n": 1}, {"n": 3}]
        assert stub.log("money") == [{"n": 2}]
        assert len(stub.acked) == 1 and stub.archive() == []
        with pytest.raises(ConfigurationError, match="has no log 'nope'; its logs: orders, money"):
            stub.log("nope")
