"""Least privilege on a vhost of the test's own: a deploy user declares (`kombu-events declare`), a runtime user
with exactly what `kombu-events permissions` prints runs a worker with --events-no-declare that consumes,
retries, archives, publishes (with delay=) and runs a periodic event; a missing queue or a refused permission
stops it at start with one clear line, and no message is lost."""
from __future__ import annotations

import re
import shlex
import time

import pytest

from ..brokers import amqp_url, rabbitmqctl
from .harness import Project, ctl, own_vhost, queue_counts, run_cli, wait_for

BODY = """
events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_levels=4, delay_unit_ms=100,
                publish_delay_levels=4, publish_delay_unit_ms=100, max_retries=3)

@events.handler("lp.work", bind=True)
def work(event):
    if event.attempt < 3:
        raise RuntimeError("not yet")
    record(handler="work", attempt=event.attempt, payload=event.payload)

@events.handler("lp.doomed")
def doomed(payload):
    raise Archive("hopeless")

@events.handler("lp.later", bind=True)
def later(event):
    record(handler="later", payload=event.payload)

@events.periodic("tick", every=1)
def tick(event):
    record(handler="tick")
"""


@pytest.fixture
def vhost(broker_url):
    """A vhost with a deploy and a runtime user (no permissions yet); guest may inspect it. Deleted after."""
    with own_vhost("kev-lp", deploy="kev-deploy", runtime="kev-run") as found:
        yield found


def url(user: str, password: str, vhost: str) -> str:
    return amqp_url(user, password, vhost)


def apply(output: str, user: str) -> list[str]:
    """Run every ``rabbitmqctl`` line of ``output`` that is for ``user``; return them."""
    lines = [line for line in output.splitlines() if line.startswith("rabbitmqctl ")]
    mine = [line for line in lines if shlex.split(line)[4] == user]
    for line in mine:
        rabbitmqctl(*shlex.split(line)[1:])  # the broker under test's rabbitmqctl
    return mine


def totals(guest_url: str, service: str) -> dict[str, int]:
    """Ready + unacknowledged messages of each queue of ``service``."""
    return {name: ready + unacked for name, (ready, unacked, _consumers) in queue_counts(guest_url).items()
            if name.startswith(service + ".")}


def settled_view(counts: dict[str, int], service: str) -> dict[str, int]:
    """``counts`` with each handler queue and the archive on its own, and the rest together: the schedule's
    token moves between its queue and the delay ladder on the broker's clock, worker or not."""
    own = {f"{service}.{name}" for name in ("work", "later", "doomed", "archive")}
    view = {name: n for name, n in counts.items() if name in own}
    view["ladder, schedule and tasks together"] = sum(n for name, n in counts.items() if name not in own)
    return view


def test_a_runtime_user_without_configure_runs_a_worker_declared_by_a_deploy_user(tmp_path, vhost):
    started = time.monotonic()
    runtime_url = url(vhost["runtime"], vhost["password"], vhost["name"])
    deploy_url = url(vhost["deploy"], vhost["password"], vhost["name"])
    guest_url = amqp_url(vhost=vhost["name"])
    project = Project(tmp_path, runtime_url, BODY)
    try:
        printed = run_cli(project, "permissions", "--user", vhost["runtime"], "--deploy-user", vhost["deploy"])
        assert printed.returncode == 0, printed.stderr
        assert len(apply(printed.stdout, vhost["deploy"])) == 1
        assert len(apply(printed.stdout, vhost["runtime"])) == 2  # set_permissions, set_topic_permissions
        configure = shlex.split(runtime_line(printed.stdout, vhost["runtime"]))[5]
        for name in ("work", "delay.0", "archive", "delivery", "schedule.tick"):
            assert not re.fullmatch(configure, f"{project.service}.{name}"), name
        for name in (project.exchange, project.exchange + ".deferred.0"):
            assert not re.fullmatch(configure, name), name

        # Without the topology, the runtime user's worker refuses to start: it cannot declare, and does not try.
        refused = project.worker("--events-no-declare")
        assert refused.wait_exit(timeout=60) == 1, refused.log[-3000:]
        assert_one_clear_line(refused.log, f"exchange '{project.exchange}'", project.module)

        declared = run_cli(project, "--broker", deploy_url, "declare")
        assert declared.returncode == 0, declared.stderr

        worker = project.worker("--events-no-declare").wait_ready(timeout=60)
        assert "topology checked without declaring" in worker.log
        sent = project.run_python("""
            from PROJ import events
            events.publish("lp.work", {"n": 1})
            events.publish("lp.doomed", {"n": 2})
            events.publish("lp.later", {"n": 3}, delay=0.3)
        """.replace("PROJ", project.module))
        assert sent.returncode == 0, sent.stderr
        wait_for(lambda: project.records(handler="work") and project.records(handler="later")
                 and project.records(handler="tick"), timeout=30, what="work retried, later delivered, tick ran")
        assert project.records(handler="work")[0]["attempt"] == 3  # twice through the ladder
        wait_for(lambda: totals(guest_url, project.service).get(f"{project.service}.archive") == 1, timeout=20,
                 what="the doomed event archived")
        assert "ACCESS_REFUSED" not in worker.log, worker.log[-3000:]
        worker.stop()

        # A queue deleted meanwhile: the worker refuses to start, takes nothing, declares nothing.
        ctl("delete_queue", "-p", vhost["name"], f"{project.service}.later")
        published = project.run_python(f"from {project.module} import events; events.publish('lp.work', {{'n': 4}})")
        assert published.returncode == 0, published.stderr
        before = totals(guest_url, project.service)
        assert before[f"{project.service}.work"] == 1
        refused = project.worker("--events-no-declare")
        assert refused.wait_exit(timeout=60) == 1, refused.log[-3000:]
        assert_one_clear_line(refused.log, f"queue '{project.service}.later'", project.module)
        after = totals(guest_url, project.service)
        assert settled_view(after, project.service) == settled_view(before, project.service)  # nothing lost
        assert set(after) == set(before)  # nothing declared

        # A permission taken away (read on one handler queue): refused at start too, one line, nothing lost.
        run_cli(project, "--broker", deploy_url, "declare")
        before = totals(guest_url, project.service)
        grant = shlex.split(runtime_line(printed.stdout, vhost["runtime"]))
        assert "later|" in grant[7]
        ctl("set_permissions", "-p", vhost["name"], vhost["runtime"], *grant[5:7], grant[7].replace("later|", ""))
        refused = project.worker("--events-no-declare")
        assert refused.wait_exit(timeout=60) == 1, refused.log[-3000:]
        assert "ACCESS_REFUSED" in refused.log and "permissions` prints" in refused.log, refused.log[-3000:]
        assert "Traceback" not in refused.log, refused.log[-3000:]
        # (the schedule's seeder, which runs before consuming starts, may have sent a token: runs dedupe them)
        # A message of a queue the worker subscribed before the refused one may have run meanwhile: its ack
        # died with the closed channel, so it is back in its queue, and its retry copy (if it failed) may be
        # there too: at least once, never fewer.
        events = [f"{project.service}.{name}" for name in ("work", "later", "doomed", "archive")]
        now = totals(guest_url, project.service)
        assert all(now[q] >= before[q] for q in events), ([now[q] for q in events], [before[q] for q in events])
        assert now[f"{project.service}.archive"] == before[f"{project.service}.archive"]
    finally:
        for w in project.workers:
            w.kill()
    print(f"least privilege: {time.monotonic() - started:.1f} s")


