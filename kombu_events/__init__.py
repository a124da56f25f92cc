"""kombu-events: consume AMQP events in a Celery worker, with broker-side retries and an archive."""
from __future__ import annotations

from .core.backoff import Constant, Exponential
from .core.batch import BatchOf
from .core.breaker import CircuitBreaker
from .core.decision import DEFERRED, Outcome
from .core.delivery import Delivery
from .core.event import Event
from .core.health import Degraded, Healthy, Unhealthy
from .core.settlement import Step
from .errors import (
    Archive,
    BacklogError,
    BacklogFullError,
    BatchFailed,
    BrokerUnavailableError,
    ConfigurationError,
    ConfirmTimeoutError,
    DecodeError,
    DelayTooLongError,
    EncodeError,
    HeaderError,
    InvalidPayload,
    KombuEventsError,
    PartitionsChangedError,
    PluginMissingError,
    Poisoned,
    PublishError,
    Retry,
    TopologyConflictError,
    UnroutableError,
    poisonous,
)
from .events import Events
from .middleware.base import Middleware
from .publishing.backlog import Backlog
from .publishing.health import PublisherCheck
from .publishing.published import Published
from .version import __version__ as __version__

__all__ = [
    "Events", "Event", "Retry", "Archive", "Poisoned", "poisonous", "BatchOf", "BatchFailed", "Exponential", "Constant",
    "Middleware", "Delivery", "Outcome", "DEFERRED", "Step", "HeaderError", "CircuitBreaker", "Healthy",
    "Degraded", "Unhealthy",
    "Published", "Backlog", "PublisherCheck",
    "KombuEventsError", "ConfigurationError", "DelayTooLongError", "TopologyConflictError", "PluginMissingError",
    "PartitionsChangedError", "PublishError", "UnroutableError", "ConfirmTimeoutError", "BrokerUnavailableError",
    "BacklogError",
    "BacklogFullError",
    "DecodeError", "EncodeError", "InvalidPayload",
]
