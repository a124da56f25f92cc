"""The console's JSON API answers with the CLI's documents, unchanged for an old client (every key it had), and
says plainly what a purge means: hidden at once, in the stream until retention or a rewrite."""
from __future__ import annotations

from jsonschema import Draft202012Validator

from kombu_events.cli.common import schema
from kombu_events.ops.archive import purge_note

from .test_console_routes_kit import BEARER_OPERATOR, archived, console

#: The keys of an answer before ``hidden_until_retention``, ``note``, ``through`` and ``command``.
EARLIER_PURGE = {"dry_run", "matched", "purged", "erased", "messages"}
EARLIER_REPLAY = {"dry_run", "matched", "replayed", "kept", "messages"}


def valid(name: str, document: dict) -> dict:
    errors = sorted(Draft202012Validator(schema(name)).iter_errors(document), key=str)
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors]
    return document


def test_an_api_purge_says_its_copies_stay_in_the_stream_until_retention_or_a_rewrite():
    c = console([archived("m1"), archived("m2")])
    key = archived("m1").key
    for body in ({"keys": [key], "dry_run": True}, {"keys": [key], "yes": True}):
        answer = valid("archive-purge", c.web.post("/api/purge", json=body, headers=BEARER_OPERATOR).json())
        assert set(answer) >= EARLIER_PURGE and [m["key"] for m in answer["messages"]] == [key]
        assert answer["hidden_until_retention"] is True and answer["note"] == purge_note()
        assert "until retention" in answer["note"] and "--for-good" in answer["note"]
        assert (answer["through"], answer["command"], answer["erased"]) == (None, None, 0)
    assert c.stub.purged == [key]


def test_an_api_replay_answers_with_the_cli_document_its_keys_pinning_the_set():
    c = console([archived("m1")])
    for body in ({"keys": [archived("m1").key], "dry_run": True}, {"keys": [archived("m1").key]}):
        answer = valid("archive-replay", c.web.post("/api/replay", json=body, headers=BEARER_OPERATOR).json())
        assert set(answer) >= EARLIER_REPLAY and (answer["through"], answer["command"]) == (None, None)
