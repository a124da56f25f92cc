"""declare.conflict_error: a refused declare becomes one clear error, with what to do about it."""
from __future__ import annotations

from amqp.exceptions import PreconditionFailed

from kombu_events.broker.declare import conflict_error


def refused(text: str) -> PreconditionFailed:
    return PreconditionFailed(text, method_sig=(50, 10), reply_code=406)


def test_an_inequivalent_queue_names_the_argument_and_the_migrate_command():
    error = conflict_error(refused("PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'svc.h' in vhost "
                                   "'/': received the value 'quorum' of type 'longstr' but current is none"),
                           "queue", "svc.h")
    assert error.argument == "x-queue-type" and error.entity == "svc.h"
    assert str(error).startswith("queue 'svc.h' already exists on the broker with a different argument 'x-queue-type'")
    assert "kombu-events migrate --to quorum" in str(error)


def test_an_inequivalent_exchange_is_not_sent_to_migrate():
    error = conflict_error(refused("PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'events' in vhost "
                                   "'/': received 'topic' but current is 'direct'"), "exchange", "events")
    assert "a different argument 'type'" in str(error) and "migrate" not in str(error)


def test_a_value_rabbitmq_refuses_is_not_called_a_conflict():
    error = conflict_error(refused("PRECONDITION_FAILED - invalid arg 'x-message-ttl' for queue 'svc.delay.31' in "
                                   "vhost '/': {value_too_large,2147483648000}"), "queue", "svc.delay.31")
    assert str(error).startswith("RabbitMQ refused argument 'x-message-ttl' of queue 'svc.delay.31'")
    assert "already exists" not in str(error) and error.argument == "x-message-ttl"
