"""The steps of ``migrate --partitions``, decided from what the broker holds (no broker here)."""
from __future__ import annotations

import pytest
from celery import Celery

from kombu_events import Events
from kombu_events.broker.declare import QueueCounts
from kombu_events.ops.migrate import MigrationError
from kombu_events.ops.repartition import Observed, repartition_steps


def partition_set(partitions: int):
    events = Events(Celery("t", broker="memory://"), service="shop")

    @events.handler("orders.#", ordered_by="key", partitions=partitions)
    def orders(payload: object) -> None:
        pass

    [found] = events.topology().partition_sets()
    return found


def observed(partitions: int, existing: dict[str, int], holding: int | None = None, consumers: int = 0,
             staging: int | None = None) -> Observed:
    return Observed(partition_set(partitions), {name: QueueCounts(n, consumers) for name, n in existing.items()},
                    None if holding is None else QueueCounts(holding, 0),
                    None if staging is None else QueueCounts(staging, 0))


def actions(steps) -> list[tuple[str, str]]:
    return [(s.action, s.source or s.queue) for s in steps]


def test_the_partitions_know_their_exchange_its_sources_and_their_queues():
    found = partition_set(12)
    assert found.queue == "shop.orders" and found.exchange == "shop.orders.partitions"
    assert [q.name for q in found.queues] == [f"shop.orders.p{i:02d}" for i in range(12)]
    assert found.sources[0] == ("events", "orders.#"), "fed by the events exchange with the handler's keys"
    assert found.sources[1][0] == "events.deferred", "and by the due exchange, with delayed events"


def test_nothing_to_do_when_the_broker_has_the_apps_partitions_or_none():
    assert repartition_steps(observed(4, {})) == []
    assert repartition_steps(observed(4, {f"shop.orders.p{i}": 3 for i in range(4)})) == []


def test_a_new_count_holds_new_events_moves_every_partition_and_drops_the_old_ones_highest_first():
    steps = repartition_steps(observed(2, {f"shop.orders.p{i}": 10 * i for i in range(4)}))
    assert actions(steps) == [
        ("declare-holding", "shop.orders.repartitioning"), ("hold", "shop.orders.repartitioning"),
        ("unhook", "shop.orders.partitions"),
        ("declare", "shop.orders.p0"), ("declare", "shop.orders.p1"),
        ("bridge", "shop.orders.p2"), ("bridge", "shop.orders.p3"),
        ("declare-staging", "shop.orders.repartitioning.old"),
        ("stage", "shop.orders.p0"), ("stage", "shop.orders.p1"), ("stage", "shop.orders.p2"),
        ("stage", "shop.orders.p3"), ("route", "shop.orders.repartitioning.old"),
        ("drain", "shop.orders.repartitioning"), ("hook", "shop.orders.partitions"),
        ("unhold", "shop.orders.repartitioning"), ("drain", "shop.orders.repartitioning"),
        ("delete", "shop.orders.repartitioning"), ("delete", "shop.orders.repartitioning.old"),
        ("delete", "shop.orders.p3"), ("delete", "shop.orders.p2")]
    assert [s.messages for s in steps if s.action == "stage"] == [0, 10, 20, 30]
    assert all(s.describe() for s in steps)


def test_a_wider_count_renames_every_partition():
    steps = repartition_steps(observed(16, {f"shop.orders.p{i}": 1 for i in range(8)}))
    assert [s.queue for s in steps if s.action == "declare"] == [f"shop.orders.p{i:02d}" for i in range(16)]
    assert [s.queue for s in steps if s.action == "delete"][2:] == [f"shop.orders.p{i}" for i in reversed(range(8))]


def test_an_unfinished_run_goes_on_from_its_holding_queue():
    steps = repartition_steps(observed(2, {"shop.orders.p0": 0, "shop.orders.p1": 5}, holding=7))
    assert actions(steps)[0] == ("hold", "shop.orders.repartitioning"), "the holding queue exists: not declared"
    assert ("drain", "shop.orders.repartitioning") in actions(steps)
    assert next(s.messages for s in steps if s.action == "drain") == 7
    staged = repartition_steps(observed(2, {"shop.orders.p0": 0, "shop.orders.p1": 5}, holding=7, staging=3))
    assert "declare-staging" not in [s.action for s in staged], "the staging queue exists: not declared"
    assert ("route", "shop.orders.repartitioning.old") in actions(staged)


def test_consumers_attached_refuse_the_move_before_any_step():
    with pytest.raises(MigrationError, match=r"consumers are attached to shop\.orders\.p0 \(2\)"):
        repartition_steps(observed(2, {f"shop.orders.p{i}": 1 for i in range(4)}, consumers=2))
