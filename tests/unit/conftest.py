"""Unit-test fixtures: no sockets, and process-wide registries restored after each test; a Celery app."""
from __future__ import annotations

import socket

import celery
import pytest

from kombu_events import registry


def _no_socket(*args, **kwargs):
    raise AssertionError("unit tests must not open a network connection")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any test that tries to connect anywhere (a unit test that needs a broker is not one)."""
    monkeypatch.setattr(socket.socket, "connect", _no_socket)
    monkeypatch.setattr(socket.socket, "connect_ex", _no_socket)
    monkeypatch.setattr(socket, "create_connection", _no_socket)


@pytest.fixture(autouse=True)
def _isolated_registry():
    """Each test starts with no registered Events and no resolved routes."""
    saved_services, saved_routes = list(registry.services), dict(registry._routes)
    registry.reset()
    yield
    registry.reset()
    registry.services.extend(saved_services)
    registry._routes.update(saved_routes)


@pytest.fixture
def app() -> celery.Celery:
    """A Celery app on the in-memory transport, not the current app (a test file may define its own ``app``)."""
    # Constructing a Celery app opens no connection (the autouse fixture would fail the test if it did).
    return celery.Celery("proj", broker="memory://", set_as_current=False)
