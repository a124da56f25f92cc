"""What RabbitMQ 4 adds: workers of classic and quorum services use none of its deprecated features, and an event
larger than its largest message (``max_message_size``, 16 MiB by default) fails at publish, saying so."""
from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from ..brokers import amqp_url, rabbitmqctl, version
from .harness import Project, own_vhost, wait_for

pytestmark = pytest.mark.integration

MiB = 1024 * 1024

SERVICE_APP = """
app.conf.task_default_queue_type = %(queue_type)r  # quorum events refuse classic task queues beside them
events = Events(app, service=SERVICE, exchange=EXCHANGE, queue_type=%(queue_type)r, delay_unit_ms=100,
                delay_levels=4)

@events.handler("orders.#", bind=True, max_retries=2, backoff=Constant(every_ms=200))
def take(event):
    record(handler="take", n=event.payload["n"], attempt=event.attempt)
    if event.payload["n"] == 2 and event.attempt == 1:
        raise RuntimeError("fails once")
"""

#: (queue type, pool) of the two workers that run side by side.
WORKERS = (("classic", "prefork"), ("quorum", "solo"))


@pytest.fixture(autouse=True)
def rabbitmq4(broker_url):
    """Skip on a broker older than 4.0: what these tests check is 4.0's (its deprecations, its 16 MiB limit)."""
    if version() < (4, 0):
        pytest.skip(f"RabbitMQ {'.'.join(map(str, version())) or '(version unknown)'} is older than 4.0")


def reported_in_use() -> set[str]:
    """The deprecated features the node says are in use: ``check_if_any_deprecated_features_are_used``.

    On 4.0.5, ``list_deprecated_features --used`` prints nothing even while a feature is in use; this command
    exits 69 and names them. It covers the whole node and names features only.
    """
    done = rabbitmqctl("check_if_any_deprecated_features_are_used", "--formatter", "json", check=False, timeout=60)
    try:
        report = json.loads(done.stdout.strip() or done.stderr.strip())
    except ValueError:
        raise AssertionError(f"no JSON report (exit {done.returncode}): {done.stdout!r} {done.stderr!r}") from None
    return set(report.get("deprecated_features", []))


def _rows(*args: str) -> list[list[str]]:
    out = rabbitmqctl(*args, "--no-table-headers", timeout=60).stdout
    return [line.split("\t") for line in out.splitlines() if line.strip()]


def deprecated_in_use(vhost: str) -> list[str]:
    """What the clients of ``vhost`` use of RabbitMQ 4's deprecated features, one line each (empty: nothing).

    The node's report (:func:`reported_in_use`), with each transient non-exclusive queue of ``vhost`` named
    (those of other vhosts, another test's, are not this one's doing). RabbitMQ 4.0 reports global QoS nowhere,
    neither in that command nor in a channel's details: a consumer that acks with no per-consumer prefetch
    (0) is the trace it leaves (global QoS set after a per-consumer one would not show).
    """
    reported = reported_in_use()
    found = [f"transient_nonexcl_queues: queue {name!r} (reported: {'transient_nonexcl_queues' in reported})"
             for name, durable, exclusive in _rows("list_queues", "-p", vhost, "name", "durable", "exclusive")
             if durable == "false" and exclusive == "false"]
    found += [f"global_qos, or no prefetch at all: a consumer of {queue!r} has no per-consumer prefetch"
              for queue, ack_required, prefetch in _rows("list_consumers", "-p", vhost, "queue_name", "ack_required",
                                                         "prefetch_count")
              if ack_required == "true" and prefetch == "0"]
    return found + sorted(reported - {"transient_nonexcl_queues"})


def _publish(project: Project, *payloads: dict) -> None:
    """Publish ``payloads`` as ``orders.placed`` through the project's own ``events.publish``."""
    done = project.run_python(f"""
        from {project.module} import events
        for payload in {list(payloads)!r}:
            events.publish("orders.placed", payload)
    """)
    assert done.returncode == 0, done.stderr


def test_classic_and_quorum_workers_use_no_deprecated_feature(tmp_path):
    with own_vhost("kev-deprecated") as vhost:
        url = amqp_url(vhost=vhost["name"])
        projects = []
        try:
            for queue_type, pool in WORKERS:
                directory = tmp_path / queue_type
                directory.mkdir()
                project = Project(directory, url, SERVICE_APP % {"queue_type": queue_type})
                projects.append(project)
                project.worker(pool=pool, concurrency=2 if pool == "prefork" else 1).wait_ready()
            for project in projects:
                _publish(project, {"n": 1}, {"n": 2})
            for project in projects:
                wait_for(lambda p=project: len(p.records(handler="take")) == 3, timeout=30,
                         what=f"{project.service}: two events handled, one of them retried once")
                runs = sorted((r["n"], r["attempt"]) for r in project.records(handler="take"))
                assert runs == [(1, 1), (2, 1), (2, 2)], project.service
            assert all(w.proc.poll() is None for p in projects for w in p.workers), "a worker exited"

            in_use = deprecated_in_use(vhost["name"])
            assert in_use == [], "deprecated features in use:\n" + "\n".join(in_use)
        finally:
            for project in projects:
                for worker in project.workers:
                    worker.kill()


BIG_APP = """
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("big.#")
def take(payload):
    pass
"""

#: Published by the project's own events.publish: a JSON body of 17 MiB, over RabbitMQ 4's default limit.
PUBLISH_BIG = """
import json, time
from {module} import events
started = time.monotonic()
try:
    events.publish("big.one", {{"pad": "x" * {size}}})
    error = None
except Exception as exc:
    error = {{"classes": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}}
seconds = time.monotonic() - started
events.publish("big.two", {{"pad": "small"}})  # the publisher goes on after the refusal
print(json.dumps({{"error": error, "seconds": seconds}}))
"""


def _publish_big(project: Project) -> dict:
    """The outcome of ``events.publish`` with a 17 MiB body: {"error": {classes, message} or None, "seconds"}."""
    project.declare()
    code = textwrap.dedent(PUBLISH_BIG).format(module=project.module, size=17 * MiB)
    try:
        done = project.run_python(code, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("events.publish of a 17 MiB event was still waiting after 120 s", pytrace=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_an_event_over_the_largest_message_fails_at_publish_and_says_which_limit(make_project):
    outcome = _publish_big(make_project(BIG_APP))
    assert outcome["error"] is not None, "RabbitMQ 4 took a 17 MiB message: is max_message_size raised?"
    assert outcome["seconds"] < 10, f"the refusal took {outcome['seconds']:.1f} s"
    assert "KombuEventsError" in outcome["error"]["classes"]
    assert "larger than configured max size 16777216" in outcome["error"]["message"]


def test_an_event_over_the_largest_message_is_a_publish_error(make_project):
    outcome = _publish_big(make_project(BIG_APP))
    assert "PublishError" in outcome["error"]["classes"]
    assert "delivery unknown" not in outcome["error"]["message"]
