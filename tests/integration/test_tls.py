"""TLS everywhere: a private RabbitMQ node that takes TLS only, with client certificates required.

The node (scripts/rabbitmq-cluster with ``KE_CLUSTER_EXTRA_CONF``) has no plain AMQP listener;
its certificates come from ``openssl`` here: a CA, a server certificate for ``localhost`` and
``127.0.0.1``, and a client certificate whose CN is ``guest`` (the EXTERNAL login's user). A
second TLS listener on 127.0.0.2, a name the server certificate does not hold, is the wrong host.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from celery import Celery

from kombu_events.broker.connections import broker_connection
from kombu_events.errors import BrokerUnavailableError
from kombu_events.publishing.publisher import Publisher, build_message

from .harness import Project, wait_for
from .private_broker import PrivateBroker, free_port

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PLUGIN = "rabbitmq_auth_mechanism_ssl"

BODY = '''
app.conf.broker_use_ssl = {ssl_options!r}
app.conf.broker_heartbeat = 2
events = Events(app, service=SERVICE, exchange=EXCHANGE)

@events.handler("tls.first")
def first(payload):
    record(step="first", n=payload["n"])
    events.publish("tls.second", {{"n": payload["n"]}})   # the publisher's own connection, over TLS

@events.handler("tls.second")
def second(payload):
    record(step="second", n=payload["n"])
'''


def _unavailable(why: str) -> None:
    if CI:
        pytest.fail(f"{why} (CI=true: must not skip)")
    pytest.skip(why)


def make_certificates(directory: Path) -> None:
    """A CA; a server certificate for localhost and 127.0.0.1; a client certificate for user guest."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    common = "basicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    (directory / "server.ext").write_text(common + "extendedKeyUsage=serverAuth\n"
                                          "subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    (directory / "client.ext").write_text(common + "extendedKeyUsage=clientAuth\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30)

    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=ke-test-ca")
    for who, cn in (("server", "localhost"), ("client", "guest")):
        openssl("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={cn}")
        openssl("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{who}.pem", "-days", "1", "-extfile", f"{who}.ext")
    for key in directory.glob("*.key"):
        key.chmod(0o644)  # the node reads the server's key


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory):
    """A TLS-only private node: ``.port``, ``.certs``, ``.external`` (the EXTERNAL mechanism is on)."""
    if shutil.which("openssl") is None:
        _unavailable("openssl is not installed")
    certs = tmp_path_factory.mktemp("certs")
    make_certificates(certs)
    port = free_port()
    external = any(Path("/usr/lib/rabbitmq/lib").glob(f"rabbitmq_server-*/plugins/{PLUGIN}-*"))
    lines = ["listeners.tcp = none", f"listeners.ssl.1 = 127.0.0.1:{port}", f"listeners.ssl.2 = 127.0.0.2:{port}",
             f"ssl_options.cacertfile = {certs}/ca.pem", f"ssl_options.certfile = {certs}/server.pem",
             f"ssl_options.keyfile = {certs}/server.key", "ssl_options.verify = verify_peer",
             "ssl_options.fail_if_no_peer_cert = true"]
    if external:
        lines += ["auth_mechanisms.1 = PLAIN", "auth_mechanisms.2 = AMQPLAIN", "auth_mechanisms.3 = EXTERNAL",
                  "ssl_cert_login_from = common_name"]
    (certs / "tls.conf").write_text("\n".join(lines) + "\n")
    broker = PrivateBroker(tmp_path_factory.mktemp("rabbitmq-tls"))
    broker.env.update(KE_CLUSTER_EXTRA_CONF=str(certs / "tls.conf"), KE_CLUSTER_PLUGINS=PLUGIN if external else "")
    try:
        broker.start()
    except Exception as exc:
        broker.stop()
        _unavailable(f"the private TLS node did not start: {exc}")
    yield SimpleNamespace(port=port, certs=certs, external=external, broker=broker)
    strays = broker.stop()
    assert not strays, f"beam processes of {broker.name} outlived `rabbitmq-cluster stop` (killed): {strays}"


def full(node) -> dict[str, str]:
    return {"ca_certs": f"{node.certs}/ca.pem", "certfile": f"{node.certs}/client.pem",
            "keyfile": f"{node.certs}/client.key"}


