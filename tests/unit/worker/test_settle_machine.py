"""The consumer's settle path as a state machine: confirms in any order, middleware that re-enters.

A ``ServiceConsumer`` runs on a fake connection that plays the broker and py-amqp:
frames (deliveries, confirms, returns) wait in an inbox until the event loop reads
them, and every synchronous channel method (``basic_cancel``, ``basic_consume``,
``basic_qos``, ``queue_declare``, ``basic_publish``) reads all of them first, as py-amqp
does while it waits for its reply. So a ``settled`` hook that pauses or resumes a
queue, or calls the broker on the worker's connection, may have another confirm or
delivery arrive inside it. A fake pool finishes handlers in any order with ok, retry
or archive; the broker confirms the copies in any order, singly or ``multiple``.

The contract checked, whatever the consumer's internals:
- no exception escapes into py-amqp's frame dispatch, the pool's callbacks or the hub;
- no error is logged but the hooks' own (a bug swallowed and logged is still a bug);
- a message is acked at most once, and only after the broker confirmed its copy
  (retry or archive); it is announced (``settled``) once at most, after its ack;
- a pause or resume reaches the consuming channel from the event loop only (the hub's
  reader, or Celery's ``call_soon`` without a hub), never inside a callback: a frame
  py-amqp dispatches, a pool result, a middleware hook;
- once the loop has turned with nothing left to do, every message the consumer got
  is settled exactly once, and a queue has a consumer iff it is not paused.
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import select
import traceback
from typing import Any

import celery
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kombu.transport.base import StdChannel

from kombu_events import Events, Middleware, registry
from kombu_events.core.decision import ARCHIVE, FAILED, OK, Outcome
from kombu_events.worker.consumer import ServiceConsumer

OUTCOMES = {"ok": Outcome(OK), "retry": Outcome(FAILED, "boom", "builtins.ValueError: boom"),
            "archive": Outcome(ARCHIVE, "poison")}
#: What may follow each outcome, as the ``settled`` hook sees it (a refused copy is archived, then held).
SETTLED_AS = {"ok": {"ack"}, "retry": {"retry", "archive", "held"}, "archive": {"archive", "held"}}
#: Things a middleware does on the event loop; queues by index into the service's two.
LOOP_ACTIONS = st.one_of(
    st.tuples(st.just("pause"), st.integers(0, 1)),
    st.tuples(st.just("resume"), st.integers(0, 1), st.sampled_from([None, 1])),
    st.tuples(st.just("broker call")),  # e.g. a passive queue_declare on the worker's connection: it reads frames
)
#: What a message's ``settled`` hook does: half of them nothing; a broker call, the one that re-enters, often.
HOOK_ACTIONS = st.one_of(st.just([]), st.lists(st.one_of(LOOP_ACTIONS, st.just(("broker call",)), st.just(("raise",))),
                                               min_size=1, max_size=2))

_app: Any = None


class HookError(Exception):
    """What a middleware hook raises on purpose."""


# -- the broker, py-amqp, the pool and the hub, faked -----------------------------------------------


class World:
    """The broker and the wire: what was sent, what waits to be read, and which callback is running."""

    def __init__(self) -> None:
        self.inbox: collections.deque[tuple[str, tuple]] = collections.deque()
        self.inside: list[str] = []  # the callbacks running now, outermost first
        self.escaped: list[str] = []
        self.consumers: dict[str, tuple[str, Any]] = {}  # consumer tag -> (queue, callback)
        self.publishes: dict[int, tuple[str, str, str]] = {}  # seq -> (exchange, routing key, message id)
        self.unconfirmed: list[int] = []
        self.fate: dict[int, str] = {}  # seq -> ack / nack / return, decided when the broker sends it
        self.seen: set[int] = set()  # seqs whose ack or nack the client has read
        self.confirm_channel: FakeChannel | None = None
        self.tags = itertools.count(1)

    def call(self, where: str, fn: Any, *args: Any) -> None:
        """Run a callback of the consumer's as py-amqp or the pool would; record what escapes it."""
        self.inside.append(where)
        try:
            fn(*args)
        except BaseException:
            self.escaped.append(f"{where}:\n{traceback.format_exc()}")
            raise
        finally:
            self.inside.pop()

    def on_loop(self, where: str, fn: Any, *args: Any) -> None:
        """Run ``fn`` as the event loop itself would (not a callback inside it: effects belong here)."""
        try:
            fn(*args)
        except BaseException:
            self.escaped.append(f"{where}:\n{traceback.format_exc()}")
            raise

    def read(self, limit: int | None = None) -> int:
        """Dispatch up to ``limit`` waiting frames, as py-amqp's drain_events does; return how many."""
        count = 0
        while self.inbox and (limit is None or count < limit):
            kind, args = self.inbox.popleft()
            count += 1
            getattr(self, f"_on_{kind}")(*args)
        return count

    def _on_deliver(self, queue: str, raw: RawMessage) -> None:
        for tag, (consumed, callback) in list(self.consumers.items()):
            if consumed == queue:
                raw.delivery_info["consumer_tag"] = tag
                raw.received = True
                self.call(f"py-amqp delivering {raw.properties['message_id']}", callback, raw)
                return
        # No consumer by now: the broker keeps it for a later one (this machine forgets it).

    def _on_confirm(self, method: str, tag: int, multiple: bool, seqs: list[int]) -> None:
        self.seen.update(seqs)
        assert self.confirm_channel is not None
        for callback in list(self.confirm_channel.events[method]):
            self.call(f"py-amqp dispatching {method}({tag}, multiple={multiple})", callback, tag, multiple)

    def _on_return(self, exchange: str, routing_key: str, message_id: str) -> None:
        assert self.confirm_channel is not None
        returned = RawMessage(b"", {"message_id": message_id})
        for callback in list(self.confirm_channel.events["basic_return"]):
            self.call(f"py-amqp dispatching basic_return of {message_id}", callback,
                      Exception("312 NO_ROUTE"), exchange, routing_key, returned)


