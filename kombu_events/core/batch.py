"""Batch handlers: ``BatchOf`` (how many events per call, how long a partial batch waits), what a batch
handler's parameter is annotated with, and which event of a call failed how. Pure: no I/O."""
from __future__ import annotations

__all__ = ["BatchOf", "check_batch", "batch_contract", "failures_of", "MAX_EVENTS", "MAX_WAIT_MS"]

import inspect
import typing
from collections.abc import Sequence as AbcSequence
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import BatchFailed, ConfigurationError
from .contracts import Contract, _first_annotation, _name_of, untyped
from .event import Event

#: At most this many events in one call of a batch handler, and at most this long (ms) a partial batch waits.
MAX_EVENTS = 10_000
MAX_WAIT_MS = 60_000


@dataclass(frozen=True)
class BatchOf:
    """``@events.handler(..., batch=BatchOf(max=500, wait_ms=50))``: the handler gets a list of events.

    ``max`` (1 .. 10000) events per call at most; ``wait_ms`` (0 .. 60000): how long the first
    event of a partial batch waits for more before the call is made with what is there.
    The handler's prefetch is raised to ``max`` when lower, so that a full batch can arrive.
    """

    max: int = 100
    wait_ms: int = 50

    def __post_init__(self) -> None:
        if isinstance(self.max, bool) or not isinstance(self.max, int) or not 1 <= self.max <= MAX_EVENTS:
            raise ConfigurationError(f"BatchOf(max=...) must be an integer within 1 .. {MAX_EVENTS} (events per "
                                     f"call of the handler), got {self.max!r}")
        wait = self.wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= MAX_WAIT_MS:
            raise ConfigurationError(f"BatchOf(wait_ms=...) must be a number of milliseconds within 0 .. "
                                     f"{MAX_WAIT_MS} (how long a partial batch waits for more), got {wait!r}")


def check_batch(value: Any, *, once: Any, concurrency: Any, ordered_by: Any = None) -> BatchOf | None:
    """A handler's ``batch`` option (None: one event per call), else ConfigurationError."""
    if value is None:
        return None
    if not isinstance(value, BatchOf):
        raise ConfigurationError(f"batch must be a BatchOf(max=..., wait_ms=...) or None, got {value!r}")
    if once and not isinstance(once, bool):
        raise ConfigurationError("batch= with once=<function> is not supported yet: use once=True (the inbox "
                                 "keys each event by its message id, else a hash of its routing key and body)")
    if concurrency is not None:
        raise ConfigurationError("batch= with concurrency= is not supported yet: a batch handler's calls are "
                                 "limited by its prefetch (BatchOf.max) and the pool; drop concurrency=")
    if ordered_by is not None:
        raise ConfigurationError("batch= with ordered_by= is not supported yet: a batch's failed events are "
                                 "retried apart from the others, which would break the order of a partition")
    return value


def batch_contract(fn: Callable[..., Any], *, bind: bool, raw: bool, where: str) -> Contract | None:
    """The contract of each event of a batch handler: its parameter annotated ``list[Model]`` (with
    ``bind=True``: ``list[Event[Model]]``); None when unannotated, ``list``, or ``raw=True``."""
    if raw:
        return None
    annotation = _first_annotation(fn, where)
    if untyped(annotation) or annotation in (list, Sequence, AbcSequence):
        return None
    if typing.get_origin(annotation) not in (list, AbcSequence):
        raise ConfigurationError(f"{where}: a batch handler gets a list, but its parameter is annotated "
                                 f"{_name_of(annotation)}; annotate it list[{_name_of(annotation)}]")
    (element,) = typing.get_args(annotation) or (inspect.Parameter.empty,)
    if bind:
        if element is Event or untyped(element):
            return None
        if typing.get_origin(element) is not Event:
            raise ConfigurationError(f"{where}: with bind=True a batch handler gets a list of Event, but its "
                                     f"parameter is annotated list[{_name_of(element)}]; annotate it "
                                     f"list[Event[{_name_of(element)}]] to validate the payloads")
        element = typing.get_args(element)[0]
    elif element is Event or typing.get_origin(element) is Event:
        raise ConfigurationError(f"{where}: its parameter is annotated list[{_name_of(element)}], but without "
                                 f"bind=True a batch handler gets the payloads, not Events: pass bind=True")
    return None if untyped(element) else Contract(element, where=where)


def failures_of(exc: BaseException | None, count: int) -> list[BaseException | None]:
    """What each of the ``count`` events of one call ended with: None (handled), or the exception to settle
    it by. ``BatchFailed`` names the failed ones by index; any other exception fails them all."""
    if exc is None:
        return [None] * count
    if not isinstance(exc, BatchFailed):
        return [exc] * count
    failures: list[BaseException | None] = [None] * count
    for index, failure in exc.failures.items():
        if 0 <= index < count:
            failures[index] = failure
    return failures
