"""Every connection the package opens, built from the Celery app's broker settings as Celery builds its own.

Celery's ``app.connection_for_write()`` passes ``broker_use_ssl``, ``broker_login_method``,
``broker_transport_options``, ``broker_connection_timeout`` (and the ``broker_user``, ``broker_password``,
``broker_vhost``, ``broker_port``, ``broker_transport``, ``broker_failover_strategy`` defaults) to kombu;
:func:`broker_connection` does the same for the publisher, its health check, the CLI and the test kit, so
that they reach a broker the worker reaches. On top, TLS verifies by default: the server's certificate
(``cert_reqs=CERT_REQUIRED``, the system's CAs unless ``ca_certs`` names others) and its name, which py-amqp
checks only when ``server_hostname`` is set (it is set to the URL's host). Turning verification off logs one
WARNING.
"""
from __future__ import annotations

__all__ = ["broker_connection", "connected", "connection_options", "tls_options", "unreachable",
           "failure_reason"]

import logging
import ssl
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from kombu import Connection
from kombu.utils.url import parse_url

from ..core.logs import safe_text, safe_url
from ..errors import BrokerUnavailableError, ConfigurationError

logger = logging.getLogger(__name__)

#: URL schemes that mean TLS (kombu's py-amqp transports).
TLS_SCHEMES = frozenset({"amqps", "pyamqps"})
#: Celery's default ``broker_connection_timeout``, for a connection made without an app.
DEFAULT_CONNECT_TIMEOUT_S = 4.0
# Celery setting -> kombu.Connection keyword, passed when set (Celery's own defaults are None).
_PASSED = {"broker_user": "userid", "broker_password": "password", "broker_vhost": "virtual_host",
           "broker_port": "port", "broker_transport": "transport", "broker_login_method": "login_method",
           "broker_failover_strategy": "failover_strategy"}
_warned: set[tuple[str, str]] = set()


def broker_connection(url: str, app: Any = None, *, connect_timeout: float | None = None,
                      heartbeat: bool = False) -> Connection:
    """A kombu Connection (not yet connected) to ``url`` with the broker settings of Celery ``app``.

    ``connect_timeout``: given, it wins over ``broker_connection_timeout`` (as in Celery).
    ``heartbeat``: carry ``broker_heartbeat``, only for a connection whose owner calls
    ``heartbeat_check`` (like Celery's ``connection_for_write``, the default sends none, so that
    an idle publisher's connection is not closed by the broker).
    """
    return Connection(url, **connection_options(url, getattr(app, "conf", None), connect_timeout=connect_timeout,
                                                heartbeat=heartbeat))


@contextmanager
def connected(url: str, app: Any = None) -> Iterator[Connection]:
    """A connected :func:`broker_connection`, released on leaving; an unreachable broker: one clear error
    (:class:`~kombu_events.errors.BrokerUnavailableError`, the URL without its password)."""
    conn = broker_connection(url, app)
    try:
        conn.ensure_connection(max_retries=1)
    except Exception as exc:
        conn.release()
        raise unreachable(url, exc) from exc
    try:
        yield conn
    finally:
        conn.release()


def connection_options(url: str, conf: Any = None, *, connect_timeout: float | None = None,
                       heartbeat: bool = False) -> dict[str, Any]:
    """The keyword arguments of ``kombu.Connection(url, ...)`` from a Celery app's ``conf`` (None: no app)."""
    options: dict[str, Any] = {kombu: _setting(conf, name) for name, kombu in _PASSED.items()
                               if _setting(conf, name) is not None}
    options["ssl"] = tls_options(url, _setting(conf, "broker_use_ssl"))
    options["transport_options"] = dict(_setting(conf, "broker_transport_options") or {})
    if connect_timeout is None:
        connect_timeout = _setting(conf, "broker_connection_timeout", DEFAULT_CONNECT_TIMEOUT_S)
    options["connect_timeout"] = connect_timeout
    if heartbeat and _setting(conf, "broker_heartbeat"):
        options["heartbeat"] = float(_setting(conf, "broker_heartbeat"))
    return options


