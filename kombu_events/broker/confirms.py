"""Pipelined publisher confirms on one channel: publish now, act when the broker confirms.

Each publish is ``mandatory``; a message the broker returns (no queue bound) or
nacks reaches ``on_fail`` instead of ``on_ok``. Returns carry no sequence number,
so they are matched by (exchange, routing key, message id); when several pending
publishes match, all of them fail -- a duplicate at worst, never a loss.

The callbacks run inside py-amqp's frame dispatch, and may publish, or drain frames
(a synchronous channel method does), so that another confirm arrives while one is
being settled. So settled publishes leave ``_pending`` before any callback runs, and
a callback that raises is logged: nothing raises back into py-amqp.

With ``on_refused``, a publish the broker refuses (ACCESS_REFUSED: the user may not write
to that exchange) settles every pending publish as failed with :attr:`Confirmer.refused`
set, instead of py-amqp reopening the channel and raising into whoever reads the
connection (Celery's event loop: it would reconnect and redeliver, for ever). The channel
is closed for good then: the owner opens another.
"""
from __future__ import annotations

__all__ = ["Confirmer", "RETURNED", "NACKED"]

import logging
import socket
import time
from itertools import takewhile
from typing import Any, Callable, NamedTuple

from amqp import Message, spec
from amqp.exceptions import AccessRefused

from ..core.logs import escape_controls, refusal_text
from ..errors import PublishError

logger = logging.getLogger(__name__)

RETURNED = "returned by the broker: no queue is bound for it"
NACKED = "nacked by the broker"
_PUBLISH = spec.Basic.Publish
_CLOSE = spec.Channel.Close
_HEADER_FRAME_OVERHEAD = 8 + 14  # frame header and end octet; class id, weight, body size

OnOk = Callable[[], Any]
OnFail = Callable[[str], Any]


class _Pending(NamedTuple):
    """One publish the broker has not settled yet; ``key`` is what a return is matched by."""

    key: tuple[str, str, Any]
    on_ok: OnOk
    on_fail: OnFail


