"""Queue types as RabbitMQ 3.10 and 4 treat them: classic and quorum services on one exchange, one of them
migrated to quorum while the others stay classic; a queue that names its type on a vhost whose default
type is quorum; a quorum message redelivered past RabbitMQ 4's default limit of 20 deliveries; an
archive read 25 times. Each on a vhost of its own, on the broker under test (tests/brokers.py)."""
from __future__ import annotations

import json

import pytest
from amqp import Message
from kombu import Connection

from kombu_events.ops.archive import read
from kombu_events.testing import temporary_vhost

from ..brokers import amqp_url, rabbitmqctl, version
from .harness import Project, management_queue, run_cli, unique, wait_for

pytestmark = pytest.mark.integration

BODY = """
QUEUE_TYPE = os.environ.get("QUEUE_TYPE", "{queue_type}")
if QUEUE_TYPE == "quorum" or {quorum_tasks}:  # quorum events want quorum task queues beside them
    app.conf.task_default_queue_type = "quorum"
    app.conf.task_default_queue = SERVICE + ".tasks.quorum"
events = Events(app, service=SERVICE, exchange=EXCHANGE, queue_type=QUEUE_TYPE,
                quorum_initial_group_size=1, delay_levels=4, delay_unit_ms=200, publish_delay_levels=4,
                publish_delay_unit_ms=200, max_retries=2)

@events.handler("orders.#", bind=True)
def take(event):
    record(n=event.payload["n"], attempt=event.attempt)
    if event.payload.get("always") or (event.payload.get("fail_once") and event.attempt == 1):
        raise RuntimeError("fails")
"""


#: The projects :func:`make` made in the running test: their workers are killed after it, whatever happened.
_made: list[Project] = []


@pytest.fixture(autouse=True)
def _workers_killed_after_each_test():
    """A worker left running after its vhost is deleted retries the connection for ever: never leave one."""
    yield
    while _made:
        for worker in _made.pop().workers:
            worker.kill()


def make(tmp_path, url: str, exchange: str, queue_type: str, name: str, quorum_tasks: bool = False) -> Project:
    directory = tmp_path / name
    directory.mkdir()
    project = Project(directory, url, BODY.format(queue_type=queue_type, quorum_tasks=quorum_tasks), exchange=exchange)
    _made.append(project)
    return project


def publish(project: Project, numbers: range, **extra: object) -> None:
    """Publish events ``numbers`` from Python, half of them delayed 0.5 s and every third failing once."""
    result = project.run_python(f"""
        from {project.module} import events
        for n in {list(numbers)!r}:
            payload = {{"n": n, "fail_once": n % 3 == 0, **{extra!r}}}
            events.publish(f"orders.{{n}}", payload, delay=0.5 if n % 2 else 0)
    """)
    assert result.returncode == 0, result.stderr


def handled(project: Project) -> list[int]:
    """The event numbers handled successfully, one entry per success (a failed attempt is not one)."""
    records = project.records()
    return sorted(r["n"] for r in records if r["n"] != 99 and not (r["n"] % 3 == 0 and r["attempt"] == 1))


def queue_type(url: str, queue: str) -> str:
    return str(management_queue(url, queue)["type"])


