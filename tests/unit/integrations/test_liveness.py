"""integrations/liveness.py: the heartbeat timer on the event loop, and the pure answer /healthz gives (liveness_of)."""
from __future__ import annotations

import pytest

from kombu_events.integrations.liveness import Liveness, liveness_of


@pytest.mark.parametrize(("last_beat", "now", "alive", "why"), [
    (None, 5.0, False, "starting: the event loop has not turned yet"),
    (100.0, 100.0, True, "ok: the event loop turned 0.0 s ago"),
    (100.0, 110.0, True, "ok: the event loop turned 10.0 s ago"),
    (100.0, 110.5, False, "stalled: the event loop last turned 10.5 s ago (more than 10 s)"),
])
def test_liveness_of(last_beat, now, alive, why):
    assert liveness_of(last_beat, now, max_age_s=10) == (alive, why)


class Control:
    def __init__(self) -> None:
        self.timers: list = []

    def call_every(self, seconds, fn):
        self.timers.append((seconds, fn))


def test_started_beats_at_once_and_sets_a_timer_that_keeps_beating():
    now = [50.0]
    liveness = Liveness(max_age_s=2, interval_s=0.5, clock=lambda: now[0])
    assert liveness.check()[0] is False
    control = Control()
    liveness.started(control)
    [(seconds, beat)] = control.timers
    assert seconds == 0.5 and liveness.check() == (True, "ok: the event loop turned 0.0 s ago")
    now[0] = 53.0
    assert liveness.check()[0] is False, "the loop did not turn for 3 s"
    beat()
    assert liveness.check()[0] is True
