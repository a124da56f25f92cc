"""A log of events (``events.log(...)``): a RabbitMQ stream bound to the events exchange, kept by age and/or
size; its name, its validation and its stream arguments (docs/logs.md); no I/O."""
from __future__ import annotations

__all__ = ["EventLog", "event_log", "log_streams", "log_queue", "log_prefix", "max_age", "max_age_s", "segment_bytes",
           "check_unique", "MIN_SEGMENT_BYTES", "MAX_SEGMENT_BYTES", "AGE_SEGMENT_BYTES"]

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

from kombu import Exchange, Queue, binding

from ..errors import ConfigurationError
from . import ladder, names
from .handlers import validate_binding_key

#: Smallest and largest segment of a log's stream: retention drops whole segments, never the one being written.
MIN_SEGMENT_BYTES = 2**20
MAX_SEGMENT_BYTES = 100_000_000
#: Segment of a log kept by age alone: small enough that a log of a few MB still drops old events.
AGE_SEGMENT_BYTES = 16 * 2**20

#: The units of ``x-max-age`` RabbitMQ accepts, in seconds (it counts a month as 30 days and a year as 365).
_UNITS_S = {"Y": 365 * 86_400, "M": 30 * 86_400, "D": 86_400, "h": 3600, "m": 60, "s": 1}
_MAX_AGE = re.compile(r"([1-9][0-9]*)([YMDhms])")


@dataclass(frozen=True)
class EventLog:
    """One log of a service: its stream queue, the binding keys that feed it, and its retention."""

    name: str
    queue: str
    binding_keys: tuple[str, ...]
    #: Keep events this many seconds (``x-max-age``); None: kept until the size bound removes them.
    keep_s: int | None
    #: Keep at most this many bytes (``x-max-length-bytes``); None: kept until they are ``keep_s`` old.
    max_bytes: int | None

    @property
    def segment_bytes(self) -> int:
        """``x-stream-max-segment-size-bytes`` of the stream (see :func:`segment_bytes`)."""
        return segment_bytes(self.max_bytes)

    def queue_arguments(self) -> dict[str, object]:
        """The stream's arguments: a stream whatever the service's ``queue_type``, and its retention."""
        args: dict[str, object] = {"x-queue-type": "stream"}
        if self.keep_s is not None:
            args["x-max-age"] = max_age(self.keep_s)
        if self.max_bytes is not None:
            args["x-max-length-bytes"] = self.max_bytes
        args["x-stream-max-segment-size-bytes"] = self.segment_bytes
        return args

    def describe_retention(self) -> str:
        """``90D and 1000000000 bytes``: the retention as the broker is told it."""
        parts = [f"{max_age(self.keep_s)}" if self.keep_s is not None else "",
                 f"{self.max_bytes} bytes" if self.max_bytes is not None else ""]
        return " and ".join(p for p in parts if p)


def log_prefix(service: str) -> str:
    """What the queue of every log of a service starts with: ``<service>.log.``."""
    return f"{service}.log."


def log_queue(service: str, name: str) -> str:
    """The stream of a log: ``<service>.log.<name>``."""
    return f"{log_prefix(service)}{name}"


def event_log(service: str, binding_keys: tuple[str, ...], *, keep: Any = None, max_bytes: Any = None,
              name: Any = None) -> EventLog:
    """What ``events.log(...)`` was given, checked: a ConfigurationError names the bad value and what fits."""
    if not binding_keys:
        raise ConfigurationError("log() needs at least one binding key, e.g. events.log('orders.#', "
                                 "keep=timedelta(days=90))")
    keys = tuple(validate_binding_key(key) for key in binding_keys)
    if keep is None and max_bytes is None:
        raise ConfigurationError(
            f"log({', '.join(map(repr, keys))}) has no retention: give keep=timedelta(...) and/or max_bytes=...; "
            "an unbounded stream grows until the broker's disk alarm blocks every publisher")
    keep_s = None if keep is None else _keep_s(keep)
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ConfigurationError(f"max_bytes of a log must be a positive number of bytes, got {max_bytes!r}")
    log_name = names.validate_name("name of a log", _default_name(keys[0]) if name is None else name)
    queue = names.validate_name(f"queue of log {log_name!r}", log_queue(service, log_name))
    return EventLog(log_name, queue, keys, keep_s, max_bytes)


