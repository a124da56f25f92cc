"""The steps of ``migrate --partitions``, decided from what the broker holds (no broker here)."""
from __future__ import annotations

import pytest
from amqp.exceptions import PreconditionFailed
from celery import Celery

from kombu_events import Events
from kombu_events.broker.declare import QueueCounts
from kombu_events.ops import repartition
from kombu_events.ops.migrate import MigrationError
from kombu_events.ops.repartition import Observed, reconcile, repartition_steps


def partition_set(partitions: int):
    events = Events(Celery("t", broker="memory://"), service="shop")

    @events.handler("orders.#", ordered_by="key", partitions=partitions)
    def orders(payload: object) -> None:
        pass

    [found] = events.topology().partition_sets()
    return found


def observed(partitions: int, existing: dict[str, int], holding: int | None = None, consumers: int = 0,
             staging: int | None = None, returns: int | None = None, routing: bool = False) -> Observed:
    return Observed(partition_set(partitions), {name: QueueCounts(n, consumers) for name, n in existing.items()},
                    None if holding is None else QueueCounts(holding, 0),
                    None if staging is None else QueueCounts(staging, 0),
                    None if returns is None else QueueCounts(returns, 0), routing)


def actions(steps) -> list[tuple[str, str]]:
    return [(s.action, s.queue if s.action in ("bridge", "reclaim") else s.source or s.queue) for s in steps]


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
        ("stage", "shop.orders.p3"), ("mark", "shop.orders.repartitioning.routing"),
        ("route", "shop.orders.repartitioning.old"), ("unmark", "shop.orders.repartitioning.routing"),
        ("delete", "shop.orders.repartitioning.old"),
        ("drain", "shop.orders.repartitioning"), ("hook", "shop.orders.partitions"),
        ("unhold", "shop.orders.repartitioning"), ("drain", "shop.orders.repartitioning"),
        ("delete", "shop.orders.repartitioning"),
        ("delete", "shop.orders.p3"), ("delete", "shop.orders.p2"),
        ("return", "shop.orders.repartitioning.returns"), ("unbridge", "shop.orders.repartitioning.returns")]
    assert {s.source for s in steps if s.action == "bridge"} == {"shop.orders.repartitioning.returns"}
    assert [s.messages for s in steps if s.action == "stage"] == [0, 10, 20, 30]
    assert all(s.describe() for s in steps)


def test_a_wider_count_renames_every_partition():
    steps = repartition_steps(observed(16, {f"shop.orders.p{i}": 1 for i in range(8)}))
    assert [s.queue for s in steps if s.action == "declare"] == [f"shop.orders.p{i:02d}" for i in range(16)]
    assert [s.queue for s in steps if s.action == "delete"][2:] == [f"shop.orders.p{i}" for i in reversed(range(8))]
    assert [s.action for s in steps][-2:] == ["return", "unbridge"], "the dropped partitions' way back, removed"


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


def test_a_run_stopped_while_routing_routes_what_is_left_staged_before_staging_again():
    existing = {f"shop.orders.p{i}": 40 for i in range(6)}  # the new partitions hold the first part, routed
    steps = actions(repartition_steps(observed(6, existing, holding=0, staging=300, routing=True)))
    assert not [a for a, _ in steps if a in ("stage", "declare-staging", "mark")], \
        "staged again behind what is left, the first part of a key would run after the rest"
    assert steps.index(("route", "shop.orders.repartitioning.old")) < steps.index(("hook", "shop.orders.partitions"))
    stopped_while_staging = actions(repartition_steps(observed(6, existing, holding=0, staging=300)))
    assert stopped_while_staging.index(("stage", "shop.orders.p5")) < \
        stopped_while_staging.index(("route", "shop.orders.repartitioning.old"))


def test_an_earlier_runs_bridge_is_removed_with_workers_running_and_reclaimed_by_a_partition_declared_again():
    running = repartition_steps(observed(2, {"shop.orders.p0": 3, "shop.orders.p1": 0}, consumers=1, returns=4))
    assert actions(running) == [("return", "shop.orders.repartitioning.returns"),
                                ("unbridge", "shop.orders.repartitioning.returns")]
    grown = actions(repartition_steps(observed(4, {"shop.orders.p0": 3, "shop.orders.p1": 0}, returns=0)))
    assert grown.index(("reclaim", "shop.orders.p0")) < grown.index(("declare", "shop.orders.p0"))
    assert [s.queue for s in repartition_steps(observed(4, {"shop.orders.p0": 3}, returns=0))
            if s.action == "reclaim"] == [f"shop.orders.p{i}" for i in range(4)]


def test_reconcile_names_each_mismatch():
    agree = {"counted": 500, "staged": 500, "staging": 500, "partitions": 500}
    assert reconcile(agree) == []
    [staged] = reconcile({**agree, "staged": 501, "staging": 501, "partitions": 501})
    assert staged.startswith("mismatch: 500 event(s) counted in the partitions") and "501 staged" in staged
    [routed] = reconcile({**agree, "partitions": 499})
    assert "500 event(s) counted staged" in routed and "499 sent to the new partitions" in routed


class _Channel:
    """A channel whose ``queue_delete`` answers as the broker would, once a message came in between."""

    def __init__(self, log: list, came: list) -> None:
        self.log, self.came = log, came

    def queue_delete(self, name: str, if_empty: bool = False) -> int:
        self.log.append(("delete", name, if_empty))
        if self.came:
            if if_empty:
                raise PreconditionFailed(f"queue '{name}' not empty")
            return self.came.pop()
        return 0

    def close(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["classic", "quorum"])
def test_a_queue_deleted_once_empty_sends_on_what_came_in_between_or_says_it_is_lost(monkeypatch, kind):
    log: list = []
    came = [1]  # found empty, then a message published to it by name before the delete
    connection = type("Connection", (), {"channel": lambda self: _Channel(log, came)})()
    monkeypatch.setattr(repartition, "peek_queues", lambda conn, names: {names[0]: QueueCounts(0, 0)})
    monkeypatch.setattr(repartition, "_through", lambda conn, source, exchange, **kw: came.pop() if came else 0)
    lines: list[str] = []
    if kind == "quorum":  # a quorum queue refuses if-empty: the message went with the queue, and the run says so
        with pytest.raises(MigrationError, match=r"1 message\(s\) were published to shop.orders.p3 by name"):
            repartition._delete_when_empty(connection, "shop.orders.p3", "shop.orders.partitions", lines.append, kind)
        assert log == [("delete", "shop.orders.p3", False)]
        return
    sent = repartition._delete_when_empty(connection, "shop.orders.p3", "shop.orders.partitions", lines.append, kind)
    assert log == [("delete", "shop.orders.p3", True)] * 2, "if-empty: the broker refuses while a message is there"
    assert sent == 1, "what came in between is sent on, and counted"
