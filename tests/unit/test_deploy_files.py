"""The files of deploy/ (docs/deployment.md): each parses, says what the others say (command line,
port, user, queue names, grace period), and the PromQL of the alert rules and the dashboard has a
sound shape and names only metrics and labels the exporter serves (rendered here without a broker;
tests/integration/test_deployment.py checks them against a real worker)."""
from __future__ import annotations

import configparser
import importlib.util
import re
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kombu_events.integrations.metrics import PrometheusMetrics

from .. import deploy_files as d

REQUIRED = [d.DOCKERFILE, d.DOCKERFILE.with_name("Dockerfile.dockerignore"), d.UNIT, d.DEPLOYMENT, d.SCALEDOBJECT,
            d.ALERTS, d.DASHBOARD, d.EXAMPLE_APP]


def exporter_samples() -> dict[str, set[str]]:
    """What a worker's /metrics holds once each kind of sample exists, rendered from the exporter's own code."""
    metrics = PrometheusMetrics(CollectorRegistry())
    q = metrics.stats("svc.handler")
    q.exceptions["builtins.ValueError"] = 1
    q.observe(0.01)
    q.depth = 0
    metrics.ladder_depths[("svc", 0)] = 0
    metrics.archive_depths["svc"] = 0
    metrics.archive_bytes["svc"] = 0
    metrics.published.labels("events", "ok").inc()
    return d.exposed_samples(generate_latest(metrics.registry).decode())


SAMPLES = exporter_samples()
#: Label names the metrics have, and those Prometheus adds to every scraped series.
LABELS = set().union(*SAMPLES.values()) | {"instance", "job", "__name__"}


def test_every_file_is_there():
    missing = [str(p.relative_to(d.ROOT)) for p in REQUIRED if not p.is_file()]
    assert not missing


@pytest.mark.parametrize("path", d.data_files(), ids=lambda p: str(p.relative_to(d.DEPLOY)))
def test_every_yaml_and_json_file_parses(path):
    documents = d.load(path)
    assert documents and all(isinstance(doc, dict) for doc in documents), f"{path.name}: not mappings"


def test_every_worker_command_runs_the_events_step_with_its_metrics_port():
    for where, argv in d.worker_commands().items():
        assert Path(argv[0]).name == "celery", f"{where}: {argv}"
        start = argv.index("-A")
        assert argv[start:start + len(d.WORKER_ARGS) + 1] == [*d.WORKER_ARGS, str(d.METRICS_PORT)], f"{where}: {argv}"
    assert Path(d.unit_command()[0]).is_absolute(), "systemd needs the executable's absolute path"


