"""The typed handler of the ``typed5`` rows: a 5-field pydantic model, validated in the pool for every message.

Imported only by ``events_app``'s ``typed`` mode (needs pydantic 2 and a ``kombu_events`` with contracts),
so the app itself still imports on older source trees. The model and the handler live in one module: the
handler's annotation (a string, with ``from __future__ import annotations``) resolves against its globals.
The payload it fits is :func:`benchmarks.broker.order_payload`.
"""
from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from benchmarks import probe


class Order5(BaseModel):
    """Five fields, one of each common kind: int, str, float, a short str, an ISO datetime string to parse."""

    i: int
    order_id: str
    amount: float
    currency: str
    placed_at: datetime


def typed5(order: Order5) -> None:
    """No-op, as ``noop``: the worker validated the payload into an ``Order5`` before the call."""
    probe.handled(order.i)
