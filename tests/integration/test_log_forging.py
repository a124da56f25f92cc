"""Forged log lines, against a real worker and a real console: what a publisher or a client sends with a line
break, a carriage return or a terminal escape in it shows escaped in the log, never as a line of its own.

The worker's log is its stdout (``celery worker`` to a file); the console's is ``kombu-events console``'s
stderr, with kombu_events' loggers at INFO so that the audit lines show too.
"""
from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .harness import Project, get_messages, publish_amqp, queue_depth, unique, wait_for

pytestmark = pytest.mark.integration

#: Each injection starts a line of its own if it is not escaped: "FORGED-<where>" then a colour change.
INJECT = "\nFORGED-{where} line\r\x1b[31mred"
SHOWN = r"\nFORGED-{where} line\r\x1b[31mred"

APP = """
import logging
if os.environ.get("FORGING_CONSOLE_LOG"):  # the console logs at WARNING (kombu-events' own basicConfig): INFO too
    logging.getLogger("kombu_events").setLevel(logging.INFO)

events = Events(app, service=SERVICE, exchange=EXCHANGE, max_retries=0)

@events.handler("forge.#", bind=True)
def forge(event):
    record(handler="forge", message_id=event.message_id)
    if event.payload.get("archive"):
        raise Archive("tenant " + event.headers["x-tenant"] + " refused" + event.payload["archive"])
    raise ValueError("cannot read " + event.payload["fail"])
"""


def _lines(log: str) -> list[str]:
    """The log's lines as a terminal or a log shipper splits them: at \\n, \\r and the other line breaks."""
    return log.splitlines()


def _assert_not_forged(log: str, *wheres: str) -> None:
    assert "\x1b" not in log and "\x9b" not in log, "a terminal escape reached the log as it is"
    forged = [line for line in _lines(log) if line.lstrip().startswith(("FORGED", "\x1b"))]
    assert forged == [], forged
    for where in wheres:
        assert SHOWN.format(where=where) in log, f"{where}: not shown escaped in\n{log[-3000:]}"


def test_a_worker_logs_hostile_ids_keys_headers_and_reasons_escaped(make_project):
    project: Project = make_project(APP)
    worker = project.worker().wait_ready()
    archive = f"{project.service}.archive"
    message_id = "m" + INJECT.format(where="id")
    publish_amqp(project.broker_url, project.exchange, "forge.archive" + INJECT.format(where="key"),
                 json.dumps({"archive": INJECT.format(where="reason")}).encode(), message_id=message_id,
                 content_type="application/json", application_headers={"x-tenant": INJECT.format(where="header")})
    publish_amqp(project.broker_url, project.exchange, "forge.fail",
                 json.dumps({"fail": INJECT.format(where="error")}).encode(), message_id=unique("m"),
                 content_type="application/json")
    publish_amqp(project.broker_url, project.exchange, "forge.encoding", b'{"n": 1}', message_id=unique("m"),
                 content_type="application/json", content_encoding="punycode" + INJECT.format(where="encoding"))

    wait_for(lambda: queue_depth(project.broker_url, archive)[0] >= 3, what="three messages archived")
    wait_for(lambda: worker.log.count("outcome=archive") >= 3, timeout=5, what="three archive lines")
    log = worker.log
    _assert_not_forged(log, "id", "key", "header", "reason", "error")
    # The refusal names the label as its repr(), and the log line shows the reason as its repr(): twice escaped.
    assert SHOWN.format(where="encoding").replace("\\", "\\\\") in log
    assert len(project.records(handler="forge")) == 2  # the third never reached its handler

    reasons = {m.properties.get("message_id"): m.headers["kombu-events-reason"]
               for m in get_messages(project.broker_url, archive)}
    assert reasons[message_id] == "tenant " + INJECT.format(where="header") + " refused" + \
        INJECT.format(where="reason")  # the archive keeps what was sent
    [refused] = [reason for reason in reasons.values() if reason.startswith("content encoding")]
    assert refused.startswith("content encoding 'punycode" + SHOWN.format(where="encoding") + "' is not accepted")


def test_punycode_is_archived_at_once_without_stalling_the_worker(make_project):
    project: Project = make_project(APP)
    project.worker().wait_ready()
    archive = f"{project.service}.archive"
    publish_amqp(project.broker_url, project.exchange, "forge.big", b"-" + b"a" * 2_000_000,
                 message_id="puny", content_type="application/json", content_encoding="punycode")
    publish_amqp(project.broker_url, project.exchange, "forge.after", json.dumps({"fail": "x"}).encode(),
                 message_id="after", content_type="application/json")
    started = time.monotonic()
    wait_for(lambda: queue_depth(project.broker_url, archive)[0] >= 2, timeout=20, what="both archived")
    assert time.monotonic() - started < 10  # decoding it would have taken minutes
    assert [r["message_id"] for r in project.records(handler="forge")] == ["after"]
    [puny] = [m for m in get_messages(project.broker_url, archive) if m.properties["message_id"] == "puny"]
    assert puny.headers["kombu-events-reason"].startswith("content encoding 'punycode' is not accepted")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(port: int, path: str, user: str, password: str, body: dict, **headers: str) -> int:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Basic {token}", "Content-Type": "application/json",
                                              **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_console_logs_and_audits_a_hostile_user_name_escaped(make_project):
    project: Project = make_project(APP)
    project.declare()
    password, port = "operator-password-" + unique(""), _free_port()
    user = "alice" + INJECT.format(where="user").replace(":", "")  # a Basic user name holds no colon
    audit = project.dir / "audit.jsonl"
    log_path = project.dir / "console.log"
    env = {**project.env(), "FORGING_CONSOLE_LOG": "1", "CONSOLE_PW": password}
    with open(log_path, "w") as log_file:
        console = subprocess.Popen(
            [str(Path(sys.executable).parent / "kombu-events"), "-A", project.module, "console", "--port", str(port),
             "--password-env", "CONSOLE_PW", "--audit-file", str(audit)],
            cwd=project.dir, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: _listening(port) or console.poll() is not None, 20, what="console listening")
            assert console.poll() is None, log_path.read_text()
            assert _post(port, "/api/purge", user, password, {"q": "", "yes": True},
                         **{"Sec-Fetch-Site": "same-origin"}) == 200
            assert _post(port, "/api/purge", user, password, {"q": "", "yes": True},
                         Origin="https://evil.example") == 403  # logged as a cross-site refusal
            wait_for(lambda: "cross-site" in log_path.read_text(errors="replace"), 5, what="the refusal logged")
        finally:
            console.terminate()
            console.wait(10)
    log = log_path.read_text(errors="replace")
    _assert_not_forged(log, "user")
    assert "console audit: alice" + SHOWN.format(where="user") + " purge 0 message(s)" in log
    assert "from alice" + SHOWN.format(where="user") in log

    text = audit.read_text(encoding="utf-8")
    _assert_not_forged(text)
    [entry] = [json.loads(line) for line in text.split("\n") if line]  # one JSON object per line, nothing else
    assert (entry["actor"], entry["action"], entry["count"]) == (user, "purge", 0)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
