"""The console's request guard, through its own application over a stubbed archive (test_console_routes_kit):
security headers on every answer, the cross-site check, roles and the read-only switch, failed logins."""
from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from kombu_events.console import logins
from kombu_events.console.auth import SECURITY_HEADERS, AuthSettings
from kombu_events.console.jobs import Job

from .test_console_routes_kit import (
    BEARER_OPERATOR,
    BEARER_VIEWER,
    JSON,
    OPERATOR,
    OPERATOR_PW,
    SAME_ORIGIN,
    VIEWER,
    archived,
    basic,
    console,
    key_of,
)

IDS = ("m1", "m2", "m3")
KEYS = [key_of(i) for i in IDS]


def _console(**settings):
    return console([archived(i) for i in IDS], **settings)


# -- (1) the security headers, on every answer -------------------------------------------------------------

ANSWERS = [
    ("GET", "/no/such/page", OPERATOR, None, 404),
    ("GET", "/events/no-such-key", OPERATOR, None, 404),
    ("GET", "/api/archive/no-such-key", BEARER_OPERATOR, None, 404),
    ("GET", "/failures?q=" + "x" * 1001, OPERATOR, None, 400),
    ("GET", "/api/archive?limit=501", BEARER_OPERATOR, None, 400),
    ("GET", "/static/no-such-file.css", OPERATOR, None, 404),
    ("GET", "/api/archive?limit=lots", BEARER_OPERATOR, None, 400),
    ("POST", "/replay", {**OPERATOR, **SAME_ORIGIN}, {"scope": "matching", "rate": "fast"}, 400),
    ("GET", "/", {}, None, 401),
    ("GET", "/", basic("eve", "not-the-password"), None, 401),
    ("POST", "/replay", {**VIEWER, **SAME_ORIGIN}, {"scope": "matching"}, 403),
    ("POST", "/purge", {**OPERATOR, "Sec-Fetch-Site": "cross-site"}, {"count": "3"}, 403),
    ("PUT", "/api/purge", BEARER_OPERATOR, None, 405),
    ("GET", "/replay", OPERATOR, None, 405),
    ("DELETE", f"/events/{KEYS[0]}", OPERATOR, None, 405),
]


@pytest.mark.parametrize("method, path, headers, form, status", ANSWERS)
def test_every_answer_carries_the_security_headers(method, path, headers, form, status):
    c = _console()
    answer = c.web.request(method, path, headers=headers, data=form)
    assert answer.status_code == status
    for name, value in SECURITY_HEADERS.items():
        assert answer.headers.get(name) == value, f"{method} {path} ({status}) has no {name}"


@pytest.mark.parametrize("path, headers", [("/failures", OPERATOR), ("/api/archive", BEARER_OPERATOR),
                                           (f"/events/{KEYS[0]}", OPERATOR), (f"/api/archive/{KEYS[0]}",
                                                                              BEARER_OPERATOR)])
def test_a_server_error_carries_the_security_headers_and_says_little(path, headers):
    c = _console()
    c.stub.fail_with = RuntimeError("a bug with a secret in its message: hunter2")
    answer = c.web.get(path, headers=headers)
    assert answer.status_code == 500
    for name, value in SECURITY_HEADERS.items():
        assert answer.headers.get(name) == value, f"a 500 of {path} has no {name}"
    assert "hunter2" not in answer.text and "Traceback" not in answer.text


# -- (4, 7a) the cross-site check ------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {**OPERATOR, "Sec-Fetch-Site": "cross-site"},
    {**OPERATOR, "Sec-Fetch-Site": "same-site"},
    {**OPERATOR, "Origin": "https://evil.example"},
    {**OPERATOR, "Origin": "https://127.0.0.1:8089"},  # another scheme, another origin
    OPERATOR,  # Basic, which a browser resends by itself, and neither header
], ids=["cross-site", "same-site", "foreign-origin", "other-scheme", "no-browser-header"])
def test_a_cross_site_state_change_is_refused_and_changes_nothing(headers):
    c = _console()
    for path, form in (("/purge", {"q": "", "count": "3"}), ("/replay", {"scope": "matching"}),
                       ("/jobs/x/cancel", {})):
        answer = c.web.post(path, data=form, headers=headers)
        assert answer.status_code == 403, path
    assert (c.stub.purged, c.stub.replayed, c.audit) == ([], [], [])