def runtime_line(output: str, user: str) -> str:
    [line] = [line for line in output.splitlines()
              if line.startswith("rabbitmqctl set_permissions") and shlex.split(line)[4] == user]
    return line


def assert_one_clear_line(log: str, names: str, module: str) -> None:
    lines = [line for line in log.splitlines() if "does not declare its topology" in line]
    assert len(lines) == 1, log[-3000:]
    assert names in lines[0] and f"kombu-events -A {module} declare" in lines[0], lines[0]
    assert "Traceback" not in log and "Unrecoverable error" not in log, log[-3000:]
    assert "consuming" not in log, log[-3000:]


READER_BODY = """
from datetime import timedelta

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_levels=2, delay_unit_ms=100)
orders = events.log("lp.#", keep=timedelta(days=1))

@events.reader(orders)
def projector(payload):
    record(handler="projector", payload=payload)
"""


def test_a_runtime_user_reads_a_log_and_writes_the_readers_position(tmp_path, vhost):
    runtime_url = url(vhost["runtime"], vhost["password"], vhost["name"])
    deploy_url = url(vhost["deploy"], vhost["password"], vhost["name"])
    project = Project(tmp_path, runtime_url, READER_BODY)
    try:
        printed = run_cli(project, "permissions", "--user", vhost["runtime"], "--deploy-user", vhost["deploy"])
        assert printed.returncode == 0, printed.stderr
        apply(printed.stdout, vhost["deploy"])
        apply(printed.stdout, vhost["runtime"])
        configure = shlex.split(runtime_line(printed.stdout, vhost["runtime"]))[5]
        for name in ("reader.projector", "reader.projector.position", "log.lp"):
            assert not re.fullmatch(configure, f"{project.service}.{name}"), name
        assert run_cli(project, "--broker", deploy_url, "declare").returncode == 0
        worker = project.worker("--events-no-declare").wait_ready(timeout=60)
        sent = project.run_python(f"""
            from {project.module} import events
            for n in range(20):
                events.publish("lp.order", {{"n": n}})
        """)
        assert sent.returncode == 0, sent.stderr
        wait_for(lambda: len(project.records(handler="projector")) == 20, timeout=30, what="20 events read")
        assert [r["payload"]["n"] for r in project.records(handler="projector")] == list(range(20))

        def position():
            status = run_cli(project, "log", "status", "--json")  # as the runtime user
            assert status.returncode == 0, status.stderr
            import json
            return json.loads(status.stdout)[0]["readers"][0]["position"]
        wait_for(lambda: position() == 20, timeout=10, what="the position written by the runtime user")
        rewound = run_cli(project, "log", "rewind", "projector", "--to", "15", "--yes")
        assert rewound.returncode == 0, rewound.stderr
        wait_for(lambda: len(project.records(handler="projector")) == 25, timeout=30, what="5 events again")
        assert "ACCESS_REFUSED" not in worker.log, worker.log[-3000:]
    finally:
        for w in project.workers:  # the vhost, and all in it, goes with the fixture
            w.kill()
