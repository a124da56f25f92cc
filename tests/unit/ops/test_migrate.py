"""migrate.migration_steps: the steps for every state a queue and its holding queue can be in (no broker)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from kombu import Queue

from kombu_events.core.wire import Undecoded
from kombu_events.ops.migrate import MigrationError, QueueState, copy_properties, holding_name, migration_steps

Q = Queue("billing.audit", durable=True, queue_arguments={"x-queue-type": "quorum"})
HOLD = holding_name(Q.name)


def steps(current: QueueState, holding: QueueState) -> list[tuple[str, str]]:
    return [(s.action, s.queue) for s in migration_steps([Q], {Q.name: current, HOLD: holding})]


def state(name: str, exists: bool = True, matches: bool = False, messages: int = 0, consumers: int = 0):
    return QueueState(name, exists=exists, matches=matches, messages=messages, consumers=consumers)


STAGE_TWO = [("declare", Q.name), ("bind", Q.name), ("unbind", HOLD), ("move", Q.name), ("delete", HOLD)]


def test_a_queue_already_declared_as_the_target_needs_nothing():
    assert steps(state(Q.name, matches=True, messages=5), state(HOLD, exists=False)) == []


def test_a_missing_queue_is_declared_and_bound():
    assert steps(state(Q.name, exists=False), state(HOLD, exists=False)) == [("declare", Q.name), ("bind", Q.name)]


def test_a_queue_of_the_other_type_goes_through_its_holding_queue_and_back():
    planned = migration_steps([Q], {Q.name: state(Q.name, messages=7), HOLD: state(HOLD, exists=False)})
    assert [(s.action, s.queue) for s in planned] == [
        ("declare-holding", HOLD), ("bind", HOLD), ("unbind", Q.name), ("move", HOLD), ("delete", Q.name),
        *STAGE_TWO]
    moves = [s for s in planned if s.action == "move"]
    assert [(m.source, m.queue, m.messages) for m in moves] == [(Q.name, HOLD, 7), (HOLD, Q.name, 7)]
    assert moves[0].describe() == f"move {Q.name} -> {HOLD}: 7 message(s) (each confirmed, then acked)"


def test_a_run_that_died_in_stage_one_starts_again_without_declaring_the_holding_queue():
    planned = migration_steps([Q], {Q.name: state(Q.name, messages=3), HOLD: state(HOLD, messages=4)})
    assert [(s.action, s.queue) for s in planned] == [
        ("bind", HOLD), ("unbind", Q.name), ("move", HOLD), ("delete", Q.name), *STAGE_TWO]
    assert planned[-2].messages == 7, "what the holding queue has, and what is still to come"


@pytest.mark.parametrize("current", [state(Q.name, exists=False), state(Q.name, matches=True, messages=2)],
                         ids=["old-queue-deleted", "new-queue-declared"])
def test_a_run_that_died_in_stage_two_finishes_it(current):
    assert steps(current, state(HOLD, messages=9)) == STAGE_TWO


@pytest.mark.parametrize("busy", ["queue", "holding"])
def test_consumers_anywhere_refuse_the_whole_plan(busy):
    other = Queue("billing.other", durable=True)
    states = {Q.name: state(Q.name, consumers=2 if busy == "queue" else 0),
              HOLD: state(HOLD, consumers=1 if busy == "holding" else 0),
              other.name: state(other.name), holding_name(other.name): state(holding_name(other.name), exists=False)}
    with pytest.raises(MigrationError, match="stop the service's workers first") as caught:
        migration_steps([other, Q], states)
    assert (f"{Q.name} (2)" if busy == "queue" else f"{HOLD} (1)") in str(caught.value)


def test_a_missing_queue_with_consumers_counts_for_nothing():
    assert steps(state(Q.name, exists=False, consumers=3), state(HOLD, exists=False)) == [
        ("declare", Q.name), ("bind", Q.name)]


def test_a_moved_copy_keeps_what_the_publisher_set_and_drops_what_the_broker_did():
    properties = {
        "message_id": "m-1", "content_type": "application/json", "delivery_mode": 2, "expiration": "60000",
        "user_id": "someone-else", "app_id": Undecoded(b"\xff".decode("utf-8", "surrogateescape")),
        "application_headers": {"x-delivery-count": 3, "x-death": [{"count": 1}], "trace": "t"},
    }
    copied = copy_properties(properties, userid="guest")
    assert copied == {
        "message_id": "m-1", "content_type": "application/json", "delivery_mode": 2, "expiration": "60000",
        "app_id": b"\xff", "application_headers": {"x-death": [{"count": 1}], "trace": "t"},
    }
    assert copy_properties({"user_id": "guest"}, userid="guest")["user_id"] == "guest"


# -- migrate --archive: the steps for each state of the archive and its holding queue ---------------------------

from kombu_events.broker.stream_headers import unpack  # noqa: E402
from kombu_events.ops.archive_rewrite import Seen  # noqa: E402
from kombu_events.ops.migrate_archive import (  # noqa: E402
    ArchiveState,
    _IntoStream,
    archive_holding_name,
    archive_steps,
)

ARCHIVE = "billing.archive"
MOVING = archive_holding_name(ARCHIVE)


def archive_plan(kind: str, holding: int | None = None, messages: int = 0, consumers: int = 0):
    hold = state(MOVING, exists=False) if holding is None else state(MOVING, messages=holding)
    return [(s.action, s.queue) for s in archive_steps(ARCHIVE, ArchiveState(kind, hold, messages, consumers))]


BACK = [("fill", ARCHIVE), ("delete", MOVING)]


def test_an_archive_of_an_earlier_version_goes_through_the_holding_queue_into_the_stream():
    assert MOVING == "billing.archive.moving"
    assert archive_plan("queue", messages=5) == [
        ("declare-holding", MOVING), ("bind", MOVING), ("unbind", ARCHIVE), ("move", MOVING), ("delete", ARCHIVE),
        ("declare-stream", ARCHIVE), *BACK]


@pytest.mark.parametrize("kind, holding, expected", [
    ("queue", 3, [("bind", MOVING), ("unbind", ARCHIVE), ("move", MOVING), ("delete", ARCHIVE),
                  ("declare-stream", ARCHIVE), *BACK]),
    ("missing", 3, [("declare-stream", ARCHIVE), *BACK]),
    ("stream", 3, BACK),
    ("stream", None, []),
    ("missing", None, []),
], ids=["died-moving-out", "died-after-deleting", "died-filling", "done", "no-archive"])
def test_a_run_that_died_anywhere_is_finished_from_what_the_broker_holds(kind, holding, expected):
    assert archive_plan(kind, holding) == expected


def test_a_reader_of_the_old_archive_refuses_the_move():
    with pytest.raises(MigrationError, match=r"billing.archive \(1\)"):
        archive_plan("queue", messages=2, consumers=1)


def test_a_moved_copy_gets_a_key_and_its_header_table_packed_as_the_worker_packs_it():
    table = {"kombu-events-archived-at": "t1", "x-death": [{"count": 1}], "t": {"k": "v"}}
    old = SimpleNamespace(body=b"{}", properties={"message_id": "m", "application_headers": table})

    body, properties = _IntoStream(Seen(), userid=None)(old)
    stored = properties["application_headers"]
    assert body == b"{}" and len(stored["kombu-events-archive-key"]) == 20
    assert "x-death" not in stored and stored["kombu-events-archived-at"] == "t1"
    assert unpack(stored) == {**table,
                              "kombu-events-archive-key": stored["kombu-events-archive-key"]}


def test_seen_knows_a_keyed_copy_by_its_key_and_an_unkeyed_one_by_its_content():
    seen = Seen()
    stamped = {"kombu-events-archive-key": "k1", "kombu-events-archived-at": "t1"}
    seen.add(stamped, {"message_id": "m"}, b"body")
    assert seen.has({"kombu-events-archived-at": "t1"}, {"message_id": "m"}, b"body"), "its original, unkeyed"
    assert not seen.has({"kombu-events-archived-at": "t2"}, {"message_id": "m"}, b"body")
    assert not seen.has({"kombu-events-archive-key": "k2", "kombu-events-archived-at": "t1"}, {"message_id": "m"},
                        b"body"), "another key is another copy"
