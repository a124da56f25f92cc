"""`kombu-events migrate --to quorum|classic` on the real broker, a vhost per test: every message
of the handler queues and the delay ladder is still there, counted by message id, and the archive
stays a stream (`migrate --archive`: test_archive_migrate.py); a run killed mid-move is finished by
the next one."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from amqp import Message
from kombu import Connection, Queue

from kombu_events.ops.migrate import QueueState, holding_name, observe
from kombu_events.testing import temporary_vhost

from .harness import Project, get_messages, management_queue, run_cli, unique, wait_for
from .json_schemas import one_document

pytestmark = pytest.mark.integration

BODY = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, queue_type=os.environ.get("QUEUE_TYPE", "classic"),
                delay_levels=4, delay_unit_ms=3_600_000)  # an hour a unit: nothing leaves the ladder meanwhile

@events.handler("a.#")
def alpha(payload):
    pass

@events.handler("b.#")
def beta(payload):
    pass
"""


@pytest.fixture
def project(tmp_path, broker_url):
    with temporary_vhost(broker_url) as url:
        made = Project(tmp_path, url, BODY)
        made.declare()
        yield made


def queues_by_role(project: Project) -> dict[str, list[str]]:
    result = project.run_python(f"""
        from {project.module} import events
        topology = events.topology()
        for queue in topology.queues:
            print(topology.role(queue.name), queue.name)
    """)
    assert result.returncode == 0, result.stderr
    roles: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        role, name = line.split()
        roles.setdefault(role, []).append(name)
    return roles


def fill(url: str, queues: list[str], per_queue: int) -> dict[str, list[str]]:
    """``per_queue`` persistent messages with ids of their own in each queue (by name, confirmed)."""
    placed: dict[str, list[str]] = {}
    with Connection(url, transport_options={"confirm_publish": True}) as conn:
        channel = conn.channel()
        for queue in queues:
            placed[queue] = [unique("m") for _ in range(per_queue)]
            for message_id in placed[queue]:
                channel.basic_publish(Message(b'{"k": 1}', message_id=message_id, delivery_mode=2,
                                              content_type="application/json",
                                              application_headers={"x-death": [], "kept": message_id}),
                                      exchange="", routing_key=queue)
    return placed


def queue_type(url: str, queue: str) -> str:
    return str(management_queue(url, queue)["type"])


def ids_in(url: str, queue: str) -> list[str]:
    return [m.properties["message_id"] for m in get_messages(url, queue)]


