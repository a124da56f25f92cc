"""publishing/backlog.py: the SQLite store (a file in tmp_path; no broker, no socket)."""
from __future__ import annotations

import os
import sqlite3
import threading

import pytest

from kombu_events import Backlog, BacklogError, BacklogFullError, BrokerUnavailableError
from kombu_events.errors import ConfigurationError, EncodeError
from kombu_events.publishing.backlog import decode_properties, encode_properties, open_backlog
from kombu_events.publishing.publisher import build_message


def item(n: int, **kwargs):
    return ("events", f"orders.{n}.created", build_message({"n": n, "name": "Zoë"}, message_id=f"m-{n}", **kwargs))


@pytest.fixture
def backlog(tmp_path):
    store = Backlog(tmp_path / "backlog.sqlite3")
    store.check()
    yield store
    store.close()


def test_events_come_back_in_order_with_the_exact_bytes_and_properties(backlog):
    items = [item(n, headers={"tenant": "acme", "n": n}, correlation_id="c") for n in range(5)]
    seqs = backlog.store(items, now=1000.0)
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    rows = backlog.head()
    assert [r.seq for r in rows] == seqs
    for row, (exchange, key, message) in zip(rows, items):
        assert (row.exchange, row.routing_key, row.stored_at) == (exchange, key, 1000.0)
        assert row.body == message.body and row.properties == message.properties
        again = row.message()
        assert again.body == message.body and again.properties == message.properties


def test_settle_deletes_confirmed_and_sets_aside_rejected(backlog):
    seqs = backlog.store([item(n) for n in range(4)], now=10.0)
    backlog.settle([seqs[0], seqs[2]], [(seqs[1], "no queue is bound")])
    assert [r.seq for r in backlog.head()] == [seqs[3]]
    assert backlog.rejected() == [(seqs[1], "orders.1.created", "m-1", "no queue is bound")]
    status = backlog.status()
    assert (status.depth, status.rejected, status.oldest_stored_at) == (1, 1, 10.0)
    assert status.age_s(12.5) == 2.5
    assert backlog.retry_rejected() == 1
    assert [r.seq for r in backlog.head()] == [seqs[1], seqs[3]], "back in line, in its place"


def test_sequence_numbers_are_never_reused(backlog):
    (first,) = backlog.store([item(1)])
    backlog.settle([first])
    assert not backlog.pending()
    (second,) = backlog.store([item(2)])
    assert second > first  # AUTOINCREMENT: a row stored later always sorts later


def test_status_of_an_empty_backlog(backlog):
    status = backlog.status()
    assert (status.depth, status.rejected, status.oldest_stored_at, status.age_s(5.0)) == (0, 0, None, None)
    assert status.as_dict(5.0) == {"path": backlog.path, "depth": 0, "rejected": 0, "oldest_age_s": None,
                                   "used_bytes": status.used_bytes, "max_bytes": backlog.max_bytes}


def test_a_full_backlog_refuses_the_event_and_keeps_what_it_has(tmp_path):
    backlog = Backlog(tmp_path / "small.sqlite3", max_bytes=64 * 1024)
    big = ("events", "a.b", build_message({"blob": "x" * 20_000}))
    backlog.store([big])
    backlog.store([big])
    with pytest.raises(BacklogFullError, match=r"backlog .*small.sqlite3 is full .*max_bytes=65536") as info:
        for _ in range(10):
            backlog.store([big])
    assert isinstance(info.value, BrokerUnavailableError), "a caller catching the old error still catches it"
    depth = backlog.status().depth
    assert 2 <= depth < 10
    backlog.settle([r.seq for r in backlog.head()])
    backlog.store([big])  # room again: freed pages are reused, not counted
    assert backlog.status().depth == 1


def test_headers_must_be_json_values(backlog):
    with pytest.raises(EncodeError, match="must be JSON values"):
        backlog.store([item(1, headers={"raw": b"\x00bytes"})])
    assert not backlog.pending()
    assert decode_properties(encode_properties({"a": [1, "b", None]})) == {"a": [1, "b", None]}


@pytest.mark.parametrize("where", ["missing/dir/backlog.sqlite3", "a-directory"])
def test_an_unusable_path_is_a_configuration_error_at_once(tmp_path, where):
    (tmp_path / "a-directory").mkdir()
    with pytest.raises(ConfigurationError, match=r"backlog=.* cannot be used: .*must exist and be writable"):
        open_backlog(str(tmp_path / where))


