"""Settling when the broker refuses: refused retries, refused archives, frames too large, workers killed.

Each test has its own service and exchange (``make_project`` deletes them). Delays are
short: 100 ms units, 8 levels.
"""
from __future__ import annotations

import json

import amqp
import pytest
from kombu import Connection

from ..brokers import rabbitmqctl, with_credentials
from .harness import Project, peek_messages, publish_amqp, queue_counts, queue_depth, unique, wait_for

pytestmark = pytest.mark.integration

SETTINGS = "delay_unit_ms=100, delay_levels=8"


def send(project: Project, routing_key: str, payload: object, **properties: object) -> str:
    properties.setdefault("message_id", unique("m"))
    properties.setdefault("content_type", "application/json")
    publish_amqp(project.broker_url, project.exchange, routing_key, json.dumps(payload).encode(), **properties)
    return str(properties["message_id"])


def delete_queue(project: Project, name: str) -> None:
    with Connection(project.broker_url) as conn:
        conn.default_channel.queue_delete(f"{project.service}.{name}")


def archived(project: Project, count: int = 1, timeout: float = 20) -> list:
    archive = f"{project.service}.archive"
    wait_for(lambda: queue_depth(project.broker_url, archive)[0] >= count, timeout, what=f"{count} archived")
    return peek_messages(project.broker_url, archive)


def handled(project: Project, message_id: str) -> list[dict]:
    return project.records(message_id=message_id)


FAILS = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS}, backoff=Constant(every_ms=200))

@events.handler("jobs.#", bind=True, max_retries=3)
def job(event):
    record(message_id=event.message_id, attempt=event.attempt)
    if event.payload.get("archive"):
        raise Archive("refused by the handler")
    raise RuntimeError("fails every time")
"""


def test_a_refused_retry_is_archived_with_the_reason(make_project):
    project = make_project(FAILS)
    project.worker().wait_ready()
    delete_queue(project, "delay.1")  # a 2-unit retry enters at level 1: now nothing is bound there
    message_id = send(project, "jobs.1", {})

    [message] = archived(project)
    reason = message.headers["kombu-events-reason"]
    assert message.properties["message_id"] == message_id
    assert reason.startswith("retry publish failed (returned by the broker"), reason
    assert "RuntimeError: fails every time" in reason
    assert [r["attempt"] for r in handled(project, message_id)] == [1]
    assert queue_counts(project.broker_url)[f"{project.service}.job"][:2] == (0, 0)


def test_a_refused_archive_is_held_unacked_then_archived_by_the_next_worker(make_project):
    project = make_project(FAILS)
    first = project.worker().wait_ready()
    delete_queue(project, "archive")
    message_id = send(project, "jobs.1", {"archive": True})

    wait_for(lambda: "outcome=held" in first.log, what="the held outcome logged")
    line = next(line for line in first.log.splitlines() if "outcome=held" in line)
    assert "ERROR" in line and message_id in line and "archive publish failed" in line
    queue = f"{project.service}.job"
    wait_for(lambda: queue_counts(project.broker_url)[queue][:2] == (0, 1), timeout=10,
             what="the message unacked, not dropped")

    first.kill()  # the broker gets the held message back; the next worker declares the archive again
    project.worker().wait_ready()
    [message] = archived(project)
    assert message.properties["message_id"] == message_id
    assert message.headers["kombu-events-reason"] == "refused by the handler"
    assert queue_counts(project.broker_url)[queue][:2] == (0, 0)


def _headers_filling_a_frame(spare: int) -> dict[str, str]:
    """Headers whose properties fill one 128 KiB frame but for ``spare`` bytes."""
    headers = {"x-request-id": "r-1", "big": ""}
    base = len(amqp.Message(b"", message_id="m" * 32, content_type="application/json",
                            application_headers=headers)._serialize_properties())
    headers["big"] = "b" * (131_072 - 8 - 14 - spare - base)
    return headers


@pytest.mark.parametrize("payload, action", [({"archive": True}, "archive"), ({}, "retry")])
def test_headers_that_leave_no_room_in_a_frame_are_archived_without_them(make_project, payload, action):
    """The broker accepted the publisher's headers; ours would push them past one frame, which
    would close the worker's connection. The copy is archived with the library's headers only."""
    project = make_project(FAILS)
    worker = project.worker().wait_ready()
    message_id = send(project, "jobs.big", payload, message_id="m" * 32,
                      application_headers=_headers_filling_a_frame(spare=64))

    [message] = archived(project)
    assert message.properties["message_id"] == message_id
    assert json.loads(message.body) == payload
    assert "big" not in message.headers and "x-request-id" not in message.headers
    assert "dropped" in message.headers["kombu-events-dropped-headers"]
    assert "frame" in message.headers["kombu-events-dropped-headers"]
    reason = message.headers["kombu-events-reason"]
    assert reason.startswith("retry publish failed") if action == "retry" else reason == "refused by the handler"
    assert worker.proc.poll() is None and "Connection" not in worker.log.split("ready.", 1)[1]


KILLER = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, {SETTINGS})

@events.handler("jobs.#", bind=True, max_retries=1)
def killer(event):
    record(message_id=event.message_id, attempt=event.attempt)
    os._exit(1)  # under --pool=solo this is the worker's main process
"""


