"""docs/tutorial.md shows what a run of it prints: docs/_tools/tutorial_run.py --check runs the page as a
reader does (its shell blocks, a worker in the background, the fix applied, the restart), in a vhost of its
own on the real RabbitMQ, and exits 1 with a diff when an output block shows something else."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

#: The broker the page's run was made on.
DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672//"
TOOL = Path(__file__).resolve().parents[2] / "docs" / "_tools" / "tutorial_run.py"
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
UNREACHABLE = 3  # the tool's exit status when RabbitMQ or its management API cannot be reached
TIMEOUT_S = 180  # a run takes about 15 s


def test_the_tutorial_shows_what_a_run_of_it_prints(broker_url):
    if broker_url != DEFAULT_BROKER_URL:
        pytest.skip("docs/tutorial.md shows a run on the reader's broker, the host's RabbitMQ 3.10 on 5672 "
                    "(its status prints the broker's version and URL)")
    tool = subprocess.Popen([sys.executable, str(TOOL), "--check", "--broker", broker_url],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = tool.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        tool.send_signal(signal.SIGTERM)  # the tool then stops its worker and deletes its vhost
        output, _ = tool.communicate(timeout=60)
        pytest.fail(f"tutorial_run.py --check did not finish within {TIMEOUT_S} s:\n{output}")
    if tool.returncode == UNREACHABLE and not CI:
        pytest.skip(output.strip().splitlines()[-1])
    assert tool.returncode == 0, output
