"""The pure core of periodic events: a schedule's periods, its token and state, and what a token means.

A schedule numbers its periods: period ``p`` is due at ``origin + p * every`` (ms
since the epoch; the origin is ``start``, else the epoch itself, so an hourly
schedule runs on the hour). A **token** (one JSON message circulating through the
service's delay ladder) is only an alarm clock; the **state** (one message in the
schedule's state queue) says which period ran last and which token was published
next. :func:`action_for` turns (token, state, now) into one :class:`TokenAction`; the
worker carries it out (``kombu_events.periodic.tokens``). docs/scheduling.md gives the
argument for each rule.
"""
from __future__ import annotations

__all__ = ["Schedule", "Token", "State", "Begin", "Stale", "Later", "Run", "Advance", "TokenAction", "action_for",
           "next_token", "make_schedule", "summary", "CATCH_UP", "MISSED_SHOWN", "DEFAULT_RETIRE_AFTER_MS", "iso"]

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Union

from ..errors import ConfigurationError
from . import names

#: The catch-up policies: run once for the latest due period, or run every missed period in turn.
CATCH_UP = ("latest", "all")

#: How long a schedule's queues outlive their last use (no worker, no run): then the schedule is retired.
#: A constant, not a multiple of ``every``: a changed period must not change the queues' ``x-expires``.
DEFAULT_RETIRE_AFTER_MS = 7 * 24 * 3600 * 1000

_MAX_EXPIRES_MS = 2**32 - 1  # RabbitMQ's limit for x-expires

#: At most this many missed periods are listed in a run's payload (``missed_count`` has them all).
MISSED_SHOWN = 100


