"""``--management-url`` on ``health`` and ``console`` as on ``status`` (validated before anything connects, and the
URL the management API is asked at), and ``status`` saying, in one line on stderr, when nothing named the API and the
URL it asked is a guess from the broker's host (also with ``--json``, whose stdout stays one document: the array of
queues has no place for it). No broker: a fake connection and a fake ``urlopen``."""
from __future__ import annotations

import json
from contextlib import nullcontext
from typing import Any

import celery
import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from kombu_events import Events
from kombu_events.cli import cli, common, console as console_command, inspect
from kombu_events.cli.common import ERROR, OK, schema
from kombu_events.core.config import MANAGEMENT_URL_ENV
from kombu_events.ops import status

from ..core.test_management_url import AmqpConnection, FakeUrlopen

GUESS = "NOTE: unacked counts from the management API at http://rabbit.example:15672, a guess from the broker's host"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MANAGEMENT_URL_ENV, raising=False)


@pytest.fixture
def run(monkeypatch):
    """``run(events, *args)``: the CLI on ``events``, over a fake connection; what the management API was asked."""
    opened = FakeUrlopen({"messages_unacknowledged": 3})
    monkeypatch.setattr(status.urllib.request, "urlopen", opened)
    for name, value in {"describe": "RabbitMQ 3.10.8 at amqp://guest:**@rabbit.example:5672//",
                        "reported_version": "3.10.8", "broker_name": "RabbitMQ 3.10.8"}.items():
        monkeypatch.setattr(inspect, name, lambda connection, value=value: value)
    monkeypatch.setattr(inspect, "missing_exchanges", lambda connection, topology: [])
    monkeypatch.setattr(status, "archived_count", lambda connection, topology: 0)  # a stream: read, not asked

    def invoke(events: Events, *args: str) -> Any:
        connection = AmqpConnection({q.name: (0, 1) for q in events.topology().queues})
        monkeypatch.setattr(common, "_select", lambda app_name, service: events)
        monkeypatch.setattr(common.Context, "connection", lambda self: nullcontext(connection))
        try:
            runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
        except TypeError:  # click >= 8.2: always apart
            runner = CliRunner()
        result = runner.invoke(cli, ["-A", "proj", *args], prog_name="kombu-events")
        result.asked = list(opened.asked)
        opened.asked.clear()
        return result
    return invoke


def service(**settings: Any) -> Events:
    app = celery.Celery("proj", broker="amqp://guest:guest@rabbit.example//", set_as_current=False)
    events = Events(app, service="billing", delay_levels=2, publish_delay_levels=0, **settings)
    events.handler("orders.#", name="orders")(lambda payload: None)
    return events


def test_status_says_in_one_line_on_stderr_that_the_url_is_a_guess(run):
    text = run(service(), "status")
    assert text.exit_code == OK, text.stderr
    notes = [line for line in text.stderr.splitlines() if line.startswith("NOTE:")]
    assert notes == [f"{GUESS} (name it with --management-url or {MANAGEMENT_URL_ENV})"]
    assert "NOTE" not in text.stdout and text.stdout.splitlines()[0].startswith("broker: RabbitMQ 3.10.8")
    assert all(url.startswith("http://rabbit.example:15672/api/") for url in text.asked)

    as_json = run(service(), "status", "--json")
    assert as_json.exit_code == OK and GUESS in as_json.stderr
    rows = json.loads(as_json.stdout)  # stdout: the document alone, as the schema describes it
    assert not list(Draft202012Validator(schema("status")).iter_errors(rows))
    assert all("management_url_guessed" not in row for row in rows)


def test_a_guess_that_does_not_answer_says_unacked_counts_are_unknown(run, monkeypatch):
    def refused(request: Any, timeout: float | None = None) -> Any:
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(status.urllib.request, "urlopen", refused)
    result = run(service(), "status")
    assert result.exit_code == OK
    assert result.stderr.splitlines()[-1] == (
        "NOTE: no management API answered at http://rabbit.example:15672, a guess from the broker's host: unacked "
        f"unknown (name it with --management-url or {MANAGEMENT_URL_ENV})")


@pytest.mark.parametrize("how", ["flag", "setting", "environment"])
def test_status_says_nothing_when_something_names_the_api(run, monkeypatch, how):
    url = "http://mgmt.example:15680"
    args, settings = (["--management-url", url], {}) if how == "flag" else ([], {"management_url": url})
    if how == "environment":
        monkeypatch.setenv(MANAGEMENT_URL_ENV, url)
        settings = {}
    result = run(service(**settings), "status", *args)
    assert result.exit_code == OK and "NOTE" not in result.stderr, result.stderr
    assert result.asked and all(asked.startswith(url + "/api/queues/") for asked in result.asked)


def test_health_takes_the_flag_and_asks_that_api(run):
    url = "https://mgmt.example:15671/rabbitmq/"
    result = run(service(management_url="http://setting.example:1"), "health", "--management-url", url, "--json")
    assert result.exit_code == OK, result.stdout + result.stderr
    assert result.asked and all(a.startswith("https://mgmt.example:15671/rabbitmq/api/queues/") for a in result.asked)
    queues = json.loads(result.stdout)["queues"]
    assert {q["unacked"] for q in queues if q["role"] != "archive"} == {3}
    assert [q["unacked"] for q in queues if q["role"] == "archive"] == [0]  # a stream: nothing unacknowledged
    setting = run(service(management_url="http://setting.example:1"), "health")
    assert setting.asked[0].startswith("http://setting.example:1/api/"), "without the flag: the setting"


@pytest.mark.parametrize("command", [["health"], ["console"]])
def test_the_flag_is_refused_in_one_line_before_anything_connects(run, monkeypatch, command):
    monkeypatch.setattr(console_command.uvicorn, "run", lambda *a, **k: pytest.fail("served with a bad URL"))
    result = run(service(), *command, "--management-url", "ftp://admin:hunter2@rabbit")
    assert result.exit_code == ERROR and result.asked == []
    assert result.stderr.strip().splitlines() == [(
        "Error: --management-url='ftp://**@rabbit' is not a management API URL (scheme ftp): give http:// or "
        "https://, a host and optionally a port and a path, e.g. http://rabbitmq.internal:15672 (no credentials: "
        "the API is asked with the broker connection's user)")]


def test_the_console_takes_the_flag_into_its_settings(run, monkeypatch, tmp_path):
    served: list[Any] = []
    monkeypatch.setattr(console_command.uvicorn, "run", lambda app, **options: served.append(app))
    url = "http://mgmt.example:15680"
    result = run(service(), "console", "--management-url", url, "--audit-file", str(tmp_path / "audit.jsonl"))
    assert result.exit_code == OK, result.stderr
    [app] = served
    assert app.state.settings.management_url == url
    assert app.state.service.management_url == url  # what its overview's status() asks
    default = run(service(), "console", "--audit-file", str(tmp_path / "audit.jsonl"))
    assert default.exit_code == OK and served[1].state.settings.management_url is None  # the setting, then the guess
