"""Batch handlers in the pool: one call of the handler with the list of events, one Outcome per event.

Each message is decoded, admitted and validated on its own, as :mod:`~kombu_events.worker.runner`
does: one that cannot be (bad JSON, a payload that does not fit the contract) is settled alone
and left out of the list. The handler then runs once; what it raised says how each event
ended (:func:`~kombu_events.core.batch.failures_of`), and each is settled by its own Outcome,
so its attempt count and its retry are its own. Middleware that knows batches (the inbox) wraps
the call once (``Middleware.handling_batch``); other middleware wraps it in each event's
``handling(event)`` context, which sees that event's own ending.
"""
from __future__ import annotations

__all__ = ["run", "run_one"]

import logging
import time
from contextlib import AbstractContextManager
from typing import Any, Sequence

from .. import registry, signals
from ..core import decision
from ..core.batch import failures_of
from ..core.event import Event
from ..errors import Archive, BatchFailed, Retry
from ..middleware.base import Handled, Middleware
from ..registry import Route
from . import awaiting, runner
from .runner import Item, Outcomes

logger = logging.getLogger(__name__)


def run_one(queue: str, body: bytes, content_type: str | None, content_encoding: str | None,
            meta: runner.Meta | None = None, final: bool = True) -> decision.Outcome:
    """:func:`run` for one message (what the hand-off sends when a batch's pool process was lost)."""
    return run([(queue, body, content_type, content_encoding, meta, final)])[0]


def run(items: Sequence[Item], async_limit: int = 100) -> Outcomes:
    """Call the handler of ``items``' queue (all of one queue) once with their events; their Outcomes, in order.

    Raises no ``Exception``: a bug of ours fails every message (each is retried). ``async_limit``
    is the hand-off's argument of every job, unused: the one call is awaited alone.
    """
    started = time.perf_counter()
    queue = items[0][0] if items else ""
    try:
        outcomes = _run(registry.route(queue), queue, items)
    except Exception as exc:
        outcomes = Outcomes(runner._bug(queue, exc) for _ in items)
    outcomes.elapsed_ms = (time.perf_counter() - started) * 1000
    return outcomes


def _run(route: Route | None, queue: str, items: Sequence[Item]) -> Outcomes:
    outcomes = Outcomes()
    if route is None:
        outcomes.extend(decision.Outcome(decision.LOST, f"no handler for queue {queue!r} in this process")
                        for _ in items)
        return outcomes
    calls: list[tuple[int, Any]] = []
    for item in items:
        ready = runner._prepare(route, *item)
        if isinstance(ready, decision.Outcome):
            outcomes.append(ready)
        else:
            calls.append((len(outcomes), ready))
            outcomes.append(_NOT_CALLED)
    if calls:
        for (index, _), outcome in zip(calls, _call(route, [call for _, call in calls])):
            outcomes[index] = outcome
    return outcomes


def _call(route: Route, calls: list[Any]) -> list[decision.Outcome]:
    """One call of the handler with the events of ``calls`` (inside the middleware's contexts)."""
    contexts = _Contexts(route, calls)
    running = contexts.enter()
    started = time.perf_counter()
    error: Exception | None = None
    if running:
        try:
            _invoke(route, [calls[i] for i in running])
        except Exception as exc:
            error = exc
    if isinstance(error, BatchFailed) and any(not 0 <= index < len(running) for index in error.failures):
        logger.warning("kombu-events: %s: BatchFailed names indices %s outside the list of %d events; ignored",
                       route.handler.queue, sorted(i for i in error.failures if not 0 <= i < len(running)),
                       len(running))
    failures = {running[j]: failure for j, failure in enumerate(failures_of(error, len(running)))
                if failure is not None}
    failures.update(contexts.leave(error, failures))
    for i in running:
        failure = failures.get(i)
        contexts.outcomes[i] = runner._succeeded(calls[i], started) if failure is None else \
            runner._failed(calls[i], _exception(failure), started)
    return [outcome or _NOT_CALLED for outcome in contexts.outcomes]


def _invoke(route: Route, calls: list[Any]) -> None:
    """Call (or await) the handler with the list of the events' arguments."""
    fn = route.handler.fn
    for call in calls:
        if call.event is not None and signals.handler_started.receivers:
            signals.handler_started.send(sender=fn, event=call.event)
    arguments = [call.argument for call in calls]
    if route.awaits:
        awaiting.run(runner._awaited(fn(arguments)))
    else:
        runner._ran(fn(arguments))


