"""A worker with quorum event queues refuses durable classic task queues: a dead node would stop it.

setup.cfg allows Celery 5.3; quorum task queues (``task_default_queue_type``) and native
delayed delivery came with 5.5, so only the tests of those are skipped on an older Celery.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from celery import Celery
from celery.app.defaults import DEFAULTS
from kombu import Queue

from kombu_events.errors import ConfigurationError
from kombu_events.worker import task_queues
from kombu_events.worker.task_queues import (
    check_task_queues,
    classic_task_queues,
    follow_connection,
)

QUORUM = SimpleNamespace(settings=SimpleNamespace(service="billing", queue_type="quorum"))
CLASSIC = SimpleNamespace(settings=SimpleNamespace(service="audit", queue_type="classic"))

#: Celery >= 5.5: Celery's own queues can be quorum queues.
quorum_task_queues = pytest.mark.skipif("task_default_queue_type" not in DEFAULTS,
                                        reason="Celery < 5.5 has no task_default_queue_type")


def _app(**conf) -> Celery:
    app = Celery("proj", set_as_current=False)
    app.conf.update(conf)
    return app


def test_celerys_default_queue_is_classic():
    assert classic_task_queues(_app()) == ["celery"]


@quorum_task_queues
def test_celerys_default_queue_is_quorum_when_configured():
    assert classic_task_queues(_app(task_default_queue_type="quorum")) == []


def test_transient_queues_do_not_count():
    app = _app(task_queues=[Queue("durable"), Queue("gone", auto_delete=True), Queue("mine", exclusive=True),
                            Queue("replicated", queue_arguments={"x-queue-type": "quorum"}),
                            Queue("stream", queue_arguments={"x-queue-type": "stream"})])
    assert classic_task_queues(app) == ["durable"]


def test_only_the_queues_this_worker_consumes_count():
    app = _app(task_queues=[Queue("a"), Queue("b", queue_arguments={"x-queue-type": "quorum"})])
    app.amqp.queues.select(["b"])  # what `celery worker -Q b` does
    assert classic_task_queues(app) == []


def test_a_quorum_service_with_a_classic_task_queue_refuses_to_start_and_says_how():
    with pytest.raises(ConfigurationError) as caught:
        check_task_queues(_app(), [CLASSIC, QUORUM])
    message = str(caught.value)
    for text in ("'billing'", "'celery'", "task_default_queue_type = 'quorum'", "x-queue-type", "-Q"):
        assert text in message
    assert "'audit'" not in message


def test_classic_services_leave_celery_alone():
    app = _app()
    check_task_queues(app, [CLASSIC])
    assert app.conf.broker_channel_error_retry is False


@quorum_task_queues
def test_a_quorum_service_lets_the_consumer_restart_after_a_channel_error(caplog):
    app = _app(task_default_queue_type="quorum")
    with caplog.at_level(logging.INFO, logger="kombu_events.worker.task_queues"):
        check_task_queues(app, [QUORUM])
    assert app.conf.broker_channel_error_retry is True
    assert "broker_channel_error_retry turned on" in caplog.text


@pytest.fixture
def delayed_delivery():
    """Celery's module of the DelayedDelivery step: the test is skipped on a Celery < 5.5, which has none."""
    return pytest.importorskip("celery.worker.consumer.delayed_delivery")


def test_a_celery_without_native_delayed_delivery_is_left_alone(monkeypatch):
    monkeypatch.setattr(task_queues, "delayed_delivery", None)  # what Celery < 5.5 gives the module
    consumer = SimpleNamespace(app=_app(broker_url="amqp://a//;amqp://b//"), blueprint=SimpleNamespace(steps={}))
    assert follow_connection(consumer) is False


def _consumer(delayed_delivery, broker_url):
    """What follow_connection sees of Celery's consumer while its blueprint is applied."""
    app = _app(broker_url=broker_url, task_default_queue_type="quorum")
    consumer = SimpleNamespace(app=app, blueprint=SimpleNamespace(steps={}))
    step = delayed_delivery.DelayedDelivery(consumer)
    consumer.blueprint.steps[step.name] = step
    return consumer, step


@pytest.mark.parametrize("broker_url", ["amqp://a//;amqp://b//", ["amqp://a//", "amqp://b//"]])
def test_with_several_urls_delayed_delivery_is_set_up_through_the_connected_node_only(mocker, delayed_delivery,
                                                                                      broker_url):
    consumer, step = _consumer(delayed_delivery, broker_url)
    assert follow_connection(consumer) is True
    assert step.name == delayed_delivery.DelayedDelivery.name
    setup = mocker.patch.object(step, "_setup_delayed_delivery")
    consumer.connection = SimpleNamespace(as_uri=lambda include_password=False: "amqp://u:p@b//")
    step.start(consumer)
    setup.assert_called_once_with(consumer, "amqp://u:p@b//")


def test_a_failing_setup_is_retried_on_the_connected_node_then_logged(mocker, caplog, delayed_delivery):
    consumer, step = _consumer(delayed_delivery, "amqp://a//;amqp://b//")
    follow_connection(consumer)
    setup = mocker.patch.object(step, "_setup_delayed_delivery", side_effect=ConnectionRefusedError("gone"))
    mocker.patch("kombu.utils.functional.sleep")  # retry_over_time's pauses
    consumer.connection = SimpleNamespace(as_uri=lambda include_password=False: "amqp://b//")
    with caplog.at_level(logging.WARNING, logger="kombu_events.worker.task_queues"):
        step.start(consumer)
    assert {call.args[1] for call in setup.call_args_list} == {"amqp://b//"}
    assert setup.call_count == delayed_delivery.MAX_RETRIES + 1
    assert "native delayed delivery not set up on amqp://b//: gone" in caplog.text


def test_one_url_or_no_delayed_delivery_step_leaves_celery_alone(delayed_delivery):
    consumer, step = _consumer(delayed_delivery, "amqp://a//")
    assert follow_connection(consumer) is False
    assert type(step) is delayed_delivery.DelayedDelivery
    consumer, step = _consumer(delayed_delivery, "amqp://a//;amqp://b//")
    consumer.blueprint.steps.clear()
    assert follow_connection(consumer) is False


def test_a_celery_without_the_parts_it_uses_keeps_its_own_step(mocker, delayed_delivery):
    consumer, step = _consumer(delayed_delivery, "amqp://a//;amqp://b//")
    mocker.patch.object(delayed_delivery, "RETRIED_EXCEPTIONS")  # restored after the test...
    delattr(delayed_delivery, "RETRIED_EXCEPTIONS")  # ...which sees a Celery without it
    assert follow_connection(consumer) is False
    assert type(step) is delayed_delivery.DelayedDelivery