class RawMessage:
    """What py-amqp hands to a consumer callback."""

    def __init__(self, body: bytes, properties: dict[str, Any], delivery_info: dict[str, Any] | None = None) -> None:
        self.body, self.properties, self.delivery_info = body, properties, delivery_info or {}
        self.received = False


class FakeMessage:
    """kombu's message, as far as the consumer uses it: the machine sees its ack."""

    def __init__(self, raw: RawMessage, machine: SettleMachine) -> None:
        self.body, self.properties, self.delivery_info = raw.body, raw.properties, raw.delivery_info
        self.errors: list[Any] = []
        self.accept: Any = None
        self._machine = machine

    def ack(self) -> None:
        self._machine.acked(self.properties["message_id"])


class FakeChannel(StdChannel):
    """A channel of kombu's py-amqp transport: a synchronous method reads every waiting frame first."""

    channel_id = 1
    is_open = True

    def __init__(self, machine: SettleMachine, connection: FakeConnection) -> None:
        self.machine, self.world, self.connection = machine, machine.world, connection
        self.events: dict[str, set[Any]] = collections.defaultdict(set)
        self.auto_decode = True
        self.message_to_python: Any = None
        self.seq = 0
        self.my_tags: set[str] = set()

    def Message(self, raw: RawMessage, channel: Any = None) -> FakeMessage:  # kombu's name for it
        return FakeMessage(raw, self.machine)

    def _wait(self) -> None:
        self.world.read()

    def _consuming_effect(self, what: str) -> None:
        """A change to what the consumer consumes: it drains frames, so not from inside a callback."""
        if self.world.inside:
            self.machine.violations.append(f"{what} ran inside {self.world.inside[-1]}")
        self._wait()

    def exchange_declare(self, *args: Any, **kwargs: Any) -> None:
        self._wait()

    def queue_declare(self, queue: str = "", *args: Any, **kwargs: Any) -> tuple[str, int, int]:
        self._wait()
        return queue, 0, 0

    def queue_bind(self, *args: Any, **kwargs: Any) -> None:
        self._wait()

    def exchange_bind(self, *args: Any, **kwargs: Any) -> None:
        self._wait()

    def basic_qos(self, *args: Any, **kwargs: Any) -> None:
        self._consuming_effect("basic_qos")

    def basic_consume(self, queue: str = "", consumer_tag: str = "", no_ack: bool = False, callback: Any = None,
                      nowait: bool = False, **kwargs: Any) -> str:
        if not nowait:
            self._consuming_effect(f"basic_consume({queue})")
        tag = consumer_tag or f"ctag{next(self.world.tags)}"
        assert tag not in self.world.consumers, f"consumer tag {tag} in use"
        self.world.consumers[tag] = (queue, callback)
        self.my_tags.add(tag)
        return tag

    def basic_cancel(self, consumer_tag: str, nowait: bool = False) -> None:
        if not nowait:
            self._consuming_effect(f"basic_cancel({self.world.consumers.get(consumer_tag, ('?',))[0]})")
        self.world.consumers.pop(consumer_tag, None)  # deliveries read before CancelOk still reached it
        self.my_tags.discard(consumer_tag)

    def confirm_select(self) -> None:
        self.world.confirm_channel = self

    def send_method(self, method: Any, signature: str, args: tuple, content: Any = None, **kwargs: Any) -> None:
        _ticket, exchange, routing_key, _mandatory, _immediate = args
        self.seq += 1
        self.world.publishes[self.seq] = (exchange, routing_key, content.properties.get("message_id"))
        self.world.unconfirmed.append(self.seq)

    def basic_publish(self, *args: Any, **kwargs: Any) -> None:
        self._wait()  # py-amqp reads what is waiting before it publishes

    def close(self) -> None:
        for tag in list(self.my_tags):
            self.world.consumers.pop(tag, None)
        self.my_tags.clear()


