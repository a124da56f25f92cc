"""core/codec.py: the text encodings a body may name in ``content_encoding`` are a closed list.

Any other Python codec a publisher names is refused before a byte is decoded: punycode
decodes in time quadratic in the body, zlib/bz2 inflate past ``max_body_bytes``, and
rot13, base64, uu, idna... have no business reading a message.
"""
from __future__ import annotations

import bz2
import json
import signal
import time
import zlib
from contextlib import contextmanager
from typing import Iterator

import celery
import pytest

from kombu_events import Events
from kombu_events.core import decision
from kombu_events.core.codec import JSON, decode
from kombu_events.core.envelopes import unwrap
from kombu_events.errors import DecodeError
from kombu_events.testing import StubEvents

JSON_ONLY = frozenset({JSON})
DATA = "application/data"  # kombu decodes it with the label's codec and nothing else
TEXT = {"name": "Zo\u00eb", "city": "K\u00f6ln"}
WIDE = {"name": "Zo\u00eb", "price": "12 \u20ac", "city": "\u6771\u4eac", "emoji": "\U0001f600"}

# (the label as a publisher sends it, the codec the body is really in)
ACCEPTED = [
    ("utf-8", "utf-8"), ("UTF-8", "utf-8"), ("utf8", "utf-8"), ("UTF8", "utf-8"), ("utf_8", "utf-8"),
    ("Utf-8", "utf-8"),
    ("utf-16", "utf-16"), ("UTF-16", "utf-16"), ("utf16", "utf-16"), ("utf_16", "utf-16"),
    ("utf-16-le", "utf-16-le"), ("utf-16le", "utf-16-le"), ("UTF-16LE", "utf-16-le"), ("utf_16_le", "utf-16-le"),
    ("utf-16-be", "utf-16-be"), ("utf-16be", "utf-16-be"), ("UTF-16BE", "utf-16-be"), ("utf_16_be", "utf-16-be"),
    ("utf-32", "utf-32"), ("UTF-32", "utf-32"), ("utf32", "utf-32"),
    ("utf-32-le", "utf-32-le"), ("utf-32le", "utf-32-le"), ("UTF-32LE", "utf-32-le"),
    ("utf-32-be", "utf-32-be"), ("utf-32be", "utf-32-be"), ("UTF-32BE", "utf-32-be"),
    ("latin-1", "latin-1"), ("latin1", "latin-1"), ("LATIN-1", "latin-1"), ("Latin1", "latin-1"),
    ("iso-8859-1", "latin-1"), ("ISO-8859-1", "latin-1"), ("iso8859-1", "latin-1"), ("iso_8859_1", "latin-1"),
    ("ascii", "ascii"), ("ASCII", "ascii"), ("us-ascii", "ascii"), ("US-ASCII", "ascii"),
    ("binary", "utf-8"), ("BINARY", "utf-8"), ("ascii-8bit", "utf-8"),  # no label: json.loads reads bytes
    (None, "utf-8"), ("", "utf-8"),
]

# Python codecs (and names) that are not on the list, each refused before anything is decoded.
REFUSED = [
    "punycode", "PUNYCODE", "idna", "rot13", "rot_13", "uu", "uu_codec", "zlib", "zlib_codec", "bz2", "base64",
    "base_64", "hex", "quopri", "unicode_escape", "raw_unicode_escape", "utf-7", "utf-8-sig", "cp1252",
    "windows-1252", "utf-16-sig", "charmap", "mbcs", "oem", "undefined", "gzip", "no-such-codec",
    # Python's own aliases of accepted codecs that no publisher sends
    "u8", "utf", "latin", "l1", "646", "us",
    # odd characters: not trimmed, not guessed at
    " utf-8", "utf-8 ", "utf 8", "utf-8\n", "utf-8\x00", "\x1b[31mutf-8", "utf-8;", "utf\u20108",
    "\u0130dna", "\uff55tf-8", "x" * 255,
]


def _json(payload: object, codec: str) -> bytes:
    return json.dumps(payload, ensure_ascii=False).encode(codec)


@pytest.mark.parametrize("label, codec", ACCEPTED, ids=[repr(label) for label, _ in ACCEPTED])
def test_an_accepted_label_decodes_json_in_its_encoding(label, codec):
    payload = TEXT if codec == "latin-1" else {"name": "plain"} if codec == "ascii" else WIDE
    assert decode(_json(payload, codec), JSON, label, JSON_ONLY) == payload


@pytest.mark.parametrize("label", ["utf-8", "UTF-16LE", "latin1", "us-ascii"])
def test_an_accepted_label_decodes_a_body_of_another_type_too(label):
    body = "Zo\u00eb".encode("ascii", "replace") if "ascii" in label else "Zo\u00eb".encode(label)
    assert decode(body, DATA, label, frozenset({DATA})) == body.decode(label)


@pytest.mark.parametrize("label", ["binary", "Binary", "ascii-8bit"])
def test_binary_means_not_decoded(label):
    assert decode(b"\xff\x00raw", DATA, label, frozenset({DATA})) == b"\xff\x00raw"


@pytest.mark.parametrize("label", ["utf-16", "latin-1"])
def test_a_body_that_arrived_as_text_is_encoded_back_with_its_label(label):
    text = json.dumps(TEXT, ensure_ascii=False)
    assert decode(text, JSON, label, JSON_ONLY) == TEXT


def _refusal(label: object) -> str:
    return f"content encoding {label!r} is not accepted"


