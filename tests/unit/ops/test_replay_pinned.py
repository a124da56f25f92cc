"""A replay run again on a new connection (``replay(progress=...)``, the CLI's and the console's after a lost
connection) selects what its first run selected, less what it settled: nothing archived after the first read,
and no more than ``limit`` over every run. Over records kept in memory (no broker)."""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest

from kombu_events.ops import archive_read, archive_replay
from kombu_events.ops.archive import ArchivedMessage, ReplayProgress
from kombu_events.ops.archive_replay import _pinned_selection, replay_reconnecting

from ..console.test_console_routes_kit import archived, events_of_svc


def copy_at(offset: int, message_id: str) -> ArchivedMessage:
    return dataclasses.replace(archived(message_id, "orders"), offset=offset)


@pytest.fixture
def stream(monkeypatch):
    """``stream(*copies)``: the archive holds ``copies`` (offsets as given)."""
    def hold(*held):
        monkeypatch.setattr(archive_read, "records", lambda connection, topology, **kwargs: iter(held))
    return hold


def select(progress: ReplayProgress, limit: int | None = None) -> list[str]:
    chosen = _pinned_selection(None, events_of_svc().topology(), lambda m: True, limit, progress, 0, "first")
    return [m.id for m in chosen]


def test_a_run_again_takes_nothing_archived_after_the_first_read_nor_what_it_settled(stream):
    progress = ReplayProgress()
    stream(copy_at(1, "m1"), copy_at(2, "m2"), copy_at(3, "m3"))
    assert select(progress) == ["m1", "m2", "m3"] and progress.through == 3
    progress.settled.add(copy_at(1, "m1").key)  # settled before the connection went; the record is not read yet
    stream(copy_at(1, "m1"), copy_at(2, "m2"), copy_at(3, "m3"), copy_at(4, "m4"))  # m4 archived meanwhile
    assert select(progress) == ["m2", "m3"]


def test_a_limit_holds_over_every_run(stream):
    progress = ReplayProgress()
    stream(copy_at(1, "m1"), copy_at(2, "m2"), copy_at(3, "m3"), copy_at(4, "m4"))
    assert select(progress, limit=3) == ["m1", "m2", "m3"] and progress.through == 3, "pinned at its last copy"
    progress.settled.update(copy_at(n, f"m{n}").key for n in (1, 2))
    assert select(progress, limit=3) == ["m3"]
    progress.settled.add(copy_at(3, "m3").key)
    assert select(progress, limit=3) == []


def test_an_empty_archive_pins_nothing_and_a_run_again_takes_nothing(stream):
    progress = ReplayProgress()
    stream()
    assert select(progress) == [] and progress.through == -1, "pinned before any offset"
    stream(copy_at(1, "m1"))
    assert select(progress) == []


class FakeConnection:
    connected = True


def connect():
    return nullcontext(FakeConnection())


def test_a_lost_connection_is_made_again_and_the_replay_goes_on(monkeypatch):
    calls, lost = [], []

    def replay(conn, topology, match, limit, *, progress, on_window):
        calls.append(progress)
        on_window([copy_at(len(calls), f"m{len(calls)}")])
        if len(calls) == 1:
            raise ConnectionResetError(104, "Connection reset by peer")
        return [], []
    monkeypatch.setattr(archive_replay, "replay", replay)
    monkeypatch.setattr(archive_replay.time, "sleep", lambda s: None)
    replayed, kept = replay_reconnecting(connect, events_of_svc().topology(), lambda m: True,
                                         on_lost=lambda n, exc, done: lost.append((n, type(exc).__name__)))
    assert [m.id for m in replayed] == ["m1", "m2"] and kept == []
    assert lost == [(1, "ConnectionResetError")] and calls[0] is calls[1], "one progress over both runs"


def test_what_the_caller_raises_while_a_window_is_settled_is_no_lost_connection(monkeypatch):
    """``kombu-events archive replay | head``: a closed stdout raises BrokenPipeError (an OSError) out of the
    printing; it stops the replay at once, as itself, instead of connecting again."""
    calls = []

    def replay(conn, topology, match, limit, *, progress, on_window):
        calls.append(1)
        on_window([copy_at(1, "m1")])
        return [], []
    monkeypatch.setattr(archive_replay, "replay", replay)

    def closed(copies):
        raise BrokenPipeError(32, "Broken pipe")
    with pytest.raises(BrokenPipeError):
        replay_reconnecting(connect, events_of_svc().topology(), lambda m: True, on_window=closed,
                            on_lost=lambda *args: pytest.fail("taken for a lost connection"))
    assert calls == [1]