class FakeConnection:
    """The worker's broker connection."""

    userid = "guest"
    frame_max = 131072

    def __init__(self, machine: SettleMachine) -> None:
        self.machine = machine

    def channel(self) -> FakeChannel:
        return FakeChannel(self.machine, self)

    def drain_events(self, timeout: float | None = None) -> None:
        if not self.machine.world.read():
            raise ConnectionError("nothing more will arrive")  # ends the consumer's wait for confirms


class FakePool:
    """A pool whose handlers finish when the machine says so, with the outcome their message was given."""

    def __init__(self, machine: SettleMachine) -> None:
        self.machine = machine
        self.jobs: list[tuple[str, Any]] = []

    def apply_async(self, fn: Any, args: tuple, callback: Any, error_callback: Any) -> None:
        _queue, body = args[0], args[1]
        self.jobs.append((body.decode(), callback))

    def finish(self, index: int) -> None:
        message_id, callback = self.jobs.pop(index)
        self.machine.world.call(f"the pool's callback for {message_id}", callback,
                                OUTCOMES[self.machine.outcome_of[message_id]])


class SyncLoop:
    """Celery's loop without a hub (gevent, eventlet): what ``consumer.call_soon`` got runs between two reads."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.pending: list[Any] = []

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.pending.append(functools.partial(fn, *args))

    def turn(self) -> bool:
        """Celery's perform_pending_operations; whether anything ran."""
        ran = bool(self.pending)
        while self.pending:
            self.world.on_loop("Celery's pending operations", self.pending.pop(0))
        return ran


class FakeHub(SyncLoop):
    """Celery's hub as far as a consumer and its Control use it; its readers run when the loop turns."""

    def __init__(self, world: World) -> None:
        super().__init__(world)
        self.readers: dict[int, tuple[Any, tuple]] = {}

    def add_reader(self, fd: int, callback: Any, *args: Any) -> None:
        self.readers[fd] = (callback, args)

    def remove(self, fd: int) -> None:
        self.readers.pop(fd, None)

    remove_reader = remove

    def call_later(self, seconds: float, callback: Any, *args: Any) -> Timer:
        return Timer()  # timers do not fire here: the machine's rules play them

    call_repeatedly = call_later

    def turn(self) -> bool:
        """One turn: call_soon callbacks, then the readers whose pipe is readable; whether any ran."""
        ran = super().turn()
        readable = select.select(list(self.readers), [], [], 0)[0] if self.readers else []
        for fd in readable:
            if fd in self.readers:
                callback, args = self.readers[fd]
                self.world.on_loop(f"the hub's reader {callback!r}", callback, *args)
                ran = True
        return ran


class Timer:
    def cancel(self) -> None:
        pass


class Scripted(Middleware):
    """A middleware whose ``settled`` hook does what its message was given to do."""

    def __init__(self, machine: SettleMachine) -> None:
        self.machine = machine

    def settled(self, delivery: Any, outcome: Any, step: Any) -> None:
        self.machine.announced(delivery.message_id, step)
        self.machine.world.inside.append(f"the settled hook of {delivery.message_id}")
        try:
            for action in self.machine.hook_actions[delivery.message_id]:
                self.machine.act(action)
        finally:
            self.machine.world.inside.pop()


class Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# -- the machine -----------------------------------------------------------------------------------


