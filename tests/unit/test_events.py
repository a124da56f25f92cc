"""events.py without a broker: handler registration (and what it refuses), the event decorator, the worker step."""
from __future__ import annotations

import asyncio

import celery
import pytest

from kombu_events import Events, registry
from kombu_events.core.backoff import Constant, Exponential
from kombu_events.errors import ConfigurationError
from kombu_events.publishing.publisher import Publisher
from kombu_events.publishing.service import ServicePublisher
from kombu_events.testing import StubEvents
from kombu_events.worker.bootstep import OPTION, EventsStep


@pytest.fixture
def events(app, monkeypatch):
    for variable in ("AMQP_EVENTS_MAX_RETRIES", "AMQP_EVENTS_ARCHIVED_MESSAGE_TTL",
                     "AMQP_EVENTS_ARCHIVED_QUEUE_LENGTH", "RABBIT_URL"):
        monkeypatch.delenv(variable, raising=False)
    return Events(app, "billing", delay_levels=4)


def test_step_and_worker_option_are_installed_once(app):
    Events(app, "billing")
    Events(app, "shipping")
    assert EventsStep in app.steps["consumer"]
    assert len(app.steps["consumer"]) == 1
    options = [o for o in app.user_options["worker"] if OPTION in getattr(o, "opts", ())]
    assert len(options) == 1
    (option,) = options
    assert option.is_flag and option.default is False
    assert option.name == "with_events_step"


def test_instances_are_registered_for_the_pool(app):
    first, second = Events(app, "billing"), Events(app, "shipping")
    assert registry.services_of(app) == [first, second]


def test_handler_registration_and_default_queue_names(events):
    @events.handler("orders.*.created")
    def on_order_created(payload):
        return payload

    @events.handler("orders.#", "refunds.#", queue="billing.audit-log", max_retries=2, bind=True)
    def audit(event):
        pass

    @events.handler("orders.#", name="second_audit", raw=True, backoff=Constant(every_ms=500))
    def audit_again(body):
        pass

    assert on_order_created({"a": 1}) == {"a": 1}, "the decorator returns the function itself"
    first, second, third = events.handlers
    assert (first.name, first.queue, first.binding_keys) == ("on_order_created", "billing.on_order_created",
                                                             ("orders.*.created",))
    assert (first.max_retries, first.bind, first.raw) == (5, False, False)
    assert first.backoff == Exponential(max_delay_ms=15_000), "default backoff clamped to 4 levels"
    assert (second.name, second.queue, second.binding_keys) == ("audit", "billing.audit-log",
                                                                ("orders.#", "refunds.#"))
    assert (second.max_retries, second.bind) == (2, True)
    assert (third.name, third.queue, third.raw, third.backoff) == (
        "second_audit", "billing.second_audit", True, Constant(every_ms=500))
    assert [(r.handler, r.hooks) for r in events.routes()] == [(h, events.hooks) for h in (first, second, third)]
    assert [q.name for q in events.topology().handler_queues] == [
        "billing.on_order_created", "billing.audit-log", "billing.second_audit"]


def test_retry_for_and_dont_retry_are_normalised(events):
    @events.handler("a.#", retry_for=OSError, dont_retry=[KeyError, ValueError])
    def handle(payload):
        pass

    (handler,) = events.handlers
    assert handler.retry_for == (OSError,)
    assert handler.dont_retry == (KeyError, ValueError)


def test_duplicate_queue_is_a_configuration_error(events):
    @events.handler("a.#")
    def handle(payload):
        pass

    @events.handler("b.#", name="handle")
    def other(payload):
        pass

    with pytest.raises(ConfigurationError) as info:
        events.handlers
    message = str(info.value)
    assert "'billing.handle'" in message and "name= or queue=" in message


@pytest.mark.parametrize("keys", [(), ("orders.*x",), ("",), ("k" * 256,)])
def test_bad_binding_keys(events, keys):
    with pytest.raises(ConfigurationError):
        events.handler(*keys)


@pytest.mark.parametrize("queue", ["billing.*", "bill ing", ""])
def test_bad_explicit_queue_names(events, queue):
    with pytest.raises(ConfigurationError, match="queue"):
        events.handler("a.#", queue=queue)


@pytest.mark.parametrize("max_retries", [-1, 10_001, "3", True, 1.5])
def test_bad_max_retries(events, max_retries):
    @events.handler("a.#", max_retries=max_retries)
    def handle(payload):
        pass

    with pytest.raises(ConfigurationError,
                       match=r"max_retries of handler 'handle' must be an integer within 0 \.\. 10000"):
        events.handlers


