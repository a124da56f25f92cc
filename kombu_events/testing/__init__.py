"""Testing your handlers: the in-memory stub, a throw-away RabbitMQ vhost, and the pytest plugin for both.

Opt in from your top-level ``conftest.py`` with
``pytest_plugins = ["kombu_events.testing"]``; it adds two fixtures:

- ``events_stub(events_or_app, **options)`` makes a :class:`StubEvents` that the app's own
  ``events.publish`` publishes into until the test ends;
- ``events_broker`` is the AMQP URL of a vhost of its own on the real RabbitMQ, deleted
  after the test. Broker from ``KOMBU_EVENTS_TEST_BROKER``, else ``RABBIT_URL``, else
  guest on localhost; management API on its host's port 15672 unless
  ``KOMBU_EVENTS_TEST_MANAGEMENT`` names it. Unreachable, the test is skipped, or
  fails under ``CI=true``.

This module needs pytest; :mod:`kombu_events.testing.stub` does not.
"""
from __future__ import annotations

__all__ = ["StubEvents", "SentMessage", "Settled", "Pending", "LostCopy", "fails_fast", "temporary_vhost",
           "running_worker", "broker_for_tests", "events_stub", "events_broker"]

import base64
import json
import logging
import os
import time
import urllib.error
import urllib.request
import uuid
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, NoReturn
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import pytest
from celery.contrib.testing.worker import start_worker

from .. import registry
from ..broker.connections import broker_connection
from ..core.logs import safe_text, safe_url
from ..errors import BrokerUnavailableError, KombuEventsError
from ..events import Events
from ..publishing.publisher import Publisher
from .records import Pending, SentMessage, Settled, fails_fast
from .stub import LostCopy, StubEvents

logger = logging.getLogger(__name__)

DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672//"


def broker_for_tests() -> str:
    """The broker tests use: ``KOMBU_EVENTS_TEST_BROKER``, else ``RABBIT_URL``, else guest on localhost."""
    return os.environ.get("KOMBU_EVENTS_TEST_BROKER") or os.environ.get("RABBIT_URL") or DEFAULT_BROKER


@contextmanager
def temporary_vhost(broker_url: str, *, management_url: str | None = None) -> Iterator[str]:
    """Create a vhost ``kev-<uuid>`` through the management API; yield its AMQP URL; delete it, come what may.

    The URL's user gets every permission on it. Raises BrokerUnavailableError when the
    management API cannot be reached, KombuEventsError when it refuses.
    """
    parts = urlsplit(broker_url)
    user, password = unquote(parts.username or "guest"), unquote(parts.password or "guest")
    api = _Management(management_url or os.environ.get("KOMBU_EVENTS_TEST_MANAGEMENT")
                      or f"http://{parts.hostname or 'localhost'}:15672", user, password)
    name = f"kev-{uuid.uuid4().hex}"
    vhost = quote(name, safe="")
    api.call("PUT", f"vhosts/{vhost}")
    try:
        api.call("PUT", f"permissions/{vhost}/{quote(user, safe='')}", {"configure": ".*", "write": ".*", "read": ".*"})
        _until_running(api, vhost)
        logger.debug("kombu-events: created vhost %s on %s", name, api.base)
        yield urlunsplit((parts.scheme, parts.netloc, "/" + vhost, parts.query, parts.fragment))
    finally:
        api.call("DELETE", f"vhosts/{vhost}", missing_ok=True)


#: Celery settings of a worker in a test: its broker, and no AMQP heartbeat, whose timer would let
#: the worker's event loop sleep up to 10 s before it notices that the test is over.
_WORKER_CONF = ("broker_read_url", "broker_write_url", "broker_heartbeat")


