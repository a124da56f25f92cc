"""The archive is a stream: a read changes nothing, every archived copy has a key of its own, and replay and
purge act on exactly the keys asked for -- with real workers, on classic and quorum services, on whichever
broker the suite runs against (3.10, then 4.0).

The stream itself is read raw here (``broker.streams.read``: offsets, bodies, header tables), never through
what is tested, to count what the archive holds before and after.
"""
from __future__ import annotations

import decimal
import importlib
import json
import sys
import threading
import time
import urllib.request
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import amqp
import pytest
from kombu import Connection

from kombu_events.broker import stream_headers, streams
from kombu_events.core import archive_records, wire
from kombu_events.ops import archive
from kombu_events.ops.archive_rewrite import rewrite
from kombu_events.ops.status import gather
from kombu_events.testing import temporary_vhost

from ..brokers import MANAGEMENT_URL
from .harness import Project, ctl, publish_amqp, queue_depth, run_cli, unique, wait_for

pytestmark = pytest.mark.integration

APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, queue_type=QUEUE_TYPE, delay_unit_ms=100, delay_levels=4,
                max_retries=0)

@events.handler("orders.#", bind=True)
def orders(event):
    replay_of = event.headers.get("kombu-events-replay-of")
    record(message_id=event.message_id, payload=event.payload, replay_of=replay_of,
           headers={k: str(v) for k, v in event.headers.items()})
    if event.payload.get("fail") and not replay_of:
        raise RuntimeError("fails until replayed")
"""


def app_of(queue_type: str) -> str:
    body = APP.replace("QUEUE_TYPE", repr(queue_type))
    if queue_type == "quorum":  # Celery's own task queue too (the events step refuses a classic one then)
        body = "app.conf.task_default_queue_type = 'quorum'\n" + body
    return body


@pytest.fixture(params=["classic", "quorum"])
def project(request, make_project):
    return make_project(app_of(request.param))


@pytest.fixture(params=["classic", "quorum"])
def project_in_own_vhost(request, tmp_path, broker_url):
    """``project``, in a vhost of the test's own: a policy set there touches no other test's queues."""
    with temporary_vhost(broker_url, management_url=MANAGEMENT_URL) as url:
        made = Project(tmp_path, url, app_of(request.param))
        made.queue_type = request.param  # type: ignore[attr-defined]
        try:
            yield made
        finally:
            made.cleanup()


def policies(broker_url: str) -> dict[str, str]:
    """{queue: the policy that applies to it} in the URL's vhost (rabbitmqctl: the management API lags)."""
    vhost = unquote(urlsplit(broker_url).path[1:]) or "/"
    lines = ctl("list_queues", "-p", vhost, "--no-table-headers", "name", "policy").stdout.splitlines()
    return {name: policy.strip() for name, _, policy in (line.partition("\t") for line in lines)}


def put_policy(broker_url: str, name: str, definition: dict[str, Any]) -> None:
    """A policy ``name`` on every queue of the URL's vhost (the management API, the URL's credentials)."""
    parts = urlsplit(broker_url)
    vhost = quote(unquote(parts.path[1:]) or "/", safe="")
    body = json.dumps({"pattern": ".*", "apply-to": "queues", "definition": definition, "priority": 7}).encode()
    request = urllib.request.Request(f"{MANAGEMENT_URL}/api/policies/{vhost}/{quote(name, safe='')}", data=body,
                                     method="PUT", headers={"content-type": "application/json"})
    password = urllib.request.HTTPPasswordMgrWithDefaultRealm()
    password.add_password(None, MANAGEMENT_URL, unquote(parts.username or "guest"), unquote(parts.password or "guest"))
    with urllib.request.build_opener(urllib.request.HTTPBasicAuthHandler(password)).open(request, timeout=10):
        pass