def test_open_backlog_accepts_a_path_or_a_backlog(tmp_path):
    assert open_backlog(None) is None
    assert open_backlog(tmp_path / "a.sqlite3").path == str(tmp_path / "a.sqlite3")
    custom = Backlog(tmp_path / "b.sqlite3", max_bytes=1 << 20)
    assert open_backlog(custom) is custom
    with pytest.raises(ConfigurationError, match="a file path or a Backlog"):
        open_backlog(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(("option", "value"), [("max_bytes", 10), ("max_bytes", True), ("busy_timeout_s", 0),
                                               ("batch_size", 0), ("batch_size", 1.5)])
def test_limits_are_validated(tmp_path, option, value):
    with pytest.raises(ConfigurationError, match=option):
        Backlog(tmp_path / "x.sqlite3", **{option: value})


def test_the_database_is_in_wal_mode(backlog):
    backlog.store([item(1)])
    with sqlite3.connect(backlog.path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_one_flusher_at_a_time(backlog):
    with backlog.flush_lock() as first:
        assert first
        with backlog.flush_lock() as second:
            assert not second, "another holder, even in the same process, is refused"
        seen = []

        def try_lock() -> None:
            with backlog.flush_lock() as held:
                seen.append(held)

        thread = threading.Thread(target=try_lock)
        thread.start()
        thread.join()
        assert seen == [False]
    with backlog.flush_lock() as again:
        assert again, "released when the holder leaves"


def test_several_writers_share_one_file(tmp_path):
    path = tmp_path / "shared.sqlite3"
    stores = [Backlog(path) for _ in range(4)]

    def write(k: int) -> None:
        for n in range(25):
            stores[k].store([("events", "a.b", build_message({}, message_id=f"{k}-{n}"))])

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = Backlog(path).head(1000)
    assert len(rows) == 100
    for k in range(4):
        mine = [r.properties["message_id"] for r in rows if r.properties["message_id"].startswith(f"{k}-")]
        assert mine == [f"{k}-{n}" for n in range(25)], "each writer's order kept"


def test_processes_opening_a_new_file_at_once_all_succeed(tmp_path):
    """gunicorn's workers start together: the first to switch the file to WAL must not fail the others."""
    path = tmp_path / "fresh.sqlite3"
    for _round in range(5):
        for leftover in tmp_path.glob("fresh.sqlite3*"):
            leftover.unlink()
        read, write = os.pipe()
        children = []
        for _ in range(8):
            pid = os.fork()
            if pid == 0:  # wait for the go, then open the backlog as Events(...) does
                try:
                    os.close(write)
                    os.read(read, 1)
                    open_backlog(str(path)).store([item(os.getpid())])
                    os._exit(0)
                except BaseException:
                    os._exit(1)
            children.append(pid)
        os.close(read)
        os.close(write)  # every child reads EOF at once: go
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
        assert codes == [0] * 8
        assert Backlog(path).status().depth == 8


def test_a_forked_child_opens_its_own_connection(backlog):
    backlog.store([item(1)])
    pid = os.fork()
    if pid == 0:  # the child: the parent's connection came along, and must not be used
        try:
            backlog.store([item(2)])
        finally:
            os._exit(0 if backlog.status().depth == 2 else 1)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    backlog.store([item(3)])
    assert [r.properties["message_id"] for r in backlog.head()] == ["m-1", "m-2", "m-3"]


def test_sqlite_errors_are_backlog_errors(tmp_path):
    path = tmp_path / "not-a-database.sqlite3"
    backlog = Backlog(path)
    backlog.store([item(1)])
    backlog.close()
    path.write_bytes(b"this is not a SQLite database, whatever its name says" * 100)
    for wal in (tmp_path / "not-a-database.sqlite3-wal", tmp_path / "not-a-database.sqlite3-shm"):
        wal.unlink(missing_ok=True)
    with pytest.raises(BacklogError, match=r"not-a-database.sqlite3: DatabaseError: file is not a database"):
        backlog.store([item(2)])
    with pytest.raises(ConfigurationError, match="cannot be used"):
        open_backlog(path)
