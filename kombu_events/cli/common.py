"""What every ``kombu-events`` sub-command shares: the :class:`Context` it receives (the ``-A`` app's selected
Events service, the broker URL, a connection that turns an unreachable broker into one clear error), the
:func:`guarded` wrapper that turns every expected failure into one line on stderr and exit code 1, the exit
codes (:data:`OK`, :data:`ERROR`, :data:`OVER_THRESHOLD`), the ``--json`` option with its JSON Schema
(:func:`json_option`, :func:`emit_json`, :func:`schema`) and :func:`examples`, which ends a command's help with
its examples."""
from __future__ import annotations

import functools
import json
import sys
from contextlib import AbstractContextManager
from importlib import resources
from typing import Any, Callable, NoReturn, TypeVar

import click
from kombu import Connection

from .. import registry
from ..broker.connections import connected
from ..core.config import broker_url
from ..core.logs import safe_text
from ..errors import KombuEventsError
from ..events import Events

#: The exit codes of every command (docs/cli.md, "Exit codes"): done and fine; an error (the broker cannot be
#: reached, bad input, a usage error, a replay or flush that left messages behind); a check that ran and found
#: something over its threshold (``status --max-archive``, ``health``, ``backlog status --max-depth/--max-age``).
OK, ERROR, OVER_THRESHOLD = 0, 1, 2

F = TypeVar("F", bound=Callable[..., Any])


class Context:
    """What every sub-command needs: the app's Events service and a broker URL."""

    def __init__(self, app_name: str | None, broker: str | None, service: str | None) -> None:
        self.app_name, self.broker, self.service_name = app_name, broker, service
        self._events: Events | None = None

    @property
    def events(self) -> Events:
        """The selected :class:`~kombu_events.Events` of the ``-A`` app."""
        if self._events is None:
            self._events = _select(self.app_name, self.service_name)
        return self._events

    @property
    def url(self) -> str:
        """``--broker``, else the service's ``events.broker_url`` (``Events(broker=)``, ``RABBIT_URL``, the app's)."""
        if self.broker or not self.app_name:
            return broker_url(None, self.broker)
        return self.events.broker_url

    @property
    def app(self) -> Any:
        """The ``-A`` app (its broker settings: ``broker_use_ssl``, ...), or None without ``-A``."""
        return self.events.app if self.app_name else None

    def connection(self) -> AbstractContextManager[Connection]:
        """A connected kombu Connection with the app's broker settings; an unreachable broker: one clear error."""
        return connected(self.url, self.app)


def _select(app_name: str | None, service: str | None) -> Events:
    from celery.app.utils import find_app

    if not app_name:
        raise click.UsageError("no app given: pass -A/--app MODULE (e.g. -A proj.events)")
    try:
        app = find_app(app_name)
    except Exception as exc:
        raise KombuEventsError(f"cannot load app {app_name!r}: {type(exc).__name__}: {exc}") from exc
    if isinstance(app, Events):  # -A module:events names the service itself
        if service is not None and app.service != service:
            raise KombuEventsError(f"{app_name!r} is the Events of service {app.service!r}, not {service!r}")
        return app
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


def over_threshold(alert: str | None = None) -> NoReturn:
    """``alert`` (if any) on stderr, then exit :data:`OVER_THRESHOLD` (what went to stdout stays as printed)."""
    if alert is not None:
        click.echo(alert, err=True)
    sys.exit(OVER_THRESHOLD)


def failed() -> NoReturn:
    """Exit :data:`ERROR` after the command said why on stderr (and printed its report, if it has one)."""
    sys.exit(ERROR)


def json_option(name: str, what: str = "one JSON document on stdout instead", note: str = "") -> Callable[[F], F]:
    """The ``--json`` flag of a command whose document is described by ``schemas/<name>.json``."""
    return click.option("--json", "as_json", is_flag=True,
                        help=f"Print {what}{note} (JSON Schema: kombu_events/cli/schemas/{name}.json).")


def emit_json(document: Any) -> None:
    """Print ``document`` as JSON on stdout: one document, nothing else (warnings and logs go to stderr)."""
    click.echo(json.dumps(document, indent=2))


def schema(name: str) -> dict[str, Any]:
    """The JSON Schema of a command's ``--json`` document (``name``: ``status``, ``archive-list``, ...)."""
    text = _schemas().joinpath(f"{name}.json").read_text(encoding="utf-8")
    found: dict[str, Any] = json.loads(text)
    return found


def schema_names() -> list[str]:
    """Every schema shipped with the package, by name."""
    return sorted(entry.name[:-len(".json")] for entry in _schemas().iterdir() if entry.name.endswith(".json"))


def _schemas() -> Any:
    """The folder of the schemas: package data (setup.cfg), in the wheel and the sdist."""
    return resources.files("kombu_events.cli").joinpath("schemas")
