"""The demo's broker check: what it decides for each broker and machine, and how it starts RabbitMQ."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kombu_events.demo import broker
from kombu_events.demo.preflight import Probe, Verdict, after_start, is_local_default, verdict_for

LOCAL = "amqp://guest:s3cret@127.0.0.1:5672//"
REFUSED = Probe(ok=False, down=True, error="[Errno 111] Connection refused")
SERVER = "/usr/sbin/rabbitmq-server"


@pytest.mark.parametrize(("url", "local"), [
    (LOCAL, True),
    ("amqp://guest:guest@localhost//", True),
    ("pyamqp://localhost:5672/vhost", True),
    ("amqp://guest:guest@[::1]:5672//", True),
    ("amqp://", True),
    ("amqp://guest:guest@127.0.0.1:5999//", False),
    ("amqp://guest:guest@rabbit.example.com//", False),
    ("amqp://127.0.0.1:5672//;amqp://127.0.0.1:5673//", False),
    ("amqp://127.0.0.1:port//", False),
])
def test_a_local_start_serves_only_the_default_local_url(url, local):
    assert is_local_default(url) is local


def test_a_broker_that_answers_runs_the_demo():
    assert verdict_for(Probe(ok=True), url=LOCAL, server=None) == Verdict("run")


def test_installed_but_stopped_on_the_default_local_url_starts_it():
    verdict = verdict_for(REFUSED, url=LOCAL, server=SERVER)
    assert verdict == Verdict("start", "kombu-events demo: RabbitMQ is installed but not running at "
                                       "amqp://guest:**@127.0.0.1:5672//: starting it "
                                       "(/usr/sbin/rabbitmq-server -detached)")


@pytest.mark.parametrize(("probe", "url", "server", "line"), [
    pytest.param(REFUSED, LOCAL, None,
                 "RabbitMQ is not reachable at amqp://guest:**@127.0.0.1:5672// and is not installed: install it "
                 "(sudo apt-get install rabbitmq-server), or set RABBIT_URL to a running broker", id="not-installed"),
    pytest.param(REFUSED, "amqp://guest:s3cret@127.0.0.1:5999//", SERVER,
                 "RabbitMQ is installed but nothing listens at amqp://guest:**@127.0.0.1:5999//: correct RABBIT_URL "
                 "(RabbitMQ's default port is 5672) or start a broker on port 5999", id="installed-other-port"),
    pytest.param(Probe(ok=False, down=True, error="timed out"), "amqp://u:s3cret@rabbit.example.com//", SERVER,
                 "RabbitMQ is not reachable at amqp://u:**@rabbit.example.com// (timed out): start it there, "
                 "or set RABBIT_URL to a running broker", id="remote"),
    pytest.param(Probe(ok=False, error="AccessRefused: (403)\nACCESS_REFUSED - amqp://u:s3cret@h//"), LOCAL, SERVER,
                 "cannot use the broker at amqp://guest:**@127.0.0.1:5672// (AccessRefused: (403) ACCESS_REFUSED - "
                 "amqp://u:**@h//): check RABBIT_URL (its user, password, vhost)", id="refused-login"),
])
def test_every_other_case_fails_with_one_line_saying_what_to_do(probe, url, server, line):
    verdict = verdict_for(probe, url=url, server=server)
    assert verdict == Verdict("fail", "kombu-events demo: " + line)
    assert "\n" not in verdict.line and "s3cret" not in verdict.line


def test_remote_brokers_are_never_started_nor_called_not_installed():
    for server in (None, SERVER):
        verdict = verdict_for(REFUSED, url="amqp://rabbit.example.com//", server=server)
        assert verdict.action == "fail" and "installed" not in verdict.line


@pytest.mark.parametrize(("probe", "error", "verdict"), [
    (Probe(ok=True), "", Verdict("run")),
    (Probe(ok=True), "already running", Verdict("run")),
    (REFUSED, "Only root or rabbitmq should run rabbitmq-server",
     Verdict("fail", "kombu-events demo: could not start RabbitMQ (Only root or rabbitmq should run "
                     "rabbitmq-server): start it yourself (sudo rabbitmq-server -detached) and run the demo again")),
    (REFUSED, "",
     Verdict("fail", "kombu-events demo: RabbitMQ did not answer at amqp://guest:**@127.0.0.1:5672// within 60 s "
                     "of starting it ([Errno 111] Connection refused): see /var/log/rabbitmq, or start it yourself "
                     "(sudo rabbitmq-server -detached)")),
])
def test_after_a_start_the_demo_runs_or_says_why_not(probe, error, verdict):
    assert after_start(probe, url=LOCAL, start_error=error, waited_s=60) == verdict


# -- the I/O around it, with fakes: no socket, no process --------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def fake_run(returncode: int = 0, stdout: str = "", stderr: str = "", calls: list | None = None):
    def run(command, **kwargs):
        if calls is not None:
            calls.append(command)
        return subprocess.CompletedProcess(command, returncode, stdout, stderr)
    return run


def test_start_runs_the_server_detached_and_waits_until_the_url_answers():
    clock, calls = FakeClock(), []
    answers = iter([REFUSED, REFUSED, Probe(ok=True)])
    verdict = broker.start(SERVER, LOCAL, run=fake_run(calls=calls), check=lambda url: next(answers),
                           sleep=clock.sleep, clock=clock)
    assert verdict == Verdict("run")
    assert calls == [[SERVER, "-detached"]] and clock.now == 2.0


def test_start_gives_up_after_its_timeout():
    clock = FakeClock()
    verdict = broker.start(SERVER, LOCAL, timeout_s=10, run=fake_run(), check=lambda url: REFUSED,
                           sleep=clock.sleep, clock=clock)
    assert verdict.action == "fail" and "within 10 s" in verdict.line
    assert clock.now == 10.0


@pytest.mark.parametrize(("run", "reason"), [
    (fake_run(1, stdout="\nOnly root or rabbitmq should run rabbitmq-server\n\n"),
     "Only root or rabbitmq should run rabbitmq-server"),
    (fake_run(2), "/usr/sbin/rabbitmq-server -detached exited with status 2"),
])
def test_a_server_that_refuses_to_start_is_not_waited_for(run, reason):
    clock = FakeClock()
    verdict = broker.start(SERVER, LOCAL, run=run, check=lambda url: REFUSED, sleep=clock.sleep, clock=clock)
    assert verdict.action == "fail" and f"could not start RabbitMQ ({reason})" in verdict.line
    assert clock.now == 0.0


def test_a_server_that_cannot_be_executed_is_one_line_too():
    def run(command, **kwargs):
        raise PermissionError(13, "Permission denied", command[0])

    verdict = broker.start(SERVER, LOCAL, run=run, check=lambda url: REFUSED, sleep=lambda s: None)
    assert verdict.action == "fail" and "Permission denied" in verdict.line and "\n" not in verdict.line


def test_the_server_is_found_on_the_path_then_in_sbin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    server = tmp_path / "bin" / "rabbitmq-server"
    server.parent.mkdir()
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    monkeypatch.setattr(broker, "SBIN_DIRS", ())
    assert broker.find_server(str(server.parent)) == str(server)
    assert broker.find_server(str(tmp_path)) is None
    monkeypatch.setattr(broker, "SBIN_DIRS", (str(server.parent),))
    assert broker.find_server(str(tmp_path)) == str(server)


def test_ready_prints_one_line_on_stderr_and_never_starts_a_broker_it_may_not(monkeypatch, capsys):
    monkeypatch.setattr(broker, "probe", lambda url: REFUSED)
    monkeypatch.setattr(broker, "find_server", lambda: SERVER)
    monkeypatch.setattr(broker, "start", lambda *a, **k: pytest.fail("started a broker on another port"))
    said: list[str] = []
    assert broker.ready("amqp://guest:guest@127.0.0.1:5999//", said.append) is False
    out, err = capsys.readouterr()
    assert said == [] and out == "" and len(err.splitlines()) == 1 and err.startswith("kombu-events demo: ")


def test_ready_says_it_starts_the_local_broker_then_runs(monkeypatch, capsys):
    monkeypatch.setattr(broker, "probe", lambda url: REFUSED)
    monkeypatch.setattr(broker, "find_server", lambda: SERVER)
    monkeypatch.setattr(broker, "start", lambda server, url: Verdict("run"))
    said: list[str] = []
    assert broker.ready(LOCAL, said.append) is True
    assert len(said) == 1 and "starting it" in said[0] and capsys.readouterr().err == ""