def test_a_state_change_from_the_console_itself_is_let_through():
    c = _console()
    assert c.web.post("/purge", data={"q": "", "count": "3"}, headers={**OPERATOR, **SAME_ORIGIN}).status_code == 200
    assert c.web.post("/purge", data={"q": "", "count": "0"},
                      headers={**OPERATOR, "Origin": "http://127.0.0.1:8089"}).status_code == 200
    assert c.stub.purged == KEYS


def test_a_script_with_a_valid_bearer_token_needs_no_browser_header():
    c = _console()
    answer = c.web.post("/api/purge", json={"q": "", "yes": True}, headers=BEARER_OPERATOR)
    assert answer.status_code == 200 and c.stub.purged == KEYS


@pytest.mark.parametrize("settings, headers", [
    ({"auth": AuthSettings()}, {"Authorization": "Bearer junk"}),  # no authentication: a local operator
    ({"auth": AuthSettings()}, {"Authorization": "Bearer " + "o" * 32}),
    ({"auth": AuthSettings(proxy_header="X-Forwarded-User", proxy_operators=frozenset({"carol"}))},
     {"X-Forwarded-User": "carol", "Authorization": "Bearer junk"}),
], ids=["no-auth-junk", "no-auth-unknown-token", "proxy-junk"])
def test_the_bearer_exemption_needs_a_bearer_token_that_authenticated_the_request(settings, headers):
    c = _console(**settings)
    assert c.web.get("/", headers=headers).status_code == 200  # in, by other means than the token
    for path, form in (("/purge", {"q": "", "count": "3"}), ("/replay", {"scope": "matching"})):
        assert c.web.post(path, data=form, headers=headers).status_code == 403, path
    answer = c.web.post("/api/purge", json={"q": "", "yes": True}, headers=headers)
    assert answer.status_code == 403 and "Sec-Fetch-Site" in answer.text
    assert (c.stub.purged, c.stub.replayed) == ([], [])


# -- (7b) roles and the read-only switch ---------------------------------------------------------------

CHANGES = [  # (method, path, form, JSON body, what the audit trail says when an operator does it)
    ("/replay", {"scope": "matching", "q": ""}, None, "replay"),
    ("/replay", {"scope": "selected", "key": KEYS[0]}, None, "replay"),
    ("/purge", {"q": "", "count": "3"}, None, "purge"),
    ("/jobs/j1/cancel", None, None, "cancel"),
    (f"/events/{KEYS[0]}/edit", {"body": "{}"}, None, "edit and replay"),
    ("/api/replay", None, b'{"q": ""}', "replay"),
    ("/api/purge", None, b'{"q": "", "yes": true}', "purge"),
]


def _change(c, headers, path, form, body):
    c.app.state.jobs._jobs["j1"] = Job("j1", "alice", frozenset({KEYS[0]}), "")  # a job to cancel, not started
    if body is not None:
        return c.web.post(path, content=body, headers={**headers, **JSON, **SAME_ORIGIN})
    return c.web.post(path, data=form, headers={**headers, **SAME_ORIGIN})


@pytest.mark.parametrize("headers", [VIEWER, BEARER_VIEWER], ids=["password", "token"])
def test_a_viewer_can_neither_replay_nor_purge_nor_cancel_nor_edit(headers):
    c = _console(allow_edit=True)
    for path, form, body, _ in CHANGES:
        answer = _change(c, headers, path, form, body)
        assert answer.status_code == 403 and "viewer" in answer.text, path
    assert (c.stub.purged, c.stub.replayed, c.audit, len(c.stub.messages)) == ([], [], [], 3)
    assert not c.app.state.jobs.get("j1").cancel.is_set()


def test_a_read_only_console_refuses_every_change_even_to_an_operator():
    c = _console(read_only=True, allow_edit=True)
    for path, form, body, _ in CHANGES:
        answer = _change(c, OPERATOR, path, form, body)
        assert answer.status_code == 403 and "read-only" in answer.text, path
    assert (c.stub.purged, c.stub.replayed, c.audit) == ([], [], [])


@pytest.mark.parametrize("path, form, body, action", CHANGES, ids=[f"{p}:{a}" for p, _, _, a in CHANGES])
def test_an_operator_can_make_each_change(path, form, body, action):
    c = _console(allow_edit=True)
    answer = _change(c, OPERATOR, path, form, body)
    assert answer.status_code in (200, 303) and c.audit[-1]["action"] == action


# -- (3) failed logins ----------------------------------------------------------------------------------

class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _throttled_console(clock, **settings):
    c = _console(**settings)
    c.app.state.logins.clock = clock
    return c


