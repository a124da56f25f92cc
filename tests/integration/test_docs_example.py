"""The example project of docs/testing.md passes, as a user runs it: against the stub and against RabbitMQ."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_the_example_of_the_testing_page_passes(broker_url):
    # CI=true: the RabbitMQ test of the example must run, not be skipped.
    env = {**os.environ, "CI": "true", "KOMBU_EVENTS_TEST_BROKER": broker_url}
    env.pop("RABBIT_URL", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA"],
                            cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "6 passed" in result.stdout and "skipped" not in result.stdout, result.stdout