@contextmanager
def running_worker(target: Any, broker_url: str, **options: Any) -> Iterator[Any]:
    """A Celery worker with the events step, on ``broker_url``, in a thread of this process, until the block ends.

    ``target`` is an ``Events`` or its Celery app; the app's services publish to
    ``broker_url`` meanwhile. Handlers run in the worker's thread (the solo pool): what
    they do is visible to the test once they ran. ``options`` go to Celery's ``start_worker``.
    """
    app = target.app if isinstance(target, Events) else target
    saved_conf = {name: app.conf.get(name) for name in _WORKER_CONF}
    saved_publishers = [(events, events.publishing._publisher) for events in registry.services_of(app)]
    app.conf.update(dict(zip(_WORKER_CONF, (broker_url, broker_url, 0))))
    for events, _previous in saved_publishers:
        events.publishing.publisher = Publisher(broker_url, app=app)
    try:
        options = {"pool": "solo", "perform_ping_check": False, **options}
        with start_worker(app, with_events_step=True, **options) as worker:
            yield worker
    finally:
        app.conf.update(saved_conf)
        for events, previous in saved_publishers:
            events.publishing.publisher.close()
            events.publishing.publisher = previous


class _Management:
    """The few calls of RabbitMQ's management HTTP API that a throw-away vhost needs."""

    def __init__(self, base: str, user: str, password: str) -> None:
        self.base = base.rstrip("/")
        self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def get(self, path: str) -> Any:
        """The JSON document at ``path`` (errors raise, as urllib's)."""
        request = urllib.request.Request(f"{self.base}/api/{path}", headers={"Authorization": self.auth})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read() or b"null")

    def call(self, method: str, path: str, body: Any = None, *, missing_ok: bool = False) -> None:
        data = None if method == "DELETE" else json.dumps(body if body is not None else {}).encode()
        request = urllib.request.Request(f"{self.base}/api/{path}", data=data, method=method,
                                         headers={"Authorization": self.auth, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10):
                return
        except urllib.error.HTTPError as exc:
            if missing_ok and exc.code == 404:
                return
            raise KombuEventsError(f"management API {method} /api/{path} at {safe_url(self.base)}: "
                                   f"{exc.code} {exc.reason}") from exc
        except OSError as exc:  # refused, timed out, no such host
            raise BrokerUnavailableError(f"cannot reach the management API at {safe_url(self.base)}: {exc}") from exc


def _until_running(api: Any, vhost: str, timeout_s: float = 10.0) -> None:
    """Wait (at most ``timeout_s``) until every node says the new vhost runs: RabbitMQ 4 starts its processes after
    answering the PUT, and a connection to it meanwhile can time out on a busy machine. Never raises."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            states = (api.get(f"vhosts/{vhost}") or {}).get("cluster_state")
        except Exception:
            return
        if not isinstance(states, dict) or all(state == "running" for state in states.values()):
            return
        time.sleep(0.05)


def _unavailable(why: str) -> NoReturn:
    """Skip the test, or fail it under ``CI=true``: there a test that needs RabbitMQ must not be skipped."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why} (CI=true: tests that need RabbitMQ must not be skipped)")
    pytest.skip(why)


@pytest.fixture
def events_stub() -> Iterator[Callable[..., StubEvents]]:
    """``events_stub(events_or_app, **options)``: a StubEvents the app publishes into until the test ends."""
    with ExitStack() as stack:
        yield lambda target, **options: stack.enter_context(StubEvents(target, **options))


@pytest.fixture
def events_broker() -> Iterator[str]:
    """The AMQP URL of a vhost of its own on the real RabbitMQ, deleted after the test."""
    base = broker_for_tests()
    with ExitStack() as stack:
        try:
            url = stack.enter_context(temporary_vhost(base))
            with broker_connection(url, connect_timeout=5) as connection:
                connection.ensure_connection(max_retries=3, interval_start=0.1)
        except BrokerUnavailableError as exc:
            _unavailable(f"RabbitMQ is not reachable: {exc}")
        except KombuEventsError:
            raise  # reachable, but it refused: a problem to see, not to skip
        except Exception as exc:  # kombu's and py-amqp's connection errors
            _unavailable(f"RabbitMQ is not reachable at {safe_url(base)}: {safe_text(str(exc))}")
        yield url