def raw(project: Project) -> list[tuple[int, bytes, dict[str, Any]]]:
    """Every record of the archive stream: (offset, body, header table as stored)."""
    with Connection(project.broker_url) as conn:
        conn.connect()
        return [(offset, bytes(m.body), dict(m.headers))
                for offset, m in streams.read(conn.connection, f"{project.service}.archive")]


def copies(project: Project) -> list[tuple[int, bytes, dict[str, Any]]]:
    """The archived copies among the records (settlements and the opening record left out)."""
    return [r for r in raw(project) if wire.SETTLEMENT not in r[2]]


def topology(project: Project):
    """The project's topology, its handlers' queues included (imported as a worker imports it)."""
    sys.path.insert(0, str(project.dir))
    try:
        return importlib.import_module(project.module).events.topology()
    finally:
        sys.path.remove(str(project.dir))


def send(project: Project, payload: dict, message_id: str | None = None, **headers: Any) -> str:
    message_id = message_id or unique("m")
    publish_amqp(project.broker_url, project.exchange, "orders.1", json.dumps(payload).encode(),
                 message_id=message_id, content_type="application/json", application_headers=headers or None)
    return message_id


def cli(project: Project, *args: str, code: int = 0):
    result = run_cli(project, *args)
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_a_hundred_reads_leave_every_archived_copy_in_place_under_a_delivery_limit_of_one(project_in_own_vhost):
    """A hundred reads, fifteen of them the CLI's own processes (``archive list``, ``archive show``), under a
    policy of ``delivery-limit: 1`` on every queue of the vhost: were a read a delivery (an archive that is a
    queue), a quorum archive would drop each copy at its second read."""
    project = project_in_own_vhost
    project.worker().wait_ready()
    put_policy(project.broker_url, "deliver-once", {"delivery-limit": 1})
    if project.queue_type == "quorum":  # a classic queue and a stream take no delivery limit
        wait_for(lambda: policies(project.broker_url).get(f"{project.service}.orders") == "deliver-once",
                 what="the policy on the quorum handler queue")
    ids = [send(project, {"fail": True, "n": n}) for n in range(3)]
    wait_for(lambda: len(copies(project)) == 3, what="3 archived copies")
    before = raw(project)
    topo = topology(project)
    with Connection(project.broker_url) as conn:
        for n in range(85):  # what list, show, dry runs, status and the console's first index read with
            if n % 3 == 0:
                found = archive.read(conn, topo)
            elif n % 3 == 1:
                found = archive.browse(conn, topo)
            else:
                found = archive.view(conn, topo).pending()
            assert sorted(m.id for m in found) == sorted(ids)
        assert [s.ready for s in gather(conn, topo) if s.role == "archive"] == [3]
    for n in range(10):  # kombu-events archive list and show, as an operator runs them
        listed = [json.loads(line) for line in cli(project, "archive", "list", "--json").stdout.splitlines()]
        assert sorted(m["id"] for m in listed) == sorted(ids)
        if n % 2:
            key = listed[n % 3]["key"]
            assert json.loads(cli(project, "archive", "show", key).stdout)["key"] == key
    assert raw(project) == before, "offsets, bodies and headers of every record as they were"
    assert project.records(replay_of=None) and len(project.records()) == 3, "nothing was delivered again"


