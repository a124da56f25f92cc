"""The worker's HTTP endpoint: ``/metrics`` for Prometheus and ``/healthz`` for a liveness probe.

:func:`serve_worker` is what ``celery worker --with-events-step --events-metrics-port PORT``
runs: one :class:`~kombu_events.integrations.metrics.PrometheusMetrics` (a registry of its own) and
one :class:`~kombu_events.integrations.liveness.Liveness` added to every service, served by a
small threaded HTTP server in the worker's main process. Pool processes forked after
it close their copy of the listening socket.
"""
from __future__ import annotations

__all__ = ["Exporter", "make_app", "serving_registry", "serve_worker", "MULTIPROC_ENV"]

import logging
import os
import socket
import sys
import threading
import weakref
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app, values
from prometheus_client.multiprocess import MultiProcessCollector

from ..core.config import MetricsSettings
from ..errors import ConfigurationError
from ..registry import EventsService
from .liveness import Liveness
from .metrics import PrometheusMetrics

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _OwnAndFiles:
    """Multiprocess mode: what this process keeps in memory, and what every process wrote to the directory.

    The worker's own counts (messages, handler time, in flight, depths, breakers) are
    plain numbers of its main process, served from memory. What lives in the directory
    -- ``kombu_events_published_total``, counted wherever events are published (pool
    processes too), and the application's own metrics -- is summed over processes, and
    wins over this process's copy of the same family.
    """

    def __init__(self, registry: CollectorRegistry, path: str) -> None:
        self._own = registry
        self._files = MultiProcessCollector(None, path)

    def collect(self) -> Iterable[Any]:
        files = list(self._files.collect())
        names = {m.name for m in files}
        yield from (m for m in self._own.collect() if m.name not in names)
        yield from files


def serving_registry(registry: CollectorRegistry, environ: Mapping[str, str] | None = None) -> CollectorRegistry:
    """What ``/metrics`` serves: ``registry``; with ``PROMETHEUS_MULTIPROC_DIR`` set, the directory's sums too."""
    environ = os.environ if environ is None else environ
    path = environ.get(MULTIPROC_ENV)
    if not path:
        return registry
    if not os.path.isdir(path):
        raise ConfigurationError(f"{MULTIPROC_ENV}={path!r} is not a directory: create it (empty) before the "
                                 "worker starts, or unset it")
    if not getattr(values.ValueClass, "_multiprocess", False):
        logger.warning("kombu-events: %s was set after prometheus_client was imported: serving this "
                       "process's metrics only", MULTIPROC_ENV)
        return registry
    serving = CollectorRegistry(auto_describe=False)
    serving.register(_OwnAndFiles(registry, path))
    return serving


def make_app(metrics: CollectorRegistry, liveness: Liveness) -> WSGIApp:
    """WSGI app: ``/metrics`` (and ``/``) from ``metrics``; ``/healthz`` 200 or 503 from ``liveness``."""
    serve_metrics = make_wsgi_app(metrics)

    def route(environ: dict[str, Any], start_response: Callable[..., Any], path: str) -> Iterable[bytes]:
        if path in ("/metrics", "/"):
            return serve_metrics(environ, start_response)
        if path == "/healthz":
            alive, why = liveness.check()
            return _text(start_response, "200 OK" if alive else "503 Service Unavailable", why)
        return _text(start_response, "404 Not Found", "not found: try /metrics or /healthz")

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        try:
            return route(environ, start_response, path)
        except Exception:  # a collector that raises: a 500 and a log line of ours, not a traceback on stderr
            logger.exception("kombu-events: serving %s failed", path)
            return _text(start_response, "500 Internal Server Error", f"serving {path} failed: see the worker's log",
                         sys.exc_info())

    return app


def _text(start_response: Callable[..., Any], status: str, text: str, exc_info: Any = None) -> list[bytes]:
    body = (text + "\n").encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))],
                   exc_info)
    return [body]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not worth a log line."""


_open: weakref.WeakSet[Exporter] = weakref.WeakSet()


class Exporter:
    """A threaded HTTP server for ``app`` on ``host:port``, in a daemon thread."""

    def __init__(self, host: str, port: int, app: WSGIApp) -> None:
        server_class = _Server6 if ":" in host else _Server
        try:
            self.server = make_server(host, port, app, server_class, handler_class=_Quiet)
        except OSError as exc:
            raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self.host, self.port = host, self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="kombu-events-metrics", daemon=True)
        self._thread.start()
        _open.add(self)

    def close(self) -> None:
        """Stop serving and close the socket."""
        _open.discard(self)
        self.server.shutdown()
        self.server.server_close()

    def _forget_in_child(self) -> None:
        """A forked pool process must not keep the port open (it serves nothing)."""
        try:
            self.server.socket.close()
        except OSError:
            pass


def _after_fork_in_child() -> None:
    for exporter in list(_open):
        exporter._forget_in_child()
    _open.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def serve_worker(services: Iterable[EventsService], settings: MetricsSettings) -> Exporter:
    """Add metrics and a heartbeat to every service's middleware; serve them on ``settings``' address."""
    assert settings.port is not None, "serve_worker needs a port"
    own = CollectorRegistry()
    serving = serving_registry(own)  # checks PROMETHEUS_MULTIPROC_DIR before any metric writes a file
    metrics, liveness = PrometheusMetrics(own), Liveness(settings.liveness_s)
    for events in services:
        events.add_middleware(metrics)
        events.add_middleware(liveness)
    exporter = Exporter(settings.host, settings.port, make_app(serving, liveness))
    logger.info("kombu-events: serving /metrics and /healthz on http://%s:%s", settings.host, exporter.port)
    return exporter
