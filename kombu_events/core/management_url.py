"""The URL of RabbitMQ's management API: its check (the ``management_url`` setting, its environment variable, the
``--management-url`` option) and the one asked when none is given."""
from __future__ import annotations

__all__ = ["MANAGEMENT_URL_ENV", "DEFAULT_MANAGEMENT_PORT", "check_management_url", "management_base_url"]

import re
import urllib.parse
from typing import Any

from ..errors import ConfigurationError
from .logs import safe_url

#: Environment variable of the ``management_url`` setting (the one setting read from the environment as text).
MANAGEMENT_URL_ENV = "KOMBU_EVENTS_MANAGEMENT_URL"

#: Port of the management API when no URL names it (RabbitMQ's default, plain HTTP on the broker's host).
DEFAULT_MANAGEMENT_PORT = 15672


def check_management_url(value: Any, *, setting: str = "management_url", variable: str | None = None) -> None:
    """Raise ConfigurationError, naming ``setting`` (or the environment ``variable`` it came from) and ``value``
    with any credentials masked, unless ``value`` is the ``http://`` or ``https://`` URL of a management API:
    a host, optionally a port and a path; no whitespace, credentials, query or fragment."""
    why = _management_url_fault(value)
    if why is None:
        return
    shown = repr(_masked(value)) if isinstance(value, str) else repr(value)
    where = f"{variable}={shown} (setting {setting})" if variable else f"{setting}={shown}"
    raise ConfigurationError(
        f"{where} is not a management API URL ({why}): give http:// or https://, a host and optionally a port "
        "and a path, e.g. http://rabbitmq.internal:15672 (no credentials: the API is asked with the broker "
        "connection's user)")


#: The user-info of a URL (``scheme://anything@``), masked whole: a token without a ``:`` is a secret too.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://)[^/?#]*@")


def _masked(url: str) -> str:
    return _USERINFO.sub(r"\1**@", safe_url(url))


def _management_url_fault(value: Any) -> str | None:
    """What is wrong with ``value`` as a management API URL, None if nothing."""
    if not isinstance(value, str):
        return "not a string"
    if not value or any(c.isspace() for c in value):
        return "empty" if not value else "it holds whitespace"
    try:
        parts = urllib.parse.urlsplit(value)
        _ = parts.port  # raises ValueError on a port out of range or not a number
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme or 'missing'}"
    if "@" in parts.netloc:
        return "it holds credentials"
    if not parts.hostname:
        return "no host"
    if parts.query or parts.fragment:
        return "it holds a query or a fragment"
    return None


def management_base_url(configured: str | None, broker_host: str | None) -> str:
    """The management API's base URL, no trailing slash: ``configured`` (``--management-url`` or the
    ``management_url`` setting), else plain HTTP on port 15672 of the broker's host."""
    if configured:
        return configured.rstrip("/")
    return f"http://{broker_host or 'localhost'}:{DEFAULT_MANAGEMENT_PORT}"