def test_copies_sharing_a_message_id_are_purged_and_replayed_one_by_one(project):
    project.worker().wait_ready()
    send(project, {"fail": True, "body": "alpha"}, message_id="dup")
    send(project, {"fail": True, "body": "beta"}, message_id="dup")
    wait_for(lambda: len(copies(project)) == 2, what="2 archived copies")
    listed = [json.loads(line) for line in cli(project, "archive", "list", "--json").stdout.splitlines()]
    keys = {json.loads(m["body"])["body"]: m["key"] for m in listed}
    assert [m["id"] for m in listed] == ["dup", "dup"] and len(set(keys.values())) == 2

    dry = json.loads(cli(project, "archive", "purge", "--key", keys["alpha"], "--dry-run", "--json").stdout)
    assert [m["key"] for m in dry["messages"]] == [keys["alpha"]]
    purged = json.loads(cli(project, "archive", "purge", "--key", keys["alpha"], "--yes", "--json").stdout)
    assert purged["purged"] == 1 and purged["messages"][0]["key"] == keys["alpha"]
    left = [json.loads(line) for line in cli(project, "archive", "list", "--json").stdout.splitlines()]
    assert [m["key"] for m in left] == [keys["beta"]], "the other copy with the same id is still archived"

    replayed = json.loads(cli(project, "archive", "replay", "--key", keys["beta"], "--json").stdout)
    assert replayed["replayed"] == 1 and replayed["messages"][0]["key"] == keys["beta"]
    wait_for(lambda: project.records(replay_of=keys["beta"]), what="the replayed copy handled")
    time.sleep(0.3)
    assert [r["payload"]["body"] for r in project.records() if r["replay_of"]] == ["beta"]
    assert cli(project, "archive", "list", "--json").stdout == ""
    assert len(copies(project)) == 2, "a purge and a replay remove nothing from the stream"
    settlements = [archive_records.parse_settlement(h, body, o) for o, body, h in raw(project)
                   if wire.SETTLEMENT in h]
    assert [(s.action, s.keys) for s in settlements] == [("opened", ()), ("purged", (keys["alpha"],)),
                                                         ("replayed", (keys["beta"],))]
    assert all(s.by == "guest" for s in settlements[1:]), "who settled them: the purge's audit"


def test_an_archived_copy_keeps_every_header_a_stream_would_drop(project):
    project.worker().wait_ready()
    send(project, {"fail": True}, message_id="h1", tags=["a", 1], meta={"k": "v", "n": 2},
         amount=decimal.Decimal("1.25"))
    wait_for(lambda: len(copies(project)) == 1, what="the archived copy")
    shown = json.loads(cli(project, "archive", "show", "h1").stdout)
    assert shown["headers"]["tags"] == ["a", 1] and shown["headers"]["meta"] == {"k": "v", "n": 2}
    assert shown["headers"]["amount"] == "1.25"
    stored = copies(project)[0][2]
    assert stream_headers.PACKED in stored and "tags" not in stored, "the table travels packed"
    cli(project, "archive", "replay", "--id", "h1")
    handled = wait_for(lambda: project.records(replay_of=shown["key"]), what="the replayed copy")
    assert handled[0]["headers"]["tags"] == "['a', 1]" and handled[0]["headers"]["amount"] == "1.25"


def test_readers_a_replay_and_a_worker_archiving_at_once_lose_and_duplicate_nothing(project):
    project.worker().wait_ready()
    topo = topology(project)
    sent: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def reading() -> None:
        try:
            with Connection(project.broker_url) as conn:
                while not stop.is_set():
                    archive.view(conn, topo)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    def replaying() -> None:
        try:
            with Connection(project.broker_url) as conn:
                while not stop.is_set():
                    archive.replay(conn, topo, lambda m: True, 25)
                    time.sleep(0.05)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reading), threading.Thread(target=reading), threading.Thread(target=replaying)]
    for t in threads:
        t.start()
    try:
        for n in range(200):
            sent.append(send(project, {"fail": True, "n": n}))
            if n % 20 == 0:
                time.sleep(0.05)
        wait_for(lambda: len(copies(project)) == len(sent), timeout=60, what="every event archived")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    with Connection(project.broker_url) as conn:
        archive.replay(conn, topo, lambda m: True)  # whatever is left
    wait_for(lambda: len(project.records(replay_of=None)) == len(sent)
             and len([r for r in project.records() if r["replay_of"]]) >= len(sent), timeout=60,
             what="every replayed copy handled")
    time.sleep(0.5)
    replayed = [r["message_id"] for r in project.records() if r["replay_of"]]
    assert sorted(replayed) == sorted(sent), "each archived copy replayed exactly once"
    assert len({r["replay_of"] for r in project.records() if r["replay_of"]}) == len(sent)
    assert len(copies(project)) == len(sent), "every copy still in the stream, settled"
    with Connection(project.broker_url) as conn:
        assert archive.view(conn, topo).pending() == []