def _keep_s(keep: Any) -> int:
    if not isinstance(keep, timedelta):
        raise ConfigurationError(f"keep of a log must be a datetime.timedelta, e.g. timedelta(days=90), "
                                 f"got {keep!r}")
    if keep < timedelta(seconds=1) or keep.microseconds:
        raise ConfigurationError(f"keep of a log must be whole seconds, at least 1 (RabbitMQ's x-max-age counts "
                                 f"whole units), got {keep!r}")
    return keep.days * 86_400 + keep.seconds


def _default_name(key: str) -> str:
    """``orders.#`` -> ``orders``, ``orders.*.created`` -> ``orders.created``, ``#`` -> ``all``."""
    kept = [word for word in key.split(".") if word not in ("*", "#")]
    return ".".join(kept) or "all"


def check_unique(log: EventLog, others: Iterable[EventLog]) -> None:
    """ConfigurationError if another of the service's logs has ``log``'s name."""
    for other in others:
        if other.name == log.name:
            raise ConfigurationError(
                f"two logs are named {log.name!r} ({', '.join(other.binding_keys)} and "
                f"{', '.join(log.binding_keys)}): give one of them name=")


def log_streams(logs: Iterable[EventLog], events: Exchange, due: Exchange | None, publish_delay_levels: int, *,
                taken: Iterable[Queue]) -> list[Queue]:
    """Each log's stream, bound to the events exchange with its keys (and to the due exchange, as a handler queue
    is: a delayed event is appended when it comes due, as if published then). A stream named as a queue of
    ``taken`` (the service's others) is a ConfigurationError."""
    others = {queue.name for queue in taken}
    streams = []
    for log in logs:
        if log.queue in others:
            raise ConfigurationError(f"the stream {log.queue!r} of log {log.name!r} has the name of another queue "
                                     "of the service: give the log (or the handler) another name=")
        bindings = [binding(events, routing_key=key) for key in log.binding_keys]
        if due is not None:
            bindings += [binding(due, routing_key=ladder.delivery_pattern(levels=publish_delay_levels, queue=key))
                         for key in log.binding_keys]
        streams.append(Queue(log.queue, bindings=bindings, durable=True, queue_arguments=log.queue_arguments()))
    return streams


def max_age(seconds: int) -> str:
    """``x-max-age`` for ``seconds``, exact, in the largest unit that divides it: ``90D``, ``36h``, ``600s``."""
    if isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 1:
        raise ValueError(f"x-max-age needs a whole number of seconds, at least 1, got {seconds!r}")
    for unit in ("D", "h", "m"):
        if seconds % _UNITS_S[unit] == 0:
            return f"{seconds // _UNITS_S[unit]}{unit}"
    return f"{seconds}s"


def max_age_s(text: str) -> int:
    """The seconds an ``x-max-age`` such as ``90D`` stands for, as RabbitMQ reads it; ValueError if it does not."""
    found = _MAX_AGE.fullmatch(text)
    if found is None:
        raise ValueError(f"not an x-max-age: {text!r} (a positive whole number and one of Y, M, D, h, m, s)")
    return int(found.group(1)) * _UNITS_S[found.group(2)]


def segment_bytes(max_bytes: int | None) -> int:
    """Segment size of a log's stream: a quarter of ``max_bytes``, between 1 MiB and 100 MB (the stream then
    holds at most ``max_bytes`` plus the segment being written); :data:`AGE_SEGMENT_BYTES` for a log kept by age
    alone."""
    if max_bytes is None:
        return AGE_SEGMENT_BYTES
    return max(MIN_SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, max_bytes // 4))
