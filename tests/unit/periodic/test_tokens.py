"""periodic/tokens.py and Events.periodic without a broker: registration, the token handler's steps, seeds, the peek."""
from __future__ import annotations

import json
import logging
import threading
from datetime import timedelta
from types import SimpleNamespace

import celery
import pytest

from kombu_events import Event, Events, signals
from kombu_events.core.schedule import State, Token
from kombu_events.errors import ConfigurationError, PublishError
from kombu_events.periodic.tokens import Seeder, peek_state


@pytest.fixture
def events(monkeypatch):
    monkeypatch.delenv("RABBIT_URL", raising=False)
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    return Events(app, "billing", delay_levels=4, delay_unit_ms=100, publish_delay_levels=0)


class FakeStore:
    """The schedules' store, in memory: one state, and every publish and write in order."""

    def __init__(self, state: State | None = None, fail_publish: bool = False) -> None:
        self.state = state
        self.log: list[tuple] = []
        self.fail_publish = fail_publish

    def peek(self, queue):
        return self.state

    def write(self, queue, state):
        self.state = state
        self.log.append(("write", queue, state.last_run, state.next))

    def send(self, exchange, routing_key, message):
        if self.fail_publish:
            raise PublishError("nacked")
        body = json.loads(message.body)
        self.log.append(("publish", exchange, routing_key, body["period"]))

    def send_many(self, items):
        for item in items:
            self.send(*item)
        return [None] * len(items)


def token_event(period, schedule) -> Event:
    payload = Token(schedule.name, period, schedule.signature).as_dict()
    return Event(payload, "schedule.tick", schedule.queue, 1, {}, {}, json.dumps(payload).encode())


def register(events, fn=None, **options):
    options.setdefault("every", 1)
    calls = []
    events.periodic("tick", **options)(fn or calls.append)
    [schedule] = events.schedules
    token_handler = next(h for h in events.handlers if h.queue == schedule.queue).fn
    return schedule, token_handler, calls


def test_a_schedule_is_a_handler_of_its_token_queue_one_at_a_time_in_the_fleet(events):
    @events.handler("orders.#")
    def audit(payload):
        pass

    def tick(event):
        pass

    assert events.periodic("tick", every=timedelta(minutes=5))(tick) is tick
    [schedule] = events.schedules
    handler = events.handlers[-1]
    assert (handler.queue, handler.binding_keys, handler.bind) == ("billing.schedule.tick", (), True)
    assert (handler.prefetch, handler.single_active_consumer, handler.expires_ms) == (1, True, 7 * 86_400_000)
    assert handler.max_retries == 10_000, "a token that fails for want of the broker is retried, never archived"
    assert schedule.every_ms == 300_000 and schedule.state_queue == "billing.schedule.tick.state"
    assert any(isinstance(m, Seeder) for m in events.hooks.middleware), "seeded when the step starts"
    roles = {q.name: events.topology().role(q.name) for q in events.topology().queues}
    assert roles["billing.schedule.tick"] == "schedule" and roles["billing.schedule.tick.state"] == "state"


def test_schedules_are_validated_and_unique(events):
    events.periodic("tick", every=1)(print)
    with pytest.raises(ConfigurationError, match="registered twice"):
        events.periodic("tick", every=2)
    with pytest.raises(ConfigurationError, match="every of schedule 'x' must be at least 1 ms"):
        events.periodic("x", every=0)
    with pytest.raises(ConfigurationError, match="catch_up of schedule 'x' must be one of 'latest', 'all'"):
        events.periodic("x", every=1, catch_up="none")
    with pytest.raises(ConfigurationError, match=r"may not end with '\.state'"):
        events.periodic("x.state", every=1)
    with pytest.raises(ConfigurationError, match="wildcard"):
        events.periodic("x.*", every=1)


def test_a_period_shorter_than_the_ladder_s_unit_is_refused(events):
    events.periodic("fast", every=0.05)(print)
    with pytest.raises(ConfigurationError, match=r"shorter than the ladder's unit \(delay_unit_ms=100\)"):
        events.handlers  # resolving validates


def test_a_handler_queue_may_not_take_a_schedule_s_name(events):
    events.handler("a.#", queue="billing.schedule.tick")(print)
    with pytest.raises(ConfigurationError, match="collides with the service's own entities"):
        events.handlers  # resolving validates


def test_a_run_writes_the_state_publishes_the_next_token_then_records_it(events, monkeypatch):
    schedule, token_handler, calls = register(events)
    store = events._schedules._store = FakeStore(State(4, 4000, 5, schedule.signature))
    monkeypatch.setattr("kombu_events.periodic.tokens.now_ms", lambda: 5_050)
    token_handler(token_event(5, schedule))
    [event] = calls
    assert event.payload == {"schedule": "tick", "period": 5, "due": "1970-01-01T00:00:05.000+00:00",
                             "missed": [], "missed_count": 0}
    assert store.log == [("write", schedule.state_queue, 5, 5),
                         ("publish", "billing.delay.3", "1.0.1.0.billing.schedule.tick", 6),  # 950 ms: 10 units
                         ("write", schedule.state_queue, 5, 6)]
    assert store.state.info["outcome"] == "ok"