def archive_by_hand(project: Project, message_id: str) -> str:
    """Archive one copy of a failed ``orders.1`` event as a worker does (stream headers packed); its key."""
    body = json.dumps({"fail": True}).encode()
    headers = stream_headers.pack({"application_headers": wire.archive_headers(
        {}, attempt=1, queue=f"{project.service}.orders", routing_key="orders.1", reason="r", exception="E",
        traceback="")})["application_headers"]
    publish_amqp(project.broker_url, f"{project.service}.archive", "", body, message_id=message_id,
                 application_headers=headers)
    wait_for(lambda: len(copies(project)) == 1, what="the archived copy")
    return str(headers[wire.ARCHIVE_KEY])


def replay_twice_before_settling(project: Project, monkeypatch, **options: Any) -> str:
    """Replay the one archived copy, the connection lost before its settlement; then replay it again; its key."""
    topo = topology(project)

    def crash(*args, **kwargs):
        raise ConnectionResetError("the connection went away before the settlement")

    with Connection(project.broker_url) as conn:
        (key,) = [m.key for m in archive.read(conn, topo)]
        with monkeypatch.context() as patched:
            patched.setattr(archive_records, "settlement_record", crash)
            with pytest.raises(ConnectionResetError):
                archive.replay(conn, topo, lambda m: True, **options)
        assert [m.key for m in archive.view(conn, topo).pending()] == [key], "not settled: still listed"
        replayed, kept = archive.replay(conn, topo, lambda m: True, **options)
        assert [m.key for m in replayed] == [key] and kept == []
        assert archive.view(conn, topo).pending() == [], "settled by the second replay"
    return key


def test_a_replay_run_again_before_its_settlement_sends_the_same_ids(project, monkeypatch):
    project.declare()
    key = archive_by_hand(project, "m-7")
    assert replay_twice_before_settling(project, monkeypatch, edits={key: b'{"fixed": true}'}) == key
    sent_twice = take(project, f"{project.service}.orders", 2)
    assert len(sent_twice) == 2
    assert sent_twice[0].properties["message_id"] == sent_twice[1].properties["message_id"] != "m-7"
    assert {m.headers[wire.REPLAY_OF] for m in sent_twice} == {key}, "an inbox drops the second one"
    assert {m.headers[archive.ORIGINAL_ID] for m in sent_twice} == {"m-7"}


ONCE_APP = """
import sqlalchemy as sa
from kombu_events.database import session

engine = sa.create_engine(DB_URL)
effects = sa.Table("effects", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
                   sa.Column("replay_of", sa.String(50), nullable=False))

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=100, delay_levels=2, max_retries=0,
                database=engine)

@events.handler("orders.#", bind=True, once=True)
def orders(event):
    replay_of = event.headers.get("kombu-events-replay-of")
    session().execute(effects.insert().values(replay_of=replay_of or ""))
    record(message_id=event.message_id, replay_of=replay_of)
"""


