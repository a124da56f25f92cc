"""Bounded waits on the worker's connection: a broker that stops answering is a lost connection.

py-amqp waits for a method's reply (``basic_cancel``, ``basic_qos``, ``basic_consume``,
a passive ``queue_declare``) with no time limit. On the worker's event loop, a
connection that goes silent without closing (a proxy or a NAT that stops forwarding)
would hold the loop in that wait for ever, and Celery's heartbeat check, a timer on
the same loop, would never run. :func:`answer_within` bounds every such wait of ours;
when it runs out, :class:`BrokerSilent` -- a ``ConnectionError``, which Celery's loop
treats as a lost connection -- makes Celery reconnect and start the step again.
"""
from __future__ import annotations

__all__ = ["BrokerSilent", "answer_within", "call_within", "ANSWER_TIMEOUT_S"]

import logging
import socket
from contextlib import contextmanager
from typing import Any, Callable, Iterator

logger = logging.getLogger(__name__)

#: How long the broker has to answer one of our synchronous calls on the worker's connection.
ANSWER_TIMEOUT_S = 10.0


class BrokerSilent(ConnectionError):
    """The broker did not answer a call on the worker's connection in time: the connection is lost."""


@contextmanager
def answer_within(connection: Any, seconds: float = ANSWER_TIMEOUT_S, *, doing: str = "a call") -> Iterator[None]:
    """Every read from ``connection``'s socket inside the block waits at most ``seconds``.

    ``connection`` is a kombu or py-amqp connection; without a socket to bound (a test
    double, a transport of another kind) the block runs unbounded. A read that times
    out raises :class:`BrokerSilent` naming ``doing``.
    """
    transport = getattr(getattr(connection, "connection", connection), "transport", None)
    having_timeout = getattr(transport, "having_timeout", None)
    if having_timeout is None or getattr(transport, "sock", None) is None:
        yield
        return
    try:
        with having_timeout(seconds):
            yield
    except socket.timeout as exc:
        raise BrokerSilent(f"kombu-events: the broker did not answer {doing} within {seconds:g} s; "
                           f"taking the connection as lost") from exc


def call_within(connection: Any, doing: str, fn: Callable[[], Any]) -> None:
    """Call ``fn`` (a synchronous call on ``connection``) with its waits bounded by :func:`answer_within`.

    BrokerSilent goes on (the connection is lost: Celery reconnects); any other failure
    (a channel that closed under us) is logged at debug and swallowed.
    """
    try:
        with answer_within(connection, doing=doing):
            fn()
    except BrokerSilent:
        raise
    except Exception as exc:
        logger.debug("kombu-events: %s failed: %s", doing, exc)
