"""The console's pure decisions: authentication, roles, the cross-site check, search (its length and its time),
grouping, the index of the archive (what it keeps of a copy, how it folds settlements in), views, audit."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from kombu_events.console import audit, auth, entries, query, views
from kombu_events.console.auth import OPERATOR, VIEWER, AuthSettings, Principal
from kombu_events.console.index import ArchiveIndex
from kombu_events.core.archive_records import OPENED, PURGED, REPLAYED, Settlement
from kombu_events.core.config import Settings
from kombu_events.errors import ConfigurationError
from kombu_events.ops.archive import ArchivedMessage

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
    key: str = "3f9c2a7b81d04e6a9b1c"

    @property
    def prefix(self) -> bytes:
        return self.body

    @property
    def failure(self) -> str:
        return query.normalise(self.exception or self.reason)


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
    ("3F9C2A7B", True),  # the archive key
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


def test_a_search_line_longer_than_the_limit_is_refused_with_the_limit_named():
    assert query.parse("x" * query.MAX_QUERY_CHARS).words == ("x" * query.MAX_QUERY_CHARS,)
    with pytest.raises(query.QueryTooLong, match="1,001 characters long; the console reads at most 1,000"):
        query.parse("x" * (query.MAX_QUERY_CHARS + 1))


class Ticks:
    """A clock that moves ``step`` seconds each time it is read."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_search_stops_at_its_budget_and_says_how_far_it_got():
    copies = [M(id=f"m{n}") for n in range(10_000)]
    clock = Ticks(0.001)  # a look at the clock every 256 copies: 1 ms each
    found = query.search(copies, query.parse("m9999"), budget_s=0.005, clock=clock)
    assert found.partial and found.searched == 6 * 256 and found.matched == [] and found.total == 10_000
    whole = query.search(copies, query.parse("m9999"), budget_s=None, clock=Ticks(1.0))
    assert not whole.partial and [m.id for m in whole.matched] == ["m9999"] and whole.searched == 10_000
    first = query.search(copies, query.parse("m99"), budget_s=None, limit=3)
    assert [m.id for m in first.matched] == ["m99", "m990", "m991"] and not first.partial
    everything = query.search(copies, query.parse(""), limit=50)
    assert len(everything.matched) == 50 and not everything.partial
    assert query.search(copies, query.parse("m1"), limit=0).matched == []


# -- the index: what it keeps of a copy, and how it folds the archive's records ---------------------------

def copy(key: str, offset: int, body: bytes = b'{"order": 1}', message_id: str = "m1", **fields: Any
         ) -> ArchivedMessage:
    values: dict[str, Any] = {"id": message_id, "queue": "svc.orders", "routing_key": "orders.1.created",
                              "reason": "gave up: KeyError: x", "attempts": 3,
                              "archived_at": "2026-11-25T10:15:00.000+00:00", "exception": "KeyError: 'order 17'",
                              "traceback": "Traceback ...", "headers": {},
                              "properties": {"content_type": "application/json"}}
    values.update(fields)
    return ArchivedMessage(key=key, offset=offset, body=body, size=len(body), **values)


def test_an_entry_keeps_a_body_prefix_and_short_texts_whatever_the_body():
    big = copy("k1", 7, body=b"x" * 15 * 2**20, exception="E: " + "y" * 5000, attempts=b"\xff" * 999)
    entry = entries.entry_of(big)
    assert (entry.key, entry.offset, entry.size, len(entry.prefix)) == ("k1", 7, 15 * 2**20, entries.BODY_PREFIX_BYTES)
    assert entry.truncated and len(entry.exception) == entries.TEXT_CHARS and len(str(entry.attempts)) <= 255
    assert entry.failure == query.normalise(entry.exception) and entry.content_type == "application/json"
    summary = entry.summary()
    assert summary["body"] == "x" * 1024 and summary["truncated"] and set(summary) == {
        "key", "id", "queue", "routing_key", "reason", "attempts", "archived_at", "exception", "body", "size",
        "truncated", "offset"}
    assert entries.entry_of(copy("k2", 8, body=b"\xff\xfe")).summary()["body"] == repr(b"\xff\xfe")


def settlement(action: str, keys: tuple[str, ...], offset: int) -> Settlement:
    return Settlement(action, keys, "alice", "2026-11-25T11:00:00.000+00:00", offset=offset)


def test_the_index_folds_settlements_in_and_keys_tell_copies_apart():
    index = ArchiveIndex()
    index.apply(settlement(OPENED, (), 0))
    index.reached(4)
    assert not index.view().caught_up
    for n, key in enumerate(("a", "b", "c"), start=1):
        index.apply(copy(key, n, message_id="same-id"))  # one message id, three copies
    index.apply(settlement(PURGED, ("b",), 4))
    view = index.view()
    assert [e.key for e in view.entries] == ["a", "c"] and view.caught_up and view.through == 4
    assert view.records == 5 and index.view() is view  # the same view until a record changes it
    assert index.get("b") is None and index.settlement("b").action == PURGED and index.get("a").id == "same-id"
    assert [e.key for e in index.with_id("same-id")] == ["a", "c"]
    index.apply(copy("c", 3))  # read again (from the start of a chunk): ignored
    index.apply(copy("b", 5))  # a copy written again by a migration: settled all the same
    index.apply(settlement(REPLAYED, ("a", "a-never-read"), 6))
    assert [e.key for e in index.view().entries] == ["c"] and index.wait_settled(["a", "b", "a-never-read"], 0)
    assert not index.wait_settled(["c"], 0.01)
    assert index.forget_before(4) == 1 and index.view().entries == ()


def test_the_index_has_caught_up_at_the_end_it_found_or_when_an_empty_stream_stays_quiet():
    empty = ArchiveIndex()
    empty.reached(None)
    assert empty.wait_caught_up(0)
    quiet = ArchiveIndex()
    quiet.reached(3)
    quiet.idle()  # the broker is slow: what was read is not all there is
    assert not quiet.caught_up
    for offset in range(4):
        quiet.apply(settlement(OPENED, (), offset))
    assert quiet.caught_up
    failing = ArchiveIndex()
    failing.failed("the archive 'svc.archive' does not exist on the broker")
    assert "does not exist" in failing.view().error


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


def test_overview_flags_a_queue_without_consumer_and_a_missing_queue_and_shows_the_archives_retention():
    settings = Settings(service="svc", archive_ttl_ms=2 * 3_600_000, archive_max_bytes=512 * 2**20)
    rows = views.overview_rows([Q("svc.delay.0", "delay"), Q("svc.archive", "archive", ready=85, consumers=0),
                                Q("svc.orders", "handler", consumers=0, state="paused"),
                                Q("svc.users", "handler", exists=False, ready=None)], settings)
    assert [r.queue for r in rows] == ["svc.orders", "svc.users", "svc.archive", "svc.delay.0"]
    assert "no consumer" in rows[0].alert and "missing" in rows[1].alert and rows[2].alert == ""
    assert rows[2].bound == "kept at most 2 h (archive_ttl_ms) and 512 MiB in all (archive_max_bytes)"
    assert views.retention(Settings(service="svc", archive_ttl_ms=0, archive_max_bytes=0)) == \
        "kept for ever (no retention set)"


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