def test_a_replay_run_again_before_its_settlement_has_one_effect_in_a_once_handler(make_project, effects_database,
                                                                                 monkeypatch):
    """Both copies of a replay run twice (the first lost its connection before the settlement) reach the handler's
    queue; a worker's ``once=True`` handler on PostgreSQL commits one effect: the inbox drops the second copy
    before the handler runs.

    Mutation check: were a replayed copy sent under a new message id each time, the inbox would take both copies
    and two rows would be written.
    """
    import psycopg

    from .conftest import POSTGRES
    url = effects_database("archive_once", "id serial PRIMARY KEY, replay_of varchar(50) NOT NULL")
    project = make_project(f"DB_URL = {url!r}\n" + ONCE_APP)
    project.declare()
    key = archive_by_hand(project, "m-8")
    assert replay_twice_before_settling(project, monkeypatch) == key
    handler_queue = f"{project.service}.orders"
    assert queue_depth(project.broker_url, handler_queue) == (2, 0), "both copies sent to the handler's queue"
    project.worker().wait_ready()
    wait_for(lambda: project.records(replay_of=key), what="the replayed copy handled")
    wait_for(lambda: queue_depth(project.broker_url, handler_queue)[0] == 0, what="both copies taken")
    time.sleep(1.0)  # the second copy's inbox check and ack, had it run the handler
    with psycopg.connect(dbname=url.rsplit("/", 1)[1], autocommit=True, **POSTGRES) as connection:
        rows = connection.execute("SELECT replay_of FROM effects").fetchall()
        inbox = connection.execute("SELECT count(*) FROM kombu_events_inbox").fetchone()
    assert rows == [(key,)], "one effect for the two copies"
    assert [r["message_id"] for r in project.records()] == ["m-8"], "the handler ran once"
    assert inbox == (1,)


def take(project: Project, queue: str, count: int) -> list[Any]:
    """Take ``count`` messages off a handler queue (no worker runs)."""
    got: list[Any] = []
    with Connection(project.broker_url) as conn:
        channel = conn.channel()
        deadline = time.monotonic() + 10
        while len(got) < count and time.monotonic() < deadline:
            message = channel.basic_get(queue, no_ack=True)
            if message is None:
                time.sleep(0.05)
            else:
                got.append(message)
    return got


def test_an_archive_of_an_earlier_version_is_refused_unread_and_kept(make_project):
    project = make_project(APP.replace("QUEUE_TYPE", repr("classic")))
    name = f"{project.service}.archive"
    with Connection(project.broker_url) as conn:
        channel = conn.channel()
        channel.queue_declare(name, durable=True, auto_delete=False,
                              arguments={"x-message-ttl": 604_800_000, "x-max-length": 100_000})
        for n in range(3):
            channel.basic_publish(amqp.Message(b"old %d" % n), exchange="", routing_key=name)
        listed = cli(project, "archive", "list", code=1)
        assert "migrate --archive" in listed.stderr and "earlier kombu-events version" in listed.stderr
        project.declare()  # a worker of this version keeps it, with a warning
        message = channel.basic_get(name, no_ack=True)
        assert message.body == b"old 0" and not message.delivery_info["redelivered"], "never read"
        assert channel.queue_declare(name, passive=True).message_count == 2


def test_the_counter_reads_only_what_was_appended_and_counts_copies_and_bytes(project):
    project.worker().wait_ready()
    topo = topology(project)
    counter = archive.ArchiveCounter(topo)
    with Connection(project.broker_url) as conn:
        assert counter.count(conn) == 0 and counter.bytes > 0, "the opening record"
        opened = counter.bytes
        send(project, {"fail": True, "pad": "x" * 5000})
        wait_for(lambda: len(copies(project)) == 1, what="the archived copy")
        assert counter.count(conn) == 1 and counter.bytes > opened + 5000
        read_to = counter.next_offset
        archive.purge(conn, topo, lambda m: True)
        assert counter.count(conn) == 0, "a purged copy is not counted"
        assert counter.next_offset == read_to + 1, "only the settlement record was read"
        assert counter.bytes > opened + 5000, "its bytes stay in the stream until retention"
        send(project, {"fail": True, "n": 2})
        wait_for(lambda: len(copies(project)) == 2, what="another archived copy")
        assert counter.count(conn) == 1
        before = counter.bytes
        rewrite(conn, topo)  # the purged copy removed for good: the stream made again, other offsets
        assert counter.count(conn) == 1, "a rewritten archive is counted again from its start"
        assert before - counter.bytes > 5000, "the purged copy's bytes are gone"
