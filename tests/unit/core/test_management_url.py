"""The ``management_url`` setting: read like every setting (``Events(...)``, Celery conf) and from
``KOMBU_EVENTS_MANAGEMENT_URL``, validated without ever showing a credential, and reaching where the
management API is asked: ``status``/``health`` (``gather``), the console, a ``declare=False`` worker's check
(``verify``, TLS rule kept) and the ``status --management-url`` flag, which wins over it. A fake ``urlopen`` records
every URL asked."""
from __future__ import annotations

import io
import json
import sys
from typing import Any

import celery
import pytest
from click.testing import CliRunner

from kombu_events import Events
from kombu_events.broker import verify
from kombu_events.cli import cli
from kombu_events.core.config import MANAGEMENT_URL_ENV, Settings, management_base_url, resolve_settings
from kombu_events.errors import ConfigurationError
from kombu_events.ops import status

from ..ops.test_status import Connection as StatusConnection

CONFIGURED = "https://mgmt.example:15671/rabbitmq/"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MANAGEMENT_URL_ENV, raising=False)


# -- reading and validating ------------------------------------------------------------------------------------

def test_unset_it_is_none_and_the_api_is_guessed_on_the_brokers_host():
    assert resolve_settings("s", conf={}, environ={}).management_url is None
    assert management_base_url(None, "rabbit.example") == "http://rabbit.example:15672"
    assert management_base_url(CONFIGURED, "rabbit.example") == "https://mgmt.example:15671/rabbitmq"


def test_precedence_kwargs_over_conf_over_env():
    env = {MANAGEMENT_URL_ENV: "http://from-env:15672"}
    conf = {"kombu_events_management_url": "http://from-conf:15672"}
    assert resolve_settings("s", conf={}, environ=env).management_url == "http://from-env:15672"
    assert resolve_settings("s", conf=conf, environ=env).management_url == "http://from-conf:15672"
    assert resolve_settings("s", conf=conf, environ=env, management_url=CONFIGURED).management_url == CONFIGURED
    assert resolve_settings("s", conf=conf, environ=env, management_url=None).management_url == \
        "http://from-conf:15672", "None means not given"
    assert resolve_settings("s", conf={}, environ={MANAGEMENT_URL_ENV: ""}).management_url is None


def test_events_reads_the_environment_variable(monkeypatch):
    monkeypatch.setenv(MANAGEMENT_URL_ENV, CONFIGURED)
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    assert Events(app, service="billing").settings.management_url == CONFIGURED
    app.conf.kombu_events_management_url = "http://conf.example:15672"
    assert Events(app, service="shipping").settings.management_url == "http://conf.example:15672"


@pytest.mark.parametrize("value", [
    "http://rabbit:15672", "https://rabbit.example.com", "http://10.0.0.5:15672/", "https://proxy/rabbitmq/api-root",
    "http://[::1]:15672",
])
def test_an_http_or_https_url_is_valid(value):
    assert Settings(service="s", management_url=value).management_url == value


@pytest.mark.parametrize("value, why", [
    ("rabbit:15672", "scheme rabbit"),
    ("ftp://rabbit:15672", "scheme ftp"),
    ("amqp://rabbit:5672//", "scheme amqp"),
    ("//rabbit:15672", "scheme missing"),
    ("http://", "no host"),
    ("http://rabbit:15672 ", "whitespace"),
    ("http://rab bit:15672", "whitespace"),
    ("http://rabbit:15672\n", "whitespace"),
    ("http://rabbit:99999", "out of range"),
    ("http://rabbit:port", "port"),
    ("http://rabbit:15672/?vhost=x", "query"),
    ("http://rabbit:15672/#top", "fragment"),
    ("", "empty"),
    (15672, "not a string"),
    (b"http://rabbit:15672", "not a string"),
])
def test_an_invalid_url_is_one_clear_error_naming_the_value_and_what_is_valid(value, why):
    with pytest.raises(ConfigurationError) as info:
        Settings(service="s", management_url=value)
    message = str(info.value)
    assert message.startswith(f"management_url={value!r} is not a management API URL (")
    assert why in message and "http:// or https://" in message and "e.g. http://rabbitmq.internal:15672" in message


