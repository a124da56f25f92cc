"""Confirmed, mandatory publishing from application code (``Events.publish``, the CLI)."""
from __future__ import annotations

__all__ = ["Publisher", "build_message", "addressed"]

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Iterable, Mapping

from amqp import Message
from amqp.exceptions import AccessRefused, NotFound, PreconditionFailed
from kombu import Connection

from ..broker.confirms import RETURNED, Confirmer
from ..broker.connections import broker_connection, unreachable
from ..core import wire
from ..core.logs import refusal_text, safe_url
from ..core.topology import Topology
from ..errors import (
    BrokerUnavailableError,
    ConfigurationError,
    ConfirmTimeoutError,
    EncodeError,
    PublishError,
    UnroutableError,
    seconds_to_ms,
)

logger = logging.getLogger(__name__)

PERSISTENT = 2


def build_message(
    payload: Any,
    *,
    message_id: str | None = None,
    correlation_id: str | None = None,
    headers: Mapping[str, Any] | None = None,
) -> Message:
    """A persistent JSON message with a fresh ``message_id`` unless one is given."""
    try:
        body = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise EncodeError(f"payload is not JSON serialisable: {exc}") from exc
    properties: dict[str, Any] = {
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "delivery_mode": PERSISTENT,
        "message_id": message_id or uuid.uuid4().hex,
        "timestamp": int(time.time()),
        "application_headers": dict(headers or {}),
    }
    if correlation_id:
        properties["correlation_id"] = correlation_id
    return Message(body, **properties)


def addressed(topology: Topology, routing_key: str, message: Message, delay_s: float = 0) -> tuple[str, str]:
    """(exchange, routing key) to publish ``message`` to for an event ``routing_key`` after ``delay_s``.

    No delay: the events exchange. A delay: the events exchange's own ladder; the
    event's key goes in a header, so handlers see it, not the ladder's.
    """
    if isinstance(delay_s, bool) or not isinstance(delay_s, (int, float)) or not delay_s >= 0:
        raise ConfigurationError(f"delay must be a number of seconds >= 0, got {delay_s!r}")
    if not delay_s:
        return topology.settings.exchange, routing_key
    address = topology.publish_address(routing_key, seconds_to_ms(delay_s))
    message.properties["application_headers"][wire.ROUTING_KEY] = routing_key
    return address.exchange, address.routing_key


class Publisher:
    """A lazily opened connection that sends built messages with confirms; safe across threads and forks.

    ``send`` and ``send_many`` take messages already built and addressed (``Events.publish``
    builds them, through :class:`~kombu_events.publishing.service.ServicePublisher`); each sends
    with ``Confirmer.publish`` (``kombu_events.broker.confirms``) (one ``basic.publish``).

    ``app``: the Celery app whose broker settings the connection takes (``broker_use_ssl``,
    ``broker_login_method``, ...; see ``kombu_events.broker.connections.broker_connection``).
    ``connect_timeout``: None takes the app's ``broker_connection_timeout``.
    """

    def __init__(self, url: str, *, app: Any = None, confirm_timeout: float = 30.0,
                 connect_timeout: float | None = None) -> None:
        self.url = url
        self.app = app
        self.confirm_timeout = confirm_timeout
        self.connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._pid = 0
        self._connection: Connection | None = None
        self._confirmer: Confirmer | None = None

    def _ensure(self) -> Confirmer:
        if self._confirmer is not None and self._pid == os.getpid():
            return self._confirmer
        self._connection = None  # a connection inherited through fork is never reused
        connection = broker_connection(self.url, self.app, connect_timeout=self.connect_timeout)
        try:
            connection.ensure_connection(max_retries=2, interval_start=0.2, interval_step=0.5)
            confirmer = Confirmer(connection.channel())
        except Exception as exc:
            connection.release()
            raise unreachable(self.url, exc) from exc
        self._connection, self._confirmer, self._pid = connection, confirmer, os.getpid()
        return confirmer

    def close(self) -> None:
        """Close the connection (it reopens on the next publish)."""
        with self._lock:
            if self._connection is not None and self._pid == os.getpid():
                self._connection.release()
            self._connection = self._confirmer = None

    def send(self, exchange: str, routing_key: str, message: Message) -> None:
        """Send one built message and wait for its confirm; raise if returned, nacked or unconfirmed."""
        errors = self.send_many([(exchange, routing_key, message)])
        if errors[0] is not None:
            raise errors[0]

    def send_many(self, items: Iterable[tuple[str, str, Message]]) -> list[PublishError | None]:
        """Send all, then wait for every confirm (pipelined); one error or None per item."""
        with self._lock:
            confirmer = self._ensure()
            results: list[PublishError | bool | None] = []
            try:
                for index, (exchange, routing_key, message) in enumerate(items):
                    results.append(False)
                    confirmer.publish(message, exchange, routing_key,
                                      on_ok=_setter(results, index, None),
                                      on_fail=_failer(results, index, exchange, routing_key))
                self._wait(confirmer)
            except Exception as exc:
                self._drop()
                if isinstance(exc, PublishError):
                    raise
                if isinstance(exc, NotFound):  # the channel is closed: nothing was delivered
                    raise PublishError(f"{exc.reply_text}: declare it "
                                       "(`kombu-events declare`, or start a consumer) before publishing") from exc
                if isinstance(exc, PreconditionFailed) and len(results) == 1:  # refused for certain
                    raise PublishError(f"RabbitMQ refused the message: {exc.reply_text} (from RabbitMQ 4 the "
                                       "broker's max_message_size is 16 MiB by default)") from exc
                if isinstance(exc, AccessRefused):  # the channel is closed: nothing was delivered
                    raise PublishError(f"{refusal_text(exc.reply_text, exc.method_sig)}; grant what "
                                       "`kombu-events -A APP permissions` prints") from exc
                raise BrokerUnavailableError(
                    f"publishing to {safe_url(self.url)} failed, delivery unknown: {exc}") from exc
            return results  # type: ignore[return-value]

    def _wait(self, confirmer: Confirmer) -> None:
        connection = self._connection
        assert connection is not None, "_ensure() opened it, under the same lock"
        deadline = time.monotonic() + self.confirm_timeout
        while confirmer.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConfirmTimeoutError(
                    f"{confirmer.pending} publish(es) not confirmed within {self.confirm_timeout} s")
            try:
                connection.drain_events(timeout=min(remaining, 1.0))
            except socket.timeout:
                continue

    def _drop(self) -> None:
        if self._connection is not None:
            try:
                self._connection.release()
            except Exception:  # the connection is already broken; nothing more to release
                pass
        self._connection = self._confirmer = None


def _setter(results: list, index: int, value: Any):
    def settle() -> None:
        results[index] = value
    return settle


def _failer(results: list, index: int, exchange: str, routing_key: str):
    def fail(why: str) -> None:
        if why == RETURNED:
            results[index] = UnroutableError(
                f"event {routing_key!r} published to exchange {exchange!r} was not routed to any queue "
                "(no queue is bound with a matching key; start a consumer or run `kombu-events declare`)",
                exchange=exchange, routing_key=routing_key)
        else:
            results[index] = PublishError(f"event {routing_key!r} to exchange {exchange!r}: {why}")
    return fail
