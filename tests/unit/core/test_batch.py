"""core/batch.py: BatchOf's validation, the checks at registration, a batch handler's contract, failures_of."""
from __future__ import annotations

import pytest
from pydantic import BaseModel

from kombu_events import BatchFailed, BatchOf, ConfigurationError, Event, Events, Retry
from kombu_events.core.batch import batch_contract, failures_of


class Order(BaseModel):
    sku: str


@pytest.mark.parametrize("kwargs, message", [
    ({"max": 0}, r"max=\.\.\.\) must be an integer within 1 \.\. 10000"),
    ({"max": 10_001}, "within 1 .. 10000"),
    ({"max": True}, "got True"),
    ({"max": 1.5}, "got 1.5"),
    ({"wait_ms": -1}, r"wait_ms=\.\.\.\) must be a number of milliseconds within 0 \.\. 60000"),
    ({"wait_ms": 60_001}, "got 60001"),
    ({"wait_ms": "50"}, "got '50'"),
])
def test_batch_of_refuses_bad_values(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        BatchOf(**kwargs)


def test_batch_of_bounds_are_accepted():
    assert BatchOf(max=1, wait_ms=0) == BatchOf(1, 0)
    assert BatchOf(max=10_000, wait_ms=60_000).max == 10_000


@pytest.mark.parametrize("options, message", [
    ({"batch": 500}, r"batch must be a BatchOf\(max=\.\.\., wait_ms=\.\.\.\) or None, got 500"),
    ({"batch": BatchOf(), "concurrency": 2}, "batch= with concurrency= is not supported yet"),
])
def test_registration_refuses_what_batches_cannot_do_yet(app, options, message):
    events = Events(app, "billing")
    with pytest.raises(ConfigurationError, match=message):
        events.handler("orders.#", **options)


def test_registration_checks_the_list_parameter(app):
    events = Events(app, "billing")
    with pytest.raises(ConfigurationError, match="gets a list, but its parameter is annotated Order"):
        @events.handler("orders.#", batch=BatchOf())
        def one(order: Order) -> None: ...
    with pytest.raises(ConfigurationError, match="cannot be called with one positional argument"):
        @events.handler("orders.#", batch=BatchOf())
        def two(a, b) -> None: ...


def test_a_batch_handlers_prefetch_is_at_least_max(app):
    events = Events(app, "billing")
    events.handler("orders.#", name="a", batch=BatchOf(max=300))(lambda payloads: None)
    events.handler("orders.#", name="b", batch=BatchOf(max=5), prefetch=50)(lambda payloads: None)
    events.handler("orders.#", name="c", batch=BatchOf(max=50), prefetch=5)(lambda payloads: None)
    assert [h.prefetch for h in events.handlers] == [600, 50, 50]  # unset: twice max


@pytest.mark.parametrize("annotation, bind, contract", [
    (list, False, None), (list[dict], False, None), (list[Order], False, "Order"),
    (list[Event], True, None), (list[Event[Order]], True, "Order"),
])
def test_batch_contract_reads_the_element_type(annotation, bind, contract):
    def fn(events):
        pass
    fn.__annotations__ = {"events": annotation}
    found = batch_contract(fn, bind=bind, raw=False, where="test")
    assert (found.name if found else None) == contract


@pytest.mark.parametrize("annotation, bind, message", [
    (list[Order], True, r"annotate it list\[Event\[Order\]\]"),
    (list[Event[Order]], False, "pass bind=True"),
])
def test_batch_contract_says_how_to_annotate(annotation, bind, message):
    def fn(events):
        pass
    fn.__annotations__ = {"events": annotation}
    with pytest.raises(ConfigurationError, match=message):
        batch_contract(fn, bind=bind, raw=False, where="test")


def test_failures_of():
    retry = Retry(1)
    assert failures_of(None, 2) == [None, None]
    boom = RuntimeError("x")
    assert failures_of(boom, 2) == [boom, boom]
    assert failures_of(BatchFailed({1: retry, 5: boom}), 3) == [None, retry, None]
    with pytest.raises(TypeError, match="BatchFailed takes"):
        BatchFailed({"1": boom})