def test_the_example_app_defines_the_handler_queues_the_scaler_watches(monkeypatch):
    for variable in ("EVENTS_SERVICE", "EVENTS_EXCHANGE", "KOMBU_EVENTS_METRICS_HOST"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no __pycache__ in deploy/example
    spec = importlib.util.spec_from_file_location("deploy_example_events_app", d.EXAMPLE_APP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # connects nowhere: Celery and Events are lazy
    assert module.events.service == d.kubernetes_env()["EVENTS_SERVICE"]
    unit_env = [v for k, v in d.unit_entries()["Service"] if k == "Environment"]
    assert f"EVENTS_SERVICE={module.events.service}" in unit_env
    handler_queues = sorted(h.queue for h in module.events.handlers)

    scaled = d.by_kind(d.SCALEDOBJECT, "ScaledObject")
    triggers = scaled["spec"]["triggers"]
    assert all(t["type"] == "rabbitmq" and t["metadata"]["mode"] == "QueueLength" for t in triggers)
    assert all(isinstance(v, str) for t in triggers for v in t["metadata"].values()), "KEDA's metadata: strings"
    assert sorted(t["metadata"]["queueName"] for t in triggers) == handler_queues, \
        "one trigger per handler queue of the example app"
    auth = d.by_kind(d.SCALEDOBJECT, "TriggerAuthentication")
    assert {t["authenticationRef"]["name"] for t in triggers} == {auth["metadata"]["name"]}
    assert [p["parameter"] for p in auth["spec"]["secretTargetRef"]] == ["host"]
    broker_secret = d.kubernetes_env()["CELERY_BROKER_URL"]["secretKeyRef"]
    assert [(p["name"], p["key"]) for p in auth["spec"]["secretTargetRef"]] == \
        [(broker_secret["name"], broker_secret["key"])], "KEDA reads the broker URL the workers use"
    deployment = d.by_kind(d.DEPLOYMENT, "Deployment")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_the_deployment_probes_healthz_on_the_metrics_port_and_stops_as_celery_does():
    deployment = d.by_kind(d.DEPLOYMENT, "Deployment")
    assert deployment["apiVersion"] == "apps/v1"
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    spec = d.container(deployment)
    (port,) = spec["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", d.METRICS_PORT)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert spec[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    liveness = spec["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 30, "rides out a short broker outage"
    assert d.kubernetes_env()["KOMBU_EVENTS_METRICS_HOST"] == "0.0.0.0", "the kubelet probes the pod's IP"
    assert spec["resources"]["requests"] and spec["resources"]["limits"]["memory"]
    annotations = pod["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (str(d.METRICS_PORT), "/metrics")
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace == int(d.unit_value("Service", "TimeoutStopSec")), "one warm-shutdown budget for both"
    assert grace >= 30
    user = [args for word, args in d.dockerfile_instructions() if word == "USER"][-1]
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert f"{security['runAsUser']}:{security['runAsGroup']}" == user, "the image's user"


def test_the_systemd_unit_stops_the_worker_warmly_and_runs_it_as_a_plain_user():
    assert d.unit_value("Service", "KillSignal") == "SIGTERM"
    assert d.unit_value("Service", "KillMode") == "mixed", "SIGTERM to Celery's main process, which stops its pool"
    assert d.unit_value("Service", "User") not in ("root", "0")
    assert d.unit_value("Service", "Restart") in ("always", "on-failure")
    assert d.unit_value("Install", "WantedBy") == "multi-user.target"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_finds_nothing_to_say(tmp_path):
    """Every directive and value as systemd reads them; the venv's path, absent here, is swapped for one that exists."""
    unit = tmp_path / d.UNIT.name
    unit.write_text(d.UNIT.read_text().replace(d.unit_command()[0], sys.executable))
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


def test_the_dockerfile_builds_from_the_checkout_as_a_plain_user():
    instructions = d.dockerfile_instructions()
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "USER", "EXPOSE", "CMD", "ENTRYPOINT",
             "STOPSIGNAL", "LABEL", "HEALTHCHECK", "SHELL", "VOLUME", "ONBUILD"}
    assert {word for word, _args in instructions} <= known
    words = [word for word, _args in instructions]
    assert set(words[:words.index("FROM")]) <= {"ARG"}, "only ARG may come before the first FROM"
    args = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value
    bases = [rest.split()[0] for word, rest in instructions if word == "FROM"]
    for base in bases:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
        assert re.fullmatch(r"python:3\.(9|1[0-3])-slim", image), f"{base}: a Python slim image, 3.9 .. 3.13"

    ignore = [line for line in d.DOCKERFILE.with_name("Dockerfile.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    for word, rest in instructions:
        if word != "COPY" or rest.startswith("--from="):
            continue
        *sources, _target = rest.split()
        for source in sources:
            source = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], source).rstrip("/")
            assert (d.ROOT / source).exists(), f"COPY {source}: not in the build context (the checkout's root)"
            assert not any(fnmatch(source, pattern) for pattern in ignore), f"COPY {source}: the ignore file drops it"

    user = [rest for word, rest in instructions if word == "USER"]
    assert user and user[-1].split(":")[0] not in ("root", "0"), "runs as a user that is not root"
    assert [rest for word, rest in instructions if word == "EXPOSE"] == [str(d.METRICS_PORT)]
    assert [rest for word, rest in instructions if word == "STOPSIGNAL"] == ["SIGTERM"]
    env = " ".join(rest for word, rest in instructions if word == "ENV")
    assert "KOMBU_EVENTS_METRICS_HOST=0.0.0.0" in env
    assert any(word == "RUN" and "[prometheus]" in rest for word, rest in instructions), "installs the extra"


def test_the_alert_rules_have_what_alertmanager_needs():
    (doc,) = d.load(d.ALERTS)
    assert set(doc) == {"groups"}
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
    rules = d.alert_rules()
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names)
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"(\d+[smh])+", rule["for"]), rule["alert"]
    for wanted in ("ArchiveGrowing", "CircuitOpen", "QueueNotConsumed", "BacklogAgeing"):
        assert f"KombuEvents{wanted}" in names


def test_the_dashboard_has_its_panels_and_reads_its_datasource_from_a_variable():
    (dash,) = d.load(d.DASHBOARD)
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(set(ids)) == len(ids)
    titles = " | ".join(p["title"].lower() for p in panels)
    for topic in ("by action", "latency", "queue depths", "archive", "circuits", "backlog"):
        assert topic in titles, topic
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and set(panel["gridPos"]) == {"h", "w", "x", "y"}, panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        assert [t["refId"] for t in panel["targets"]] == [chr(65 + n) for n in range(len(panel["targets"]))]


@pytest.mark.parametrize("where, expr", [(f"alert {r['alert']}", r["expr"]) for r in d.alert_rules()]
                         + d.dashboard_promql())
def test_every_promql_expression_has_a_sound_shape(where, expr):
    assert d.promql_problems(expr, LABELS) == [], where


def test_every_metric_queried_is_one_the_exporter_serves():
    unknown = {name: sorted(where) for name, where in d.queried_metrics().items() if name not in SAMPLES}
    assert not unknown, f"not in a worker's /metrics ({sorted(SAMPLES)}): {unknown}"
    families = {d.family(name) for name in d.queried_metrics()}
    assert {"kombu_events_messages", "kombu_events_handler_duration_seconds", "kombu_events_queue_depth",
            "kombu_events_archive_depth", "kombu_events_circuit_state"} <= families


@pytest.mark.parametrize("expr, problem", [
    ('sum(rate(kombu_events_messages_total[5m])', "unclosed"),
    ('rate(kombu_events_messages_total[5m]))', "unbalanced"),
    ('sum by (service) (rates(kombu_events_messages_total[5m]))', "unknown function rates()"),
    ('kombu_events_queue_depth{queue="a" state="b"}', "bad label matcher"),
    ('kombu_events_queue_depth{queu="a"}', "label 'queu'"),
    ('sum by (servce) (kombu_events_queue_depth)', "label 'servce'"),
    ('rate(kombu_events_messages_total[5 minutes])', "not a duration"),
    ('kombu_events_queue_depth > treshold', "'treshold' is neither"),
])
def test_the_shape_check_catches_broken_expressions(expr, problem):
    problems = d.promql_problems(expr, LABELS)
    assert any(problem in p for p in problems), problems


# -- what docs/install.md and docs/deployment.md say about them -------------------------------------

def setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser(interpolation=None)
    config.read(d.ROOT / "setup.cfg")
    return config


def test_the_install_page_names_every_extra_and_the_celery_and_kombu_ranges_of_setup_cfg():
    page = (d.ROOT / "docs" / "install.md").read_text()
    config = setup_cfg()
    for extra in config["options.extras_require"]:
        assert f"| `{extra}` |" in page, f"docs/install.md's extras table lacks {extra}"
    requires = [r.strip() for r in config["options"]["install_requires"].splitlines() if r.strip()]
    for name in ("celery", "kombu"):
        (requirement,) = [r for r in requires if re.match(rf"{name}\b", r)]
        assert f"`{requirement}`" in page, f"docs/install.md does not state {requirement}"


def test_the_oldest_deps_env_pins_the_lower_bounds_of_setup_cfg():
    """tox -e oldest-deps tests what setup.cfg claims: bump one, and the pin must follow."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(d.ROOT / "tox.ini")
    pins = dict(line.split("==") for line in tox["testenv:oldest-deps"]["deps"].split() if "==" in line)
    config = setup_cfg()
    requirements = config["options"]["install_requires"] + config["options.extras_require"]["prometheus"] + \
        config["options.extras_require"]["opentelemetry"]
    lower = dict(re.findall(r"^\s*([A-Za-z0-9_.-]+)>=([0-9.]+)", requirements, flags=re.MULTILINE))
    def release(version: str) -> list[int]:  # 5.3 and 5.3.0 are one release
        numbers = [int(n) for n in version.split(".")]
        return numbers + [0] * (3 - len(numbers))

    for name in ("celery", "kombu", "prometheus_client", "opentelemetry-api"):
        assert release(pins[name]) == release(lower[name]), \
            f"{name}: oldest-deps pins {pins[name]}, setup.cfg says >={lower[name]}"


def test_the_deployment_page_shows_every_file_of_deploy():
    page = (d.ROOT / "docs" / "deployment.md").read_text()
    for path in sorted(p for p in d.DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        assert f"deploy/{path.relative_to(d.DEPLOY).as_posix()}" in page or path.name in page, path
