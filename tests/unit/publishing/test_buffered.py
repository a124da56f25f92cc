"""publishing/buffered.py: publish or store, flush in order, the daemon thread -- over an in-memory fake broker."""
from __future__ import annotations

import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck as Hypothesis, event, given, settings, strategies as st

from kombu_events.core.breaker import CircuitBreaker
from kombu_events.core.health import Healthy, Unhealthy
from kombu_events.errors import BacklogError, BrokerUnavailableError, ConfirmTimeoutError, EncodeError, UnroutableError
from kombu_events.publishing.backlog import Backlog
from kombu_events.publishing.breakers import PublisherBreakers
from kombu_events.publishing.buffered import STORED, BacklogPublisher
from kombu_events.publishing.health import BROKER, PublisherCheck
from kombu_events.publishing.publisher import build_message


class FakeBroker:
    """Publishes into a list; ``up`` False refuses like a stopped broker; ``unroutable`` keys are returned."""

    def __init__(self) -> None:
        self.up = True
        self.delivered: list[str] = []
        self.calls = 0
        self.unroutable: set[str] = set()
        self.failure: Exception = BrokerUnavailableError("connection refused")

    def send_many(self, items):
        self.calls += 1
        if not self.up:
            raise self.failure
        results: list[Exception | None] = []
        for exchange, key, message in items:
            if key in self.unroutable:
                results.append(UnroutableError("no queue", exchange=exchange, routing_key=key))
            else:
                self.delivered.append(message.properties["message_id"])
                results.append(None)
        return results


def answers(broker: FakeBroker) -> PublisherCheck:
    """The broker check of the fake: healthy while it is up."""
    return PublisherCheck(lambda: Healthy if broker.up else Unhealthy("down"), interval_s=None, name=BROKER)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


#: Memory-backed when the machine has it: the property test stores a lot, and FULL sync waits for the disk.
SCRATCH = "/dev/shm" if Path("/dev/shm").is_dir() else None

QUICK = CircuitBreaker(max_failures=1, max_unhealthy=1, reset_s=0.5, max_reset_s=0.5)


def make_outbox(path: Path, broker: FakeBroker, clock=time.monotonic, flushed=None, batch_size=200) -> BacklogPublisher:
    return BacklogPublisher(Backlog(path, batch_size=batch_size), lambda: broker,
                            PublisherBreakers([answers(broker)], QUICK), on_flushed=flushed, clock=clock,
                            idle_poll_s=0.05)


@pytest.fixture
def broker():
    return FakeBroker()


@pytest.fixture
def backlog_publisher(tmp_path, broker):
    box = make_outbox(tmp_path / "backlog.sqlite3", broker, Clock())
    box.start = lambda: None  # type: ignore[method-assign]  # these tests drive the steps themselves
    return box


def items(*ids: str, key: str = "a.b"):
    return [("events", key, build_message({"id": i}, message_id=i)) for i in ids]


def test_while_the_broker_answers_events_are_published_and_confirmed(backlog_publisher, broker):
    assert backlog_publisher.publish_or_store(items("1", "2")) == [None, None]
    assert broker.delivered == ["1", "2"] and not backlog_publisher.backlog.pending()


@pytest.mark.parametrize("failure", [BrokerUnavailableError("refused"), ConfirmTimeoutError("not confirmed")])
def test_an_unreachable_broker_stores_the_event_and_opens_the_circuit(backlog_publisher, broker, failure):
    broker.up, broker.failure = False, failure
    assert backlog_publisher.publish_or_store(items("1")) == [STORED]
    assert not backlog_publisher.breakers.closed()
    calls = broker.calls
    assert backlog_publisher.publish_or_store(items("2", "3")) == [STORED, STORED]
    assert broker.calls == calls, "while the circuit is open, the broker is not even tried"
    assert [r.properties["message_id"] for r in backlog_publisher.backlog.head()] == ["1", "2", "3"]


def test_an_unroutable_event_is_the_callers_error_never_stored(backlog_publisher, broker):
    broker.unroutable.add("nobody.listens")
    (result,) = backlog_publisher.publish_or_store(items("1", key="nobody.listens"))
    assert isinstance(result, UnroutableError)
    assert not backlog_publisher.backlog.pending() and backlog_publisher.breakers.closed()


def test_headers_that_cannot_be_stored_fail_even_while_the_broker_is_up(backlog_publisher, broker):
    bad = [("events", "a.b", build_message({}, headers={"when": b"raw"}))]
    with pytest.raises(EncodeError):
        backlog_publisher.publish_or_store(bad)
    assert broker.calls == 0


def test_new_events_wait_behind_stored_ones_even_with_the_circuit_closed(backlog_publisher, broker):
    backlog_publisher.backlog.store(items("old"))
    assert backlog_publisher.publish_or_store(items("new")) == [STORED]
    assert broker.calls == 0
    assert backlog_publisher.flush().published == 2
    assert broker.delivered == ["old", "new"]