def test_failed_logins_are_logged_without_the_password_and_slowed_down_per_client(caplog):
    clock = Clock()
    c = _throttled_console(clock)
    wrong = basic("mallory\nforged line", "guess-number-1-secret")
    free = logins.LoginLimits().free_failures
    with caplog.at_level(logging.WARNING, logger="kombu_events.console"):
        for _ in range(free):
            assert c.web.get("/", headers=wrong).status_code == 401
        locked = c.web.get("/", headers=wrong)
        right_meanwhile = c.web.get("/", headers=OPERATOR)  # the right password waits too: no guessing
    assert locked.status_code == 429 and int(locked.headers["retry-after"]) >= 1
    assert right_meanwhile.status_code == 429
    for name, value in SECURITY_HEADERS.items():
        assert locked.headers.get(name) == value
    failed = [r.getMessage() for r in caplog.records if "failed login" in r.getMessage()]
    assert len(failed) == free
    assert all("mallory" in line and "127.0.0.1" in line for line in failed)
    assert all("\n" not in line for line in failed)  # the user name cannot forge a log line
    assert "guess-number-1-secret" not in caplog.text and "forged line\n" not in caplog.text

    # another client is not slowed down by this one
    other = TestClient(c.web.app, base_url="http://console.example", client=("10.9.8.7", 50000))
    assert other.get("/failures", headers=OPERATOR).status_code == 200

    clock.now += int(locked.headers["retry-after"])
    assert c.web.get("/", headers=OPERATOR).status_code == 200  # the lock is over, and a success resets
    for _ in range(free):
        assert c.web.get("/", headers=wrong).status_code == 401


def test_a_failed_bearer_token_counts_and_is_logged_without_the_token(caplog):
    c = _throttled_console(Clock())
    junk = {"Authorization": "Bearer not-a-token-but-a-secret-anyway"}
    with caplog.at_level(logging.WARNING, logger="kombu_events.console"):
        answers = [c.web.get("/api/archive", headers=junk).status_code for _ in range(logins.LoginLimits()
                                                                                       .free_failures + 1)]
    assert answers[-1] == 429 and set(answers[:-1]) == {401}
    assert "not-a-token-but-a-secret-anyway" not in caplog.text and "failed login" in caplog.text


def test_a_request_without_credentials_is_no_failed_login():
    c = _throttled_console(Clock())
    for _ in range(3 * logins.LoginLimits().free_failures):
        assert c.web.get("/").status_code == 401  # a browser's first request, before it asks for a password
    assert c.web.get("/", headers=OPERATOR).status_code == 200


def test_the_lockout_grows_and_is_capped():
    limits = logins.LoginLimits(free_failures=2, first_lockout_s=1.0, max_lockout_s=8.0)
    clock = Clock()
    table = logins.FailedLogins(limits, clock=clock)
    waits = []
    for _ in range(8):
        assert table.wait_s("10.0.0.1") == 0.0
        table.failed("10.0.0.1")
        waits.append(table.wait_s("10.0.0.1"))
        clock.now += waits[-1]
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    table.succeeded("10.0.0.1")
    table.failed("10.0.0.1")
    assert table.wait_s("10.0.0.1") == 0.0


def test_a_client_is_forgotten_after_a_quiet_while_and_the_table_is_bounded():
    limits = logins.LoginLimits(free_failures=1, max_clients=100)
    clock = Clock()
    table = logins.FailedLogins(limits, clock=clock)
    table.failed("10.0.0.1")
    assert table.wait_s("10.0.0.1") > 0
    clock.now += limits.forget_after_s + 1
    assert table.wait_s("10.0.0.1") == 0.0 and table.failures("10.0.0.1") == 0
    for n in range(10_000):
        table.failed(f"10.{n // 65536}.{n // 256 % 256}.{n % 256}")
    assert len(table) <= 100
    assert table.failures("10.0.39.15") == 1  # the latest are kept, the oldest forgotten


def test_an_ipv6_client_is_counted_by_its_64_bit_network():
    table = logins.FailedLogins(logins.LoginLimits(free_failures=1), clock=Clock())
    table.failed("2001:db8:1:2::1")
    assert table.wait_s("2001:db8:1:2:ffff::9") > 0 and table.wait_s("2001:db8:1:3::1") == 0.0


def test_a_right_password_resets_the_count():
    c = _throttled_console(Clock())
    wrong = basic("alice", "typo-" + OPERATOR_PW)
    for _ in range(3):
        for _ in range(logins.LoginLimits().free_failures - 1):
            assert c.web.get("/", headers=wrong).status_code == 401
        assert c.web.get("/", headers=OPERATOR).status_code == 200
