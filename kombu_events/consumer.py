"""Consume one service's handler queues inside a worker; hand messages to the pool; act on decisions.

Glue, on the worker's event loop: every decision comes from :func:`decision.decide`.
Retries and archiving republish with pipelined confirms and ack the original only
when the broker has confirmed the copy, so a crash in between duplicates, never loses.
"""
from __future__ import annotations

__all__ = ["ServiceConsumer"]

import logging
import os
import socket
import threading
import time
from collections import deque
from functools import partial
from typing import Any

from amqp import Message
from kombu import Consumer

from . import decision, headers as wire, ladder, runner
from .confirms import Confirmer
from .declare import declare
from .handlers import Handler
from .logs import log_outcome

logger = logging.getLogger(__name__)


class ServiceConsumer:
    """The consumers of one :class:`~kombu_events.Events` service on a worker connection."""

    def __init__(self, events: Any) -> None:
        self.events = events
        self.settings = events.settings
        self.handlers = events.handlers  # resolving validates: bad config fails at start-up
        self.topology = events.topology()
        self._queues = {q.name: q for q in self.topology.handler_queues}
        self._consumers: list[Consumer] = []
        self._channels: list[Any] = []
        self._confirmer: Confirmer | None = None
        self._pool = self._hub = None
        self._userid: str | None = None
        self._loop_ident = threading.get_ident()
        self._mailbox: deque = deque()
        self._wake: tuple[int, int] | None = None

    # -- lifecycle (Celery restarts the consumer blueprint on every reconnect) ---------------

    def start(self, connection: Any, pool: Any, hub: Any) -> None:
        """Declare the topology and start consuming on fresh channels of ``connection``."""
        self._close_channels()
        declare(self.topology, connection)
        self._pool, self._hub = pool, hub
        self._userid = getattr(connection, "userid", None)
        self._loop_ident = threading.get_ident()
        channel = connection.channel()
        channel.auto_decode = False  # handlers get the body bytes as published, never a str
        channel.basic_qos(0, self.settings.prefetch_count, False)
        publish_channel = connection.channel()
        self._confirmer = Confirmer(publish_channel)
        self._channels = [channel, publish_channel]
        self._consumers = [
            Consumer(channel, queues=[self._queues[h.queue]], no_ack=False, auto_declare=False,
                     on_message=partial(self._on_message, h))
            for h in self.handlers
        ]
        if hub is None:
            self.consume()  # no event loop (synloop): nothing else will call consume()

    def consume(self) -> None:
        """Start receiving; with an event loop only once the pool is registered with it."""
        if self._hub is not None:
            if self._wake is None:
                self._wake = os.pipe()
                os.set_blocking(self._wake[0], False)
                os.set_blocking(self._wake[1], False)
            self._hub.add_reader(self._wake[0], self._drain_mailbox)
        for consumer in self._consumers:
            consumer.consume()
        logger.info("kombu-events: service %s consuming %s", self.settings.service,
                    ", ".join(h.queue for h in self.handlers))

    def stop(self) -> None:
        """Stop receiving; keep channels so handlers still running can ack."""
        for consumer in self._consumers:
            _quietly(consumer.cancel)
        self._consumers = []

    def shutdown(self) -> None:
        """Settle what finished after the loop stopped, wait for pending confirms, close everything."""
        self.stop()
        self._drain_mailbox()  # thread-pool completions posted once the event loop had stopped
        self._await_confirms(timeout_s=5.0)
        self._close_channels()
        if self._wake is not None:
            if self._hub is not None:
                _quietly(self._hub.remove, self._wake[0])
            for fd in self._wake:
                _quietly(os.close, fd)
            self._wake = None

    def _await_confirms(self, *, timeout_s: float) -> None:
        confirmer = self._confirmer
        deadline = time.monotonic() + timeout_s
        while confirmer is not None and confirmer.pending and time.monotonic() < deadline:
            try:
                confirmer.channel.connection.drain_events(timeout=0.2)
            except socket.timeout:
                continue
            except Exception as exc:  # connection gone: unconfirmed originals are redelivered
                logger.debug("kombu-events: stopped waiting for confirms: %s", exc)
                return

    def _close_channels(self) -> None:
        # Pending confirms die with their channel; their originals are redelivered.
        self._confirmer = None
        for channel in self._channels:
            _quietly(channel.close)
        self._channels = []

    # -- receiving ----------------------------------------------------------------------------

    def _on_message(self, handler: Handler, message: Any) -> None:
        headers = message.headers
        queue = handler.queue
        attempt = wire.attempt_of(headers, queue)
        routing_key = wire.original_routing_key(headers, message.delivery_info["routing_key"], queue)
        done = partial(self._post, handler, message, attempt, routing_key, time.monotonic())
        if message.delivery_info.get("redelivered"):
            # Its last delivery ended without an ack (worker or connection lost): send it back,
            # counted, so a message that keeps killing its worker cannot loop forever.
            done(decision.Outcome(decision.REDELIVERED, "redelivered after an unacknowledged delivery"))
            return
        meta = (routing_key, attempt, headers, message.properties) if handler.bind else None
        self._pool.apply_async(runner.run, (queue, message.body, message.content_type,
                                            message.content_encoding, meta, attempt > handler.max_retries),
                               callback=done, error_callback=done)

    def _post(self, *item: Any) -> None:
        """Pool callback: settle on the loop thread (thread pools call back from their threads)."""
        if self._wake is None or threading.get_ident() == self._loop_ident:
            self._settle(*item)
            return
        self._mailbox.append(item)
        try:
            os.write(self._wake[1], b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up byte is already pending

    def _drain_mailbox(self, *_: Any) -> None:
        try:
            while self._wake is not None and os.read(self._wake[0], 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while self._mailbox:
            self._settle(*self._mailbox.popleft())

    # -- acting on a decision -----------------------------------------------------------------

    def _settle(self, handler: Handler, message: Any, attempt: int, routing_key: str,
                started: float, result: Any) -> None:
        try:
            self._carry_out(handler, message, attempt, routing_key, started, result)
        except Exception:  # never let one message break the event loop; it stays unacked
            logger.exception("kombu-events: could not settle message %s from %s; left unacked",
                             message.properties.get("message_id"), handler.queue)

    def _carry_out(self, handler: Handler, message: Any, attempt: int, routing_key: str,
                   started: float, result: Any) -> None:
        if not isinstance(result, decision.Outcome):  # billiard's ExceptionInfo: the process died
            exc = getattr(result, "exception", result)
            exc = getattr(exc, "exc", exc)  # billiard wraps it in ExceptionWithTraceback
            what = f"{type(exc).__name__}: {exc}"
            result = decision.Outcome(decision.LOST, f"pool process lost: {what}", what,
                                      str(getattr(result, "traceback", "") or "")[-self.settings.traceback_limit:])
        redeliveries = wire.redeliveries_of(message.headers) + 1 if result.kind == decision.REDELIVERED else 0
        verdict = decision.decide(
            result, attempt=attempt, max_retries=handler.max_retries, backoff=handler.backoff,
            max_delay_ms=self.settings.max_delay_ms, lost_delay_ms=self.settings.delay_unit_ms,
            redeliveries=redeliveries)
        log = partial(log_outcome, queue=handler.queue, routing_key=routing_key,
                      message_id=message.properties.get("message_id"), attempt=attempt,
                      duration_ms=(time.monotonic() - started) * 1000)
        if verdict.action == "ack":
            if _quietly(message.ack):
                log("ack")
        elif verdict.action == "retry":
            headers = wire.retry_headers(message.headers, attempt=attempt, routing_key=routing_key,
                                         error=result.exception or verdict.reason)
            self._send_back(handler, message, attempt, routing_key, verdict, headers, log, result)
        elif verdict.action == "requeue":
            headers = wire.requeue_headers(message.headers, attempt=attempt, redeliveries=redeliveries,
                                           routing_key=routing_key)
            self._send_back(handler, message, attempt, routing_key, verdict, headers, log, result)
        else:
            self._archive(handler, message, attempt, routing_key, verdict.reason, result, log)

    def _send_back(self, handler, message, attempt, routing_key, verdict, headers, log, result) -> None:
        """Republish into the ladder, addressed to this queue after ``verdict.delay_ms``; then ack."""
        s = self.settings
        units = ladder.units_for(delay_ms=verdict.delay_ms, unit_ms=s.delay_unit_ms, levels=s.delay_levels)
        key = ladder.routing_key(delay_units=units, levels=s.delay_levels, queue=handler.queue)

        def confirmed() -> None:
            if _quietly(message.ack):
                log(verdict.action, delay_ms=units * s.delay_unit_ms, reason=verdict.reason)

        def refused(why: str) -> None:
            self._archive(handler, message, attempt, routing_key, f"{verdict.action} publish failed ({why}); "
                          f"{verdict.reason}", result, log)

        self._republish(message, headers, self.topology.entry_exchange(units), key, confirmed, refused)

    def _archive(self, handler, message, attempt, routing_key, reason, result, log) -> None:
        headers = wire.archive_headers(
            message.headers, attempt=attempt, queue=handler.queue, routing_key=routing_key,
            reason=reason, exception=result.exception, traceback=result.traceback)

        def confirmed() -> None:
            if _quietly(message.ack):
                log("archive", reason=reason)

        def refused(why: str) -> None:
            # Nowhere safe to put it: keep it unacked (visible as unacked in the broker).
            log("held", reason=f"archive publish failed ({why}); message left unacked: {reason}")

        self._republish(message, headers, self.topology.archive_exchange, routing_key, confirmed, refused)

    def _republish(self, message, headers, exchange, routing_key, on_ok, on_fail) -> None:
        properties = dict(message.properties)
        if properties.get("expiration") is not None:
            # A publisher's per-message TTL would cut short a ladder wait or silently drop the
            # message from the archive: it governs the first delivery only, and is kept here.
            headers[wire.EXPIRATION] = str(properties.pop("expiration"))
        properties["application_headers"] = headers
        if properties.get("user_id") not in (None, self._userid):
            properties.pop("user_id")  # the broker refuses a user_id other than the connection's
        if self._confirmer is None:
            return  # channels are gone: the original is redelivered
        try:
            self._confirmer.publish(Message(message.body, **properties), exchange, routing_key, on_ok, on_fail)
        except Exception as exc:  # not sent (connection lost, unencodable header): not acked either
            on_fail(f"publish raised {type(exc).__name__}: {exc}")


def _quietly(fn: Any, *args: Any) -> bool:
    """Call ``fn``; log and swallow errors of a channel that closed under us."""
    try:
        fn(*args)
        return True
    except Exception as exc:
        logger.debug("kombu-events: %s failed: %s", getattr(fn, "__name__", fn), exc)
        return False