def test_backoff_beyond_the_ladder(events):
    @events.handler("a.#", backoff=Exponential(max_delay_ms=16_000))
    def handle(payload):
        pass

    with pytest.raises(ConfigurationError, match=r"backoff max_delay_ms of handler 'handle'.*at most 15000 ms"):
        events.handlers


def test_queue_name_too_long_for_the_ladder(events):
    longest = events.settings.max_queue_bytes  # 255 - 2 * 4 levels
    assert longest == 247

    @events.handler("a.#", queue="q" * longest)
    def fits(payload):
        pass

    assert events.handlers[0].queue == "q" * longest

    @events.handler("a.#", queue="q" * (longest + 1))
    def too_long(payload):
        pass

    with pytest.raises(ConfigurationError, match=f"queue of handler 'too_long'.*at most {longest} bytes"):
        events.handlers


@pytest.mark.parametrize("queue", ["billing.delivery", "billing.archive", "billing.delay.0", "billing.delay.x"])
def test_queue_names_of_the_service_itself_are_reserved(events, queue):
    @events.handler("a.#", queue=queue)
    def handle(payload):
        pass

    with pytest.raises(ConfigurationError, match="collides with the service's own entities"):
        events.handlers


def test_invalid_service_name(app):
    with pytest.raises(ConfigurationError, match="service"):
        Events(app, "bill*ing")


def test_settings_come_from_celery_conf(app, monkeypatch):
    monkeypatch.delenv("AMQP_EVENTS_MAX_RETRIES", raising=False)
    app.conf.update(kombu_events_max_retries=2, kombu_events_delay_levels=6)
    events = Events(app, "billing", delay_levels=5)
    assert (events.settings.max_retries, events.settings.delay_levels) == (2, 5)


def test_broker_url(app, monkeypatch):
    monkeypatch.delenv("RABBIT_URL", raising=False)
    assert Events(app, "a").broker_url == "memory://"
    assert Events(app, "b", broker="amqp://explicit//").broker_url == "amqp://explicit//"
    monkeypatch.setenv("RABBIT_URL", "amqp://env//")
    assert Events(app, "c").broker_url == "amqp://env//"


def test_publish_builds_and_sends_a_confirmed_message(events, mocker):
    publisher = mocker.Mock()
    events.publishing.publisher = publisher
    message_id = events.publish("billing.invoice.paid", {"id": 7}, headers={"x-request-id": "r"},
                                message_id="m-7", correlation_id="c-7")
    assert message_id == "m-7"
    ((exchange, routing_key, message), _kwargs) = publisher.send.call_args
    assert (exchange, routing_key) == ("events", "billing.invoice.paid")
    assert message.body == b'{"id":7}'
    assert message.properties["application_headers"] == {"x-request-id": "r"}
    assert message.properties["correlation_id"] == "c-7"


@pytest.mark.parametrize("routing_key", ["billing.*", "", "a b"])
def test_publish_rejects_bad_routing_keys_before_publishing(events, mocker, routing_key):
    publisher = mocker.Mock()
    events.publishing.publisher = publisher
    with pytest.raises(ConfigurationError, match="routing_key"):
        events.publish(routing_key, {})
    publisher.send.assert_not_called()


@pytest.fixture
def published(mocker):
    return mocker.patch.object(ServicePublisher, "publish", autospec=True, return_value="m-1")


def test_event_decorator_publishes_the_bound_arguments(events, published):
    @events.event("billing.invoice.paid")
    def invoice_paid(invoice_id, amount, currency="EUR"):
        """Validate an invoice payment."""

    assert invoice_paid(7, amount=12.5) == "m-1"
    published.assert_called_once_with(events.publishing, "billing.invoice.paid",
                                      {"invoice_id": 7, "amount": 12.5, "currency": "EUR"})
    assert invoice_paid.routing_key == "billing.invoice.paid"
    assert invoice_paid.__name__ == "invoice_paid" and invoice_paid.__doc__ == "Validate an invoice payment."


def test_event_decorator_publishes_the_return_value(events, published):
    @events.event("billing.invoice.paid")
    def invoice_paid(invoice_id):
        return {"id": invoice_id, "version": 2}

    invoice_paid(7)
    published.assert_called_once_with(events.publishing, "billing.invoice.paid", {"id": 7, "version": 2})