def _exception(failure: BaseException) -> Exception:
    """What an event's failure is settled by (a BaseException a handler put in BatchFailed counts as failing)."""
    return failure if isinstance(failure, Exception) else RuntimeError(decision.describe(failure))


class _Contexts:
    """The middleware contexts around one call: batch contexts (once) and each event's ``handling`` ones."""

    def __init__(self, route: Route, calls: list[Any]) -> None:
        self.route, self.calls = route, calls
        self.outcomes: list[decision.Outcome | None] = [None] * len(calls)
        self.batch: list[AbstractContextManager[Any]] = []
        self.each: dict[int, list[AbstractContextManager[Any]]] = {}

    def enter(self) -> list[int]:
        """Enter every context; the indices of the events the handler gets (not handled before, not steered)."""
        hooks = self.route.hooks
        if not hooks.on_handling:
            return list(range(len(self.calls)))
        events: list[Event[Any]] = [call.event for call in self.calls]
        per_event: list[Middleware] = []
        for m in hooks.on_handling:
            if not self._enter_batch(m, events):
                per_event.append(m)
        if per_event:
            for i, event in enumerate(events):
                if self.outcomes[i] is None:
                    self._enter_each(per_event, i, event)
        return [i for i, outcome in enumerate(self.outcomes) if outcome is None]

    def _enter_batch(self, m: Middleware, events: list[Event[Any]]) -> bool:
        """Enter ``m``'s batch context; False when it has none (its ``handling(event)`` is used)."""
        try:
            context = m.handling_batch(events)
            if context is None:
                return False
            handled = context.__enter__()
        except (Retry, Archive) as exc:  # e.g. the database cannot be reached: every event waiting is steered
            for i, outcome in enumerate(self.outcomes):
                if outcome is None:
                    self.outcomes[i] = runner._failed(self.calls[i], exc, time.perf_counter())
            return True
        except Exception:
            logger.exception("kombu-events: middleware %r failed entering handling_batch() for %d events of %s; "
                             "skipped", m, len(events), self.route.handler.queue)
            return True
        self.batch.append(context)
        for i in handled or ():
            if self.outcomes[i] is None:
                self.outcomes[i] = decision.Outcome(decision.OK)  # handled before: acked, not passed again
        return True

    def _enter_each(self, middleware: list[Middleware], i: int, event: Event[Any]) -> None:
        entered: list[AbstractContextManager[Any]] = []
        for m in middleware:
            try:
                context = m.handling(event)
                context.__enter__()
                entered.append(context)
            except (Handled, Retry, Archive) as exc:
                self.route.hooks.leave(entered, None)
                self.outcomes[i] = decision.Outcome(decision.OK) if isinstance(exc, Handled) else \
                    runner._failed(self.calls[i], exc, time.perf_counter())
                return
            except Exception:
                logger.exception("kombu-events: middleware %r failed entering handling() for message %r of %s; "
                                 "skipped", m, event.message_id, event.queue)
        self.each[i] = entered

    def leave(self, error: Exception | None, failures: dict[int, BaseException]) -> dict[int, BaseException]:
        """Leave each event's contexts (with its own ending), then the batch contexts (with the events that
        failed, by index, or the handler's exception); the failures a context raised on leaving."""
        steered: dict[int, BaseException] = {}
        for i, entered in self.each.items():
            failure = failures.get(i)
            try:
                self.route.hooks.leave(entered, failure)
            except (Retry, Archive) as exc:
                steered[i] = exc
        failed = {**failures, **steered}
        failed.update({i: Archive("not run") for i, o in enumerate(self.outcomes)
                       if o is not None and o.kind != decision.OK})
        seen: Exception | None = error if error is not None and not isinstance(error, BatchFailed) else \
            BatchFailed(failed) if failed else None
        for context in reversed(self.batch):
            try:
                context.__exit__(type(seen) if seen else None, seen, seen.__traceback__ if seen else None)
            except (Retry, Archive) as exc:  # e.g. the inbox could not commit: no event counts as handled
                steered.update({i: exc for i, o in enumerate(self.outcomes) if o is None and i not in failed})
            except Exception:
                logger.exception("kombu-events: middleware context %r failed on exit; ignored", context)
        return steered


#: A placeholder in the list until the call ended.
_NOT_CALLED = decision.Outcome(decision.LOST, "not called")
