"""Settings of an events service: defaults, environment, Celery config, validation (the management API's URL:
:mod:`.management_url`)."""
from __future__ import annotations

__all__ = ["Settings", "resolve_settings", "check_setting_names", "broker_url", "ENV", "MANAGEMENT_URL_ENV",
           "SETTING_NAMES", "DJANGO_CONNECTIONS", "MetricsSettings", "resolve_metrics_settings",
           "check_management_url", "management_base_url"]

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..errors import ConfigurationError
from . import ladder, names
from .backoff import Backoff, Exponential
from .breaker import CircuitBreaker
from .codec import MAX_BODY_BYTES, accept_set
from .management_url import MANAGEMENT_URL_ENV, check_management_url, management_base_url

#: Environment variables honoured (celery-amqp-events' names for retries and the archive).
ENV = {
    "max_retries": "AMQP_EVENTS_MAX_RETRIES",
    "archive_ttl_ms": "AMQP_EVENTS_ARCHIVED_MESSAGE_TTL",
    "archive_max_length": "AMQP_EVENTS_ARCHIVED_QUEUE_LENGTH",
    "archive_max_bytes": "KOMBU_EVENTS_ARCHIVE_MAX_BYTES",
}

QUEUE_TYPES = ("classic", "quorum")

#: What the worker does with Django's database connections around each handler (when Django is in use).
DJANGO_CONNECTIONS = ("close", "max_age", "off")

#: Valid range of every integer setting (inclusive).
LIMITS = {
    "max_retries": (0, 10_000),
    "delay_levels": (1, 32),
    "delay_unit_ms": (1, 24 * 3600 * 1000),
    "publish_delay_levels": (0, 32),
    "publish_delay_unit_ms": (1, 24 * 3600 * 1000),
    "archive_ttl_ms": (0, 2**32 - 1),
    "archive_max_length": (0, 2**31 - 1),
    "archive_max_bytes": (0, 2**53),
    "prefetch_count": (1, 65_535),
    "traceback_limit": (0, 60_000),
    "quorum_initial_group_size": (1, 999),
    "max_body_bytes": (1, 2**31 - 1),
    "inflight_max_bytes": (0, 2**40),
    "async_concurrency": (1, 10_000),
    "inbox_retention_ms": (0, 2**53),
    "outbox_poll_interval_ms": (1, 3_600_000),
    "outbox_batch_size": (1, 10_000),
    "retry_in_place_ms": (0, 60_000),
}

#: Integer settings that may be left unset (None): the library then picks (see auto_prefetch).
UNSET_ALLOWED = frozenset({"prefetch_count", "inbox_retention_ms"})