def test_classic_and_quorum_services_share_an_exchange_and_one_moves_to_quorum(tmp_path, broker_url):
    with temporary_vhost(broker_url) as url:
        exchange = unique("ex")
        # The exchange's delayed-publishing ladder is declared first by a classic service, then by a quorum one.
        services = {name: make(tmp_path, url, exchange, kind, name)
                    for name, kind in (("first", "classic"), ("second", "quorum"), ("third", "classic"))}
        for project in services.values():
            project.worker().wait_ready()
        assert queue_type(url, f"{exchange}.deferred.0") == "classic"
        assert queue_type(url, f"{services['second'].service}.take") == "quorum"
        assert queue_type(url, f"{services['first'].service}.take") == "classic"
        publish(services["second"], range(12))
        for name, project in services.items():
            wait_for(lambda p=project: handled(p) == list(range(12)), timeout=30, what=f"{name}: 12 events, once each")

        # One service moves to quorum, the others stay classic: all keep working, the shared ladder too.
        first = services["first"]
        for worker in first.workers:
            worker.stop()
        moved = run_cli(first, "migrate", "--to", "quorum", timeout=120)
        assert moved.returncode == 0, moved.stdout + moved.stderr
        first_env = {**first.env(), "QUEUE_TYPE": "quorum"}  # the module reads it at import
        first.env = lambda: first_env  # type: ignore[method-assign]
        first.worker().wait_ready()
        assert queue_type(url, f"{first.service}.take") == "quorum"
        assert queue_type(url, f"{exchange}.deferred.0") == "classic"  # the shared ladder kept its type
        publish(services["third"], range(12, 24))
        for name, project in services.items():
            wait_for(lambda p=project: handled(p) == list(range(24)), timeout=30, what=f"{name}: 24 events, once each")
        for project in services.values():
            for worker in project.workers:
                worker.stop()


def test_a_quorum_message_redelivered_past_twenty_times_is_kept_and_archived_by_kombu_events(tmp_path, broker_url):
    """RabbitMQ 4 drops (or dead-letters) a quorum message at its 20th delivery unless the queue sets a limit:
    kombu-events sets the largest and decides itself. A message rejected 25 times with requeue (a consumer
    that keeps dying) is still in its queue, and the worker archives it, unhandled: redelivered more than
    max_retries + 1 times is taken for a message that kills its worker (docs/failures.md). Likewise on 3.10."""
    with temporary_vhost(broker_url) as url:
        project = make(tmp_path, url, unique("ex"), "quorum", "p")
        project.declare()
        queue = f"{project.service}.take"
        with Connection(url, transport_options={"confirm_publish": True}) as conn:
            channel = conn.channel()
            channel.basic_publish(Message(json.dumps({"n": 1}).encode(), content_type="application/json",
                                          delivery_mode=2, message_id="m-1"), exchange="", routing_key=queue)
            for delivery in range(25):
                got = channel.basic_get(queue, no_ack=False)
                assert got is not None, f"the message left {queue} after {delivery} deliveries"
                channel.basic_reject(got.delivery_tag, requeue=True)
        assert management_queue(url, queue)["arguments"]["x-delivery-limit"] == 2**31 - 1
        project.worker().wait_ready()
        topology = _topology(project)

        def archived() -> list:
            with Connection(url) as conn:
                return read(conn, topology)
        [message] = wait_for(archived, timeout=30, what="the message archived")
        assert message.id == "m-1" and message.reason.startswith("redelivered 25 times"), message.reason
        assert handled(project) == [] and queue_counts_of(url, queue) == 0


def queue_counts_of(url: str, queue: str) -> int:
    with Connection(url) as conn:
        return int(conn.default_channel.queue_declare(queue, passive=True)[1])


def test_a_quorum_service_archives_into_a_stream_that_25_reads_leave_whole(tmp_path, broker_url):
    """The archive is a stream whatever queue type the handlers use: a quorum service's archive is declared
    ``x-queue-type: stream``, and 25 reads find the same three copies at the same offsets (a quorum archive
    counted a delivery per read, and RabbitMQ 4 dropped its messages at the 20th)."""
    with temporary_vhost(broker_url) as url:
        project = make(tmp_path, url, unique("ex"), "quorum", "p")
        project.declare()
        archive = f"{project.service}.archive"
        with Connection(url, transport_options={"confirm_publish": True}) as conn:
            for n in range(3):
                conn.default_channel.basic_publish(Message(b"{}", message_id=f"a-{n}", delivery_mode=2),
                                                   exchange=archive, routing_key="")
        assert queue_type(url, archive) == "stream"
        topology = _topology(project)
        with Connection(url) as conn:
            first = [(m.offset, m.id) for m in read(conn, topology)]
            assert [i for _, i in first] == ["a-0", "a-1", "a-2"]
            for _ in range(24):  # a stream read by offset: each read sees the same records, none delivered
                assert [(m.offset, m.id) for m in read(conn, topology)] == first