def test_a_failing_function_is_reported_and_the_schedule_goes_on(events, monkeypatch):
    def boom(event):
        raise RuntimeError("no report today")

    schedule, token_handler, _ = register(events, boom)
    store = events._schedules._store = FakeStore(State(4, 4000, 5, schedule.signature))
    monkeypatch.setattr("kombu_events.periodic.tokens.now_ms", lambda: 5_000)
    seen = []

    def receiver(sender, event, exception, **kwargs):
        seen.append((sender, event.payload["period"], str(exception)))

    signals.handler_failed.connect(receiver)
    try:
        token_handler(token_event(5, schedule))
    finally:
        signals.handler_failed.disconnect(receiver)
    assert seen == [(boom, 5, "no report today")]
    assert store.state.last_run == 5 and store.state.next == 6
    assert store.state.info["outcome"] == "failed: RuntimeError: no report today"


def test_a_token_that_is_not_due_goes_round_again_and_a_stale_one_is_only_acked(events, monkeypatch):
    schedule, token_handler, calls = register(events)
    store = events._schedules._store = FakeStore(State(4, 4000, 5, schedule.signature))
    monkeypatch.setattr("kombu_events.periodic.tokens.now_ms", lambda: 4_800)
    token_handler(token_event(5, schedule))
    assert store.log == [("publish", "billing.delay.1", "0.0.1.0.billing.schedule.tick", 5)] and calls == []
    store.log.clear()
    token_handler(token_event(3, schedule))
    assert store.log == [] and calls == []


def test_a_token_beyond_the_ladder_s_reach_hops(events, monkeypatch):
    schedule, token_handler, calls = register(events, every=3600)  # the ladder holds 15 units of 100 ms
    store = events._schedules._store = FakeStore(State(0, 0, 1, schedule.signature))
    monkeypatch.setattr("kombu_events.periodic.tokens.now_ms", lambda: 10)
    token_handler(token_event(1, schedule))
    assert store.log == [("publish", "billing.delay.3", "1.1.1.1.billing.schedule.tick", 1)] and calls == []


def test_a_new_schedule_records_its_beginning_before_it_runs(events, monkeypatch):
    schedule, token_handler, calls = register(events)
    store = events._schedules._store = FakeStore()
    monkeypatch.setattr("kombu_events.periodic.tokens.now_ms", lambda: 7_000)
    token_handler(token_event(None, schedule))
    assert store.log[0] == ("write", schedule.state_queue, None, 7)
    assert [e.payload["period"] for e in calls] == [7]


def test_a_failed_publish_raises_so_the_token_is_retried_not_acked(events, monkeypatch):
    schedule, token_handler, _ = register(events)
    events._schedules._store = FakeStore(State(4, 4000, 5, schedule.signature), fail_publish=True)
    monkeypatch.setattr("kombu_events.periodic.tokens.now_ms", lambda: 5_000)
    with pytest.raises(PublishError):
        token_handler(token_event(5, schedule))


def test_seeds_go_to_each_schedule_s_token_queue_without_delay(events):
    events.periodic("a", every=1)(print)
    events.periodic("b", every=2)(print)
    store = events._schedules._store = FakeStore()
    assert Seeder(events._schedules).seed() is True
    assert store.log == [("publish", "billing.delivery", "0.0.0.0.billing.schedule.a", None),
                         ("publish", "billing.delivery", "0.0.0.0.billing.schedule.b", None)]


def test_seeding_tries_again_then_gives_up(events):
    events.periodic("a", every=1)(print)
    events._schedules._store = FakeStore(fail_publish=True)
    assert Seeder(events._schedules).seed(attempts=2, pause_s=0) is False


class BrokenStore(FakeStore):
    def send_many(self, items):
        raise RuntimeError("the store broke")


def _seed_in_the_worker(events) -> None:
    """What the step does: ``started`` seeds from a thread of its own; wait for that thread."""
    before = set(threading.enumerate())
    Seeder(events._schedules).started(SimpleNamespace(service="billing"))
    for thread in set(threading.enumerate()) - before:
        thread.join(5)


@pytest.mark.parametrize("store, logged", [
    (BrokenStore(), "seeding the schedules of billing failed"),
    (FakeStore(fail_publish=True), "gave up seeding the schedules of billing"),
])
def test_the_seeding_thread_logs_what_went_wrong_with_its_service(events, store, logged, monkeypatch, caplog):
    events.periodic("a", every=1)(print)
    events._schedules._store = store
    monkeypatch.setattr(Seeder.seed, "__kwdefaults__", {"attempts": 1, "pause_s": 0})  # the thread's seed()
    with caplog.at_level(logging.WARNING, logger="kombu_events.periodic.tokens"):
        _seed_in_the_worker(events)
    assert logged in caplog.text
    assert [r for r in caplog.records if r.levelno == logging.ERROR]


class FakeChannel:
    def __init__(self, bodies):
        self.ready = [SimpleNamespace(body=b, delivery_tag=i) for i, b in enumerate(bodies, 1)]
        self.acked, self.requeued = [], []

    def basic_get(self, queue, no_ack):
        return self.ready.pop(0) if self.ready else None

    def basic_ack(self, tag):
        self.acked.append(tag)

    def basic_reject(self, tag, requeue):
        assert requeue
        self.requeued.append(tag)


def test_the_peek_leaves_the_newest_state_and_cleans_older_ones_only_when_asked():
    sig = {"every_ms": 1, "origin_ms": 0}
    older = json.dumps(State(4, 4, 5, sig).as_dict())
    newer = json.dumps(State(5, 5, 6, sig).as_dict())
    channel = FakeChannel([newer, older])
    assert peek_state(channel, "q") == State(5, 5, 6, sig)
    assert channel.requeued == [2, 1] and channel.acked == []
    channel = FakeChannel([older, newer, "not json"])
    assert peek_state(channel, "q", clean=True) == State(5, 5, 6, sig)
    assert channel.requeued == [2] and sorted(channel.acked) == [1, 3]
    assert peek_state(FakeChannel([]), "q") is None
