"""Fixtures of the CLI's tests."""
from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _own_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group callback puts "." on sys.path (as `celery -A` does): not into the test process's."""
    monkeypatch.setattr(sys, "path", list(sys.path))
