"""The console's pure decisions: authentication, roles, the cross-site check, search, grouping, views, audit."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from kombu_events.console import audit, auth, query, views
from kombu_events.console.auth import OPERATOR, VIEWER, AuthSettings, Principal
from kombu_events.core.config import Settings
from kombu_events.errors import ConfigurationError

PW, VPW = "operator-password-1", "viewer-password-12"
SETTINGS = AuthSettings(passwords={"operator": PW, "viewer": VPW}, tokens={"x" * 30: ("bot", VIEWER)})


def basic(user: str, password: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode(),
            "host": "console.example:8089"}


# -- authentication and roles -------------------------------------------------------------------------

@pytest.mark.parametrize("headers, client, expected", [
    (basic("alice", PW), "10.0.0.5", Principal("alice", OPERATOR, "password")),
    (basic("bob", VPW), "10.0.0.5", Principal("bob", VIEWER, "password")),
    (basic("eve", PW + "x"), "10.0.0.5", None),
    (basic("eve", ""), "127.0.0.1", None),
    ({"authorization": "Basic !!notbase64"}, "10.0.0.5", None),
    ({"authorization": "Bearer " + "x" * 30}, "10.0.0.5", Principal("bot", VIEWER, "token")),
    ({"authorization": "Bearer " + "y" * 30}, "10.0.0.5", None),
    ({"host": "127.0.0.1:8089"}, "127.0.0.1", None),  # authentication configured: loopback is no excuse
])
def test_authenticate(headers, client, expected):
    assert auth.authenticate(headers, client, SETTINGS) == expected


def test_without_authentication_only_loopback_to_a_loopback_host_gets_in():
    none = AuthSettings()
    assert auth.authenticate({"host": "127.0.0.1:8089"}, "127.0.0.1", none) == Principal("local", OPERATOR, "local")
    assert auth.authenticate({"host": "localhost"}, "::1", none) is not None
    assert auth.authenticate({"host": "[::1]:8089"}, "::1", none) is not None
    assert auth.authenticate({"host": "attacker.example"}, "127.0.0.1", none) is None  # DNS rebinding
    assert auth.authenticate({"host": "127.0.0.1"}, "192.168.1.4", none) is None


def test_proxy_header_is_believed_from_trusted_proxies_only():
    proxy = AuthSettings(proxy_header="X-Forwarded-User", trusted_proxies=frozenset({"10.0.0.1"}),
                         proxy_operators=frozenset({"carol"}))
    assert auth.authenticate({"x-forwarded-user": "carol"}, "10.0.0.1", proxy) == Principal("carol", OPERATOR,
                                                                                             "proxy")
    assert auth.authenticate({"x-forwarded-user": "dave"}, "10.0.0.1", proxy).role == VIEWER
    assert auth.authenticate({"x-forwarded-user": "carol"}, "10.0.0.2", proxy) is None
    assert auth.authenticate({}, "10.0.0.1", proxy) is None


@pytest.mark.parametrize("host, configured, refused", [
    ("127.0.0.1", False, False), ("::1", False, False), ("localhost", False, False),
    ("0.0.0.0", False, True), ("192.168.1.4", False, True), ("0.0.0.0", True, False),
])
def test_check_listen_refuses_beyond_loopback_without_authentication(host, configured, refused):
    settings = AuthSettings(passwords={"operator": PW}) if configured else AuthSettings()
    if refused:
        with pytest.raises(ConfigurationError, match="without authentication"):
            auth.check_listen(host, settings)
    else:
        auth.check_listen(host, settings)


def test_weak_password_and_unknown_role_are_refused():
    with pytest.raises(ConfigurationError, match="at least 12"):
        AuthSettings(passwords={"operator": "short"})
    with pytest.raises(ConfigurationError, match="unknown role 'admin'"):
        AuthSettings(passwords={"admin": "long-enough-password"})


@pytest.mark.parametrize("headers, refused", [
    ({"sec-fetch-site": "same-origin"}, False),
    ({"sec-fetch-site": "none"}, False),
    ({"sec-fetch-site": "cross-site"}, True),
    ({"sec-fetch-site": "same-site"}, True),
    ({"origin": "http://console:8089", "host": "console:8089"}, False),
    ({"origin": "http://evil:8089", "host": "console:8089"}, True),
    ({"origin": "https://console:8089", "host": "console:8089"}, True),  # another scheme: another origin
    ({"authorization": "Bearer abc"}, True),  # a bearer header alone, its token not checked: no exemption
    ({"authorization": "Basic abc"}, True),  # a browser resends Basic by itself
    ({}, True),
])
def test_cross_site_refusal(headers, refused):
    assert (auth.cross_site_refusal(headers, "http") is not None) is refused


def test_a_request_a_valid_bearer_token_logged_in_is_exempt():
    """A script: no ambient credential, once its token was checked (by_token)."""
    assert auth.cross_site_refusal({"authorization": "Bearer abc"}, "http", by_token=True) is None
    assert auth.cross_site_refusal({"sec-fetch-site": "cross-site"}, "http", by_token=True) is not None


def test_content_security_policy_allows_no_inline_script():
    csp = auth.CONTENT_SECURITY_POLICY
    assert "script-src 'self';" in csp and "'unsafe-inline'" not in csp and "'unsafe-eval'" not in csp


# -- search and grouping -------------------------------------------------------------------------------

@dataclass
class M:
    id: str = "m1"
    queue: str = "svc.orders"
    routing_key: str = "orders.1.created"
    reason: str = "gave up"
    archived_at: str = "2026-11-25T10:15:00.000+00:00"
    exception: str = "KeyError: 'order 1 not found'"
    body: bytes = b'{"order": 1}'
    headers: dict[str, Any] = field(default_factory=dict)
    properties: dict[str, Any] = field(default_factory=dict)
    attempts: Any = 3
    traceback: str = ""


def test_parse_qualifiers_and_words():
    q = query.parse('handler:orders key:orders.# exception:"Key Error" since:2026-11 refund "two words" x:y')
    assert (q.handler, q.key, q.exception, q.since) == ("orders", "orders.#", "Key Error", "2026-11")
    assert q.words == ("refund", "two words", "x:y")
    assert query.parse('unbalanced "quote').words == ("unbalanced", '"quote')
    assert query.parse("").empty


@pytest.mark.parametrize("text, hit", [
    ("", True), ("handler:orders", True), ("handler:svc.orders", True), ("handler:users", False),
    ("key:orders.*.created", True), ("key:orders.#", True), ("key:users.#", False),
    ("exception:keyerror", True), ("exception:ValueError", False),
    ("since:2026-11-25T10", True), ("since:2026-11-25T11", False),
    ("until:2026-11-25T11", True), ("until:2026-11-25T10:15", False),
    ('"order 1 not"', True), ('"order 2"', False), ("ORDER", True), ("refund", False), ("m1", True),
])
def test_matches(text, hit):
    assert query.matches(query.parse(text), M()) is hit


@pytest.mark.parametrize("raw, normal", [
    ("KeyError: 'order 17 not found'", "KeyError: <str>"),
    ("TimeoutError: took 30.5 s on attempt 3", "TimeoutError: took <n> s on attempt <n>"),
    ("LookupError: no 4fbcc418-7f8e-49a6-87d3-721b2007dc15", "LookupError: no <uuid>"),
    ("LookupError: no 0x7fa3 nor 4fbcc4187f8e49a6", "LookupError: no <hex> nor <hex>"),
    ("RuntimeError: boom\nsecond line", "RuntimeError: boom"),
])
def test_normalise(raw, normal):
    assert query.normalise(raw) == normal


def test_group_by_exception_key_and_hour_and_group_qualifier():
    messages = [M(id="a"), M(id="b", exception="KeyError: 'order 2 not found'", routing_key="orders.2.created"),
                M(id="c", exception="ValueError: bad", archived_at="2026-11-25T11:01:00.000+00:00"),
                M(id="d", queue="svc.users", routing_key="users.1.joined")]
    by_exception = query.group(messages, "exception")
    assert [(g.key, g.count) for g in by_exception] == [
        (("svc.orders", "KeyError: <str>"), 2), (("svc.orders", "ValueError: bad"), 1),
        (("svc.users", "KeyError: <str>"), 1)]
    assert by_exception[0].first == "2026-11-25T10:15:00.000+00:00"
    assert [(g.key, g.count) for g in query.group(messages, "hour")] == [(("2026-11-25T10",), 3),
                                                                          (("2026-11-25T11",), 1)]
    assert query.group(messages, "key")[0].key == ("orders.1.created",)
    chosen = query.parse(f"group:{by_exception[0].id}")
    assert [m.id for m in messages if query.matches(chosen, m)] == ["a", "b"]
    with pytest.raises(ValueError, match="unknown grouping"):
        query.group(messages, "day")


# -- views and audit -----------------------------------------------------------------------------------

def test_body_view_json_text_hex():
    assert views.body_view(b'{"a":1}', "application/json") == ("json", '{\n  "a": 1\n}')
    assert views.body_view(b"plain", None) == ("text", "plain")
    assert views.body_view(b"{not json", "application/json") == ("text", "{not json")
    assert views.body_view(b"\xff\x00", None) == ("hex", "ff 00")


@dataclass
class Q:
    queue: str
    role: str
    ready: int | None = 0
    unacked: int | None = 0
    consumers: int | None = 1
    exists: bool = True
    state: str | None = None


def test_overview_flags_a_queue_without_consumer_a_nearly_full_archive_and_a_missing_queue():
    settings = Settings(service="svc", archive_max_length=100)
    rows = views.overview_rows([Q("svc.delay.0", "delay"), Q("svc.archive", "archive", ready=85, consumers=0),
                                Q("svc.orders", "handler", consumers=0, state="paused"),
                                Q("svc.users", "handler", exists=False, ready=None)], settings)
    assert [r.queue for r in rows] == ["svc.orders", "svc.users", "svc.archive", "svc.delay.0"]
    assert "no consumer" in rows[0].alert and "missing" in rows[1].alert and "nearly full" in rows[2].alert
    assert rows[2].bound.startswith("at most 100 messages")
    assert views.overview_rows([Q("svc.archive", "archive", ready=10)], settings)[0].alert == ""


def test_event_view_sections():
    m = M(headers={"kombu-events-first-failure-at": "t0", "x-death": [{"queue": "svc.orders", "count": 2}]},
          properties={"content_type": "application/json", "application_headers": {}})
    view = views.event_view(m)
    assert view.body_kind == "json" and ("content_type", "application/json") in view.properties
    assert ("first failure at", "t0") in view.failure and view.deaths == [{"queue": "svc.orders", "count": "2"}]
    assert all(k != "x-death" for k, _ in view.headers)


def test_audit_log_appends_and_reloads(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = audit.AuditLog(path)
    log.record("alice", OPERATOR, "replay", 3, job="j1")
    log.record("bob", OPERATOR, "purge", 1)
    assert [e["action"] for e in audit.AuditLog(path).recent()] == ["purge", "replay"]
    assert json.loads(path.read_text().splitlines()[0])["job"] == "j1"
    assert set(audit.stamp("alice", "j1")) == {audit.BY_HEADER, audit.AT_HEADER, audit.JOB_HEADER}


# -- the command -----------------------------------------------------------------------------------------

def _console(*args: str, env: dict[str, str] | None = None) -> Any:
    from click.testing import CliRunner

    from kombu_events.cli import cli

    return CliRunner().invoke(cli, ["-A", "no_such_module_needed", "console", *args], env=env,
                              prog_name="kombu-events")


def test_the_command_refuses_to_listen_beyond_loopback_without_authentication():
    result = _console("--host", "0.0.0.0")
    assert result.exit_code == 1 and "refusing to listen on 0.0.0.0 without authentication" in result.output


def test_the_command_reads_passwords_and_tokens_and_says_what_is_wrong(tmp_path):
    missing = _console("--host", "0.0.0.0", "--password-env", "NO_SUCH_VARIABLE_SET")
    assert missing.exit_code == 1 and "NO_SUCH_VARIABLE_SET is not set" in missing.output
    weak = _console("--password-env", "PW", env={"PW": "short"})
    assert weak.exit_code == 1 and "at least 12" in weak.output
    tokens = tmp_path / "tokens"
    tokens.write_text("# role name token\noperator ci-bot tooshort\n")
    bad = _console("--token-file", str(tokens))
    assert bad.exit_code == 1 and f"{tokens}:2" in bad.output