@dataclass(frozen=True)
class Settings:
    """Everything that shapes one service's topology and failure policy.

    Read from, in order: keyword arguments of :class:`~kombu_events.Events`, Celery
    settings prefixed ``kombu_events_`` (``kombu_events_max_retries``), the
    environment variables in :data:`ENV`, then these defaults.
    """

    service: str
    exchange: str = "events"
    max_retries: int = 5
    backoff: Backoff | None = None  # default: Exponential capped at 1 h or the ladder's reach
    delay_levels: int = 16
    delay_unit_ms: int = 1000
    publish_delay_levels: int = 16
    publish_delay_unit_ms: int = 1000
    archive_ttl_ms: int = 7 * 24 * 3600 * 1000
    #: No longer bounds the archive (a stream is bounded by age and bytes); read for compatibility only.
    archive_max_length: int = 100_000
    #: The archive stream's retention by size (``x-max-length-bytes``; 0: none): its oldest segments go past it.
    archive_max_bytes: int = 1024**3
    prefetch_count: int | None = None  # per handler queue; None: auto_prefetch(number of handler queues)
    queue_type: str = "classic"
    quorum_initial_group_size: int = 3  # replicas of each quorum queue (at most the cluster's nodes)
    accept_content: tuple[str, ...] = ("application/json",)
    #: Largest body a handler gets, as received and once inflated (a ``compression`` header); larger: archived.
    max_body_bytes: int = MAX_BODY_BYTES
    #: Body bytes a worker holds for this service, received and not settled (0: no budget). Past it the
    #: worker takes no more until some are settled; each consumer's prefetch is capped so that bodies of
    #: ``max_body_bytes`` fit it. One body larger than the budget is still taken, alone.
    inflight_max_bytes: int = 256 * 1024 * 1024
    traceback_limit: int = 2000
    django_connections: str = "close"
    circuit_breaker: CircuitBreaker | None = None  # every handler's, unless it says otherwise; off by default
    declare: bool = True  # False: workers only check the topology `kombu-events declare` created (no configure)
    #: ``async def`` handlers awaited at once per pool process (or thread), on its asyncio loop.
    async_concurrency: int = 100
    #: Inbox rows older than this are pruned by the worker (None: the archive's TTL; 0: never). effectively-once.md
    inbox_retention_ms: int | None = None
    #: How often the outbox relay looks for committed rows when the last pass found fewer than a batch.
    outbox_poll_interval_ms: int = 200
    #: Outbox rows one relay pass claims, publishes (pipelined confirms) and deletes in one transaction.
    outbox_batch_size: int = 100
    #: A retry whose delay is at most this runs again in the worker after its delay, the message held unacked,
    #: instead of going through the ladder (0: every retry goes through the ladder). docs/failures.md
    retry_in_place_ms: int = 0
    #: RabbitMQ's management API (``https://rabbitmq.internal:15671``), asked with the broker connection's
    #: credentials by ``status``, ``health``, the console and a ``declare=False`` worker's check. None:
    #: ``http://<broker host>:15672`` (which that worker does not ask over a TLS broker connection).
    management_url: str | None = None

    def __post_init__(self) -> None:
        names.validate_name("service", self.service, max_bytes=200)
        names.validate_name("exchange", self.exchange)
        for setting, (low, high) in LIMITS.items():
            value = getattr(self, setting)
            if value is not None or setting not in UNSET_ALLOWED:
                _check_int(setting, value, low, high)
        _check_choice("queue_type", self.queue_type, QUEUE_TYPES)
        _check_choice("django_connections", self.django_connections, DJANGO_CONNECTIONS)
        if isinstance(self.accept_content, str) or not self.accept_content:
            raise ConfigurationError(
                f"accept_content must be a non-empty list of content types, got {self.accept_content!r}"
            )
        accept_set(self.accept_content)  # unknown serializer names fail here, at start-up
        if self.backoff is not None and not callable(getattr(self.backoff, "delay_ms", None)):
            raise ConfigurationError(
                f"backoff must be a backoff policy such as Exponential(...) or Constant(...), got {self.backoff!r}"
            )
        if self.publish_delay_levels and len(self.exchange.encode("utf-8")) > names.MAX_NAME_BYTES - 13:
            raise ConfigurationError(
                f"exchange={self.exchange!r} leaves no room for the names of its delayed-publishing ladder "
                f"('<exchange>.deferred.<level>' must fit {names.MAX_NAME_BYTES} bytes): shorten it, "
                "or set publish_delay_levels=0")
        for levels, unit in (("delay_levels", "delay_unit_ms"), ("publish_delay_levels", "publish_delay_unit_ms")):
            _check_ladder(levels, getattr(self, levels), unit, getattr(self, unit))
        self._check_circuit_breaker()
        if not isinstance(self.declare, bool):
            raise ConfigurationError(f"declare must be True or False, got {self.declare!r}")
        if self.management_url is not None:
            check_management_url(self.management_url)
        backoff = self.backoff
        if backoff is None:
            backoff = Exponential(max_delay_ms=min(3_600_000, self.max_delay_ms))
            object.__setattr__(self, "backoff", backoff)
        self.check_delay("backoff max_delay_ms", backoff.max_delay_ms)

    def _check_circuit_breaker(self) -> None:
        """A CircuitBreaker, or None; a mapping (from Celery config) becomes ``CircuitBreaker(**mapping)``."""
        value: Any = self.circuit_breaker
        if isinstance(value, Mapping):
            try:
                value = CircuitBreaker(**value)
            except TypeError as exc:
                raise ConfigurationError(f"circuit_breaker={dict(value)!r}: {exc}") from None
            object.__setattr__(self, "circuit_breaker", value)
        elif value is False:
            object.__setattr__(self, "circuit_breaker", None)
        elif value is not None and not isinstance(value, CircuitBreaker):
            raise ConfigurationError(
                f"circuit_breaker must be a CircuitBreaker(...) or a mapping of its fields, got {value!r}")

    @property
    def max_queue_bytes(self) -> int:
        """Longest handler queue name: its ladder routing key must fit 255 bytes."""
        return names.MAX_NAME_BYTES - 2 * self.delay_levels

    @property
    def max_binding_key_bytes(self) -> int:
        """Longest binding key: its delayed-publishing binding (one word per level before it) must fit."""
        return names.MAX_NAME_BYTES - 2 * self.publish_delay_levels

    @property
    def max_publish_delay_ms(self) -> int:
        """Longest delay ``events.publish(..., delay=...)`` can ask for (0: delayed publishing is off)."""
        return ladder.max_delay_units(levels=self.publish_delay_levels) * self.publish_delay_unit_ms

    @property
    def max_delay_ms(self) -> int:
        """Longest delay the ladder can hold."""
        return ladder.max_delay_units(levels=self.delay_levels) * self.delay_unit_ms

    @property
    def default_backoff(self) -> Backoff:
        """The service's backoff (``backoff``, always set once the settings are validated)."""
        assert self.backoff is not None  # __post_init__ sets the default
        return self.backoff

    def prefetch_per_queue(self, queues: int) -> int:
        """Messages in flight per handler queue for a service of ``queues`` handler queues."""
        return auto_prefetch(queues) if self.prefetch_count is None else self.prefetch_count

    def check_delay(self, setting: str, delay_ms: float) -> None:
        """Raise ConfigurationError if ``delay_ms`` does not fit the ladder."""
        if delay_ms != float("inf") and delay_ms <= self.max_delay_ms:
            return
        raise ConfigurationError(
            f"{setting}={delay_ms:g} does not fit the delay ladder: {self.delay_levels} levels of "
            f"{self.delay_unit_ms} ms hold at most {self.max_delay_ms} ms; lower it or raise delay_levels"
        )


