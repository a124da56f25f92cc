"""Hostile input against a real prefork worker: a compression bomb, a body over max_body_bytes, JSON nested too
deep, and publishers= with two real RabbitMQ users. Each is archived with its reason; the pool stays small.

The worker's own limit is set below 16 MiB here: RabbitMQ 4 refuses any larger message at publish (its default
``max_message_size``), so a body over the default ``max_body_bytes`` (16 MiB) never reaches a worker there."""
from __future__ import annotations

import zlib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ..brokers import amqp_url, rabbitmqctl, version
from .harness import Project, get_messages, unique, wait_for

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
#: The pool process's peak RSS (VmHWM) may not exceed this after the bomb: inflating it all would take 1 GiB.
POOL_PEAK_BOUND_MIB = 200
#: The worker's max_body_bytes in HOSTILE_APP: half of RabbitMQ 4's largest message, so a body over it gets through.
MAX_BODY_BYTES = 8 * MiB

HOSTILE_APP = f"""
events = Events(app, service=SERVICE, exchange=EXCHANGE, max_body_bytes={MAX_BODY_BYTES})

@events.handler("hostile.#")
def take(payload):
    record(handler="take", n=payload.get("n") if isinstance(payload, dict) else "other")
"""


def _bomb(inflated: int = 1024 * MiB) -> bytes:
    """zlib of ``inflated`` zero bytes (about 1 MB), built a MiB at a time: the test never holds 1 GiB."""
    compressor, zeros, parts = zlib.compressobj(9), bytes(MiB), []
    for _ in range(inflated // MiB):
        parts.append(compressor.compress(zeros))
    parts.append(compressor.flush())
    return b"".join(parts)


def _publish_confirmed(url: str, exchange: str, routing_key: str, body: bytes, **properties: object) -> None:
    """Publish as ``publish_amqp`` does, then wait for the broker's confirm: a refusal fails the test, saying why."""
    import amqp
    from kombu import Connection

    with Connection(url) as conn:
        channel = conn.channel()
        try:
            channel.basic_publish_confirm(amqp.Message(body, **properties), exchange=exchange,
                                          routing_key=routing_key, mandatory=True, confirm_timeout=60)
        except (amqp.exceptions.AMQPError, amqp.exceptions.MessageNacked, TimeoutError) as exc:
            pytest.fail(f"RabbitMQ {'.'.join(map(str, version()))} refused {routing_key!r} ({len(body)} bytes): "
                        f"{exc!r}", pytrace=False)
        channel.close()


def _pool_children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children]


def _peak_rss_mib(pid: int) -> float:
    """VmHWM of ``pid``: the largest resident set it ever had, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_a_bomb_a_huge_body_and_deep_json_are_archived_and_the_pool_stays_small(make_project):
    project = make_project(HOSTILE_APP)
    worker = project.worker(pool="prefork", concurrency=1).wait_ready()
    url, archive = project.broker_url, f"{project.service}.archive"
    [child] = wait_for(lambda: _pool_children(worker.proc.pid), what="the pool process")
    before = _peak_rss_mib(child)

    bomb = _bomb()
    assert len(bomb) < 1.1 * MiB
    big = b'{"pad": "' + b"x" * MAX_BODY_BYTES + b'"}'  # over the worker's limit, under any broker's
    _publish_confirmed(url, project.exchange, "hostile.bomb", bomb, content_type="application/json",
                       message_id="bomb", application_headers={"compression": "application/x-gzip"})
    _publish_confirmed(url, project.exchange, "hostile.big", big, content_type="application/json", message_id="big")
    _publish_confirmed(url, project.exchange, "hostile.deep", b"[" * 100_000 + b"]" * 100_000,
                       content_type="application/json", message_id="deep")
    _publish_confirmed(url, project.exchange, "hostile.ok", b'{"n": 1}', content_type="application/json")

    wait_for(lambda: project.records(handler="take"), timeout=60, what="the normal event handled")
    archived: dict[str, object] = {}
    wait_for(lambda: archived.update({m.properties["message_id"]: m for m in get_messages(url, archive)})
             or len(archived) == 3, timeout=30, what="three messages archived")
    after = _peak_rss_mib(child)
    print(f"pool process peak RSS: {before:.0f} MiB before, {after:.0f} MiB after the bomb; "
          f"worker main process peak {_peak_rss_mib(worker.proc.pid):.0f} MiB")
    assert after < POOL_PEAK_BOUND_MIB, f"the pool process peaked at {after:.0f} MiB"
    reasons = {mid: m.headers["kombu-events-reason"] for mid, m in archived.items()}  # type: ignore[attr-defined]
    assert reasons["bomb"] == (f"body of {len(bomb)} bytes inflates beyond max_body_bytes={MAX_BODY_BYTES} "
                               f"(compression 'application/x-gzip')")
    assert reasons["big"] == f"body of {len(big)} bytes is larger than max_body_bytes={MAX_BODY_BYTES}"
    assert archived["big"].body == big  # type: ignore[attr-defined]
    assert "not valid JSON" in reasons["deep"] and "RecursionError" in reasons["deep"]
    assert archived["bomb"].body == bomb  # type: ignore[attr-defined]  # the archive keeps what was published

    assert _pool_children(worker.proc.pid) == [child]  # the same pool process: it never died

    _publish_confirmed(url, project.exchange, "hostile.ok", b'{"n": 2}', content_type="application/json")
    wait_for(lambda: len(project.records(handler="take")) == 2, timeout=30, what="a normal event afterwards")
    assert sorted(r["n"] for r in project.records(handler="take")) == [1, 2]


PUBLISHERS_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=200, delay_levels=4)

@events.handler("orders.#", publishers={%(allowed)r}, bind=True, max_retries=2)
def take(event):
    record(handler="take", n=event.payload["n"], user_id=event.user_id, app_id=event.app_id, attempt=event.attempt)
    if event.payload["n"] == 2 and event.attempt == 1:
        raise Retry(delay=0.2)
"""


