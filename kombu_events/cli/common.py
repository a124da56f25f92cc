"""What every ``kombu-events`` sub-command shares: the :class:`Context` it receives (the ``-A`` app's selected
Events service, the broker URL, a connection that turns an unreachable broker into one clear error), the
:func:`guarded` wrapper that turns every expected failure into one line on stderr and exit code 1, and
:func:`examples`, which ends a command's help with its examples."""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import click
from kombu import Connection

from .. import registry
from ..core.config import broker_url
from ..core.logs import safe_text, safe_url
from ..errors import BrokerUnavailableError, KombuEventsError


class Context:
    """What every sub-command needs: the app's Events service and a broker URL."""

    def __init__(self, app_name: str | None, broker: str | None, service: str | None) -> None:
        self.app_name, self.broker, self.service_name = app_name, broker, service
        self._events: Any = None

    @property
    def events(self) -> Any:
        """The selected :class:`~kombu_events.Events` of the ``-A`` app."""
        if self._events is None:
            self._events = _select(self.app_name, self.service_name)
        return self._events

    @property
    def url(self) -> str:
        """``--broker``, else ``RABBIT_URL``, else the app's broker."""
        app = self.events.app if self.app_name else None
        return broker_url(app, self.broker)

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A connected kombu Connection; an unreachable broker becomes one clear error."""
        conn = Connection(self.url, connect_timeout=5)
        try:
            conn.ensure_connection(max_retries=1)
        except Exception as exc:
            conn.release()
            raise BrokerUnavailableError(f"cannot reach the broker at {safe_url(self.url)}: {exc}") from exc
        try:
            yield conn
        finally:
            conn.release()


def _select(app_name: str | None, service: str | None) -> Any:
    from celery.app.utils import find_app

    if not app_name:
        raise click.UsageError("no app given: pass -A/--app MODULE (e.g. -A proj.events)")
    try:
        app = find_app(app_name)
    except Exception as exc:
        raise KombuEventsError(f"cannot load app {app_name!r}: {type(exc).__name__}: {exc}") from exc
    services = registry.services_of(app)
    if not services:
        raise KombuEventsError(f"app {app_name!r} registers no Events(app, service=...)")
    if service is None:
        if len(services) > 1:
            names = ", ".join(e.service for e in services)
            raise KombuEventsError(f"app {app_name!r} has several services ({names}); pick one with --service")
        return services[0]
    for events in services:
        if events.service == service:
            return events
    raise KombuEventsError(f"unknown service {service!r}; app {app_name!r} has: "
                           + ", ".join(e.service for e in services))


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn every expected failure into one line on stderr and exit code 1 (never a traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except (KombuEventsError, OSError, ConnectionError) as exc:
            raise click.ClickException(safe_text(str(exc))) from exc
        except Exception as exc:  # amqp/kombu errors: still one clear line
            raise click.ClickException(safe_text(f"{type(exc).__name__}: {exc}")) from exc

    return wrapper


def examples(command: click.Command, *lines: str) -> None:
    """End ``command``'s help with an Examples block of ``lines`` (``\\b``: click prints it as written).

    Each command's module calls this right below the command, so that its options and its examples change
    together.
    """
    command.epilog = "\b\nExamples:\n" + "\n".join("  " + line for line in lines)
