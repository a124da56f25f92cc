"""Log helpers: broker URLs with the password masked, control characters escaped, one structured line per outcome."""
from __future__ import annotations

__all__ = ["safe_url", "safe_text", "escape_controls", "log_outcome", "refusal_text"]

import logging
import re
from typing import Any

logger = logging.getLogger("kombu_events.outcome")

# ``scheme://user:`` then the password up to the last "@" of the URL, so that an unencoded
# "@", ":" or "/" in it is masked too. kombu separates fail-over URLs with ";": a ";" ends
# a URL when another ``scheme://`` follows. A regex rather than a URL parser because a
# parser raises on exactly the malformed URLs whose errors end up in logs.
_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*://"
_URL_PASSWORD = re.compile(rf"({_SCHEME}[^:@/;]*):(?:[^;]|;(?!{_SCHEME}))*@")
# In free text a URL also ends at whitespace (a password with a raw space is masked by safe_url only).
_TEXT_PASSWORD = re.compile(rf"({_SCHEME}[^:@/;\s]*):(?:[^;\s]|;(?!{_SCHEME}))*@")


def safe_url(url: Any) -> str:
    """``url`` (one URL, ``;``-separated URLs or a list of them) with every password replaced by ``**``.

    The rest stays as given; safe to log or print.
    """
    text = ";".join(map(str, url)) if isinstance(url, (list, tuple)) else str(url)
    return _URL_PASSWORD.sub(r"\1:**@", text)


def safe_text(text: str) -> str:
    """``text`` (say an error message) with the password of every URL in it replaced by ``**``."""
    return _TEXT_PASSWORD.sub(r"\1:**@", text)


# Unicode's control characters (C0, DEL and C1: ESC and CSI among them), the line and paragraph
# separators (str.splitlines and some log viewers break lines there) and lone surrogates (from
# bytes read with surrogateescape; a log file's encoder raises on them).
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_controls(value: Any) -> str:
    """``value`` as text with every control character shown as an escape (``\\n``, ``\\x1b``, ``\\u2028``).

    For whatever a message or a request put in a log line (a message id, a routing key, a
    user name, an error's text): it cannot start a line of its own nor drive a terminal.
    Nothing else changes: non-ASCII letters stay, and so does a backslash.
    """
    text = value if isinstance(value, str) else str(value)
    if text.isprintable():  # no control character, no separator but the space: nothing to escape (fast path)
        return text
    return _CONTROLS.sub(_escaped, text)


def _escaped(found: re.Match[str]) -> str:
    char = found.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


# RabbitMQ's reply text for ACCESS_REFUSED on a resource, and the permission each method needs on it.
_ACCESS_REFUSED = re.compile(r"access to (?P<kind>\w+) '(?P<name>.*)' in vhost '.*' refused for user '(?P<user>.*)'")
_PERMISSION = {(60, 40): "write to", (60, 20): "read from", (60, 70): "read from", (40, 10): "configure",
               (50, 10): "configure", (50, 40): "configure", (40, 20): "configure"}


def refusal_text(reply_text: str, method_sig: Any = None) -> str:
    """One line for a broker's ACCESS_REFUSED: which permission on which exchange or queue, for which user.

    ``method_sig`` is the refused method's (class id, method id): ``(60, 40)``, basic.publish, needs *write*.
    """
    found = _ACCESS_REFUSED.search(reply_text)
    if found is None:
        return f"RabbitMQ refused access ({reply_text})"
    permission = _PERMISSION.get(tuple(method_sig) if method_sig else (), "access to")
    kind, name, user = found["kind"], found["name"], found["user"]
    return f"RabbitMQ refused {permission} {kind} '{name}' for user '{user}' (ACCESS_REFUSED)"


_LEVELS = {"ack": logging.INFO, "requeue": logging.WARNING, "retry": logging.INFO, "archive": logging.ERROR,
           "held": logging.ERROR}


def log_outcome(
    outcome: str, *, queue: str, routing_key: str, message_id: Any, attempt: int,
    duration_ms: float, delay_ms: float = 0, reason: str = "",
) -> None:
    """One ``key=value`` line per message outcome; the same fields are in ``record.kombu_events``.

    What the publisher chose (the routing key, the message id, the reason's text) is shown
    escaped in the line (:func:`escape_controls`; the reason as its ``repr``) and kept as sent
    in ``record.kombu_events``, for a JSON formatter to encode.
    """
    level = _LEVELS.get(outcome, logging.INFO)
    if not logger.isEnabledFor(level):
        return
    fields = {
        "outcome": outcome, "queue": queue, "routing_key": routing_key, "message_id": message_id,
        "attempt": attempt, "duration_ms": round(duration_ms, 3), "delay_ms": round(delay_ms),
    }
    if reason:
        fields["reason"] = reason
    logger.log(level, "event %s", " ".join(f"{k}={v!r}" if k == "reason" else f"{k}={escape_controls(v)}"
                                           for k, v in fields.items()), extra={"kombu_events": fields})