def _ctl(*args: str) -> None:
    rabbitmqctl(*args, timeout=60)


def _forged(url: str, exchange: str, *, user_id: str) -> str:
    """Publish as one user claiming to be ``user_id``: the channel error RabbitMQ answers with."""
    import amqp
    from kombu import Connection

    with Connection(url) as conn:
        channel = conn.channel()
        channel.basic_publish(amqp.Message(b'{"n": 5}', user_id=user_id), exchange=exchange, routing_key="orders.5")
        try:
            channel.exchange_declare(exchange, "topic", passive=True)  # a round trip: the refusal arrives first
        except amqp.exceptions.ChannelError as exc:
            return str(exc)
    return ""


def _url(broker_url: str, user: str, vhost: str) -> str:
    return amqp_url(user, "secret", vhost, host=urlsplit(broker_url).hostname)


def test_publishers_runs_the_handler_only_for_events_of_the_users_named(tmp_path, broker_url):
    vhost, worker_user, allowed, other = unique("vh"), unique("wk"), unique("orders"), unique("mallory")
    _ctl("add_vhost", vhost)
    project = None
    try:
        for user in (worker_user, allowed, other):
            _ctl("add_user", user, "secret")
            _ctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        project = Project(tmp_path, _url(broker_url, worker_user, vhost), PUBLISHERS_APP % {"allowed": allowed})
        project.worker().wait_ready()
        as_allowed, as_other = _url(broker_url, allowed, vhost), _url(broker_url, other, vhost)
        _publish_confirmed(as_allowed, project.exchange, "orders.1", b'{"n": 1}', user_id=allowed, app_id="shop",
                           message_id="m1")
        _publish_confirmed(as_allowed, project.exchange, "orders.2", b'{"n": 2}', user_id=allowed, message_id="m2")
        _publish_confirmed(as_other, project.exchange, "orders.3", b'{"n": 3}', user_id=other, message_id="m3")
        _publish_confirmed(as_other, project.exchange, "orders.4", b'{"n": 4}', message_id="m4")  # no user_id
        assert "PRECONDITION_FAILED" in _forged(as_other, project.exchange, user_id=allowed)  # RabbitMQ checks it

        wait_for(lambda: len(project.records(handler="take")) >= 3, timeout=30, what="3 handler calls")
        archived: dict[str, object] = {}
        wait_for(lambda: archived.update({m.properties["message_id"]: m for m in
                                          get_messages(project.broker_url, f"{project.service}.archive")})
                 or len(archived) == 2, timeout=30, what="two messages archived")
        runs = sorted((r["n"], r["attempt"], r["user_id"], r["app_id"]) for r in project.records(handler="take"))
        # The retry is the worker's own copy: RabbitMQ lets it carry only the worker's user.
        assert runs == [(1, 1, allowed, "shop"), (2, 1, allowed, None), (2, 2, worker_user, None)]
        reasons = {mid: m.headers["kombu-events-reason"] for mid, m in archived.items()}  # type: ignore[attr-defined]
        assert reasons == {
            "m3": f"published by user_id {other!r}, not one of the handler's publishers ({allowed})",
            "m4": f"published by a publisher that set no user_id, not one of the handler's publishers ({allowed})"}
    finally:
        if project is not None:
            for worker in project.workers:
                worker.kill()
        _ctl("delete_vhost", vhost)
        for user in (worker_user, allowed, other):
            rabbitmqctl("delete_user", user, check=False, timeout=60)
