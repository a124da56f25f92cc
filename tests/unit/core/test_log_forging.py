"""core/logs.py ``escape_controls`` and the log lines that carry what a publisher or a request sent.

A message id, routing key, header value, reason or user name with a line break or a terminal
escape in it must not start a line of its own in a log, nor recolour a terminal: every
control character is shown as an escape, and nothing else changes.
"""
from __future__ import annotations

import json
import logging
import re
import unicodedata
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings, strategies as st
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient

from kombu_events.console.app import ConsoleSettings, Guard
from kombu_events.console.audit import AuditLog
from kombu_events.console.auth import AuthSettings
from kombu_events.core.breaker import OPEN
from kombu_events.core.logs import escape_controls, log_outcome
from kombu_events.database import inbox
from kombu_events.middleware import breakers
from kombu_events.middleware.control import Control

#: What must never reach a log line as it is: Unicode's control characters (C0, DEL, C1: ESC and
#: CSI among them), the line and paragraph separators, and lone surrogates.
UNSAFE = frozenset({"Cc", "Zl", "Zp", "Cs"})
HOSTILE = "m-1\nERROR forged line\r\x1b[31mred\x9b2J\x00\x7f\u2028\u2029\x85\udcff"
SHOWN = r"m-1\nERROR forged line\r\x1b[31mred\x9b2J\x00\x7f\u2028\u2029\x85\udcff"
SETTINGS = settings(max_examples=300, deadline=None)


def unsafe(text: str) -> list[str]:
    return [char for char in text if unicodedata.category(char) in UNSAFE]


# -- the helper ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, shown", [
    ("\n", r"\n"), ("\r", r"\r"), ("\t", r"\t"), ("\x00", r"\x00"), ("\x1b[31m", r"\x1b[31m"), ("\x7f", r"\x7f"),
    ("\x85", r"\x85"), ("\x9b", r"\x9b"), ("\x9f", r"\x9f"), ("\u2028", r"\u2028"), ("\u2029", r"\u2029"),
    ("\udcff", r"\udcff"), ("\ud800", r"\ud800"), (HOSTILE, SHOWN),
    ("a\\nb", "a\\nb"),  # a backslash stays: it cannot break a line
    ("Zo\u00eb K\u00f6ln \u6771\u4eac \U0001f600 \u00a0\u00ad\ufeff\u202e", None),  # printable or format: kept
    ("", None), ("plain text: 'quoted' \"and\" {braces} %s %(x)s", None),
])
def test_escape_controls(value, shown):
    assert escape_controls(value) == (value if shown is None else shown)


@pytest.mark.parametrize("value, shown", [(None, "None"), (42, "42"), (b"a\nb", "b'a\\nb'"),
                                          (ValueError("bad\nvalue"), r"bad\nvalue")])
def test_escape_controls_takes_any_value_as_its_text(value, shown):
    assert escape_controls(value) == shown


@SETTINGS
@given(st.text())
@example(HOSTILE)
def test_no_control_character_survives(text):
    shown = escape_controls(text)
    assert unsafe(shown) == []
    assert len(shown.splitlines()) <= 1
    assert escape_controls(shown) == shown  # nothing left to escape


@SETTINGS
@given(st.text(st.characters(blacklist_categories=tuple(UNSAFE))))
@example("Zo\u00eb \u6771\u4eac \U0001f600 \\x1b")
def test_printable_text_is_unchanged(text):
    assert escape_controls(text) == text


@SETTINGS
@given(st.text(st.characters(whitelist_categories=tuple(UNSAFE)), min_size=1))
def test_each_control_character_becomes_a_visible_ascii_escape(text):
    shown = escape_controls(text)
    assert re.fullmatch(r"(\\n|\\r|\\t|\\x[0-9a-f]{2}|\\u[0-9a-f]{4})+", shown), shown
    assert len(re.findall(r"\\", shown)) == len(text)


# -- the worker's outcome line -----------------------------------------------------------------------

def _outcome_line(caplog, **fields):
    caplog.set_level(logging.DEBUG, logger="kombu_events.outcome")
    arguments = {"queue": "billing.audit", "routing_key": "orders.1", "message_id": "m-1", "attempt": 1,
                 "duration_ms": 1.0, "reason": "", **fields}
    log_outcome("archive", **arguments)
    [record] = caplog.records
    return record