def test_flush_publishes_in_order_deletes_what_was_confirmed_and_sets_aside_the_unroutable(tmp_path, broker):
    seen = []
    box = make_outbox(tmp_path / "b.sqlite3", broker, flushed=lambda x, k, p, e: seen.append((p["message_id"], e)),
                      batch_size=3)
    box.backlog.store(items("1", "2") + items("3", key="nobody") + items("4", "5"))
    broker.unroutable.add("nobody")
    report = box.flush()
    assert (report.published, report.rejected, report.error) == (4, 1, None)
    assert broker.delivered == ["1", "2", "4", "5"] and broker.calls == 2, "two batches of 3"
    assert not box.backlog.pending() and box.backlog.status().rejected == 1
    assert [mid for mid, _e in seen] == ["1", "2", "3", "4", "5"]
    assert isinstance(seen[2][1], UnroutableError) and all(e is None for i, (_m, e) in enumerate(seen) if i != 2)


def test_a_failed_flush_keeps_every_row(backlog_publisher, broker):
    backlog_publisher.backlog.store(items("1", "2"))
    broker.up = False
    report = backlog_publisher.flush()
    assert report.published == 0 and isinstance(report.error, BrokerUnavailableError)
    assert backlog_publisher.backlog.status().depth == 2


def test_only_one_flusher_at_a_time(backlog_publisher, broker):
    backlog_publisher.backlog.store(items("1"))
    with backlog_publisher.backlog.flush_lock():
        assert backlog_publisher.flush_once().busy
    assert broker.delivered == []


def test_the_daemon_thread_drains_once_the_broker_answers_then_ends(tmp_path, broker):
    box = make_outbox(tmp_path / "b.sqlite3", broker)
    broker.up = False
    assert box.publish_or_store(items("1", "2", "3")) == [STORED] * 3
    thread = box._thread
    assert thread is not None and thread.is_alive()
    time.sleep(0.2)
    assert broker.delivered == [] and not box.breakers.closed()
    broker.up = True
    thread.join(10)
    assert not thread.is_alive(), "nothing left to do: the thread ends"
    assert broker.delivered == ["1", "2", "3"] and box.breakers.closed() and not box.backlog.pending()
    assert box.publish_or_store(items("4")) == [None]
    box.stop()


def test_the_daemon_thread_survives_a_backlog_that_fails_while_it_decides_to_end(tmp_path, broker, monkeypatch,
                                                                                  caplog):
    box = make_outbox(tmp_path / "b.sqlite3", broker)
    answers: list[bool | Exception] = [BacklogError("disk I/O error"), False]

    def pending() -> bool:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(box, "_step", lambda: None)  # nothing flushed: the thread asks whether to end
    monkeypatch.setattr(box.backlog, "pending", pending)
    escaped: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    with caplog.at_level(logging.ERROR, logger="kombu_events.publishing.buffered"):
        box.start()
        thread = box._thread
        assert thread is not None
        thread.join(5)
    assert escaped == [] and answers == [], "the failure was logged, the thread asked again and then ended"
    assert f"the backlog flusher of {box.backlog.path} failed" in caplog.text
    assert box._thread is None


OPS = st.lists(st.one_of(st.tuples(st.just("publish"), st.integers(1, 5)),
                         st.sampled_from([("down",), ("up",), ("step",), ("crash",), ("crash",)])), max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[Hypothesis.function_scoped_fixture])
@given(OPS)
def test_every_event_arrives_in_publish_order_duplicated_only_by_a_crashed_flush(ops):
    """Any interleaving of publishes, outages, flush steps and flushes killed between the broker's confirm
    and the delete: at the end every event was delivered, first occurrences in publish order, and the
    duplicates are exactly the rows a killed flush had published."""
    broker, clock = FakeBroker(), Clock()
    with tempfile.TemporaryDirectory(dir=SCRATCH) as directory:
        box = make_outbox(Path(directory) / "b.sqlite3", broker, clock, batch_size=4)
        box.start = lambda: None  # type: ignore[method-assign]
        published, crashed = [], 0
        for op in ops:
            clock.now += 1.0
            if op[0] == "publish":
                ids = [str(len(published) + i) for i in range(op[1])]
                assert all(r in (None, STORED) for r in box.publish_or_store(items(*ids)))
                published += ids
            elif op[0] in ("down", "up"):
                broker.up = op[0] == "up"
            elif op[0] == "step":
                box._step()
            elif broker.up and box.breakers.closed():  # crash: published and confirmed, never deleted
                crashed += len(broker.send_many([(r.exchange, r.routing_key, r.message())
                                                    for r in box.backlog.head()]))
        event(f"crashed flushes published {'some' if crashed else 'no'} rows")
        broker.up = True
        for _ in range(len(published) + 10):
            clock.now += 1.0
            box._step()
        assert not box.backlog.pending() and box.breakers.closed()
        box.backlog.close()
    first = list(dict.fromkeys(broker.delivered))
    assert first == published, "each event at least once, in publish order"
    assert len(broker.delivered) - len(published) == crashed
