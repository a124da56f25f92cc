"""kombu-events: consume AMQP events in a Celery worker, with broker-side retries and an archive."""
from __future__ import annotations

__version__ = "0.2.0"

from .backoff import Constant, Exponential
from .decision import Outcome
from .delivery import Delivery
from .errors import (
    BrokerUnavailableError,
    ConfigurationError,
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
from .middleware import Middleware

__all__ = [
    "Events", "Event", "Retry", "Archive", "Poisoned", "poisonous", "Exponential", "Constant",
    "Middleware", "Delivery", "Outcome", "HeaderError",
    "KombuEventsError", "ConfigurationError", "DelayTooLongError", "TopologyConflictError",
    "PublishError", "UnroutableError", "BrokerUnavailableError", "DecodeError", "EncodeError",
]