@pytest.mark.parametrize("field", ["routing_key", "message_id", "queue", "reason"])
def test_an_outcome_line_shows_a_hostile_field_escaped(caplog, field):
    record = _outcome_line(caplog, **{field: HOSTILE})
    line = record.getMessage()
    assert unsafe(line) == [] and "\n" not in line
    assert SHOWN in line or repr(HOSTILE)[1:-1] in line  # the reason is shown as repr() already
    assert record.kombu_events[field] == HOSTILE  # the structured fields keep what was sent


def test_an_outcome_line_with_an_integer_message_id_is_unchanged(caplog):
    record = _outcome_line(caplog, message_id=7)
    assert " message_id=7 " in record.getMessage()


def test_a_json_formatter_of_an_outcome_line_writes_one_valid_json_line(caplog):
    record = _outcome_line(caplog, routing_key=HOSTILE, message_id=HOSTILE, reason=HOSTILE)
    line = json.dumps({"message": record.getMessage(), **record.kombu_events})
    assert "\n" not in line and unsafe(line) == []
    assert json.loads(line)["message_id"] == HOSTILE


# -- the console -------------------------------------------------------------------------------------

def _assert_shown_escaped(caplog, *hostile: str) -> list[str]:
    lines = [record.getMessage() for record in caplog.records]
    assert lines
    for line in lines:
        assert unsafe(line) == [], line
    for text in hostile:
        assert any(escape_controls(text) in line for line in lines), (text, lines)
    return lines


def test_the_audit_trail_logs_a_hostile_user_name_escaped_and_writes_one_json_line(caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="kombu_events.console.audit")
    path = tmp_path / "audit.jsonl"
    AuditLog(path).record(HOSTILE, "operator", "purge", 2, query="q\nforged", before="x")
    _assert_shown_escaped(caplog, HOSTILE)
    [line] = path.read_text(encoding="utf-8").split("\n")[:-1]
    assert unsafe(line) == []
    assert json.loads(line)["actor"] == HOSTILE
    assert AuditLog(path).recent()[0]["actor"] == HOSTILE


async def _ok(scope, receive, send):
    await PlainTextResponse("ok")(scope, receive, send)


def test_the_console_logs_a_refused_request_with_the_user_name_and_origin_escaped(caplog):
    caplog.set_level(logging.WARNING, logger="kombu_events.console.app")
    guard = Guard(_ok, ConsoleSettings(auth=AuthSettings(passwords={"operator": "operator-password-1"})))
    user = "alice\n[2024-01-01 00.00.00,000 WARNING/MainProcess] console forged\r\x1b[31m"  # no colon: Basic
    web = TestClient(guard, base_url="http://127.0.0.1:8089", client=("127.0.0.1", 50000))  # no lifespan
    answer = web.post("/replay", auth=(user, "operator-password-1"),
                      headers={"Origin": "https://evil.example/\x9b2J".encode("latin-1")})
    assert answer.status_code == 403
    [line] = _assert_shown_escaped(caplog, user)
    assert "Origin: https://evil.example/" in line and r"\x9b2J)" in line


# -- other lines that carry a reason or error text from a message or a request -----------------------

class _Consuming:
    def call_soon_threadsafe(self, fn):
        pass


def test_a_pause_logs_its_reason_escaped(caplog):
    caplog.set_level(logging.INFO, logger="kombu_events.middleware.control")
    Control("svc", ("svc.a",), _Consuming()).pause("svc.a", f"circuit open: {HOSTILE}")
    _assert_shown_escaped(caplog, HOSTILE)


def test_a_circuit_logs_the_failure_that_tripped_it_escaped(caplog):
    caplog.set_level(logging.INFO, logger="kombu_events.middleware.breakers")
    breaker = SimpleNamespace(reason=f"5 failures: {HOSTILE}", reopens_at=10.0, trips_in_a_row=1,
                              log_level=lambda now: "warning")
    circuit = SimpleNamespace(breaker=breaker, handler=SimpleNamespace(name="audit"), queue="svc.audit")
    breakers._log(circuit, OPEN, 1.0, f" (last failure: {HOSTILE})")
    _assert_shown_escaped(caplog, HOSTILE)


def test_an_inbox_failure_logs_the_database_error_escaped(caplog):
    caplog.set_level(logging.WARNING, logger="kombu_events.database.inbox")
    once = SimpleNamespace(queue="svc.audit", key=HOSTILE, backend=SimpleNamespace(name="postgresql"))
    inbox._retry("inserting its inbox row", once, ValueError(f"duplicate key ({HOSTILE})"))
    _assert_shown_escaped(caplog, HOSTILE)
