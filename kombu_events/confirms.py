"""Pipelined publisher confirms on one channel: publish now, act when the broker confirms.

Each publish is ``mandatory``; a message the broker returns (no queue bound) or
nacks reaches ``on_fail`` instead of ``on_ok``. Returns carry no sequence number,
so they are matched by (exchange, routing key, message id); when several pending
publishes match, all of them fail -- a duplicate at worst, never a loss.
"""
from __future__ import annotations

__all__ = ["Confirmer", "RETURNED", "NACKED"]

import logging
from typing import Any, Callable

from amqp import Message, spec

from .errors import PublishError

logger = logging.getLogger(__name__)

RETURNED = "returned by the broker: no queue is bound for it"
NACKED = "nacked by the broker"
_PUBLISH = spec.Basic.Publish
_HEADER_FRAME_OVERHEAD = 8 + 14  # frame header and end octet; class id, weight, body size

OnOk = Callable[[], Any]
OnFail = Callable[[str], Any]


class Confirmer:
    """Publish with confirms on ``channel`` and call back once each publish is settled."""

    def __init__(self, channel: Any, *, check_frame_size: bool = False) -> None:
        self.channel = channel
        self.check_frame_size = check_frame_size
        self._seq = 0
        self._pending: dict[int, tuple[tuple[str, str, Any], OnOk, OnFail]] = {}
        self._returned: set[int] = set()
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel.events["basic_return"].add(self._on_return)

    @property
    def pending(self) -> int:
        """Publishes not yet confirmed."""
        return len(self._pending)

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
        self._pending[self._seq] = (key, on_ok, on_fail)
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
        for _key, _ok, on_fail in pending.values():
            on_fail(why)

    def _settled(self, tag: int, multiple: bool) -> list[int]:
        if not multiple:
            return [tag] if tag in self._pending else []
        return sorted(seq for seq in self._pending if seq <= tag)

    def _on_ack(self, tag: int, multiple: bool) -> None:
        for seq in self._settled(tag, multiple):
            _key, on_ok, on_fail = self._pending.pop(seq)
            if seq in self._returned:
                self._returned.discard(seq)
                on_fail(RETURNED)
            else:
                on_ok()

    def _on_nack(self, tag: int, multiple: bool) -> None:
        for seq in self._settled(tag, multiple):
            _key, _ok, on_fail = self._pending.pop(seq)
            self._returned.discard(seq)
            on_fail(NACKED)

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Message) -> None:
        key = (exchange, _text(routing_key), message.properties.get("message_id"))
        matched = [seq for seq, (k, _ok, _fail) in self._pending.items() if k == key]
        logger.debug("returned %s/%s (%s): matches %d pending publish(es)", exchange, routing_key, exc, len(matched))
        self._returned.update(matched)


def _text(routing_key: str | bytes) -> str:
    """A routing key as the broker will return it (invalid UTF-8 as surrogate escapes)."""
    return routing_key.decode("utf-8", "surrogateescape") if isinstance(routing_key, bytes) else routing_key