@pytest.mark.parametrize("value, shown", [
    ("http://admin:hunter2@rabbit:15672", "http://**@rabbit:15672"),
    ("https://token-hunter2@rabbit", "https://**@rabbit"),  # a token without a ":" is a secret too
    ("http://admin:hunter2@rab bit:15672", "http://**@rab bit:15672"),
    ("ftp://admin:hunter2@rabbit", "ftp://**@rabbit"),
])
def test_a_url_with_credentials_is_refused_and_never_shown_unmasked(value, shown):
    for source in ({"management_url": value}, {"environ": {MANAGEMENT_URL_ENV: value}}):
        with pytest.raises(ConfigurationError) as info:
            resolve_settings("s", conf={}, **{"environ": {}, **source})
        assert "hunter2" not in str(info.value) and repr(shown) in str(info.value)


def test_an_invalid_environment_value_names_the_variable_and_the_setting():
    with pytest.raises(ConfigurationError) as info:
        resolve_settings("s", conf={}, environ={MANAGEMENT_URL_ENV: "rabbit:15672"})
    assert str(info.value).startswith(
        f"{MANAGEMENT_URL_ENV}='rabbit:15672' (setting management_url) is not a management API URL (scheme rabbit)")


# -- reaching where it is used ---------------------------------------------------------------------------------

class FakeUrlopen:
    """``urllib.request.urlopen``: records each URL and its Authorization header; answers ``body`` as JSON."""

    def __init__(self, body: Any) -> None:
        self.body, self.asked, self.auth = body, [], []

    def __call__(self, request: Any, timeout: float | None = None) -> io.BytesIO:
        self.asked.append(request.full_url)
        self.auth.append(request.get_header("Authorization"))
        return io.BytesIO(json.dumps(self.body).encode())


def _events(**settings: Any) -> Events:
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, service="billing", delay_levels=2, publish_delay_levels=0, **settings)
    events.handler("orders.#", name="orders")(lambda payload: None)
    return events


class AmqpConnection(StatusConnection):
    """The fake of test_status (passive declares) with the credentials, vhost and TLS flag the API calls read."""

    userid, password, virtual_host, ssl = "guest", "guest", "/", False


def _gather(monkeypatch, events: Events, management_url: str | None = None) -> tuple[list[Any], FakeUrlopen]:
    opened = FakeUrlopen({"messages_unacknowledged": 7})
    monkeypatch.setattr(status.urllib.request, "urlopen", opened)
    monkeypatch.setattr(status, "archived_count", lambda connection, topology: 1)  # a stream: read, not asked
    topology = events.topology()
    connection = AmqpConnection({q.name: (1, 1) for q in topology.queues})
    return status.gather(connection, topology, management_url), opened


def test_gather_asks_the_configured_management_api(monkeypatch):
    rows, opened = _gather(monkeypatch, _events(management_url=CONFIGURED))
    assert opened.asked[0] == "https://mgmt.example:15671/rabbitmq/api/queues/%2F/billing.orders"
    assert all(url.startswith("https://mgmt.example:15671/rabbitmq/api/queues/%2F/") for url in opened.asked)
    assert {r.unacked for r in rows if r.role != "archive"} == {7}
    assert [r.unacked for r in rows if r.role == "archive"] == [0]  # the API is not asked about the archive
    assert not [url for url in opened.asked if url.endswith(".archive")]


def test_gather_reads_the_environment_variable_through_the_services_settings(monkeypatch):
    monkeypatch.setenv(MANAGEMENT_URL_ENV, "http://from-env.example:15680")
    _, opened = _gather(monkeypatch, _events())
    assert opened.asked[0] == "http://from-env.example:15680/api/queues/%2F/billing.orders"


def test_gather_without_the_setting_guesses_the_brokers_host_and_an_explicit_url_wins(monkeypatch):
    _, guessed = _gather(monkeypatch, _events())
    assert guessed.asked[0] == "http://rabbit.example:15672/api/queues/%2F/billing.orders"
    _, explicit = _gather(monkeypatch, _events(management_url=CONFIGURED), "http://flag.example:1/")
    assert explicit.asked[0] == "http://flag.example:1/api/queues/%2F/billing.orders"