def _topology(project: Project):
    import importlib
    import sys

    sys.path.insert(0, str(project.dir))
    try:
        return importlib.import_module(project.module).events.topology()
    finally:
        sys.path.remove(str(project.dir))


def test_a_classic_service_on_a_vhost_whose_default_type_is_quorum_gets_classic_queues(tmp_path, broker_url):
    vhost = unique("kev-dqt-")
    made = rabbitmqctl("add_vhost", vhost, "--default-queue-type", "quorum", check=False)
    if made.returncode != 0:
        pytest.skip(f"this RabbitMQ ({'.'.join(map(str, version()))}) has no default queue type per vhost: "
                    f"{made.stderr.strip()[:120]}")
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        url = amqp_url(vhost=vhost)
        # Celery's own task queue becomes quorum there too, and a quorum queue refuses the global QoS Celery
        # asks for unless told its queues are quorum (docs/rabbitmq-versions.md).
        project = make(tmp_path, url, unique("ex"), "classic", "p", quorum_tasks=True)
        project.declare()
        for name in ("take", "delay.0"):
            assert queue_type(url, f"{project.service}.{name}") == "classic", name
        assert queue_type(url, f"{project.service}.archive") == "stream"  # the archive: a stream, whatever type
        project.worker().wait_ready()
        publish(project, range(6))
        wait_for(lambda: handled(project) == list(range(6)), timeout=30, what="6 events, once each")
        for worker in project.workers:
            worker.stop()
    finally:
        rabbitmqctl("delete_vhost", vhost, check=False)


def test_declare_retries_the_archive_and_replay_on_a_node_with_khepri(tmp_path):
    """Khepri replaces Mnesia as RabbitMQ's metadata store (opt-in on 4.0, the only one from 4.3): a private
    4.0 node with it switched on runs a quorum and a classic service, retries, archives and replays."""
    from ..brokers import RABBITMQ_ROOT
    from .private_broker import PrivateBroker

    if not RABBITMQ_ROOT:
        pytest.skip("Khepri is RabbitMQ 4's: this run's private nodes are the host's RabbitMQ 3.10")
    broker = PrivateBroker(tmp_path / "node")
    broker.start()
    try:
        broker.ctl(1, "enable_feature_flag", "--opt-in", "khepri_db")
        flags = broker.ctl(1, "list_feature_flags", "--formatter", "json")
        assert {"name": "khepri_db", "state": "enabled"} in json.loads(flags), flags[:300]
        exchange = unique("ex")
        for kind in ("quorum", "classic"):
            project = make(tmp_path, broker.url, exchange, kind, kind)
            project.worker().wait_ready()
            publish(project, range(6))
            wait_for(lambda p=project: handled(p) == list(range(6)), timeout=30, what=f"{kind}: 6 events")
            sent = project.run_python(f"""
                from {project.module} import events
                events.publish("orders.99", {{"n": 99, "fail_once": False, "always": True}})
            """)
            assert sent.returncode == 0, sent.stderr
            wait_for(lambda p=project: _archived_ids(p, broker.url), timeout=30, what=f"{kind}: one archived")
            replayed = run_cli(project, "archive", "replay")
            assert replayed.returncode == 0, replayed.stdout + replayed.stderr
            wait_for(lambda p=project: len([r for r in p.records() if r["n"] == 99]) == 6, timeout=30,
                     what=f"{kind}: the archived event run again after the replay (3 attempts twice)")
            for worker in project.workers:
                worker.stop()
    finally:
        broker.stop()


def _archived_ids(project: Project, url: str) -> list[str]:
    with Connection(url) as conn:
        return [m.id for m in read(conn, _topology(project))]
