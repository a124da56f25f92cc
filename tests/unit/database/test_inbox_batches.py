"""The inbox around a batch handler: one transaction for the call, one row per event; duplicates left out."""
from __future__ import annotations

import pytest
import sqlalchemy as sa

from kombu_events import BatchFailed, BatchOf, Events
from kombu_events.database import session
from kombu_events.database.tables import metadata
from kombu_events.testing import StubEvents


@pytest.fixture
def engine(tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite3'}")
    metadata.create_all(engine)
    sa.Table("effects", sa.MetaData(), sa.Column("n", sa.Integer)).create(engine)
    yield engine
    engine.dispose()


def _rows(engine, sql):
    with engine.connect() as c:
        return sorted(tuple(r) for r in c.execute(sa.text(sql)))


def test_one_row_per_event_a_failed_event_retried_and_a_redelivery_left_out(app, engine):
    events = Events(app, "billing", database=engine, delay_unit_ms=100, delay_levels=8)
    calls: list[list[int]] = []

    @events.handler("orders.#", batch=BatchOf(max=10), once=True)
    def store(payloads):
        calls.append([p["n"] for p in payloads])
        for p in payloads:
            session().execute(sa.text("INSERT INTO effects (n) VALUES (:n)"), {"n": p["n"]})
        if len(calls) == 1:
            raise BatchFailed({1: ValueError("bad sku")})  # n=1: its write must roll back... by the handler

    stub = StubEvents(events)
    for n in range(3):
        stub.publish("orders.created", {"n": n}, message_id=f"m{n}")
    stub.publish("orders.created", {"n": 0}, message_id="m0")  # a copy of m0 in the same batch: left out
    stub.join(fail_fast=False)
    assert calls == [[0, 1, 2]]
    assert [s.action for s in stub.settled] == ["ack", "retry", "ack", "ack"]
    assert [k for (_, k) in _rows(engine, "SELECT queue, dedup_key FROM kombu_events_inbox")] == ["m0", "m2"]
    stub.advance(5, fail_fast=False)
    assert calls[1:] == [[1]]
    assert [k for (_, k) in _rows(engine, "SELECT queue, dedup_key FROM kombu_events_inbox")] == ["m0", "m1", "m2"]
    stub.publish("orders.created", {"n": 2}, message_id="m2")  # handled before: acked, the handler not called
    stub.join()
    assert calls[2:] == [] and stub.settled[-1].action == "ack"


def test_a_plain_exception_rolls_the_whole_call_back(app, engine):
    events = Events(app, "billing", database=engine, delay_unit_ms=100, delay_levels=8)

    @events.handler("orders.#", batch=BatchOf(max=10), once=True)
    def store(payloads):
        for p in payloads:
            session().execute(sa.text("INSERT INTO effects (n) VALUES (:n)"), {"n": p["n"]})
        raise RuntimeError("constraint")

    stub = StubEvents(events)
    for n in range(3):
        stub.publish("orders.created", {"n": n}, message_id=f"m{n}")
    stub.join(fail_fast=False)
    assert [s.action for s in stub.settled] == ["retry"] * 3
    assert _rows(engine, "SELECT n FROM effects") == []
    assert _rows(engine, "SELECT dedup_key FROM kombu_events_inbox") == []