class SettleMachine(RuleBasedStateMachine):
    """One service of two handler queues on a fake worker connection, with or without an event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.started = False
        self.loop: SyncLoop | None = None
        self.outcome_of: dict[str, str] = {}
        self.hook_actions: dict[str, list[tuple]] = {}
        self.sent: dict[str, RawMessage] = {}
        self.acks: collections.Counter[str] = collections.Counter()
        self.announcements: dict[str, list[str]] = collections.defaultdict(list)
        self.violations: list[str] = []  # found inside callbacks, where an assert could be swallowed
        self.messages = itertools.count(1)
        self.errors = Errors()
        logging.getLogger("kombu_events").addHandler(self.errors)

    @initialize(with_hub=st.booleans())
    def start(self, with_hub: bool) -> None:
        global _app
        if _app is None:
            _app = celery.Celery("settle-machine", broker="memory://", set_as_current=False)
        # A small topology: it is declared (on the fake) once per example.
        self.events = Events(_app, "svc", max_retries=3, delay_levels=2, publish_delay_levels=0,
                             middleware=[Scripted(self)])
        for name in ("a", "b"):
            self.events.handler(f"orders.{name}", name=name)(lambda payload: None)
        self.consumer = ServiceConsumer(self.events)
        self.control = self.consumer.control
        self.queues = self.control.queues
        self.pool = FakePool(self)
        self.started = True
        if with_hub:
            self.loop = hub = FakeHub(self.world)
            self.consumer.start(FakeConnection(self), self.pool, hub)
            self.consumer.consume()  # the bootstep's register_with_event_loop
        else:
            self.loop = SyncLoop(self.world)
            self.consumer.start(FakeConnection(self), self.pool, None, call_soon=self.loop.call_soon)

    def teardown(self) -> None:
        try:
            if self.started:
                self.settle_everything()
        finally:
            logging.getLogger("kombu_events").removeHandler(self.errors)
            if self.started:
                self.consumer.shutdown()  # closes the wake-up pipe, if any
                registry.services.remove(self.events)

    # -- what the consumer does to the fakes, checked as it happens ----------------------------------

    def acked(self, message_id: str) -> None:
        self.acks[message_id] += 1
        if self.acks[message_id] > 1:
            self.violations.append(f"{message_id} acked {self.acks[message_id]} times")
        if self.outcome_of[message_id] != "ok" and not self.copy_confirmed(message_id):
            self.violations.append(f"{message_id} ({self.outcome_of[message_id]}) acked before its copy was confirmed")

    def announced(self, message_id: str, step: Any) -> None:
        settled = self.announcements[message_id]
        settled.append(step.action)
        if len(settled) > 1:
            self.violations.append(f"{message_id} settled twice: {settled}")
        if step.action not in SETTLED_AS[self.outcome_of[message_id]]:
            self.violations.append(f"{message_id} ({self.outcome_of[message_id]}) settled as {step.action}")
        if (step.action != "held") != bool(self.acks[message_id]):
            self.violations.append(f"{message_id} settled as {step.action} with {self.acks[message_id]} ack(s)")

    def copy_confirmed(self, message_id: str) -> bool:
        return any(mid == message_id and seq in self.world.seen and self.world.fate[seq] == "ack"
                   for seq, (_exchange, _routing_key, mid) in self.world.publishes.items())

    def act(self, action: tuple) -> None:
        kind, *args = action
        if kind == "raise":
            raise HookError("a middleware hook failed")
        if kind == "broker call":
            self.control.connection.channel().queue_declare(self.queues[0], passive=True)
        elif kind == "pause":
            self.control.pause(self.queues[args[0]], "a middleware")
        else:
            self.control.resume(self.queues[args[0]], prefetch=args[1])

    # -- rules: the broker --------------------------------------------------------------------------

    @rule(data=st.data(), messages=st.lists(st.tuples(st.sampled_from(sorted(OUTCOMES)), HOOK_ACTIONS),
                                            min_size=1, max_size=3))
    def broker_delivers(self, data: st.DataObject, messages: list[tuple[str, list[tuple]]]) -> None:
        """Send messages to consumers: each with how its handler ends and what its ``settled`` hook does."""
        consumed = sorted({queue for queue, _callback in self.world.consumers.values()})
        for outcome, actions in messages if consumed else ():
            queue = data.draw(st.sampled_from(consumed))
            message_id = f"m{next(self.messages)}"
            self.outcome_of[message_id], self.hook_actions[message_id] = outcome, actions
            raw = RawMessage(message_id.encode(), {"message_id": message_id, "content_type": "application/json"},
                             {"routing_key": f"orders.{queue[-1]}", "redelivered": False,
                              "delivery_tag": next(self.world.tags)})
            self.world.inbox.append(("deliver", (queue, raw)))
            self.sent[message_id] = raw

    @precondition(lambda self: self.world.unconfirmed)
    @rule(data=st.data(), confirms=st.lists(st.tuples(st.sampled_from(["ack", "ack", "nack", "return"]),
                                                      st.sampled_from([True, True, False])), min_size=1, max_size=3))
    def broker_confirms(self, data: st.DataObject, confirms: list[tuple[str, bool]]) -> None:
        """Confirm copies in any order: each (fate, multiple) settles one, or every one up to it."""
        for fate, multiple in confirms:
            if not self.world.unconfirmed:
                return
            tag = data.draw(st.sampled_from(self.world.unconfirmed))
            seqs = [seq for seq in self.world.unconfirmed if (seq <= tag if multiple else seq == tag)]
            for seq in seqs:
                self.world.unconfirmed.remove(seq)
                self.world.fate[seq] = "nack" if fate == "nack" else "ack"
            if fate == "return":  # the broker returns a message before it acks it
                self.world.fate[tag] = fate
                self.world.inbox.append(("return", self.world.publishes[tag]))
            method = "basic_nack" if fate == "nack" else "basic_ack"
            self.world.inbox.append(("confirm", (method, tag, multiple, seqs)))

    @precondition(lambda self: self.world.unconfirmed)
    @rule(group=st.integers(1, 3))
    def broker_acks_everything(self, group: int) -> None:
        """Ack every copy sent, ``group`` at a time (``multiple``): a burst of confirms waiting to be read."""
        unconfirmed, self.world.unconfirmed = self.world.unconfirmed, []
        for start in range(0, len(unconfirmed), group):
            seqs = unconfirmed[start:start + group]
            self.world.fate.update(dict.fromkeys(seqs, "ack"))
            self.world.inbox.append(("confirm", ("basic_ack", seqs[-1], True, seqs)))

    @rule(limit=st.sampled_from([1, 2, None]))
    def loop_reads(self, limit: int | None) -> None:
        self.world.read(limit)

    # -- rules: the pool, the loop, a middleware's timer ---------------------------------------------

    @precondition(lambda self: self.pool.jobs)
    @rule(data=st.data(), count=st.integers(1, 3))
    def handlers_finish(self, data: st.DataObject, count: int) -> None:
        """Up to ``count`` handlers finish, in any order."""
        for _ in range(min(count, len(self.pool.jobs))):
            self.pool.finish(data.draw(st.integers(0, len(self.pool.jobs) - 1)))

    @rule()
    def loop_turns(self) -> None:
        assert self.loop is not None
        self.loop.turn()

    @rule(action=LOOP_ACTIONS)
    def middleware_timer(self, action: tuple) -> None:
        """A middleware's timer fires on the loop, outside any callback."""
        self.act(action)

    def settle_everything(self) -> None:
        """Handlers finish, the broker acks every copy, the loop turns: until nothing is left to do."""
        for _ in range(200):
            progress = self.world.read() > 0
            if self.pool.jobs:
                self.pool.finish(0)
                progress = True
            if self.world.unconfirmed:
                seqs, self.world.unconfirmed = self.world.unconfirmed, []
                self.world.fate.update(dict.fromkeys(seqs, "ack"))
                self.world.inbox.append(("confirm", ("basic_ack", seqs[-1], True, seqs)))
                progress = True
            assert self.loop is not None
            progress = self.loop.turn() or progress
            if not progress:
                break
        else:
            raise AssertionError("still busy after 200 turns of the loop")
        self.consistent()
        for message_id, raw in self.sent.items():
            settled = self.announcements.get(message_id, [])
            assert len(settled) == raw.received, f"{message_id} ({self.outcome_of[message_id]}) settled {settled}"
        for queue in self.queues:
            consumers = [tag for tag, (q, _callback) in self.world.consumers.items() if q == queue]
            paused = self.control.is_paused(queue)
            assert len(consumers) == (not paused), f"{queue} (paused: {paused}) has consumers {consumers}"

    # -- invariants ---------------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        """Checked after every step, the most telling first."""
        self.nothing_escaped()
        self.callbacks_kept_the_contract()
        self.no_error_but_the_hooks()

    def nothing_escaped(self) -> None:
        assert not self.world.escaped, "\n".join(self.world.escaped)

    def callbacks_kept_the_contract(self) -> None:
        assert not self.violations, self.violations

    def no_error_but_the_hooks(self) -> None:
        unexpected = [r for r in self.errors.records if r.name != "kombu_events.outcome"  # an archive is an error
                      and not (r.exc_info and r.exc_info[0] is HookError)]
        assert not unexpected, "\n".join(f"{r.name}: {r.getMessage()}\n{_trace(r)}" for r in unexpected)


def _trace(record: logging.LogRecord) -> str:
    return "".join(traceback.format_exception(*record.exc_info)) if record.exc_info else ""


SettleMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                           report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow])
TestSettleMachine = SettleMachine.TestCase
