"""worker/batch_handlers.py: one call of a batch handler with the list, one Outcome per event."""
from __future__ import annotations

import asyncio
import json

from pydantic import BaseModel

from kombu_events import registry
from kombu_events.core import decision
from kombu_events.core.backoff import Exponential
from kombu_events.core.batch import BatchOf, batch_contract
from kombu_events.core.codec import JSON
from kombu_events.core.handlers import Handler
from kombu_events.errors import Archive, BatchFailed, Retry
from kombu_events.middleware.base import Hooks, Middleware
from kombu_events.registry import Route
from kombu_events.worker import batch_handlers

QUEUE = "billing.store"


class Order(BaseModel):
    sku: str


def _put(fn, hooks=None, **kwargs):
    options = {"name": "store", "queue": QUEUE, "binding_keys": ("orders.#",), "max_retries": 5,
               "backoff": Exponential(), "batch": BatchOf(max=10)}
    options.update(kwargs)
    registry._routes[QUEUE] = Route(Handler(fn=fn, **options), frozenset({JSON}), 2000, hooks or Hooks())


def _items(*bodies, attempt=1):
    return [(QUEUE, body if isinstance(body, bytes) else json.dumps(body).encode(), JSON, "utf-8",
             ("orders.created", attempt, {}, {"message_id": f"m{n}"}), False) for n, body in enumerate(bodies)]


def kinds(outcomes):
    return [o.kind for o in outcomes]


def test_one_call_with_the_payloads_and_an_ok_each():
    calls = []
    _put(calls.append)
    outcomes = batch_handlers.run(_items({"n": 1}, {"n": 2}, {"n": 3}))
    assert calls == [[{"n": 1}, {"n": 2}, {"n": 3}]]
    assert kinds(outcomes) == ["ok"] * 3 and outcomes.elapsed_ms >= 0


def test_batch_failed_settles_the_named_events_each_by_its_exception():
    def fn(payloads):
        raise BatchFailed({0: ValueError("bad sku"), 2: Archive("gone"), 3: Retry(5), 99: ValueError("ignored")})

    _put(fn)
    outcomes = batch_handlers.run(_items(*({"n": n} for n in range(4))))
    assert kinds(outcomes) == [decision.FAILED, decision.OK, decision.ARCHIVE, decision.RETRY]
    assert "bad sku" in outcomes[0].reason and outcomes[3].delay_ms == 5000


def test_any_other_exception_fails_every_event():
    def fn(payloads):
        raise ConnectionError("database down")

    _put(fn)
    assert kinds(batch_handlers.run(_items({"n": 1}, {"n": 2}))) == [decision.FAILED] * 2


def test_an_undecodable_or_invalid_event_is_settled_alone_and_indices_are_of_the_list_given():
    got = []

    def fn(orders: list[Order]):
        got.append([o.sku for o in orders])
        raise BatchFailed({1: ValueError("second of the list")})

    _put(fn, contract=batch_contract(fn, bind=False, raw=False, where="test"))
    outcomes = batch_handlers.run(_items({"sku": "a"}, b"{not json", {"nope": 1}, {"sku": "b"}))
    assert got == [["a", "b"]]
    assert kinds(outcomes) == [decision.OK, decision.UNDECODABLE, decision.INVALID, decision.FAILED]


def test_async_def_handlers_are_awaited_once_with_the_list():
    calls = []

    async def fn(payloads):
        await asyncio.sleep(0)
        calls.append(len(payloads))

    _put(fn)
    assert kinds(batch_handlers.run(_items({"n": 1}, {"n": 2}))) == ["ok", "ok"]
    assert calls == [2]


def test_run_one_is_a_list_of_one_and_a_missing_route_is_lost():
    calls = []
    _put(calls.append)
    assert batch_handlers.run_one(*_items({"n": 1})[0]).kind == "ok" and calls == [[{"n": 1}]]
    registry._routes.clear()
    assert kinds(batch_handlers.run(_items({"n": 1}))) == [decision.LOST]


def test_each_event_sees_its_own_ending_in_handling_contexts():
    seen = []

    class Watch(Middleware):
        def handling(self, event):

            class Context:
                def __enter__(self):
                    return None

                def __exit__(self, exc_type, exc, tb):
                    seen.append((event.message_id, exc_type.__name__ if exc_type else None))
            return Context()

    def fn(payloads):
        raise BatchFailed({1: ValueError("x")})

    _put(fn, Hooks([Watch()]))
    batch_handlers.run(_items({"n": 0}, {"n": 1}))
    assert sorted(seen) == [("m0", None), ("m1", "ValueError")]
