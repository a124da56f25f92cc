"""Unit-test fixtures: no sockets, and process-wide registries restored after each test."""
from __future__ import annotations

import socket

import pytest

from kombu_events import events, runner


def _no_socket(*args, **kwargs):
    raise AssertionError("unit tests must not open a network connection")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any test that tries to connect anywhere (a unit test that needs a broker is not one)."""
    monkeypatch.setattr(socket.socket, "connect", _no_socket)
    monkeypatch.setattr(socket.socket, "connect_ex", _no_socket)
    monkeypatch.setattr(socket, "create_connection", _no_socket)


@pytest.fixture(autouse=True)
def _isolated_registries():
    """Each test starts with no registered Events and an empty runner registry."""
    saved_events, saved_runner = list(events.registered), dict(runner._registry)
    events.registered.clear()
    runner._registry.clear()
    yield
    events.registered[:] = saved_events
    runner._registry.clear()
    runner._registry.update(saved_runner)