def test_a_service_moves_to_quorum_and_back_with_every_message(project):
    url = project.broker_url
    roles = queues_by_role(project)
    queues = roles["handler"] + roles["delay"]  # the archive is a stream, whatever the type: left alone
    placed = fill(url, queues, 40)

    dry = run_cli(project, "migrate", "--to", "quorum", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"{roles['handler'][0]}: 40 message(s), to move" in dry.stdout
    archive = roles["archive"][0]
    assert "dry run:" in dry.stdout and archive not in dry.stdout
    assert all(queue_type(url, q) == "classic" for q in queues), "a dry run changes nothing"

    done = run_cli(project, "migrate", "--to", "quorum")
    assert done.returncode == 0, done.stderr + done.stdout
    assert f"{40 * len(queues)} message(s) moved" in done.stdout
    assert "set queue_type='quorum' before starting its workers" in done.stderr
    assert {q: queue_type(url, q) for q in queues} == dict.fromkeys(queues, "quorum")
    project_env = {"QUEUE_TYPE": "quorum"}
    declared = run_cli_env(project, project_env, "declare")
    assert declared.returncode == 0, declared.stderr  # the quorum declaration now matches what is there
    again = run_cli(project, "migrate", "--to", "quorum")
    assert "nothing to do" in again.stdout

    back = run_cli_env(project, project_env, "migrate", "--to", "classic")
    assert back.returncode == 0, back.stderr + back.stdout
    assert {q: queue_type(url, q) for q in queues} == dict.fromkeys(queues, "classic")
    assert queue_type(url, archive) == "stream"
    for queue in queues:
        assert ids_in(url, queue) == placed[queue], f"{queue}: every message, once, in order"
    with Connection(url) as conn:
        for queue in queues:
            with pytest.raises(Exception, match="NOT_FOUND"):
                conn.channel().queue_declare(queue + ".migrating", passive=True)


def test_migration_refuses_to_start_while_a_consumer_is_attached(project):
    url = project.broker_url
    handler = queues_by_role(project)["handler"][0]
    fill(url, [handler], 5)
    with Connection(url) as conn:
        channel = conn.channel()
        channel.basic_consume(handler, callback=lambda message: None)
        refused = run_cli(project, "migrate", "--to", "quorum")
    assert refused.returncode == 1
    assert f"consumers are attached to {handler} (1)" in refused.stderr
    assert "stop the service's workers first" in refused.stderr
    assert queue_type(url, handler) == "classic"
    assert len(ids_in(url, handler)) == 5, "its messages are where they were"


def test_a_migration_as_json_is_one_document_with_its_progress_on_stderr(project):
    url = project.broker_url
    roles = queues_by_role(project)
    queues = roles["handler"] + roles["delay"]
    placed = fill(url, queues, 5)

    done = run_cli(project, "migrate", "--to", "quorum", "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    report = one_document("migrate", done.stdout)
    assert (report["to"], report["dry_run"], report["declared_queue_type"]) == ("quorum", False, "classic")
    assert report["moved"] == 5 * len(queues)
    by_name = {q["queue"]: q for q in report["queues"]}
    assert all(by_name[q]["messages"] == 5 and not by_name[q]["matches"] for q in queues)
    assert set(by_name) == set(queues), "the archive is not among them"
    assert all(by_name[q]["holding_queue"] == q + ".migrating" and by_name[q]["holding_messages"] is None
               for q in queues)
    moves = [st for st in report["steps"] if st["action"] == "move"]
    assert {(st["source"], st["queue"]) for st in moves} >= {(q, q + ".migrating") for q in queues}
    assert all(st["description"].startswith("move ") for st in moves)
    assert "  moved 5 message(s)" in done.stderr.splitlines(), "each step's progress, on stderr"
    assert "set queue_type='quorum' before starting its workers" in done.stderr
    assert {q: queue_type(url, q) for q in queues} == dict.fromkeys(queues, "quorum")
    for queue in queues:
        assert ids_in(url, queue) == placed[queue]


def run_cli_env(project: Project, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).parent / "kombu-events"
    return subprocess.run([str(cli), "-A", project.module, *args], cwd=project.dir, env={**project.env(), **env},
                          capture_output=True, text=True, timeout=120)


def test_a_run_killed_mid_move_is_finished_by_the_next_and_loses_nothing(project):
    url = project.broker_url
    handler = queues_by_role(project)["handler"][0]
    placed = fill(url, [handler], 4000)[handler]
    cli = Path(sys.executable).parent / "kombu-events"
    run = subprocess.Popen([str(cli), "-A", project.module, "migrate", "--to", "quorum"], cwd=project.dir,
                           env=project.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def holding() -> int:
        with Connection(url) as conn:
            try:
                return int(conn.channel().queue_declare(handler + ".migrating", passive=True)[1])
            except Exception:
                return 0

    wait_for(lambda: holding() >= 1000 or run.poll() is not None, timeout=60, interval=0.02,
             what="the move under way")
    assert run.poll() is None, "the run must still be moving when it is killed: " + run.communicate()[1]
    run.send_signal(signal.SIGKILL)
    run.wait()
    time.sleep(0.5)  # the broker sees the connection go: the unacked originals are back in the queue

    finished = run_cli(project, "migrate", "--to", "quorum", timeout=180)
    assert finished.returncode == 0, finished.stderr + finished.stdout
    assert "from an unfinished run" in finished.stdout
    assert queue_type(url, handler) == "quorum"
    found = Counter(ids_in(url, handler))
    lost = set(placed) - set(found)
    duplicates = sum(n - 1 for n in found.values())
    print(f"\n[migrate] kill -9 with {handler} partly moved: {len(placed)} messages, lost {len(lost)}, "
          f"duplicates {duplicates}")
    assert not lost
    assert duplicates <= 200, "at most the batch in flight (confirmed, not yet acked) twice"


def test_observe_reads_missing_matching_and_refused_queues_and_their_holding_queues(broker_url):
    """Passive declares for the counts (a missing queue among them), a declare for the match; no channel kept."""
    names = {role: unique(f"observe-{role}.") for role in ("gone", "same", "other")}
    targets = [Queue(name, durable=True, queue_arguments={"x-max-length": 10}) for name in names.values()]
    with Connection(broker_url) as conn:
        conn.connect()
        channel = conn.channel()
        channel.confirm_select()
        channel.queue_declare(names["same"], durable=True, auto_delete=False, arguments={"x-max-length": 10})
        channel.queue_declare(names["other"], durable=True, auto_delete=False)  # no limit: not the target
        channel.queue_declare(holding_name(names["other"]), durable=True, auto_delete=False)
        for queue in (names["other"], names["other"], holding_name(names["other"])):
            channel.basic_publish(Message(b"x"), exchange="", routing_key=queue)
        try:
            open_before = set(conn.connection.channels)
            states = observe(conn, targets)
            assert set(conn.connection.channels) == open_before
        finally:
            for name in (names["same"], names["other"], holding_name(names["other"])):
                channel.queue_delete(name)
            channel.close()
    gone, same, other = names["gone"], names["same"], names["other"]
    assert states[gone] == QueueState(gone, exists=False)
    assert states[holding_name(gone)] == QueueState(holding_name(gone), exists=False)
    assert states[same] == QueueState(same, exists=True, matches=True)
    assert states[holding_name(same)] == QueueState(holding_name(same), exists=False)
    assert (states[other].exists, states[other].matches, states[other].messages) == (True, False, 2)
    assert "x-max-length" in states[other].why
    assert states[holding_name(other)] == QueueState(holding_name(other), exists=True, messages=1)
