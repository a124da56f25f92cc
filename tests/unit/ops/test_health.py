"""ops/health.py: the problems `kombu-events health` reports, one line each (pure), and missing exchanges."""
from __future__ import annotations

import celery
from amqp.exceptions import NotFound

from kombu_events import Events
from kombu_events.ops.health import missing_exchanges, problems
from kombu_events.ops.status import QueueStatus

HEALTHY = [
    QueueStatus("billing.audit", "handler", 0, 0, 2),
    QueueStatus("billing.delay.0", "delay", 3, 0, 0),
    QueueStatus("billing.archive", "archive", 7, 0, 0),
]


def test_a_healthy_service_has_no_problem():
    assert problems(HEALTHY) == []
    assert problems(HEALTHY, max_archive=7) == [], "at the threshold is fine: more than it is a problem"


def test_every_problem_is_one_line():
    rows = [
        QueueStatus("billing.audit", "handler", 5, None, 0),
        QueueStatus("billing.charge", "handler", None, None, None, exists=False),
        QueueStatus("billing.archive", "archive", 12, None, 0),
    ]
    assert problems(rows, missing=["billing.delivery"], max_archive=10) == [
        "exchange billing.delivery: missing (run `kombu-events declare` or start a worker)",
        "queue billing.audit: no consumer (paused: its circuit breaker is open, or no worker runs)",
        "queue billing.charge: missing (run `kombu-events declare` or start a worker)",
        "archive billing.archive: 12 messages, more than --max-archive 10",
    ]


def test_the_archive_is_not_checked_without_a_threshold():
    assert problems([QueueStatus("billing.archive", "archive", 10**6, None, 0)]) == []


class Channel:
    def __init__(self, existing, log):
        self.existing, self.log = existing, log
        log.append("open")

    def exchange_declare(self, name, type, passive):
        assert passive
        self.log.append(name)
        if name not in self.existing:
            raise NotFound("no exchange", (40, 10), None)

    def close(self):
        self.log.append("close")


class Connection:
    def __init__(self, existing):
        self.existing, self.log = existing, []

    def channel(self):
        return Channel(self.existing, self.log)


def test_missing_exchanges_are_found_with_passive_declares():
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, service="billing", delay_levels=2)
    events.handler("orders.#")(lambda payload: None)
    topology = events.topology()
    names = [e.name for e in topology.exchanges]
    connection = Connection(existing=set(names) - {"billing.archive"})
    assert missing_exchanges(connection, topology) == ["billing.archive"]
    assert connection.log.count("open") == 2, "one channel, replaced after the missing exchange"
    assert connection.log.count("close") == 2, "every channel closed, the one the missing exchange closed too"
    assert [n for n in connection.log if n not in ("open", "close")] == names, "one passive declare each, in order"


def test_a_reader_no_worker_reads_and_one_too_far_behind_are_problems():
    from kombu_events.ops.health import reader_problems
    from kombu_events.ops.log_status import ReaderStatus

    def status(name, reading, lag):
        return ReaderStatus(name, f"svc.reader.{name}", 10, 0, lag, reading, 0)
    readers = [status("a", True, 5), status("b", False, 0), status("c", True, 5000), status("d", None, None)]
    assert reader_problems(readers) == [("reader b: no worker reads it (paused: its circuit breaker is open, or no "
                                        "worker runs)")]
    assert reader_problems(readers, max_lag=1000) == [
        "reader b: no worker reads it (paused: its circuit breaker is open, or no worker runs)",
        "reader c: 5000 events behind its log, more than --max-lag 1000"]
    assert reader_problems(readers, max_lag=4999)[1:] == [("reader c: 5000 events behind its log, more than "
                                                          "--max-lag 4999")]