def test_event_decorator_body_can_refuse(events, published):
    @events.event("billing.invoice.paid")
    def invoice_paid(amount):
        if amount <= 0:
            raise ValueError("amount must be positive")

    with pytest.raises(ValueError, match="positive"):
        invoice_paid(-1)
    with pytest.raises(TypeError):
        invoice_paid()  # wrong arguments never publish either
    published.assert_not_called()


def test_event_decorator_rejects_wildcard_routing_keys(events):
    with pytest.raises(ConfigurationError, match="routing_key"):
        events.event("billing.#")


def test_a_misspelt_setting_fails_when_events_is_created():
    app = celery.Celery("typo", broker="memory://")
    with pytest.raises(ConfigurationError, match=r"unknown setting.*max_retry.*valid:.*max_retries"):
        Events(app, service="billing", max_retry=3)


def test_the_publisher_can_be_replaced_and_reset(events):
    published = []

    class Recorder(Publisher):
        def send_many(self, items):
            items = list(items)
            published.extend((exchange, key, message.body) for exchange, key, message in items)
            return [None] * len(items)

    events.publishing.publisher = Recorder("memory://")
    events.publish("orders.1.created", {"n": 1})
    assert published == [("events", "orders.1.created", b'{"n":1}')]
    events.publishing.publisher = None
    assert type(events.publishing.publisher) is Publisher  # a new one, opened on first use


# -- what the worker could not run as written is refused when it is registered ----------------------


def test_an_async_handler_registers_and_is_awaited(events):
    ran = []

    @events.handler("billing.invoice.paid")
    async def on_paid(payload):
        await asyncio.sleep(0)
        ran.append(payload)

    assert [h.fn for h in events.handlers] == [on_paid]
    stub = StubEvents(events)
    stub.publish("billing.invoice.paid", {"id": 7})
    stub.join()
    assert ran == [{"id": 7}]
    assert [(s.action, s.handler) for s in stub.settled] == [("ack", on_paid)]


def test_a_generator_handler_and_a_class_are_refused(events):
    def on_paid(payload):
        yield payload

    class OnPaid:
        def __init__(self, payload):
            pass

    with pytest.raises(ConfigurationError, match="is a generator function"):
        events.handler("a.#")(on_paid)
    with pytest.raises(ConfigurationError, match="is a class: calling it would only construct an instance"):
        events.handler("a.#")(OnPaid)
    assert events.handlers == ()


@pytest.mark.parametrize(
    "options, argument",
    [({}, r"the event's payload\).*def two\(payload\)"), ({"raw": True}, r"the body bytes, as raw=True\).*\(body\)"),
     ({"bind": True}, r"an Event, as bind=True\).*def two\(event\)"),
     ({"bind": True, "raw": True}, r"an Event, as bind=True\)")],
)
def test_a_handler_that_cannot_take_the_argument_is_refused_with_its_signature(events, options, argument):
    def two(event, extra):
        pass

    with pytest.raises(ConfigurationError, match=r"handler .*\.two\(event, extra\) cannot be called with one "
                                                 rf"positional argument \({argument}"):
        events.handler("a.#", **options)(two)


def test_a_callable_object_registers_with_a_name(events):
    class Notifier:
        def __call__(self, payload):
            return payload

    notifier = Notifier()
    with pytest.raises(ConfigurationError, match="has no __name__ to name its queue after: pass name="):
        events.handler("a.#")(notifier)
    assert events.handler("a.#", name="notify")(notifier) is notifier
    (handler,) = events.handlers
    assert (handler.fn, handler.queue) == (notifier, "billing.notify")


def test_a_periodic_function_is_checked_like_a_handler(events):
    async def tick(event):
        pass

    def takes_nothing():
        pass

    with pytest.raises(ConfigurationError, match=r"^schedule 'tick': function .*\.tick is an async def function"):
        events.periodic("tick", every=60)(tick)
    with pytest.raises(ConfigurationError, match=r"^schedule 'tick': function .*\.takes_nothing\(\) cannot be "
                                                 r"called with one positional argument \(an Event\)"):
        events.periodic("tick", every=60)(takes_nothing)
    assert events.schedules == ()


def test_through_the_stub_an_async_handler_that_raises_is_retried(events):
    @events.handler("billing.invoice.paid", max_retries=1)
    async def on_paid(payload):
        await asyncio.sleep(0)
        raise ValueError("boom")

    stub = StubEvents(events)
    stub.publish("billing.invoice.paid", {"id": 7})
    stub.join(fail_fast=False)
    assert [(s.action, s.attempt) for s in stub.settled] == [("retry", 1)]