def tls_options(url: str, use_ssl: Any) -> dict[str, Any] | bool:
    """py-amqp's ``ssl=`` for ``url`` and ``broker_use_ssl``: False for plain AMQP, else a dict that
    verifies the server's certificate and hostname unless ``use_ssl`` turns it off (then one WARNING)."""
    if isinstance(use_ssl, ssl.SSLContext):
        raise ConfigurationError(
            "broker_use_ssl is an ssl.SSLContext, which py-amqp (Celery's amqp transport) ignores: it would "
            "connect with default TLS settings, without your CA or client certificate. Give a dict instead: "
            "{'ca_certs': PATH, 'certfile': PATH, 'keyfile': PATH, 'cert_reqs': ssl.CERT_REQUIRED}")
    if use_ssl is not None and not isinstance(use_ssl, (bool, Mapping)):
        raise ConfigurationError(f"broker_use_ssl must be True, False or a dict of ssl options "
                                 f"(keyfile, certfile, ca_certs, cert_reqs, server_hostname), got {use_ssl!r}")
    hosts = [parse_url(one) for one in url.split(";") if one.strip()]
    if not use_ssl and not any(host.get("transport") in TLS_SCHEMES for host in hosts):
        return False
    options = dict(use_ssl) if isinstance(use_ssl, Mapping) else {}
    if "context" in options:  # py-amqp: ssl.create_default_context(**context), which verifies; check_hostname too
        options["context"] = context = dict(options["context"])
        if context.get("check_hostname") is None:
            context["check_hostname"] = True
        unverified = "" if context["check_hostname"] else "the broker's name (context check_hostname=False)"
    else:
        if options.get("cert_reqs") is None:
            options["cert_reqs"] = ssl.CERT_REQUIRED
        unverified = "" if options["cert_reqs"] != ssl.CERT_NONE else "the broker's certificate (cert_reqs=CERT_NONE)"
    if not unverified and options.get("server_hostname") is None:
        if len(hosts) == 1:
            options["server_hostname"] = hosts[0].get("hostname") or "localhost"
        else:  # one name for every fail-over host would fail all but one (kombu's own fill-in keeps the first)
            options.pop("server_hostname", None)
            unverified = "the broker's name (several fail-over URLs: set broker_use_ssl['server_hostname'])"
    if unverified:
        _warn_once(url, unverified)
    return options


def unreachable(url: str, exc: BaseException, doing: str = "cannot reach the broker at") -> BrokerUnavailableError:
    """The error to raise ``from exc`` when a connection to ``url`` failed: the broker (password masked), and why."""
    return BrokerUnavailableError(safe_text(f"{doing} {safe_url(url)}: {failure_reason(exc, url)}"))


def failure_reason(exc: BaseException, url: str = "") -> str:
    """Why a connection failed, in one line; for a TLS failure, what was refused and which setting fixes it."""
    tls = _ssl_error(exc)
    if isinstance(tls, ssl.SSLCertVerificationError):
        why = getattr(tls, "verify_message", None) or str(tls)
        if "mismatch" in why:
            return (f"TLS: the broker's certificate is not valid for the host connected to ({why}); connect to "
                    "a name in its subjectAltName, or set broker_use_ssl['server_hostname']")
        return (f"TLS: the broker's certificate was not verified ({why}); name the CA that signed it: "
                "broker_use_ssl={'ca_certs': PATH, ...}")
    if tls is not None:
        text = str(tls)
        if "CERTIFICATE_REQUIRED" in text.upper() or "certificate required" in text:
            return (f"TLS: the broker requires a client certificate ({text}): "
                    "broker_use_ssl={'certfile': PATH, 'keyfile': PATH, ...}")
        if "EOF" in text or "ALERT" in text.upper():  # the broker hung up on the handshake: it refused us
            return (f"TLS: the broker ended the handshake ({text}); does it require a client certificate "
                    "(broker_use_ssl={'certfile': PATH, 'keyfile': PATH, ...}) or not trust the one given?")
        return f"TLS: {text}"
    text = str(exc) or type(exc).__name__
    plain = url and not any(parse_url(one).get("transport") in TLS_SCHEMES for one in url.split(";") if one.strip())
    root = _root(exc)
    # 3.10's TLS listener resets a plain AMQP handshake; 4.0's closes it, which py-amqp reads as an OSError.
    hung_up = isinstance(root, OSError) and "unexpectedly closed connection" in str(root)
    if plain and (hung_up or isinstance(root, (ConnectionResetError, ConnectionAbortedError, EOFError))):
        text += " (if that port takes TLS only: use amqps:// and broker_use_ssl)"
    return text


def _ssl_error(exc: BaseException | None) -> ssl.SSLError | None:
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, ssl.SSLError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _root(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return exc


def _setting(conf: Any, name: str, default: Any = None) -> Any:
    value = None if conf is None else conf.get(name)
    return default if value is None else value


def _warn_once(url: str, what: str) -> None:
    if (url, what) not in _warned:
        _warned.add((url, what))
        logger.warning("TLS to %s does not verify %s in broker_use_ssl: anyone on the path can pose as the "
                       "broker", safe_url(url), what)
