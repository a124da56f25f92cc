"""A worker with quorum event queues refuses durable classic task queues: a dead node would stop it."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from celery import Celery
from kombu import Queue

from kombu_events.errors import ConfigurationError
from kombu_events.task_queues import check_task_queues, classic_task_queues

QUORUM = SimpleNamespace(settings=SimpleNamespace(service="billing", queue_type="quorum"))
CLASSIC = SimpleNamespace(settings=SimpleNamespace(service="audit", queue_type="classic"))


def _app(**conf) -> Celery:
    app = Celery("proj", set_as_current=False)
    app.conf.update(conf)
    return app


def test_celerys_default_queue_is_classic_unless_configured():
    assert classic_task_queues(_app()) == ["celery"]
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


def test_a_quorum_service_lets_the_consumer_restart_after_a_channel_error(caplog):
    app = _app(task_default_queue_type="quorum")
    with caplog.at_level(logging.INFO, logger="kombu_events.task_queues"):
        check_task_queues(app, [QUORUM])
    assert app.conf.broker_channel_error_retry is True
    assert "broker_channel_error_retry turned on" in caplog.text
