"""ops/status.py: which handler queues show as paused; every queue's counts, a missing one among them."""
from __future__ import annotations

import celery
import pytest
from amqp.exceptions import NotFound

from kombu_events import Events
from kombu_events.ops import status
from kombu_events.ops.archive import LegacyArchiveError
from kombu_events.ops.status import CONSUMING, PAUSED, QueueStatus, queue_state


@pytest.mark.parametrize("role, consumers, state", [
    ("handler", 0, PAUSED), ("handler", 1, CONSUMING), ("handler", 3, CONSUMING), ("handler", None, None),
    ("delay", 0, None), ("archive", 0, None), ("unrouted", 0, None),
])
def test_a_handler_queue_with_no_consumer_is_paused_and_other_queues_have_no_state(role, consumers, state):
    assert queue_state(role, consumers) == state


def test_the_state_is_in_the_json_form():
    row = QueueStatus("billing.charge", "handler", 4, 0, 0, state=PAUSED)
    assert row.as_dict()["state"] == "paused"


class Channel:
    def __init__(self, counts, log):
        self.counts, self.log = counts, log
        log.append("open")

    def queue_declare(self, name, passive):
        assert passive, "status never creates a queue"
        if name not in self.counts:
            raise NotFound(f"no queue '{name}'", (50, 10), 404)
        return (name, *self.counts[name])

    def close(self):
        self.log.append("close")


class Connection:
    hostname = "rabbit.example"

    def __init__(self, counts):
        self.counts, self.log = counts, []

    def channel(self):
        return Channel(self.counts, self.log)


def _topology():
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, service="billing", delay_levels=2, publish_delay_levels=0)
    events.handler("orders.#", name="orders")(lambda payload: None)
    events.handler("users.#", name="users")(lambda payload: None)
    return events.topology()


def test_gather_reads_every_queue_a_missing_one_included_and_asks_the_api_until_it_fails(monkeypatch):
    topology = _topology()
    names = [q.name for q in topology.queues]
    handlers = [q.name for q in topology.handler_queues]
    counts = {name: (index, 0) for index, name in enumerate(names) if name != "billing.delay.1"}
    counts[handlers[0]] = (5, 2)
    asked = []

    def management(connection, queue, base_url):
        asked.append((queue, base_url))
        return {"messages_unacknowledged": 3} if len(asked) == 1 else None

    monkeypatch.setattr(status, "queue_statistics", management)
    monkeypatch.setattr(status, "archived_count", lambda connection, topology: 7)  # read from the stream
    connection = Connection(counts)
    rows = status.gather(connection, topology)
    assert [r.queue for r in rows] == names
    by_name = {r.queue: r for r in rows}
    assert by_name["billing.delay.1"] == QueueStatus("billing.delay.1", "delay", None, None, None, exists=False)
    assert by_name[handlers[0]] == QueueStatus(handlers[0], "handler", 5, 3, 2, state=CONSUMING)
    assert by_name[handlers[1]] == QueueStatus(handlers[1], "handler", counts[handlers[1]][0], None, 0, state=PAUSED)
    # the archive, a stream: its pending copies, read; nothing in it is ever unacknowledged
    archive = counts["billing.archive"]
    assert by_name["billing.archive"] == QueueStatus("billing.archive", "archive", 7, 0, archive[1])
    assert [q for q, _ in asked] == handlers, "the API is not asked again once it failed"
    assert {url for _, url in asked} == {"http://rabbit.example:15672"}
    assert connection.log.count("open") == connection.log.count("close") == 2, "one channel, renewed after the 404"


def test_an_archive_of_an_earlier_version_is_counted_by_its_passive_declare(monkeypatch):
    def legacy(connection, topology):
        raise LegacyArchiveError("a classic queue")

    topology = _topology()
    monkeypatch.setattr(status, "queue_statistics", lambda connection, queue, base_url: None)
    monkeypatch.setattr(status, "archived_count", legacy)
    rows = status.gather(Connection({q.name: (3, 0) for q in topology.queues}), topology)
    assert rows[-1] == QueueStatus("billing.archive", "archive", 3, None, 0)


def test_read_depths_leaves_a_missing_queue_out():
    connection = Connection({"a": (4, 1), "c": (0, 0)})
    assert status.read_depths(connection, ["a", "b", "c"]) == {"a": 4, "c": 0}
    assert connection.log.count("open") == connection.log.count("close") == 2
