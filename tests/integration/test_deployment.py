"""deploy/ against a real worker: the Kubernetes container's command line and environment (the image's
ENV under it) run the example app against RabbitMQ; /healthz answers as the probes expect, /metrics
serves every metric the alert rules and the dashboard query, SIGTERM ends it as a pod's termination
does, and promtool accepts the rules and the dashboard's PromQL."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from .. import deploy_files as d
from ..conftest import CI
from .harness import delete_service, http_get, publish_amqp, unique, wait_for
from .private_broker import free_port

pytestmark = pytest.mark.integration



def image_env() -> dict[str, str]:
    """The ``ENV`` of the Dockerfile's last stage (the image the Deployment runs)."""
    instructions = d.dockerfile_instructions()
    last_from = max(n for n, (word, _rest) in enumerate(instructions) if word == "FROM")
    env = {}
    for word, rest in instructions[last_from:]:
        if word == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest))
    return env


def counted(text: str, queue: str, action: str) -> float:
    for line in text.splitlines():
        if (line.startswith("kombu_events_messages_total{") and f'queue="{queue}"' in line
                and f'action="{action}"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_deployed_worker_serves_every_metric_the_rules_and_the_dashboard_query(broker_url, tmp_path):
    service, exchange = unique("deploy"), unique("ex")
    port = free_port()
    argv = d.kubernetes_command()
    assert argv[0] == "celery"
    argv = [sys.executable, "-m", "celery", *argv[1:]]
    argv[argv.index("--events-metrics-port") + 1] = str(port)
    argv.append(f"--hostname={unique('w')}@%h")  # the pod's host name makes Celery's node name unique there

    env = {k: v for k, v in os.environ.items() if k != "RABBIT_URL"}
    env.update(image_env())
    env.update({k: v for k, v in d.kubernetes_env().items() if isinstance(v, str)})
    env.update(CELERY_BROKER_URL=broker_url, EVENTS_SERVICE=service, EVENTS_EXCHANGE=exchange)
    assert env["KOMBU_EVENTS_METRICS_HOST"] == "0.0.0.0"

    log_path = tmp_path / "worker.log"
    grace_s = d.by_kind(d.DEPLOYMENT, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    with open(log_path, "w") as log:
        # cwd: the app's directory, as the image's WORKDIR and the unit's WorkingDirectory hold it.
        worker = subprocess.Popen(argv, cwd=d.EXAMPLE_APP.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        def healthy():
            assert worker.poll() is None, f"the worker exited with {worker.returncode}:\n{log_path.read_text()[-4000:]}"
            return http_get(port, "/healthz")[0] == 200
        wait_for(healthy, timeout=30, interval=0.2, what="/healthz 200 (the startup and readiness probes)")
        status, text = http_get(port, "/healthz")
        assert status == 200 and text.startswith("ok: the event loop turned"), text

        # One event of each handler acked, one archived: every family has samples (exceptions included).
        for key, payload in [("orders.1.created", {"order_id": 1}), ("orders.2.created", {}),
                             ("orders.3.cancelled", {"order_id": 3})]:
            publish_amqp(broker_url, exchange, key, json.dumps(payload).encode(), content_type="application/json")
        created, cancelled = f"{service}.on_order_created", f"{service}.on_order_cancelled"

        def settled():
            status, text = http_get(port, "/metrics")
            assert status == 200, text
            done = (counted(text, created, "ack"), counted(text, created, "archive"), counted(text, cancelled, "ack"))
            # the archive's gauges come from a count of its own (a thread that reads the stream): once it ran
            return done == (1, 1, 1) and "kombu_events_archive_bytes{" in text and text
        text = wait_for(settled, timeout=20, interval=0.2, what="2 events acked and 1 archived")

        samples = d.exposed_samples(text)
        queried = d.queried_metrics()
        missing = {name: sorted(where) for name, where in queried.items() if name not in samples}
        assert not missing, f"queried but not served by the worker: {missing}; served: {sorted(samples)}"
        assert f'service="{service}"' in text and 'exception_type="kombu_events.errors.Poisoned"' in text

        # A pod's termination (and `systemctl stop`): SIGTERM, then Celery's warm shutdown within the grace period.
        started = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=min(grace_s, 30)) == 0, log_path.read_text()[-4000:]
        assert time.monotonic() - started < grace_s
        assert http_get(port, "/healthz")[0] == 0, "the endpoint closes with the worker"
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
        try:
            os.killpg(worker.pid, signal.SIGKILL)  # pool processes left behind, if any
        except (ProcessLookupError, PermissionError):
            pass
        delete_service(broker_url, service, (exchange,))


def test_promtool_accepts_the_alert_rules_and_the_dashboards_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        message = "promtool is not installed (Debian: apt-get install prometheus)"
        if CI:
            pytest.fail(message + " (CI=true: must not skip)")
        pytest.skip(message)
    dashboard = tmp_path / "dashboard-rules.yaml"
    dashboard.write_text(d.rule_file_of(d.dashboard_promql()))
    for path in (d.ALERTS, dashboard):
        result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout, result.stdout


def test_the_images_wheel_stage_builds_from_the_files_it_copies(tmp_path):
    """deploy/Dockerfile's first stage without Docker: only the files it COPYs, then its `pip wheel` line (which
    fetches setuptools from PyPI into an isolated build environment, as in the image)."""
    instructions = d.dockerfile_instructions()
    stage = instructions[:[n for n, (word, _rest) in enumerate(instructions) if word == "FROM"][1]]
    src = tmp_path / "src"
    src.mkdir()
    for word, rest in stage:
        if word == "COPY":
            *sources, target = rest.split()
            for source in sources:
                destination = src / target / Path(source).name if target.endswith("/") else src / target
                if (d.ROOT / source).is_dir():
                    shutil.copytree(d.ROOT / source, destination, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(d.ROOT / source, destination)
    (run,) = [shlex.split(rest) for word, rest in stage if word == "RUN"]
    assert run[:2] == ["pip", "wheel"] and run[-1] == "." and "/wheels" in run, run
    wheels = tmp_path / "wheels"
    run = [sys.executable, "-m", *run[:-1], "--quiet", "."]  # the image's line, this Python's pip
    run[run.index("/wheels")] = str(wheels)
    result = subprocess.run(run, cwd=src, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = wheels.glob("kombu_events-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kombu_events/py.typed" in names and "kombu_events/worker/bootstep.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
