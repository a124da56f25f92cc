"""A rewrite copies a stream, then deletes it: its read of the source must never end early. The stream read's
"retention emptied it" ending (broker/streams.py) is off for it (no broker: the read is recorded)."""
from __future__ import annotations

from types import SimpleNamespace

from kombu_events.broker import streams
from kombu_events.ops import archive_rewrite


def test_the_copy_reads_every_record_of_its_source_or_fails(monkeypatch):
    asked: list[dict] = []

    def read(connection, queue, **options):
        asked.append({"queue": queue, **options})
        return iter(())
    monkeypatch.setattr(streams, "read", read)
    counts = {"read": 0, "duplicates": 0, "erased": 0}
    writer = SimpleNamespace(flush=lambda: None)
    last = archive_rewrite._copy_stream(None, "svc.archive", writer, archive_rewrite.Seen(),
                                        lambda offset, headers, message: None, 5, counts)
    assert asked == [{"queue": "svc.archive", "start": 5, "end_if_emptied": False}] and last == 4
