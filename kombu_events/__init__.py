"""kombu-events: consume AMQP events in a Celery worker, with broker-side retries and an archive."""
from __future__ import annotations

__version__ = "0.2.0"

from .backlog import Backlog
from .backoff import Constant, Exponential
from .circuit import CircuitBreaker
from .decision import Outcome
from .delivery import Delivery
from .errors import (
    BacklogError,
    BacklogFullError,
    BrokerUnavailableError,
    ConfigurationError,
    ConfirmTimeoutError,
    DecodeError,
    DelayTooLongError,
    EncodeError,
    HeaderError,
    KombuEventsError,
    PublishError,
    TopologyConflictError,
    UnroutableError,
)
from .event import Event
from .events import Events
from .failures import Archive, Poisoned, Retry, poisonous
from .health import Degraded, Healthy, Unhealthy
from .middleware import Middleware
from .parking import Published
from .probes import PublisherCheck

__all__ = [
    "Events", "Event", "Retry", "Archive", "Poisoned", "poisonous", "Exponential", "Constant",
    "Middleware", "Delivery", "Outcome", "HeaderError", "CircuitBreaker", "Healthy", "Degraded", "Unhealthy",
    "Published", "Backlog", "PublisherCheck",
    "KombuEventsError", "ConfigurationError", "DelayTooLongError", "TopologyConflictError",
    "PublishError", "UnroutableError", "ConfirmTimeoutError", "BrokerUnavailableError", "BacklogError",
    "BacklogFullError",
    "DecodeError", "EncodeError",
]