def test_a_handler_that_kills_a_solo_worker_ends_in_the_archive_after_the_redelivery_cap(make_project):
    """Each worker runs the handler once and dies with it; the redelivery count grows until the
    message is archived. A worker may die after publishing a requeued copy but before acking the
    original (the copy can arrive before the confirm): then both come back, counted, and both end
    in the archive -- duplicates, never a loss, never an endless loop.

    Every copy runs at redelivery counts 0, 1 and 2 on its way to the archive, so the runs form a
    tree whose every path from the first run to an archived copy holds 3 runs: at least 3 in all,
    at most 3 per archived copy (a clean-clone CI run saw 7 runs, over the bound of 6 this test had)."""
    project = make_project(KILLER)
    project.declare()
    message_id = send(project, "jobs.1", {})
    queue, archive = f"{project.service}.killer", f"{project.service}.archive"

    def settled() -> bool:
        return queue_depth(project.broker_url, archive)[0] > 0 and queue_counts(project.broker_url)[queue][:2] == (0, 0)

    died = 0
    while not settled():
        assert died < 20, "the message was not archived after the redelivery cap"
        worker = project.worker()
        wait_for(lambda w=worker: w.proc.poll() is not None or settled(), timeout=30,
                 what="the worker killed by its handler, or every copy archived")
        died += worker.proc.poll() is not None
        worker.kill()

    copies = peek_messages(project.broker_url, archive)
    assert {m.properties["message_id"] for m in copies} == {message_id}
    # max_retries=1: archived on the third redelivery, never run again; one run per worker that died
    assert len(handled(project, message_id)) == died and 3 <= died <= 3 * len(copies), (died, len(copies))
    for copy in copies:
        assert copy.headers["kombu-events-reason"].startswith("redelivered 3 times without an ack")
        assert copy.headers["kombu-events-redeliveries"] == 2


def test_archive_replay_by_another_user_never_sends_a_user_id_the_broker_would_refuse(make_project):
    """A message published with user_id=guest and archived keeps it; an operator replaying as another
    user must not send it back with that user_id (the broker would refuse the publish): the copy carries
    the operator's own, and the worker's archive copy of it the worker's (docs/security.md)."""

    from .harness import run_cli

    project = make_project(FAILS)
    user, password = unique("op"), unique("pw")
    rabbitmqctl("add_user", user, password)
    try:
        rabbitmqctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        project.worker().wait_ready()
        message_id = send(project, "jobs.1", {"archive": True}, user_id="guest")
        [message] = archived(project)
        assert message.properties["user_id"] == "guest"

        operator = with_credentials(project.broker_url, user, password)
        result = run_cli(project, "--broker", operator, "archive", "replay")
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"replayed {message.key} (id {message_id})" in result.stdout
        # replayed as the operator, handled again, and archived again by the worker (as its own user, guest)
        wait_for(lambda: len(handled(project, message_id)) == 2, what="the replayed message handled")
        [again] = archived(project)
        assert again.properties["message_id"] == message_id and again.properties["user_id"] == "guest"
        assert again.key != message.key and again.headers["kombu-events-replay-of"] == message.key
    finally:
        rabbitmqctl("delete_user", user, check=False)
