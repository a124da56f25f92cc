"""kombu-events: consume AMQP events in a Celery worker, with broker-side retries and an archive."""
from __future__ import annotations

__version__ = "0.1.0"

from .backoff import Constant, Exponential
from .errors import (
    BrokerUnavailableError,
    ConfigurationError,
    DecodeError,
    DelayTooLongError,
    EncodeError,
    KombuEventsError,
    PublishError,
    TopologyConflictError,
    UnroutableError,
)
from .event import Event
from .events import Events
from .failures import Archive, Poisoned, Retry, poisonous

__all__ = [
    "Events", "Event", "Retry", "Archive", "Poisoned", "poisonous", "Exponential", "Constant",
    "KombuEventsError", "ConfigurationError", "DelayTooLongError", "TopologyConflictError",
    "PublishError", "UnroutableError", "BrokerUnavailableError", "DecodeError", "EncodeError",
]
