"""``archive replay``/``purge --dry-run`` pin what they showed: the offset they read through and the command line
that acts on exactly those copies (``--through``), which the real runs, and ``list``, take. No broker: the
archive is records in memory."""
from __future__ import annotations

import dataclasses
import json
import shlex
from contextlib import nullcontext

import pytest

from kombu_events.cli import archive as archive_cli, common
from kombu_events.ops import archive_read, archive_replay
from kombu_events.ops.archive import ArchivedMessage, purge_note

from ..console.test_console_routes_kit import archived, events_of_svc
from .test_cli_scripting import assert_valid, invoke

HELD = [dataclasses.replace(archived(f"m{n}"), offset=n) for n in range(1, 4)]


@pytest.fixture(autouse=True)
def archive_in_memory(monkeypatch):
    """Service ``svc`` (``-A app``), its archive the copies at offsets 1 to 3; what replay and purge were asked."""
    events = events_of_svc()
    asked: dict[str, list[ArchivedMessage]] = {}
    monkeypatch.setattr(common, "_select", lambda app_name, service: events)
    monkeypatch.setattr(common.Context, "connection", lambda self: nullcontext(object()))
    monkeypatch.setattr(archive_read, "records", lambda connection, topology, **kwargs: iter(HELD))

    def replay(connection, topology, match, limit=None, *, progress=None, on_window=None):
        asked["replay"] = [m for m in HELD if match(m)][:limit]
        if on_window is not None:  # as ops.archive.replay does, once a window is settled
            on_window(asked["replay"])
        return asked["replay"], []

    def purge(connection, topology, match, limit=None):
        asked["purge"] = [m for m in HELD if match(m)][:limit]
        return asked["purge"]

    monkeypatch.setattr(archive_replay, "replay", replay)  # what the CLI's replay_reconnecting runs
    monkeypatch.setattr(archive_cli, "purge", purge)
    return asked


def test_a_replay_dry_run_reports_its_offset_and_the_command_that_replays_exactly_that():
    result = invoke("-A", "app", "archive", "replay", "--queue", "svc.orders", "--id", "m 1", "--id", "m2",
                    "--dry-run", "--json")
    document = json.loads(result.stdout)
    assert_valid("archive-replay", document)
    assert document["through"] == 3
    assert document["command"] == ("kombu-events -A app archive replay --queue svc.orders --id 'm 1' --id m2 "
                                   "--through 3")
    text = invoke("-A", "app", "archive", "replay", "--limit", "2", "--dry-run")
    assert text.stderr.splitlines()[-1] == ("read through archive offset 2; to replay exactly these 2, none archived "
                                            "since: kombu-events -A app archive replay --limit 2 --through 2")
    by_keys = invoke("-A", "app", "archive", "replay", "--key", HELD[0].key, "--dry-run")
    assert by_keys.stdout.startswith(f"would replay {HELD[0].key} ")
    assert "read through" not in by_keys.stderr, "archive keys alone pin the selection already"
    one = invoke("-A", "app", "archive", "purge", "--id", "m2", "--dry-run")
    assert one.stderr.splitlines()[-1] == ("read through archive offset 3; to purge exactly this one, none archived "
                                           "since: kombu-events -A app archive purge --id m2 --through 3 --yes")


@pytest.mark.parametrize("word", ["a\nb", "it's\n", "x\\y\x7f", "tab\there", "plain", "sp ace"])
def test_a_pinned_command_line_is_one_line_that_bash_reads_back_as_given(word):
    import subprocess

    quoted = archive_cli._shell_word(word)
    assert "\n" not in quoted
    assert subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True, text=True).stdout == word


def test_a_purge_dry_run_pins_with_yes_and_hides_no_password():
    result = invoke("-A", "app", "--broker", "amqp://u:secret-pw@rabbit:5672//", "archive", "purge", "--through", "2",
                    "--for-good", "--dry-run", "--json")
    document = json.loads(result.stdout)
    assert_valid("archive-purge", document)
    assert [m["id"] for m in document["messages"]] == ["m1", "m2"]
    assert document["through"] == 2, "no further than the --through asked"
    assert shlex.split(document["command"]) == ["kombu-events", "-A", "app", "--broker", "amqp://u:**@rabbit:5672//",
                                                "archive", "purge", "--through", "2", "--for-good", "--yes"]
    assert (document["hidden_until_retention"], document["note"]) == (False, purge_note(for_good=True))


def test_the_real_runs_and_list_take_only_the_copies_through_the_offset(archive_in_memory):
    replayed = json.loads(invoke("-A", "app", "archive", "replay", "--through", "2", "--json").stdout)
    assert_valid("archive-replay", replayed)
    assert [m.id for m in archive_in_memory["replay"]] == ["m1", "m2"]
    assert (replayed["through"], replayed["command"]) == (2, None)
    purged = json.loads(invoke("-A", "app", "archive", "purge", "--through", "1", "--yes", "--json").stdout)
    assert_valid("archive-purge", purged)
    assert [m.id for m in archive_in_memory["purge"]] == ["m1"]
    assert (purged["hidden_until_retention"], purged["note"]) == (True, purge_note())
    listed = invoke("-A", "app", "archive", "list", "--through", "2", "--json").stdout.splitlines()
    assert [json.loads(line)["id"] for line in listed] == ["m1", "m2"]