def test_the_console_asks_the_configured_management_api_unless_its_own_settings_name_one(monkeypatch):
    pytest.importorskip("starlette")
    from contextlib import nullcontext

    from kombu_events.console import reading
    from kombu_events.console.app import ConsoleSettings, create_app

    events = _events(management_url=CONFIGURED)
    connection = AmqpConnection({q.name: (1, 1) for q in events.topology().queues})
    monkeypatch.setattr(reading, "connected", lambda url, app: nullcontext(connection))
    monkeypatch.setattr(status, "archived_count", lambda connection, topology: 1)
    for settings, asked in [(ConsoleSettings(), "https://mgmt.example:15671/rabbitmq/api/"),
                            (ConsoleSettings(management_url="http://console.example:1"), "http://console.example:1/")]:
        opened = FakeUrlopen({"messages_unacknowledged": 2})
        monkeypatch.setattr(status.urllib.request, "urlopen", opened)
        rows = create_app(events, settings).state.service.status()
        assert opened.asked[0].startswith(asked) and {r.unacked for r in rows if r.role != "archive"} == {2}


def _check(monkeypatch, events: Events, *, ssl: bool, management_url: str | None = None) -> FakeUrlopen:
    opened = FakeUrlopen([])
    monkeypatch.setattr(verify.urllib.request, "urlopen", opened)
    monkeypatch.setattr(verify, "missing", lambda topology, connection: [])
    connection = AmqpConnection({})
    connection.ssl = ssl
    verify.check(events.topology(), connection, command="kombu-events declare", management_url=management_url)
    return opened


def test_the_workers_check_asks_the_configured_management_api(monkeypatch):
    opened = _check(monkeypatch, _events(management_url=CONFIGURED, declare=False), ssl=False)
    assert opened.asked == ["https://mgmt.example:15671/rabbitmq/api/queues/%2F?columns=name,type,arguments",
                            "https://mgmt.example:15671/rabbitmq/api/exchanges/%2F?columns=name,type,arguments"]
    guessed = _check(monkeypatch, _events(declare=False), ssl=False)
    assert guessed.asked[0].startswith("http://rabbit.example:15672/api/queues/")


def test_over_tls_only_a_configured_url_is_asked(monkeypatch):
    """The worker's credentials never go in plain HTTP to a guessed URL when its AMQP is TLS."""
    assert _check(monkeypatch, _events(declare=False), ssl=True).asked == []
    opened = _check(monkeypatch, _events(management_url=CONFIGURED, declare=False), ssl=True)
    assert opened.asked[0].startswith("https://mgmt.example:15671/rabbitmq/api/queues/")
    assert opened.auth[0] == "Basic Z3Vlc3Q6Z3Vlc3Q="  # guest:guest, to the URL the setting named


def test_the_workers_consumer_checks_with_its_services_setting(monkeypatch):
    from kombu_events.worker.consumer import ServiceConsumer

    seen: list[str | None] = []

    class Checked(Exception):
        pass

    def listing(connection, management_url):
        seen.append(management_url)
        raise Checked

    monkeypatch.setattr(verify, "_listing", listing)
    monkeypatch.setattr(verify, "missing", lambda topology, connection: [])
    service = ServiceConsumer(_events(management_url=CONFIGURED, declare=False))
    with pytest.raises(Checked):
        service.start(AmqpConnection({}), None, None)
    assert seen == [CONFIGURED]


def test_the_status_flag_is_validated_before_connecting(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:  # click >= 8.2
        runner = CliRunner()
    result = runner.invoke(cli, ["-A", "no_such_module_anywhere", "status", "--management-url",
                                 "ftp://admin:hunter2@rabbit"], prog_name="kombu-events")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [(
        "Error: --management-url='ftp://**@rabbit' is not a management API URL (scheme ftp): give http:// or "
        "https://, a host and optionally a port and a path, e.g. http://rabbitmq.internal:15672 (no credentials: "
        "the API is asked with the broker connection's user)")]
    assert "hunter2" not in result.stdout + result.stderr
