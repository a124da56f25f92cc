"""Handler errors to Sentry, tagged with queue, routing key, attempt and outcome, once ``sentry_sdk`` is initialised.

As Sentry's Celery integration does for tasks, it is automatic: a worker started
with ``--with-events-step`` connects :func:`report` to the ``handler_failed`` signal
when the ``sentry_sdk`` package is installed (before the pool forks, so prefork
children have it), and :func:`report` sends nothing until the application has called
``sentry_sdk.init(...)`` (in its app module, or in Celery's ``worker_process_init``).
No hard dependency: ``sentry_sdk`` is never imported here, only looked up.

:func:`connect` reports elsewhere too (a test with the stub); :func:`disconnect`, at
import time of the app module, turns the automatic reporting off.
"""
from __future__ import annotations

__all__ = ["connect", "disconnect", "install", "uninstall", "report", "tags", "DISPATCH_UID"]

import importlib.util
import logging
import sys
from typing import Any

from .. import signals
from ..core.event import Event
from ..errors import Archive, Poisoned, Retry

logger = logging.getLogger(__name__)

DISPATCH_UID = "kombu_events.integrations.sentry.report"

#: Sentry's limit on the length of a tag value.
TAG_VALUE_LIMIT = 200

_state = {"disabled": False, "connected": False}


def tags(event: Event, action: str) -> dict[str, str]:
    """The tags of a handler's error: where it happened and what the worker does with the message next."""
    values = {"kombu_events.queue": event.queue, "kombu_events.routing_key": event.routing_key,
              "kombu_events.attempt": str(event.attempt), "kombu_events.outcome": action}
    return {name: value[:TAG_VALUE_LIMIT] for name, value in values.items()}


def _reported(exception: BaseException) -> bool:
    """Not the handler's own steering (``Retry``, ``Archive``), as Sentry skips Celery's Retry and Reject."""
    return isinstance(exception, Poisoned) or not isinstance(exception, (Retry, Archive))


def _active(sentry_sdk: Any) -> bool:
    get_client = getattr(sentry_sdk, "get_client", None)
    if get_client is not None:
        return bool(get_client().is_active())
    return getattr(sentry_sdk.Hub.current, "client", None) is not None  # sentry-sdk 1.x


def report(sender: Any, event: Event | None = None, exception: BaseException | None = None,
           action: str = "", duration_ms: float = 0.0, **kwargs: Any) -> None:
    """``handler_failed`` receiver: capture the exception in Sentry if ``sentry_sdk`` is initialised."""
    sentry_sdk = sys.modules.get("sentry_sdk")
    if sentry_sdk is None or event is None or exception is None or not _reported(exception):
        return
    try:
        if _active(sentry_sdk):
            _capture(sentry_sdk, sender, event, exception, action, duration_ms)
    except Exception:  # Sentry's own trouble: the handler's outcome stands, and its error is logged by the worker
        logger.exception("kombu-events: reporting the error of handler %s (queue %s, message %r) to Sentry failed",
                         getattr(sender, "__qualname__", sender), event.queue, event.message_id)


def _capture(sentry_sdk: Any, sender: Any, event: Event, exception: BaseException, action: str,
             duration_ms: float) -> None:
    scope_of = getattr(sentry_sdk, "new_scope", None) or sentry_sdk.push_scope
    with scope_of() as scope:
        for name, value in tags(event, action).items():
            scope.set_tag(name, value)
        scope.set_context("kombu_events", {
            "handler": getattr(sender, "__qualname__", repr(sender)), "message_id": event.message_id,
            "correlation_id": event.correlation_id, "duration_ms": round(duration_ms, 3)})
        sentry_sdk.capture_exception(exception)


def connect() -> None:
    """Report handler errors to Sentry in this process (idempotent; pool children forked later inherit it)."""
    _state["disabled"] = False
    _connect()


def disconnect() -> None:
    """Stop reporting, and keep the worker from connecting :func:`report` at start-up."""
    _state["disabled"] = True
    _disconnect()


def install() -> bool:
    """The worker's step, at start-up: connect :func:`report` if ``sentry_sdk`` is installed, not turned off
    and not connected yet. True if it connected it (the step then calls :func:`uninstall` at shutdown)."""
    if _state["disabled"] or _state["connected"] or importlib.util.find_spec("sentry_sdk") is None:
        return False
    _connect()
    logger.debug("kombu-events: handler errors go to Sentry once sentry_sdk is initialised")
    return True


def uninstall() -> None:
    """The worker's step, at shutdown: disconnect what :func:`install` connected (a test's worker ends)."""
    _disconnect()


def _connect() -> None:
    signals.handler_failed.connect(weak=False, dispatch_uid=DISPATCH_UID)(report)
    _state["connected"] = True


def _disconnect() -> None:
    signals.handler_failed.disconnect(report, dispatch_uid=DISPATCH_UID)
    _state["connected"] = False
