"""README.md's Python examples as a user writes them under ``mypy --strict``: type-checked, never run.

``tox -e type`` checks this file against the installed package (its ``py.typed``), the
way a user's own mypy sees it. Keep it in step with README.md; pytest does not collect it.
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Callable

from celery import Celery

from kombu_events import (
    Archive,
    BrokerUnavailableError,
    Constant,
    Delivery,
    Event,
    Events,
    Exponential,
    KombuEventsError,
    Middleware,
    Outcome,
    Published,
    PublishError,
    Retry,
    UnroutableError,
    poisonous,
    signals,
)
from kombu_events.core.settlement import Step
from kombu_events.testing import StubEvents


def charge(order_id: int) -> None: ...
def validate(payload: Any) -> None: ...
def store(payload: Any) -> None: ...


# -- the first example (proj/events.py) ----------------------------------------------------------

app = Celery("billing", broker="amqp://guest:guest@localhost//")
events = Events(app, service="billing")        # unique per consuming service


@events.handler("orders.*.created")            # topic binding key(s)
def on_order_created(payload: dict[str, Any]) -> None:  # the decoded JSON body
    charge(payload["order_id"])


@events.handler("orders.#", max_retries=3, bind=True)
def audit(event: Event) -> None:               # bind=True: an Event (payload, routing_key,
    with poisonous():                          # headers, message_id, attempt, ...)
        validate(event.payload)                # a failure here is archived at once
    store(event.payload)


# -- Handlers: every option of @events.handler ---------------------------------------------------

@events.handler(
    "invoices.*.paid", "invoices.*.refunded",
    queue="billing.invoices", max_retries=10,
    backoff=Exponential(base_ms=1000, factor=2, max_delay_ms=60_000, jitter=0.25),
    retry_for=(ConnectionError, TimeoutError), dont_retry=KeyError,
)
def on_invoice(payload: dict[str, Any]) -> None:
    if payload.get("status") == "pending":
        raise Retry(delay=30)                  # retry after 30 s
    if "amount" not in payload:
        raise Archive("no amount")             # archive now
    with poisonous():                          # archive now if the section raises
        validate(payload)


@events.handler("ledger.#", prefetch=1, single_active_consumer=True)   # one at a time, in order, fleet-wide
def on_ledger(payload: dict[str, Any]) -> None:
    store(str(payload))


@events.handler("reports.#", name="reports", backoff=Constant(every_ms=5000), raw=True)
def on_report(body: bytes) -> None:
    store(body.decode("utf-8"))


@events.handler("users.#", bind=True)
def on_user(event: Event) -> None:
    key: str = event.routing_key
    attempt: int = event.attempt
    headers: dict[str, Any] = event.headers
    message_id: str | None = event.message_id
    correlation_id: str | None = event.correlation_id
    content_type: str | None = event.content_type
    store((key, attempt, headers, message_id, correlation_id, content_type, event.queue, event.body))


# -- Configuration -------------------------------------------------------------------------------

app.conf.kombu_events_max_retries = 3
tuned = Events(
    app, service="billing-tuned", exchange="events", max_retries=5,
    backoff=Exponential(base_ms=500, factor=3, max_delay_ms=3_600_000), delay_levels=16, delay_unit_ms=1000,
    archive_ttl_ms=7 * 24 * 3600 * 1000, archive_max_length=100_000, prefetch_count=100,
    queue_type="quorum", accept_content=["application/json"],
)
steady = Events(app, service="billing-steady", backoff=Constant(every_ms=1000), broker="amqp://localhost//")


# -- Publishing ----------------------------------------------------------------------------------

@events.event("billing.invoice.created")
def invoice_created(invoice_id: int, amount_cents: int) -> None:
    if amount_cents < 0:
        raise ValueError("amount_cents must be >= 0")  # refuse: nothing is published


def publish_examples() -> list[str]:
    """The README's publishing calls; each returns the message id(s)."""
    sent: str = events.publish("billing.invoice.paid", {"id": 7})   # persistent, mandatory, confirmed
    with_options: str = events.publish(
        "billing.invoice.paid", {"id": 8}, headers={"source": "readme"}, message_id="m-8", correlation_id="c-8",
    )
    batch: list[Published] = events.publish_many([("billing.invoice.paid", {"id": 9}),
                                                  ("billing.invoice.void", {"id": 9})])
    created: str = invoice_created(7, amount_cents=1200)
    try:
        events.publish("nobody.listens", {})
    except UnroutableError as exc:
        store((exc.exchange, exc.routing_key))
    except (PublishError, BrokerUnavailableError) as exc:
        store(str(exc))
    except KombuEventsError:
        raise
    return [sent, with_options, *batch, created]


if __name__ == "__main__":
    events.publish("billing.invoice.paid", {"id": 7})


def backlog_example(log: logging.Logger) -> Published:
    """The README's backlog= example."""
    events = Events(app, service="billing", backlog="/var/lib/billing/events-backlog.sqlite3")

    result = events.publish("billing.invoice.paid", {"id": 7})
    if result.stored_locally:      # the broker is unreachable: kept in the local backlog
        log.info("invoice %s: event %s stored locally", 7, result)
    return result


# -- Periodic events ------------------------------------------------------------------------------

def build_report(period: int) -> None: ...


@events.periodic("reports.hourly", every=timedelta(hours=1))   # or every=3600; start=, catch_up=
def hourly_report(event: Event) -> None:
    build_report(event.payload["period"])   # {"schedule", "period", "due", "missed", "missed_count"}


hourly_report(Event({"period": 1}, "reports.hourly", "billing.schedule.reports.hourly", 1))


# -- Testing ----------------------------------------------------------------------------------------

def test_a_created_order_is_charged(events_stub: Callable[..., StubEvents]) -> None:
    stub = events_stub(events)                 # the app's handlers, in memory, on a virtual clock
    events.publish("orders.42.created", {"order_id": 42})
    stub.join()                                # runs what is due; re-raises a handler's bug
    assert stub.calls(on_order_created) == [{"order_id": 42}]
    stub.advance(1.5)
    assert [(r.attempt, r.delay_ms, r.reason) for r in stub.retried + stub.archived + stub.acked] == []


# -- Extending: middleware and signals ------------------------------------------------------------

class CountOutcomes(Middleware):
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def settled(self, delivery: Delivery, outcome: Outcome, step: Step) -> None:  # main process, per message
        self.counts[step.action] = self.counts.get(step.action, 0) + 1


extended = Events(app, service="billing-extended", middleware=[CountOutcomes()])


@signals.handler_failed.connect                      # in the pool process that ran the handler
def report(sender: Any, event: Event, exception: Exception, **kwargs: Any) -> None:
    print(f"{sender.__name__} failed on {event.routing_key}: {exception!r}")