def test_a_worker_consumes_and_its_handler_publishes_over_tls_and_keeps_its_connection(tls_node, tmp_path):
    url = f"amqps://guest:guest@localhost:{tls_node.port}//"
    project = Project(tmp_path, url, BODY.format(ssl_options=full(tls_node)))
    worker = project.worker()
    try:
        worker.wait_ready(timeout=40)
        publish = ["publish", "tls.first", '{"n": 1}']
        result = run_cli(project, *publish)
        assert result.returncode == 0, result.stderr
        wait_for(lambda: project.records(step="second", n=1), 20, what="the event its handler published")
        assert [r["n"] for r in project.records(step="first")] == [1]

        status = run_cli(project, "status", "--json", "--management-url", "http://127.0.0.1:9")
        assert status.returncode == 0, status.stderr
        rows = {row["queue"]: row for row in json.loads(status.stdout)}
        assert rows[f"{project.service}.first"]["consumers"] == 1

        connections = tls_node.broker.ctl(1, "list_connections", "timeout", "ssl").split("\n")
        assert "2\ttrue" in connections, connections  # the worker's: heartbeats every 2 s, over TLS
        time.sleep(8)  # idle through 4 heartbeat intervals (broker_heartbeat=2)
        assert run_cli(project, "publish", "tls.first", '{"n": 2}').returncode == 0
        wait_for(lambda: project.records(step="second", n=2), 20, what="an event after the idle spell")
        log = worker.log
        assert "lost" not in log.lower() and "reconnect" not in log.lower(), log[-3000:]
        assert "CERTIFICATE_VERIFY_FAILED" not in log, log[-3000:]
    finally:
        worker.kill()


def test_a_worker_checks_the_brokers_name_without_server_hostname_in_broker_use_ssl(tls_node, tmp_path):
    url = f"amqps://guest:guest@127.0.0.2:{tls_node.port}//"  # a name the server certificate does not hold
    project = Project(tmp_path, url, BODY.format(ssl_options=full(tls_node)))  # CA, no server_hostname
    worker = project.worker()
    try:
        wait_for(lambda: "mismatch" in worker.log or " ready." in worker.log, 30, what="the worker's TLS verdict")
        log = worker.log
        assert " ready." not in log and "IP address mismatch" in log, log[-3000:]
        assert "server_hostname='127.0.0.2'" in log, log[-3000:]  # the one INFO line saying what was set
    finally:
        worker.kill()


@pytest.mark.parametrize("case", ["no CA", "another name", "no client certificate", "plain AMQP"])
def test_a_tls_failure_is_one_clear_error_naming_the_broker_and_the_reason(tls_node, case):
    port, options = tls_node.port, full(tls_node)
    url = f"amqps://guest:guest@localhost:{port}//"
    if case == "no CA":
        del options["ca_certs"]
        expected = "certificate was not verified"
    elif case == "another name":
        url = f"amqps://guest:guest@127.0.0.2:{port}//"
        expected = "not valid for the host connected to"
    elif case == "no client certificate":
        del options["certfile"], options["keyfile"]
        expected = "client certificate"
    else:
        url, options = f"amqp://guest:guest@localhost:{port}//", None
        expected = "TLS only"
    app = Celery("tls", broker=url)
    app.conf.broker_use_ssl = options
    publisher = Publisher(url, app=app, connect_timeout=5)
    with pytest.raises(BrokerUnavailableError) as failure:
        publisher.send("amq.topic", "tls.nobody", build_message({}))
    message = str(failure.value)
    assert f"guest:**@{url.split('@')[1]}" in message and "guest:guest" not in message
    assert expected in message, message


def test_the_cli_says_what_is_wrong_in_one_line(tls_node, tmp_path):
    body = BODY.format(ssl_options={"ca_certs": full(tls_node)["ca_certs"]})  # no client certificate
    project = Project(tmp_path, f"amqps://guest:guest@localhost:{tls_node.port}//", body)
    result = run_cli(project, "status")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"amqps://guest:**@localhost:{tls_node.port}//" in result.stderr
    assert "client certificate" in result.stderr


def test_external_login_with_the_client_certificate(tls_node):
    if not tls_node.external:
        _unavailable(f"RabbitMQ's {PLUGIN} plugin is not installed here")
    url = f"amqps://guest:not-the-password@localhost:{tls_node.port}//"
    app = Celery("tls", broker=url)
    app.conf.broker_use_ssl = full(tls_node)
    with broker_connection(url, app) as refused, pytest.raises(Exception, match=r"ACCESS_REFUSED|authentication"):
        refused.ensure_connection(max_retries=0)  # PLAIN with a wrong password: refused
    app.conf.broker_login_method = "EXTERNAL"
    with broker_connection(url, app) as connection:  # the certificate's CN is the user
        connection.ensure_connection(max_retries=0)
        assert connection.channel() is not None


def run_cli(project: Project, *args: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).parent / "kombu-events"
    return subprocess.run([str(cli), "-A", project.module, *args], cwd=project.dir, env=project.env(),
                          capture_output=True, text=True, timeout=60)