class Confirmer:
    """Publish with confirms on ``channel`` and call back once each publish is settled."""

    def __init__(self, channel: Any, *, check_frame_size: bool = False,
                 on_refused: Callable[[str], Any] | None = None) -> None:
        self.channel = channel
        #: Why the broker closed the channel with ACCESS_REFUSED (then every publish fails), else None.
        self.refused: str | None = None
        self._on_refused = on_refused
        self.check_frame_size = check_frame_size
        self._seq = 0
        self._pending: dict[int, _Pending] = {}  # in publish order: sequence numbers only grow
        self._returned: set[int] = set()
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel.events["basic_return"].add(self._on_return)
        callbacks = getattr(channel, "_callbacks", None)  # py-amqp's per-channel method handlers
        if on_refused is not None and isinstance(callbacks, dict) and _CLOSE in callbacks:
            self._py_amqp_close = callbacks[_CLOSE]
            callbacks[_CLOSE] = self._on_close

    @property
    def pending(self) -> int:
        """Publishes not yet confirmed."""
        return len(self._pending)

    def wait(self, *, timeout_s: float, reraise: bool = False) -> None:
        """Read the channel's connection until every publish is settled or ``timeout_s`` has passed.

        A connection that fails meanwhile ends the wait (logged at debug; ``reraise``: raised): what
        was not confirmed dies with its channel, and its original is redelivered.
        """
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            try:
                self.channel.connection.drain_events(timeout=0.2)
            except socket.timeout:
                continue
            except Exception as exc:
                logger.debug("kombu-events: stopped waiting for confirms: %s", exc)
                if reraise:
                    raise
                return

    def publish(self, message: Message, exchange: str, routing_key: str | bytes, on_ok: OnOk, on_fail: OnFail) -> int:
        """Publish ``message``; exactly one of ``on_ok``/``on_fail`` runs when it is settled.

        If this raises, nothing was sent or registered and neither callback will run.
        With ``check_frame_size``, properties too large for one frame raise PublishError
        instead of being sent (the broker would close the whole connection).
        """
        if self.check_frame_size:
            self._check_frame_size(message)
        # send_method, not basic_publish: py-amqp's basic_publish drains inbound frames
        # first, which re-enters delivery callbacks from inside a callback and, under a
        # burst of failures, recurses until RecursionError. The frame is the same.
        self.channel.send_method(_PUBLISH, "Bssbb", (0, exchange, routing_key, True, False), message)
        # Count only what was sent: the broker numbers confirms by publishes it received.
        self._seq += 1
        key = (exchange, _text(routing_key), message.properties.get("message_id"))
        self._pending[self._seq] = _Pending(key, on_ok, on_fail)
        return self._seq

    def _check_frame_size(self, message: Message) -> None:
        limit = self.channel.connection.frame_max - _HEADER_FRAME_OVERHEAD
        size = len(message._serialize_properties())  # also raises for a value py-amqp cannot encode
        if size > limit:
            raise PublishError(f"message properties take {size} bytes, more than fit in one frame ({limit})")

    def fail_all(self, why: str) -> None:
        """Settle every pending publish as failed (the channel is gone)."""
        pending, self._pending = self._pending, {}
        self._returned.clear()
        for seq, entry in pending.items():
            self._call(seq, entry, entry.on_fail, why)

    def _take(self, tag: int, multiple: bool) -> list[tuple[int, _Pending, bool]]:
        """Remove what ``tag`` settles from ``_pending``: (seq, entry, returned), in publish order.

        A tag already settled or never published (a broker bug, or a confirm for the
        previous channel) settles nothing.
        """
        if multiple:
            seqs = list(takewhile(lambda seq: seq <= tag, self._pending))
        else:
            seqs = [tag] if tag in self._pending else []
        if not seqs:
            logger.debug("kombu-events: confirm for delivery tag %r (multiple=%s) settles nothing pending",
                         tag, multiple)
        taken: list[tuple[int, _Pending, bool]] = []
        for seq in seqs:
            returned = seq in self._returned
            self._returned.discard(seq)
            taken.append((seq, self._pending.pop(seq), returned))
        return taken

    def _on_ack(self, tag: int, multiple: bool) -> None:
        for seq, entry, returned in self._take(tag, multiple):
            if returned:  # the broker acks a message it returned: it was routed nowhere
                self._call(seq, entry, entry.on_fail, RETURNED)
            else:
                self._call(seq, entry, entry.on_ok)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        for seq, entry, _returned in self._take(tag, multiple):
            self._call(seq, entry, entry.on_fail, NACKED)

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Message) -> None:
        key = (exchange, _text(routing_key), message.properties.get("message_id"))
        matched = [seq for seq, entry in self._pending.items() if entry.key == key]
        logger.debug("returned %s/%s (%s): matches %d pending publish(es)", escape_controls(exchange),
                     escape_controls(routing_key), escape_controls(exc), len(matched))
        self._returned.update(matched)

    def _on_close(self, reply_code: int, reply_text: str, class_id: int, method_id: int) -> None:
        """The broker closes the channel: on ACCESS_REFUSED, close it for good and fail what is pending."""
        if reply_code != AccessRefused.code:
            self._py_amqp_close(reply_code, reply_text, class_id, method_id)  # reopens, raises
            return
        try:
            self.channel.send_method(spec.Channel.CloseOk)
            self.channel.collect()
        except Exception:  # the connection went too: its owner reconnects; nothing may raise into py-amqp here
            logger.exception("kombu-events: closing a channel the broker refused failed")
        self.refused = refusal_text(reply_text, (class_id, method_id))
        try:
            assert self._on_refused is not None
            self._on_refused(self.refused)
        except Exception:
            logger.exception("kombu-events: the refusal callback failed")
        self.fail_all(self.refused)

    def _call(self, seq: int, entry: _Pending, callback: Callable[..., Any], *args: Any) -> None:
        # py-amqp's frame dispatch (and Celery's event loop above it) must not see a
        # caller's error; the other publishes settled by the same confirm still get theirs.
        try:
            callback(*args)
        except Exception:
            exchange, routing_key, message_id = entry.key
            logger.exception("kombu-events: confirm callback of publish %d to %r/%r (message id %r) failed",
                             seq, exchange, routing_key, message_id)


def _text(routing_key: str | bytes) -> str:
    """A routing key as the broker will return it (invalid UTF-8 as surrogate escapes)."""
    return routing_key.decode("utf-8", "surrogateescape") if isinstance(routing_key, bytes) else routing_key