@dataclass(frozen=True)
class Schedule:
    """One periodic schedule of a service, resolved: its timing and its two queues."""

    name: str
    every_ms: int
    origin_ms: int
    catch_up: str
    retire_after_ms: int
    queue: str
    state_queue: str

    @property
    def signature(self) -> dict[str, int]:
        """What numbers the periods: a token or state of another signature belongs to an older timing."""
        return {"every_ms": self.every_ms, "origin_ms": self.origin_ms}

    def due_ms(self, period: int) -> int:
        """When ``period`` is due (ms since the epoch)."""
        return self.origin_ms + period * self.every_ms

    def first_at_or_after(self, when_ms: int) -> int:
        """The first period due at or after ``when_ms`` (never before period 0)."""
        return max(0, -((self.origin_ms - when_ms) // self.every_ms))

    def first_after(self, when_ms: int) -> int:
        """The first period due strictly after ``when_ms``."""
        return self.first_at_or_after(when_ms + 1)

    def latest_due(self, now_ms: int) -> int:
        """The last period due at or before ``now_ms`` (-1: none yet)."""
        return (now_ms - self.origin_ms) // self.every_ms if now_ms >= self.origin_ms else -1


@dataclass(frozen=True)
class Token:
    """The alarm clock of a schedule: ``period`` is due when it arrives (None: a seed, "start me")."""

    schedule: str
    period: int | None
    signature: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        """The token's JSON body."""
        return {"schedule": self.schedule, "period": self.period, "signature": self.signature}

    @classmethod
    def from_dict(cls, data: Any) -> Token:
        """A token from its JSON body; ValueError if it is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("schedule"), str):
            raise ValueError(f"not a schedule token: {data!r}")
        period = data.get("period")
        if period is not None and (isinstance(period, bool) or not isinstance(period, int)):
            raise ValueError(f"token period must be an integer or null, got {period!r}")
        return cls(data["schedule"], period, dict(data.get("signature") or {}))


@dataclass(frozen=True)
class State:
    """A schedule's last run (``last_run``, due at ``last_due_ms``) and the next token published (``next``).

    ``info`` carries what the CLI shows (when it ran, how it ended); decisions ignore it.
    """

    last_run: int | None
    last_due_ms: int | None
    next: int | None
    signature: dict[str, int]
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The state's JSON body."""
        return {"last_run": self.last_run, "last_due_ms": self.last_due_ms,
                "last_due": iso(self.last_due_ms), "next": self.next, "signature": self.signature, **self.info}

    @classmethod
    def from_dict(cls, data: Any) -> State:
        """A state from its JSON body; ValueError if it is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("signature"), dict):
            raise ValueError(f"not a schedule state: {data!r}")
        ints = {k: data.get(k) for k in ("last_run", "last_due_ms", "next")}
        if any(v is not None and (isinstance(v, bool) or not isinstance(v, int)) for v in ints.values()):
            raise ValueError(f"schedule state with a non-integer period: {data!r}")
        info = {k: v for k, v in data.items() if k not in (*ints, "signature", "last_due")}
        return cls(ints["last_run"], ints["last_due_ms"], ints["next"], dict(data["signature"]), info)


@dataclass(frozen=True)
class Begin:
    """No state yet: record that the schedule begins at ``first`` (a state with no run), then decide again.

    The first period of a new schedule depends on when its first seed arrives; once
    recorded, a crash of its first run cannot make a later seed start after it.
    """

    first: int

    def state(self, schedule: Schedule) -> State:
        """The state to write."""
        return State(None, None, self.first, schedule.signature)


@dataclass(frozen=True)
class Stale:
    """Ack the token and do nothing: its period ran, or it belongs to an older timing."""

    reason: str


@dataclass(frozen=True)
class Later:
    """Not due yet: publish the token for ``period`` again, ``delay_ms`` from now, then ack."""

    period: int
    delay_ms: int


@dataclass(frozen=True)
class Run:
    """Run period ``target`` (``missed``: the earlier periods it stands for), then publish the next token."""

    target: int
    due_ms: int
    first: int  # the first period not run yet: ``first .. target - 1`` are missed
    previous_next: int | None  # the state's ``next`` before this run, kept by the first state write

    @property
    def missed(self) -> range:
        """The periods this run stands for, besides its own (catch-up ``latest``)."""
        return range(self.first, self.target)


@dataclass(frozen=True)
class Advance:
    """The period ran but its next token was not recorded (a crash): publish it, record it, ack."""

    last_run: int


TokenAction = Union[Begin, Stale, Later, Run, Advance]


def iso(when_ms: int | None) -> str | None:
    """``when_ms`` as an ISO 8601 UTC time, to the millisecond."""
    if when_ms is None:
        return None
    return datetime.fromtimestamp(when_ms / 1000, timezone.utc).isoformat(timespec="milliseconds")


def _effective(schedule: Schedule, state: State | None) -> tuple[int | None, int | None]:
    """(last run, recorded next token) in this schedule's numbering.

    A state of another signature (``every``/``start`` changed) restarts the numbering
    after its last run's due time; its recorded token means nothing any more.
    """
    if state is None:
        return None, None
    if state.signature == schedule.signature:
        return state.last_run, state.next
    if state.last_due_ms is None:
        return None, None
    return schedule.first_after(state.last_due_ms) - 1, None


def action_for(schedule: Schedule, token: Token, state: State | None, now_ms: int) -> TokenAction:
    """What the arrival of ``token`` at ``now_ms`` means, given the schedule's ``state``."""
    if token.signature != schedule.signature:
        return Stale("token of an earlier timing of the schedule")
    last, recorded = _effective(schedule, state)
    if last is None:
        if recorded is None:  # a seed begins with the first period from now
            return Begin(schedule.first_at_or_after(now_ms) if token.period is None else token.period)
        first = recorded  # none ran yet: the recorded beginning
    elif token.period is not None and token.period <= last:
        if recorded is None or recorded <= token.period:
            return Advance(last)
        return Stale(f"period {token.period} ran already (last run {last})")
    else:
        first = last + 1
    if now_ms < schedule.due_ms(first):
        return Later(first, schedule.due_ms(first) - now_ms)
    target = first if schedule.catch_up == "all" else max(first, schedule.latest_due(now_ms))
    previous = recorded if state is not None and state.signature == schedule.signature else None
    return Run(target, schedule.due_ms(target), first, previous)


def next_token(schedule: Schedule, last_run: int, now_ms: int) -> Later:
    """The token to publish after ``last_run`` ran: the next period, when it is due (0: at once)."""
    period = last_run + 1
    return Later(period, max(0, schedule.due_ms(period) - now_ms))


def make_schedule(service: str, name: str, *, every: Any, start: Any = None, catch_up: str = "latest",
                  retire_after: Any = None) -> Schedule:
    """A validated schedule of ``service``; ConfigurationError names the bad value and what would do."""
    names.validate_name("schedule name", name, max_bytes=200)
    if name.endswith(names.STATE_SUFFIX):
        raise ConfigurationError(f"schedule name {name!r} may not end with {names.STATE_SUFFIX!r} "
                                 "(the suffix of its state queue)")
    every_ms = _duration_ms(f"every of schedule {name!r}", every)
    if catch_up not in CATCH_UP:
        raise ConfigurationError(f"catch_up of schedule {name!r} must be one of {', '.join(map(repr, CATCH_UP))}, "
                                 f"got {catch_up!r}")
    retire_ms = DEFAULT_RETIRE_AFTER_MS if retire_after is None else \
        _duration_ms(f"retire_after of schedule {name!r}", retire_after)
    if not 2 * every_ms <= retire_ms <= _MAX_EXPIRES_MS:
        raise ConfigurationError(
            f"retire_after of schedule {name!r} is {retire_ms} ms: it must be at least twice every ({2 * every_ms} ms: "
            f"the state queue is read once a period) and at most {_MAX_EXPIRES_MS} ms; set retire_after=")
    return Schedule(name, every_ms, _origin_ms(name, start), catch_up, retire_ms,
                    names.schedule_queue(service, name), names.schedule_state(service, name))


def _duration_ms(setting: str, value: Any) -> int:
    """Whole milliseconds of a ``timedelta`` or a number of seconds (at least 1 ms)."""
    if isinstance(value, timedelta):
        ms = (value.days * 86_400_000_000 + value.seconds * 1_000_000 + value.microseconds) // 1000
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value < 1e15:
        ms = round(value * 1000)
    else:
        raise ConfigurationError(f"{setting} must be a timedelta or a number of seconds, got {value!r}")
    if ms < 1:
        raise ConfigurationError(f"{setting} must be at least 1 ms, got {value!r}")
    return ms


def _origin_ms(name: str, start: Any) -> int:
    if start is None:
        return 0
    if not isinstance(start, datetime):
        raise ConfigurationError(f"start of schedule {name!r} must be a datetime (naive: local time), got {start!r}")
    return round(start.timestamp() * 1000)


def summary(schedule: Schedule, state: State | None, now_ms: int) -> dict[str, Any]:
    """What ``kombu-events schedules`` shows of a schedule: its period, its last run, its next due time."""
    last, recorded = _effective(schedule, state)
    if last is not None:
        upcoming: int | None = last + 1
    else:
        upcoming = recorded
    row: dict[str, Any] = {
        "schedule": schedule.name, "every_s": schedule.every_ms / 1000, "catch_up": schedule.catch_up,
        "queue": schedule.queue, "last_run": None, "last_due": None, "next": upcoming,
        "next_due": iso(schedule.due_ms(upcoming)) if upcoming is not None else None,
    }
    if state is not None and state.last_run is not None:
        row.update(last_run=state.last_run, last_due=iso(state.last_due_ms), ran_at=state.info.get("ran_at"),
                   outcome=state.info.get("outcome"), duration_ms=state.info.get("duration_ms"))
    if state is not None and state.signature != schedule.signature:
        row["note"] = "the period changed: the next run numbers on from the last one"
    if upcoming is None:
        row["note"] = "not started: no worker with --with-events-step has run it yet"
        row["next_due"] = iso(schedule.due_ms(schedule.first_at_or_after(now_ms)))
    return row
