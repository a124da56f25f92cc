"""A replay asked for ids that match nothing says so, for each of them, on the real broker: ``kombu-events archive
replay --id`` (stderr, exit 1, ``not_found`` entries in its JSON document, a dry run too), the console's replay (its
dry run and its job's progress) and its JSON API. The id that trips users is one copied with a trailing newline:
it is shown quoted, so the newline shows. And the event page's dry-run box is ticked, as the failures page's is."""
from __future__ import annotations

import json
import re
import sys

import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from kombu_events.cli import cli, common
from kombu_events.console import AuthSettings, ConsoleSettings, create_app

from .console_helpers import SAME_ORIGIN, Seeded, basic, seeded
from .harness import wait_for
from .json_schemas import assert_valid

pytestmark = pytest.mark.integration

PW = "operator-pw-0123456789"
OPERATOR = basic("alice", PW)


@pytest.fixture
def service(broker_url):
    yield from seeded(broker_url)


def archive(service: Seeded, count: int) -> list[str]:
    return service.archive([("orders", f"orders.{n}.created", "KeyError: 'sku'", json.dumps({"order": n}).encode())
                            for n in range(count)])


@pytest.fixture
def replay_cli(service, monkeypatch):
    """``kombu-events -A <the seeded app> --broker URL archive replay ARGS`` in this process."""
    monkeypatch.setattr(common, "_select", lambda app_name, service_name: service.events)
    monkeypatch.setattr(sys, "path", list(sys.path))

    def run(*args: str):
        try:
            runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
        except TypeError:  # click >= 8.2: always apart
            runner = CliRunner()
        return runner.invoke(cli, ["-A", "seeded", "--broker", service.broker_url, "archive", "replay", *args],
                             prog_name="kombu-events")
    return run


def test_the_cli_reports_every_id_it_did_not_find_and_exits_1(service, replay_cli):
    first, second, third = archive(service, 3)
    dry = replay_cli("--id", first, "--id", first + "\n", "--dry-run")
    assert dry.exit_code == 1
    key = dry.stdout.split()[2]
    assert dry.stdout == f"would replay {key} (id {first}) to {service.queue('orders')} (key orders.0.created)\n"
    pinned, not_found = dry.stderr.splitlines(keepends=True)
    assert pinned.startswith("read through archive offset "), pinned
    assert "; to replay exactly this one, none archived since: kombu-events " in pinned, pinned
    assert "--id $'" in pinned, "the id with a newline, quoted on the command's one line"
    assert not_found == f"not found: no archived copy with id {first + chr(10)!r}\n"
    dry_json = replay_cli("--id", first, "--id", "nope", "--dry-run", "--json")
    document = assert_valid("archive-replay", json.loads(dry_json.stdout))
    assert [(m["id"], m["outcome"]) for m in document["messages"]] == [(first, "would_replay"), ("nope", "not_found")]

    done = replay_cli("--id", first, "--id", second + " ", "--id", first)  # an id given twice is one
    assert done.exit_code == 1, done.stderr
    assert done.stdout == f"replayed {key} (id {first}) to {service.queue('orders')}\n"
    assert done.stderr.splitlines() == ["1 replayed, 0 kept, 1 not found",
                                        f"not found: no archived copy with id '{second} '"]
    as_json = replay_cli("--id", third, "--id", first, "--json")  # first: replayed already
    assert as_json.exit_code == 1
    document = assert_valid("archive-replay", json.loads(as_json.stdout))
    assert (document["matched"], document["replayed"], document["kept"]) == (1, 1, 0)
    assert document["messages"][1] == {"key": "", "id": first, "queue": "", "routing_key": "", "archived_at": "",
                                       "reason": "", "outcome": "not_found", "why": document["messages"][1]["why"]}
    assert "no archived copy has this message id" in document["messages"][1]["why"]
    everything = replay_cli()  # no --id: nothing can be "not found"
    assert (everything.exit_code, everything.stderr) == (0, "1 replayed, 0 kept\n")
    assert sorted(m.properties["message_id"] for m in service.take("orders")) == sorted([first, second, third])


def client(service: Seeded, tmp_path) -> TestClient:
    settings = ConsoleSettings(auth=AuthSettings(passwords={"operator": PW}), audit_path=tmp_path / "audit.jsonl")
    return TestClient(create_app(service.events, settings), base_url="http://127.0.0.1:8089",
                      client=("127.0.0.1", 50000))


def test_the_console_reports_the_keys_it_did_not_find_in_the_dry_run_the_job_and_the_api(service, tmp_path):
    ids = archive(service, 3)
    keys = [service.key_of[i] for i in ids]
    asked = [keys[0], keys[0] + "\n"]
    with client(service, tmp_path) as web:
        page = web.get(f"/events/{keys[0]}", headers=OPERATOR).text
        assert re.search(r'<input type="checkbox" name="dry_run" value="1" checked> dry run', page), \
            "the event page's dry run is ticked, as the failures page's"
        dry = web.post("/replay", data={"scope": "selected", "key": asked, "dry_run": "1"},
                       headers={**OPERATOR, **SAME_ORIGIN})
        assert dry.status_code == 200 and "1 archived copy would be replayed" in dry.text
        assert "1 selected key(s) not found in the archive" in dry.text
        assert f"<code>{json.dumps(keys[0] + chr(10))}</code>" in dry.text  # "…\n": the newline shows
        started = web.post("/replay", data={"scope": "selected", "key": asked}, headers={**OPERATOR, **SAME_ORIGIN},
                           follow_redirects=False)
        assert started.status_code == 303
        job_id = started.headers["location"].rsplit("/", 1)[1]
        progress = wait_for(lambda: (lambda j: j if j["state"] == "done" else None)(
            web.get(f"/api/jobs/{job_id}", headers=OPERATOR).json()), 20, what="job done")
        assert (progress["total"], progress["replayed"], progress["missing"]) == (1, 1, [keys[0] + "\n"])
        shown = web.get(f"/jobs/{job_id}", headers=OPERATOR).text
        assert "<strong>1</strong> of 1 replayed" in shown and "1 selected key(s) not found in the archive" in shown
        api = web.post("/api/replay", json={"keys": [keys[1], "nope"]}, headers={**OPERATOR, **SAME_ORIGIN})
        assert api.status_code == 207
        document = assert_valid("archive-replay", api.json())
        assert [(m["key"], m["id"], m["outcome"]) for m in document["messages"]] == [
            (keys[1], ids[1], "replayed"), ("nope", "", "not_found")]
        dry_api = web.post("/api/replay", json={"keys": [keys[2], keys[1]], "dry_run": True},
                           headers={**OPERATOR, **SAME_ORIGIN}).json()
        assert [(m["key"], m["outcome"]) for m in assert_valid("archive-replay", dry_api)["messages"]] == [
            (keys[2], "would_replay"), (keys[1], "not_found")]
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert audit[0]["action"] == "replay" and audit[0]["not_found"] == 1
