"""broker/connections.py: every connection built from the app's broker settings, TLS verified by default."""
from __future__ import annotations

import logging
import ssl

import pytest
from celery import Celery

from kombu_events.broker import connections
from kombu_events.broker.connections import (
    broker_connection,
    connection_options,
    failure_reason,
    tls_options,
    unreachable,
)
from kombu_events.errors import BrokerUnavailableError, ConfigurationError

URL = "amqps://user:s3cret@broker.example.com:5671/vh"
TLS = {"ca_certs": "/etc/ca.pem", "certfile": "/etc/client.pem", "keyfile": "/etc/client.key",
       "cert_reqs": ssl.CERT_REQUIRED}


@pytest.fixture(autouse=True)
def _fresh_warnings():
    connections._warned.clear()
    yield
    connections._warned.clear()


def app_with(**conf):
    app = Celery("t", broker=URL, set_as_current=False)
    app.conf.update(conf)
    return app


def test_amqps_verifies_the_certificate_and_the_url_host_by_default():
    assert tls_options(URL, None) == {"cert_reqs": ssl.CERT_REQUIRED, "server_hostname": "broker.example.com"}
    assert tls_options(URL, True) == tls_options(URL, None)


def test_a_dict_is_kept_and_completed_never_changed_in_place():
    given = {k: v for k, v in TLS.items() if k != "cert_reqs"}
    options = tls_options(URL, given)
    assert options == {**given, "cert_reqs": ssl.CERT_REQUIRED, "server_hostname": "broker.example.com"}
    assert "server_hostname" not in given and "cert_reqs" not in given


def test_the_users_server_hostname_wins():
    assert tls_options(URL, {"server_hostname": "rabbit.internal"})["server_hostname"] == "rabbit.internal"


def test_broker_use_ssl_with_a_plain_url_still_means_tls():
    assert tls_options("amqp://localhost:5671//", TLS)["server_hostname"] == "localhost"


def test_plain_amqp_without_broker_use_ssl_is_plain():
    assert tls_options("amqp://guest:guest@localhost//", None) is False
    assert tls_options("amqp://guest:guest@localhost//", False) is False


def test_fail_over_urls_cannot_check_one_name_and_say_so(caplog):
    with caplog.at_level(logging.WARNING, logger="kombu_events.broker.connections"):
        options = tls_options("amqps://a.example.com//;amqps://b.example.com//", None)
    assert "server_hostname" not in options and options["cert_reqs"] == ssl.CERT_REQUIRED
    assert "several fail-over URLs" in caplog.text
    given = tls_options("amqps://a.example.com//;amqps://b.example.com//", {"server_hostname": "rabbit"})
    assert given["server_hostname"] == "rabbit"


def test_a_context_dict_checks_the_hostname_unless_told_not_to(caplog):
    options = tls_options(URL, {"context": {"cafile": "/etc/ca.pem"}})
    assert options["context"] == {"cafile": "/etc/ca.pem", "check_hostname": True}
    assert options["server_hostname"] == "broker.example.com"
    with caplog.at_level(logging.WARNING, logger="kombu_events.broker.connections"):
        tls_options(URL, {"context": {"check_hostname": False}})
    assert "the broker's name (context check_hostname=False)" in caplog.text


def test_turning_verification_off_logs_one_warning_naming_it_without_the_password(caplog):
    with caplog.at_level(logging.WARNING, logger="kombu_events.broker.connections"):
        for _ in range(3):
            options = tls_options(URL, {"cert_reqs": ssl.CERT_NONE})
    assert options == {"cert_reqs": ssl.CERT_NONE}  # no server_hostname: py-amqp refuses it with CERT_NONE
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "cert_reqs=CERT_NONE" in text and "user:**@broker.example.com" in text and "s3cret" not in text


def test_verifying_logs_nothing(caplog):
    with caplog.at_level(logging.WARNING):
        tls_options(URL, TLS)
    assert not caplog.records


def test_an_ssl_context_is_refused_since_py_amqp_would_ignore_it():
    with pytest.raises(ConfigurationError, match=r"SSLContext.*ignores.*Give a dict"):
        tls_options(URL, ssl.create_default_context())


def test_anything_else_is_refused():
    with pytest.raises(ConfigurationError, match="broker_use_ssl must be True, False or a dict"):
        tls_options(URL, "yes")


def test_the_apps_settings_are_carried_as_celery_carries_them():
    app = app_with(broker_use_ssl=TLS, broker_login_method="EXTERNAL", broker_transport_options={"x": 1},
                   broker_heartbeat=7, broker_connection_timeout=3.5)
    options = connection_options(URL, app.conf)
    assert options["ssl"] == {**TLS, "server_hostname": "broker.example.com"}
    assert options["login_method"] == "EXTERNAL"
    assert options["transport_options"] == {"x": 1}
    assert options["connect_timeout"] == 3.5
    assert "heartbeat" not in options  # like connection_for_write: nobody sends heartbeats on it
    assert connection_options(URL, app.conf, heartbeat=True)["heartbeat"] == 7.0
    assert connection_options(URL, app.conf, connect_timeout=1)["connect_timeout"] == 1


def test_without_an_app_the_defaults():
    options = connection_options("amqp://localhost//")
    assert options == {"ssl": False, "transport_options": {}, "connect_timeout": 4.0}


def test_broker_connection_builds_a_kombu_connection_with_them():
    app = app_with(broker_use_ssl=TLS, broker_login_method="EXTERNAL")
    connection = broker_connection(URL, app)
    assert connection.ssl["server_hostname"] == "broker.example.com"
    assert connection.ssl["ca_certs"] == "/etc/ca.pem"
    assert connection.login_method == "EXTERNAL"
    assert connection.hostname == "broker.example.com" and connection.port == 5671


@pytest.mark.parametrize(("error", "says"), [
    (ssl.SSLCertVerificationError(1, "certificate verify failed"), "name the CA that signed it"),
    (ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert certificate required"),
     "requires a client certificate"),
    (ssl.SSLError(8, "EOF occurred in violation of protocol"), "client certificate"),
    (ConnectionResetError(104, "Connection reset by peer"), "use amqps://"),
])
def test_failure_reasons(error, says):
    wrapped = RuntimeError(str(error))
    wrapped.__cause__ = error
    assert says in failure_reason(wrapped, "amqp://localhost:5671//")


def test_hostname_mismatch_reason():
    error = ssl.SSLCertVerificationError(1, "x")
    error.verify_message = "Hostname mismatch, certificate is not valid for 'b.example.com'."
    assert "subjectAltName" in failure_reason(error, URL)


def test_a_refused_connection_gets_no_tls_hint():
    assert "amqps" not in failure_reason(ConnectionRefusedError(111, "Connection refused"), "amqp://localhost//")


def test_unreachable_names_the_broker_without_the_password():
    error = unreachable(URL, ssl.SSLCertVerificationError(1, f"failed for {URL}"))
    assert isinstance(error, BrokerUnavailableError)
    assert "user:**@broker.example.com:5671/vh" in str(error) and "s3cret" not in str(error)
