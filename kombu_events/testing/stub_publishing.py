"""What the stub publishes, and as whom: the messages of ``StubEvents.publish``, the user of the app's broker
URL, and the publisher the app's services publish through while a stub stands in for the broker."""
from __future__ import annotations

__all__ = ["published_message", "broker_user", "default_exchange", "StubPublisher"]

import logging
from typing import Any, Iterable, Mapping
from urllib.parse import unquote, urlsplit

from .. import registry
from ..core.contracts import outgoing
from ..errors import ConfigurationError, PublishError
from ..events import Events
from ..publishing.publisher import Publisher, build_message
from .stub_broker import StubBroker

logger = logging.getLogger(__name__)


def published_message(payload: Any, headers: Mapping[str, Any] | None, content_type: str | None,
                      content_encoding: str | None, message_id: str | None, correlation_id: str | None,
                      properties: Mapping[str, Any] | None) -> tuple[bytes, dict[str, Any]]:
    """The body and properties :meth:`~kombu_events.testing.stub.StubEvents.publish` sends, as any AMQP
    publisher would."""
    message = build_message(None if isinstance(payload, bytes) else outgoing(payload), message_id=message_id,
                            correlation_id=correlation_id, headers=headers)
    sent = dict(message.properties)
    for name, value in (("content_type", content_type), ("content_encoding", content_encoding)):
        if value is None:
            sent.pop(name, None)
        else:
            sent[name] = value
    sent.update(properties or {})
    return (payload if isinstance(payload, bytes) else bytes(message.body)), sent


def broker_user(url: Any) -> str | None:
    """The user name of the app's (first) broker URL, as the worker's connection would log in; None if none."""
    try:
        user = urlsplit(str(url or "").split(";")[0]).username
    except ValueError:
        return None
    return unquote(user) if user else None


def default_exchange(events: Events | None, app: Any) -> str:
    """The exchange :meth:`~kombu_events.testing.stub.StubEvents.publish` publishes to when given none: the
    target's, else the app's one."""
    if events is not None:
        return str(events.settings.exchange)
    exchanges = sorted({service.settings.exchange for service in registry.services_of(app)})
    if len(exchanges) != 1:
        raise ConfigurationError(f"the app's services use exchanges {exchanges}: pass exchange=")
    return str(exchanges[0])


class StubPublisher(Publisher):
    """What ``Events.publish`` and ``publish_many`` publish through while a stub stands in for the broker."""

    def __init__(self, broker: StubBroker) -> None:
        super().__init__("memory://")
        self.broker = broker

    def send_many(self, items: Iterable[tuple[str, str, Any]]) -> list[PublishError | None]:
        """Route each message into the stub's broker, mandatory, as the broker would; one error or None each."""
        return [self.broker.route(exchange, routing_key, bytes(message.body), dict(message.properties), True)
                for exchange, routing_key, message in items]

    def close(self) -> None:
        """Nothing to close."""