@pytest.mark.parametrize("label", REFUSED, ids=[repr(label)[:40] for label in REFUSED])
@pytest.mark.parametrize("content_type, accept", [(JSON, JSON_ONLY), (None, JSON_ONLY), (DATA, frozenset({DATA}))],
                         ids=["json", "no content type", "application/data"])
def test_any_other_encoding_is_refused_by_name(label, content_type, accept):
    with pytest.raises(DecodeError) as info:
        decode(b"-abc", content_type, label, accept)
    message = str(info.value)
    assert message.startswith(_refusal(label)), message
    assert "utf-8, utf-16, utf-32" in message and "binary" in message


@pytest.mark.parametrize("label", [b"utf-8", 8, ["utf-8"]], ids=["bytes", "int", "list"])
def test_a_label_that_is_not_text_is_refused(label):
    with pytest.raises(DecodeError, match=r"content encoding .* is not accepted"):
        decode(b"{}", JSON, label, JSON_ONLY)


@pytest.mark.parametrize("label", ["punycode", "rot13", "\x1b[31mutf-8"])
def test_a_body_that_arrived_as_text_is_refused_too(label):
    with pytest.raises(DecodeError) as info:
        decode('{"a": 1}', JSON, label, JSON_ONLY)
    assert str(info.value).startswith(_refusal(label))


def test_the_refusal_shows_the_label_escaped():
    with pytest.raises(DecodeError) as info:
        decode(b"{}", JSON, "x\nERROR forged\r\x1b[31m\x9b2J", JSON_ONLY)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message and "\x1b" not in message and "\x9b" not in message
    assert r"x\nERROR forged\r\x1b[31m\x9b2J" in message


@pytest.mark.parametrize("label, body", [("zlib", zlib.compress(b"x" * 100_000)),
                                         ("bz2", bz2.compress(b"x" * 100_000))])
def test_a_compression_codec_is_no_way_around_max_body_bytes(label, body):
    with pytest.raises(DecodeError, match="not accepted"):
        decode(body, DATA, label, frozenset({DATA}))


def test_a_refused_encoding_wins_over_a_content_type_that_is_not_accepted():
    with pytest.raises(DecodeError) as info:
        decode(b"{}", "text/plain", "punycode", JSON_ONLY)
    assert str(info.value).startswith(_refusal("punycode"))


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """TimeoutError in the main thread after ``seconds`` (the punycode codec is Python: it is interrupted)."""
    def ring(signum: int, frame: object) -> None:
        raise TimeoutError(f"still decoding after {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("content_type, accept", [(JSON, JSON_ONLY), (DATA, frozenset({DATA}))])
def test_punycode_with_a_2_mb_body_is_refused_in_well_under_a_second(content_type, accept):
    body = b"-" + b"a" * 2_000_000  # decodes in time quadratic in its size: minutes
    started = time.perf_counter()
    with _alarm(2.0), pytest.raises(DecodeError) as info:
        decode(body, content_type, "punycode", accept)
    assert time.perf_counter() - started < 0.2
    assert str(info.value).startswith(_refusal("punycode"))


def test_a_refused_encoding_is_archived_at_once_with_the_encoding_in_the_reason():
    app = celery.Celery("encodings", broker="memory://")
    events = Events(app, service="billing", exchange="shop", max_retries=5)
    calls = []

    @events.handler("orders.#")
    def audit(payload):
        calls.append(payload)

    stub = StubEvents(events)
    stub.publish("orders.1", b"-" + b"a" * 100_000, content_encoding="punycode")
    stub.publish("orders.2", b'{"n": 2}', content_encoding="rot13")
    stub.publish("orders.3", b'{"n": 3}', content_encoding="UTF-8")
    stub.join()
    assert calls == [{"n": 3}]
    assert [(s.routing_key, s.attempt, s.outcome.kind) for s in stub.archived] == [
        ("orders.1", 1, decision.UNDECODABLE), ("orders.2", 1, decision.UNDECODABLE)]
    for settled, label in zip(stub.archived, ("punycode", "rot13")):
        assert settled.reason.startswith(_refusal(label))
        assert settled.headers["kombu-events-reason"].startswith(_refusal(label))


def _envelope_decode(body: bytes, content_type: str | None, content_encoding: str | None) -> object:
    return decode(body, content_type, content_encoding, JSON_ONLY)


HEADER_BORNE = {
    "masstransit raw": {"MT-MessageType": "urn:message:Shop:OrderPlaced"},
    "nservicebus": {"NServiceBus.EnclosedMessageTypes": "Shop.OrderPlaced"},
    "spring": {"__TypeId__": "shop.OrderPlaced"},
    "cloudevents binary": {"ce-specversion": "1.0", "ce-id": "1", "ce-source": "shop", "ce-type": "placed"},
}


@pytest.mark.parametrize("headers", HEADER_BORNE.values(), ids=HEADER_BORNE.keys())
def test_an_envelope_that_hands_its_body_to_the_codec_refuses_punycode_too(headers):
    with pytest.raises(DecodeError) as info:
        unwrap(b"-" + b"a" * 10_000, JSON, "punycode", headers, {}, _envelope_decode)
    assert str(info.value).startswith(_refusal("punycode"))


@pytest.mark.parametrize("content_type, label", [("application/cloudevents+json", "punycode"),
                                                 ("application/cloudevents+json; charset=punycode", None)])
def test_a_structured_envelope_refuses_punycode_quickly(content_type, label):
    started = time.perf_counter()
    with _alarm(0.5), pytest.raises(DecodeError):
        unwrap(b"-" + b"a" * 200_000, content_type, label, {}, {}, _envelope_decode)
    assert time.perf_counter() - started < 0.2
