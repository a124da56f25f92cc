"""Shared pytest configuration: integration tests need the real broker and fail loudly in CI; Hypothesis
draws the same examples on every CI run."""
from __future__ import annotations

import os

import pytest
from hypothesis import settings as hypothesis_settings

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# Locally, Hypothesis's default profile: new examples every run, and a failure found once is replayed
# from .hypothesis/ until fixed. Under CI=true, the examples depend on the test alone, so a red build
# is the code's doing and reproduces; an edge case found locally is pinned with @example. No deadline
# there: a shared runner's pauses are not the code's doing either. HYPOTHESIS_PROFILE picks another.
hypothesis_settings.register_profile("ci", derandomize=True, database=None, deadline=None)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if CI else "default"))

#: The test kit's fixtures (events_stub, events_broker), opted into as a user would.
pytest_plugins = ["kombu_events.testing"]

from .brokers import BROKER_URL  # noqa: E402 (the one place that says which broker)


def broker_reachable(url: str = BROKER_URL) -> str | None:
    """None if the broker answers, else why not."""
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1)
        return None
    except Exception as exc:  # any failure to connect means: not reachable
        return str(exc)


@pytest.fixture(scope="session")
def broker_url() -> str:
    """URL of the real RabbitMQ; skips locally without it, fails under CI=true."""
    why = broker_reachable()
    if why is not None:
        message = f"RabbitMQ is not reachable at {BROKER_URL}: {why}"
        if CI:
            pytest.fail(message + " (CI=true: integration tests must not be skipped)")
        pytest.skip(message)
    return BROKER_URL

#: tests/typing is type-checked by mypy (tox -e type), never run.
collect_ignore = ["typing"]