#: Unset ``prefetch_count``: this many per handler queue, fewer once the service has more than
#: PREFETCH_BUDGET // DEFAULT_PREFETCH queues, never fewer than MIN_AUTO_PREFETCH.
DEFAULT_PREFETCH, PREFETCH_BUDGET, MIN_AUTO_PREFETCH = 100, 500, 10


def auto_prefetch(queues: int) -> int:
    """Per-queue prefetch when the user set none: 100, or a share of 500 in flight for many queues.

    Every handler queue has its own consumer, so a service of 50 queues at 100 each could
    hold 5,000 messages in one worker, all redelivered if it dies and none left for the
    fleet's other workers. Throughput with 50 queues was within run-to-run noise either way
    (benchmarks/README.md, "Scaling").
    """
    return max(MIN_AUTO_PREFETCH, min(DEFAULT_PREFETCH, PREFETCH_BUDGET // max(1, queues)))


#: The largest x-message-ttl RabbitMQ accepts (ms, about 49.7 days).
MAX_TTL_MS = 2**32 - 1


def _check_ladder(levels_setting: str, levels: int, unit_setting: str, unit_ms: int) -> None:
    """The top level of a ladder waits ``unit_ms * 2**(levels - 1)``: RabbitMQ must accept it as a queue TTL."""
    if levels and unit_ms * 2 ** (levels - 1) > MAX_TTL_MS:
        fit = max(n for n in range(1, 33) if unit_ms * 2 ** (n - 1) <= MAX_TTL_MS)
        raise ConfigurationError(
            f"{levels_setting}={levels} with {unit_setting}={unit_ms}: the top level's TTL "
            f"({unit_ms * 2 ** (levels - 1)} ms) is more than RabbitMQ accepts ({MAX_TTL_MS} ms, about 49 days); "
            f"at most {fit} levels of {unit_ms} ms")


def _check_int(setting: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigurationError(f"{setting} must be an integer within {low} .. {high}, got {value!r}")


def _check_choice(setting: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigurationError(f"{setting}={value!r} is not one of {', '.join(choices)}")


def _from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    url = environ.get(MANAGEMENT_URL_ENV)
    if url:
        check_management_url(url, variable=MANAGEMENT_URL_ENV)
        found["management_url"] = url
    for setting, variable in ENV.items():
        raw = environ.get(variable)
        if raw is None or raw == "":
            continue
        try:
            found[setting] = int(raw)
        except ValueError:
            low, high = LIMITS[setting]
            raise ConfigurationError(
                f"{variable}={raw!r} (setting {setting}) must be an integer within {low} .. {high}"
            ) from None
    return found


SETTING_NAMES = frozenset(f.name for f in fields(Settings)) - {"service"}


def check_setting_names(overrides: Mapping[str, Any]) -> None:
    """Raise ConfigurationError naming any key of ``overrides`` that is not a setting."""
    unknown = set(overrides) - SETTING_NAMES
    if unknown:
        raise ConfigurationError(
            f"unknown setting(s) {', '.join(sorted(unknown))}; valid: {', '.join(sorted(SETTING_NAMES))}"
        )


def resolve_settings(
    service: str,
    conf: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Build and validate :class:`Settings` from keyword overrides, Celery conf and environment."""
    environ = os.environ if environ is None else environ
    check_setting_names(overrides)
    values = _from_env(environ)
    for name in SETTING_NAMES:
        value = _conf_get(conf, f"kombu_events_{name}")
        if value is not None:
            values[name] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "accept_content" in values and not isinstance(values["accept_content"], str):
        values["accept_content"] = tuple(values["accept_content"])
    return Settings(service=service, **values)


def _conf_get(conf: Mapping[str, Any] | None, key: str) -> Any:
    if conf is None:
        return None
    try:
        return conf.get(key)
    except Exception:  # Celery's Settings may raise on odd keys; treat as unset.
        return None


@dataclass(frozen=True)
class MetricsSettings:
    """Where a worker serves ``/metrics`` and ``/healthz`` (one per worker, not per service).

    ``port`` None: no endpoint. ``liveness_s``: ``/healthz`` answers 503 once the
    worker's event loop has not turned for that long.
    """

    port: int | None = None
    host: str = "127.0.0.1"
    liveness_s: float = 10.0

    def __post_init__(self) -> None:
        if self.port is not None:
            _check_int("kombu_events_metrics_port", self.port, 1, 65_535)
        if not isinstance(self.host, str) or not self.host.strip() or any(c.isspace() for c in self.host):
            raise ConfigurationError(f"kombu_events_metrics_host must be a host name or address such as "
                                     f"127.0.0.1 or 0.0.0.0, got {self.host!r}")
        value = self.liveness_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= 3600:
            raise ConfigurationError(f"kombu_events_metrics_liveness_s must be a number of seconds within "
                                     f"1 .. 3600, got {value!r}")


def resolve_metrics_settings(conf: Mapping[str, Any] | None, *, port: int | None = None) -> MetricsSettings:
    """:class:`MetricsSettings` from the worker's ``--events-metrics-port`` (``port``), else Celery conf."""
    values: dict[str, Any] = {}
    for name in ("port", "host", "liveness_s"):
        value = _conf_get(conf, f"kombu_events_metrics_{name}")
        if value is not None:
            values[name] = value
    if port is not None:
        values["port"] = port
    return MetricsSettings(**values)


def broker_url(app: Any = None, explicit: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Broker URL: ``explicit`` (``--broker``), else ``RABBIT_URL``, else the Celery app's."""
    environ = os.environ if environ is None else environ
    if explicit:
        return explicit
    if environ.get("RABBIT_URL"):
        return environ["RABBIT_URL"]
    if app is not None and app.conf.broker_url:
        return str(app.conf.broker_url)
    return "amqp://guest:guest@localhost:5672//"

