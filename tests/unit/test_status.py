"""status.py's pure part: which handler queues show as paused."""
from __future__ import annotations

import pytest

from kombu_events.ops.status import CONSUMING, PAUSED, QueueStatus, queue_state


@pytest.mark.parametrize("role, consumers, state", [
    ("handler", 0, PAUSED), ("handler", 1, CONSUMING), ("handler", 3, CONSUMING), ("handler", None, None),
    ("delay", 0, None), ("archive", 0, None), ("unrouted", 0, None),
])
def test_a_handler_queue_with_no_consumer_is_paused_and_other_queues_have_no_state(role, consumers, state):
    assert queue_state(role, consumers) == state


def test_the_state_is_in_the_json_form():
    row = QueueStatus("billing.charge", "handler", 4, 0, 0, state=PAUSED)
    assert row.as_dict()["state"] == "paused"
