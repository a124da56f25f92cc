"""worker/bootstep.py: the step's start errors go on to Celery named by service; stop and shutdown
reach every service.
"""
from __future__ import annotations

import logging
from types import SimpleNamespace

import celery
import pytest

from kombu_events.worker.bootstep import EventsStep

LOGGER = "kombu_events.worker.bootstep"


class Consumer:
    """A ServiceConsumer that records its calls; ``fails`` names the one that raises."""

    def __init__(self, service: str, calls: list[tuple[str, str]], fails: str = "") -> None:
        self.settings = SimpleNamespace(service=service)
        self.calls, self.fails = calls, fails

    def _call(self, what: str) -> None:
        self.calls.append((what, self.settings.service))
        if what == self.fails:
            raise RuntimeError(f"{self.settings.service} broke in {what}")

    def start(self, connection, pool, hub, call_soon=None):
        self._call("start")

    def consume(self):
        self._call("consume")

    def stop(self):
        self._call("stop")

    def shutdown(self):
        self._call("shutdown")


def _step(fails: str) -> tuple[EventsStep, list[tuple[str, str]], SimpleNamespace]:
    parent = SimpleNamespace(app=celery.Celery("proj", broker="memory://", set_as_current=False),
                             connection=None, pool=None, hub=None)
    step = EventsStep(parent)  # without --with-events-step: no services of its own
    calls: list[tuple[str, str]] = []
    step.consumers = [Consumer("billing", calls, fails), Consumer("shipping", calls)]  # type: ignore[list-item]
    return step, calls, parent


@pytest.mark.parametrize("method", ["stop", "shutdown"])
def test_a_service_that_fails_to_stop_is_logged_and_the_others_still_stop(method, caplog):
    step, calls, parent = _step(fails=method)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        getattr(step, method)(parent)
    assert calls == [(method, "billing"), (method, "shipping")]
    (record,) = caplog.records
    assert "service billing failed" in record.getMessage()
    assert record.exc_info[1].args == (f"billing broke in {method}",)


@pytest.mark.parametrize("method, called", [("start", "start"), ("register_with_event_loop", "consume")])
def test_a_service_that_fails_to_start_is_named_and_celery_sees_the_error(method, called, caplog):
    step, calls, parent = _step(fails=called)
    with caplog.at_level(logging.ERROR, logger=LOGGER), pytest.raises(RuntimeError, match="billing broke"):
        getattr(step, method)(parent, *(() if method == "start" else (None,)))
    assert calls == [(called, "billing")]  # Celery restarts the step, or stops the worker: not ours to hide
    (record,) = caplog.records
    assert "service billing failed: RuntimeError: billing broke" in record.getMessage()


class _Settings:
    broker_channel_error_retry = False


@pytest.mark.parametrize("setup, expected", [
    (lambda app: None, True),  # left unset: a RESOURCE_LOCKED after a silent connection must not end the worker
    (lambda app: app.config_from_object(_Settings), False),
    (lambda app: setattr(app.conf, "broker_channel_error_retry", False), False),
])
def test_channel_errors_are_retried_unless_the_app_chose(setup, expected):
    from celery import Celery

    from kombu_events.worker.bootstep import _retry_channel_errors
    app = Celery("t", set_as_current=False)
    setup(app)
    app.conf.broker_url
    _retry_channel_errors(app)
    assert app.conf.broker_channel_error_retry is expected


def _tls_app(url: str, use_ssl=None) -> celery.Celery:
    app = celery.Celery("proj", broker=url, set_as_current=False)
    if use_ssl is not None:
        app.conf.broker_use_ssl = use_ssl
    return app


def test_the_workers_own_amqps_connection_checks_the_brokers_name_by_default(caplog):
    import ssl

    from kombu_events.worker.bootstep import _verify_tls

    given = {"ca_certs": "/etc/tls/ca.pem"}
    app = _tls_app("amqps://u:secret@rabbit.example.com:5671/v", given)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _verify_tls(app)
    assert app.conf.broker_use_ssl == {"ca_certs": "/etc/tls/ca.pem", "cert_reqs": ssl.CERT_REQUIRED,
                                       "server_hostname": "rabbit.example.com"}
    assert given == {"ca_certs": "/etc/tls/ca.pem"}  # a copy: the app's own dict is left alone
    [line] = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "cert_reqs=ssl.CERT_REQUIRED, server_hostname='rabbit.example.com' added" in line and "secret" not in line
    for use_ssl in (True, None, False):  # None: Celery's default (False); kombu's amqps:// turns it on
        app = _tls_app("amqps://rabbit.example.com//", use_ssl)
        _verify_tls(app)
        assert app.conf.broker_use_ssl["server_hostname"] == "rabbit.example.com"


@pytest.mark.parametrize(("url", "use_ssl"), [
    ("amqps://rabbit.example.com//", {"server_hostname": "rabbit", "cert_reqs": 2}),  # the user chose
    ("amqp://rabbit.example.com//", None),  # plain AMQP
    ("amqp://rabbit.example.com//", {"ca_certs": "ca.pem"}),  # not amqps://: left as the user wrote it
    ("amqps://a.example.com//;amqps://b.example.com//", {"ca_certs": "ca.pem"}),  # fail-over: no one name
])
def test_the_workers_own_connection_is_left_alone_when_chosen_or_not_single_amqps(url, use_ssl, caplog):
    from kombu_events.worker.bootstep import _verify_tls

    app = _tls_app(url, use_ssl)
    before = app.conf.broker_use_ssl
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _verify_tls(app)
    assert app.conf.broker_use_ssl == before and not caplog.records


def test_verification_turned_off_on_the_workers_connection_is_kept_and_warned(caplog):
    import ssl

    from kombu_events.worker.bootstep import _verify_tls

    app = _tls_app("amqps://unverified-worker.example.com//", {"cert_reqs": ssl.CERT_NONE})
    with caplog.at_level(logging.INFO):
        _verify_tls(app)
    assert app.conf.broker_use_ssl == {"cert_reqs": ssl.CERT_NONE}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "does not verify the broker's certificate" in warnings[0], warnings
    assert not [r for r in caplog.records if r.name == LOGGER]
