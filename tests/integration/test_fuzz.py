"""Fuzz: nothing a publisher can send may break the worker, lose a message or leave it unacked.

Thousands of messages from a raw py-amqp publisher (not ``Events.publish``): random bodies,
content types, encodings, properties, and headers of every AMQP field type, including
malformed ``x-death`` and ``kombu-events-*`` headers. Every message carries a unique
``message_id``; afterwards each one is handled or in ``<service>.archive`` (exact
accounting), no queue of the service holds a message or an unacked delivery, and the
worker is alive. A second, small set is written with a hand encoder: frames the broker
accepts but py-amqp cannot write (invalid UTF-8 short strings, timestamps past year 9999,
very deep tables, a header at the frame size limit, ...).

Reproduce a run with ``KOMBU_EVENTS_FUZZ_SEED=<seed>`` (printed; ``-s`` shows it and the
counts); ``KOMBU_EVENTS_FUZZ_COUNT`` sets the number of random messages per pool.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import struct
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import amqp
import pytest

from ..brokers import PORT
from .amqp_wire import (
    Field,
    HandEncoded,
    encode_properties,
    field_bytes,
    nested_arrays,
    nested_tables,
    table_bytes,
    timestamp_field,
    total_property_decoder,
)
from .harness import Project, Worker, get_messages, queue_counts

pytestmark = pytest.mark.integration

SEED = int(os.environ.get("KOMBU_EVENTS_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
COUNT = int(os.environ.get("KOMBU_EVENTS_FUZZ_COUNT") or 2000)
SETTLE_TIMEOUT_S = 60.0
IDLE_S = 5.0  # every queue empty this long: nothing is in flight any more (the longest delay is 2.55 s)
POOLS = [("solo", 1), ("prefork", 2)]

#: What a handler does with a message: picked by crc32 of its message id (raw handler: of its body).
BEHAVIOURS = ("ok", "ok", "ok", "fail", "flaky", "retry", "archive", "poison")

APP = """
import hashlib, zlib

events = Events(app, service=SERVICE, exchange=EXCHANGE, delay_unit_ms=10, delay_levels=8, max_retries=2,
                backoff=Constant(every_ms=10))

BEHAVIOURS = BEHAVIOURS_TUPLE

def act(key, attempt, done):
    # A deterministic function of the message: replaying the seed replays the outcomes.
    kind = BEHAVIOURS[zlib.crc32(key) % len(BEHAVIOURS)]
    if kind == "fail":
        raise RuntimeError("fuzz: always fails")
    if kind == "flaky" and attempt == 1:
        raise RuntimeError("fuzz: fails on the first attempt")
    if kind == "retry" and attempt in (1, None):
        raise Retry(delay=0.02)
    if kind == "archive":
        raise Archive("fuzz: archived by the handler")
    if kind == "poison":
        with poisonous():
            raise ValueError("fuzz: poison")
    done()

def as_published(body):
    # Handlers get the body bytes as published; note anything else, then carry on with bytes.
    if not isinstance(body, bytes):
        record(key="not-bytes", type=type(body).__name__, body=repr(body)[:80])
        body = body.encode("utf-8", "surrogateescape") if isinstance(body, str) else bytes(body)
    return body

@events.handler("fz.raw.#", raw=True)
def raw(body):
    # No message id here: raw bodies are unique per message, the test maps their hash back.
    body = as_published(body)
    act(body, None, lambda: record(key=hashlib.sha256(body).hexdigest()))

@events.handler("fz.json.#", bind=True)
def js(event):
    as_published(event.body)
    act(event.message_id.encode(), event.attempt, lambda: record(key=event.message_id))
""".replace("BEHAVIOURS_TUPLE", repr(BEHAVIOURS))


# -- messages -----------------------------------------------------------------------------------

@dataclass
class Sent:
    """One published message and how the test recognises it afterwards."""

    message_id: str
    routing_key: str
    body: bytes
    properties: dict[str, Any]
    shape: str  # what it is, for failure messages
    hand_encoded: bool = False
    tags: set[str] = field(default_factory=set)

    @property
    def handled_key(self) -> str:
        """What the handler records: the message id, or for the raw handler the body's hash."""
        if self.routing_key.startswith("fz.raw."):
            return hashlib.sha256(self.body).hexdigest()
        return self.message_id

    def message(self) -> amqp.Message:
        properties = dict(self.properties, message_id=self.message_id)
        cls = HandEncoded if self.hand_encoded else amqp.Message
        return cls(self.body, **properties)


class _Bomb:
    """Unpickling it calls ``fn(*args)``: what a hostile publisher would send."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


_ALPHABET = ("abcxyzABC019 _-.:/#*\\\"'{}[],\t\n\x00\x1f\x7f\u00e9\u00df\u00ff\u0100\u2028\u4e2d\u202e"
             "\ufeff\ufffd\U0001f600\U0010ffff")
_CONTENT_TYPES = [None, "application/json", "application/json", "application/json; charset=utf-8",
                  "Application/JSON", " application/json ", "application/json;", "", "text/plain",
                  "application/x-python-serialize", "application/x-yaml", "application/data",
                  "application/x-msgpack", "application/octet-stream", "json", "*/*"]
_ENCODINGS = [None, None, "utf-8", "UTF-8", "utf8", "latin-1", "utf-16", "utf-32", "binary", "ascii",
              "no-such-codec", "", "rot13", "base64", "idna", "unicode_escape"]
# Not CC or BCC: the broker routes a copy to each key they list (and refuses any other type).
_HEADER_NAMES = ["x-death", "x-first-death-queue", "x-last-death-reason", "x-delay", "x-match", "x-foo",
                 "kombu-events-attempts", "kombu-events-redeliveries", "kombu-events-routing-key",
                 "kombu-events-reason", "kombu-events-queue", "kombu-events-expiration",
                 "kombu-events-traceback", "kombu-events-first-failure-at", "id", "task", "retries",
                 "", "k" * 255, "\u00e9t\u00e9", "compression", "content-type"]
_NUMBERS = [0, 1, -1, 2**31 - 1, -2**31, 2**31, 2**32, 2**53 + 1, 2**63 - 1, -2**63, 10**18]


def nested_json(opening: bytes, closing: bytes, depth: int, middle: bytes = b"") -> bytes:
    return opening * depth + middle + closing * depth


class Fuzzer:
    """Random messages py-amqp can write and RabbitMQ accepts, from one seeded ``random.Random``."""

    def __init__(self, rng: random.Random, service: str, frame_max: int) -> None:
        self.rng = rng
        self.queues = {"fz.raw": f"{service}.raw", "fz.json": f"{service}.js"}
        self.frame_max = frame_max
        self.raw_bodies: set[bytes] = set()
        self.count = 0

    def new_id(self, behaviour: str | None = None) -> str:
        """A unique message id; one the JSON handler treats with ``behaviour``, if given."""
        self.count += 1
        flavour = self.rng.choice(["", "", " \u00e9\u2713", "/\U0001f600", "." * 150])
        while True:
            message_id = f"fz-{self.count:05d}-{self.rng.getrandbits(32):08x}{flavour}"
            if behaviour in (None, BEHAVIOURS[zlib.crc32(message_id.encode()) % len(BEHAVIOURS)]):
                return message_id

    def text(self, max_len: int = 40) -> str:
        return "".join(self.rng.choice(_ALPHABET) for _ in range(self.rng.randrange(max_len + 1)))

    def shortstr(self) -> str:
        data = self.text(self.rng.choice([8, 40, 255])).encode()[:255]
        return data.decode("utf-8", "ignore")

    # bodies --------------------------------------------------------------------------------

    def json_value(self, depth: int = 0) -> Any:
        kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] * 2 if depth < 4 else [])
        kind = self.rng.choice(kinds)
        if kind == "int":
            return self.rng.choice([*_NUMBERS, self.rng.randrange(-10 ** 30, 10 ** 30)])
        if kind == "float":
            return self.rng.choice([0.5, -0.0, 1e308, 5e-324, self.rng.random()])
        if kind == "str":
            return self.text()
        if kind == "bool":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        if kind == "list":
            return [self.json_value(depth + 1) for _ in range(self.rng.randrange(5))]
        return {self.text(10): self.json_value(depth + 1) for _ in range(self.rng.randrange(5))}

    def body(self) -> tuple[bytes, dict[str, Any], str]:
        """(body, content properties, shape): a body and the content type/encoding sent with it."""
        rng = self.rng
        text = json.dumps(self.json_value(), ensure_ascii=rng.random() < 0.5)
        actual = rng.choice(["utf-16", "utf-16-le", "utf-32", "latin-1", "utf-8-sig", "cp1252"])
        makers = {
            "json": lambda: text.encode(),
            "json-encoded": lambda: text.encode(actual, "replace"),
            "json-nan": lambda: b'{"a": NaN, "b": [Infinity, -Infinity]}',
            "json-bigint": lambda: b"[" + b"7" * rng.choice([4300, 5000, 100_000]) + b"]",
            "json-surrogate": lambda: b'{"s": "\\ud800\\udfff\\udc00", "z": "\\u0000"}',
            "truncated": lambda: text.encode()[:max(1, len(text) // 2)],
            "empty": lambda: b"",
            "bytes": lambda: rng.randbytes(rng.randrange(1, 2000)),
            "invalid-utf8": lambda: b'{"a": "\xff\xfe\xc3\x28"}',
            "deep-list": lambda: nested_json(b"[", b"]", rng.choice([100, 990, 5000, 20_000])),
            "deep-dict": lambda: nested_json(b'{"a":', b"}", rng.choice([1000, 5000]), b"1"),
            "pickle": lambda: pickle.dumps({"a": [1, 2.5, "x"]}, protocol=rng.randrange(6)),
            "yaml": lambda: b"a: 1\nb: [x, y]\n",
            "scalar": lambda: rng.choice([b"null", b"true", b"1", b'"s"', b"  {}  ", b"\xef\xbb\xbf{}"]),
            "huge": lambda: json.dumps({"blob": "x" * rng.choice([200_000, 1_000_000])}).encode(),
        }
        kinds = ["json"] * 6 + [k for k in makers if k not in ("json", "huge")]
        kind = "huge" if rng.random() < 0.005 else rng.choice(kinds)  # a few: they cost time
        body = makers[kind]()
        content_type, encoding = rng.choice(_CONTENT_TYPES), rng.choice(_ENCODINGS)
        if kind == "json-encoded":
            encoding = rng.choice([actual, actual, None, "utf-8", "latin-1"])  # matching or not
        if kind == "json" and rng.random() < 0.5:  # enough decodable events to reach the handlers
            content_type, encoding = "application/json", rng.choice([None, "utf-8"])
        if rng.random() < 0.05:
            content_type = self.shortstr()
        if rng.random() < 0.05:
            encoding = self.shortstr()
        return body, {"content_type": content_type, "content_encoding": encoding}, kind

    def unique_raw_body(self, body: bytes) -> bytes:
        """The raw handler sees bytes only: every body sent to it must differ from the others."""
        while body in self.raw_bodies:
            body += self.rng.randbytes(4)
        self.raw_bodies.add(body)
        return body

    # headers -------------------------------------------------------------------------------

    def header_value(self, depth: int = 0) -> Any:
        """Any value py-amqp can write and RabbitMQ accepts (finite floats: NaN/inf kill the connection)."""
        rng = self.rng
        kinds = ["str", "bytes", "int", "float", "bool", "none", "decimal", "datetime"]
        kind = rng.choice(kinds + (["table", "array"] * 2 if depth < 5 else []))
        if kind == "str":
            return self.text(rng.choice([5, 50, 500]))
        if kind == "bytes":
            return rng.choice([rng.randbytes(rng.randrange(20)), b"\xff\xfe\x00", b""])
        if kind == "int":
            return rng.choice([*_NUMBERS, rng.randrange(-2 ** 63, 2 ** 63)])
        if kind == "float":
            return rng.choice([0.0, -0.0, 1.5, -2.25e-300, 1.7976931348623157e308, rng.uniform(-1e9, 1e9)])
        if kind == "bool":
            return rng.random() < 0.5
        if kind == "none":
            return None
        if kind == "decimal":
            digits = tuple(int(d) for d in str(rng.randrange(2**31)))
            return Decimal((rng.randrange(2), digits, -rng.randrange(256)))
        if kind == "datetime":
            return datetime(1970, 1, 1) + timedelta(seconds=rng.randrange(253402300800))
        if kind == "table":
            return {self.header_name(): self.header_value(depth + 1) for _ in range(rng.randrange(5))}
        return [self.header_value(depth + 1) for _ in range(rng.randrange(5))]

    def header_name(self) -> str | bytes:
        roll = self.rng.random()
        if roll < 0.3:
            return self.rng.choice(_HEADER_NAMES)
        if roll < 0.33:
            return b"\xff\xfe-" + self.rng.randbytes(3)  # not UTF-8: py-amqp hands it over as bytes
        name = self.shortstr()
        return name if name not in ("CC", "BCC") else name.lower()  # the broker gives those two a meaning

    def odd_library_header(self) -> tuple[str, Any]:
        name = self.rng.choice(["kombu-events-attempts", "kombu-events-redeliveries", "kombu-events-routing-key"])
        value = self.rng.choice([b"\xff", {"a": 1}, [1, 2], 1.5, 2**63 - 1, -2**63, None, Decimal("1.5"),
                                 datetime(2030, 1, 1), "abc", "7", True, "r" * 300, self.header_value()])
        return name, value

    def x_death(self, queue: str) -> Any:
        """An ``x-death`` as a publisher (or a buggy relay) might send it: right, wrong or half right."""
        rng = self.rng
        entry = {"queue": rng.choice([queue, queue, "elsewhere"]), "reason": rng.choice(["rejected", "expired"]),
                 "count": rng.choice([1, 2, 0, -3, 2**40, "abc", "3", {"n": 1}, [1], b"\xff", None, 1.5, True,
                                      Decimal("2.5"), datetime(2020, 1, 1)]),
                 "exchange": "", "time": datetime(2024, 1, 1)}
        if rng.random() < 0.7:
            entry["routing-keys"] = rng.choice([["fz.json.x"], [], "fz.json.x", 5, {"a": 1}, [7], [b"\xff"], [None]])
        return rng.choice([[entry], [entry, dict(entry)], entry, "x-death", 5, 1.5, True, None, [],
                           ["abc", 5], Decimal("1"), datetime(2020, 1, 1), self.header_value()])

    def headers(self, queue: str, allow_x_death: bool) -> dict:
        rng = self.rng
        headers = {self.header_name(): self.header_value() for _ in range(rng.choice([0, 0, 1, 3, 8]))}
        if rng.random() < 0.15:
            name, value = self.odd_library_header()
            headers[name] = value
        if allow_x_death and rng.random() < 0.1:
            headers["x-death"] = self.x_death(queue)
        elif "x-death" in headers and not allow_x_death:
            del headers["x-death"]
        if rng.random() < 0.02:
            headers["compression"] = rng.choice(["application/x-gzip", "zlib", "no-such", 5, {"a": 1}])
        if rng.random() < 0.005:
            headers["big"] = "h" * rng.randrange(60_000, 120_000)
        return headers

    # whole messages ------------------------------------------------------------------------

    def properties(self) -> dict[str, Any]:
        rng = self.rng
        properties: dict[str, Any] = {}
        optional = {
            "priority": lambda: rng.randrange(256),
            "delivery_mode": lambda: rng.choice([1, 2]),
            "correlation_id": self.shortstr,
            "reply_to": self.shortstr,
            # Long enough never to elapse here: a publisher's expiration that elapses while the message
            # waits unconsumed is honoured by the broker (docs/failures.md), which accounting cannot see.
            "expiration": lambda: rng.choice(["60000", "600000", "4294967295"]),
            "timestamp": lambda: rng.choice([0, 1_700_000_000, 2**32, 2**64 - 1, rng.randrange(2**64)]),
            "type": self.shortstr,
            "app_id": self.shortstr,
            "user_id": lambda: "guest",  # the broker refuses any other than the connection's user
            "cluster_id": self.shortstr,
        }
        for name, make in optional.items():
            if rng.random() < 0.3:
                properties[name] = make()
        return properties

    def message(self) -> Sent:
        rng = self.rng
        route = rng.choice(["fz.raw", "fz.json"])
        routing_key = ".".join([route] + [self.rng.choice(["a", "b", "x-y", "9", "\u00e9"])
                                          for _ in range(rng.randrange(1, 4))])
        body, content, kind = self.body()
        properties = {k: v for k, v in {**content, **self.properties()}.items() if v is not None}
        # A client-made x-death on a message that may expire would exercise the broker's dead-lettering
        # of it, not ours: keep the two apart.
        headers = self.headers(self.queues[route], allow_x_death="expiration" not in properties)
        if headers:
            properties["application_headers"] = headers
        sent = Sent(self.new_id(), routing_key, body, properties, f"random {kind} body")
        if route == "fz.raw":
            sent.body = self.unique_raw_body(sent.body)
        sent.shape += f", properties {sorted(k for k in properties if k != 'application_headers')}"
        sent.shape += f", headers {sorted(map(repr, headers))}"[:300]
        return sent if self.fits(sent) else self.message()

    def fits(self, sent: Sent) -> bool:
        """py-amqp can write it, and the header frame leaves room for the library's failure headers."""
        try:
            size = len(sent.message()._serialize_properties())
        except (struct.error, ValueError, TypeError, OverflowError, amqp.exceptions.FrameSyntaxError):
            return False
        return size < self.frame_max - 8 - 12 - 8_000


# -- fixed probes ----------------------------------------------------------------------------------

def json_probe(fuzzer: Fuzzer, shape: str, route: str = "fz.json", body: bytes | None = None,
               behaviour: str | None = None, **properties: Any) -> Sent:
    """A clean JSON event (unless ``body``) with the given properties: only ``shape`` is odd about it."""
    properties.setdefault("content_type", "application/json")
    message_id = fuzzer.new_id(behaviour)
    if body is None:
        body = json.dumps({"probe": shape, "id": message_id}).encode()
    sent = Sent(message_id, f"{route}.probe", body, properties, shape)
    if route == "fz.raw":
        sent.body = fuzzer.unique_raw_body(sent.body)
    return sent


#: x-death values the library must read (entries for the consuming queue) but cannot: the issue
#: wants each archived with a reason that names the header -- neither handled nor raised.
UNREADABLE_X_DEATH = {
    "x-death count 'abc'": lambda q: [{"queue": q, "reason": "rejected", "count": "abc"}],
    "x-death count a table": lambda q: [{"queue": q, "reason": "rejected", "count": {"n": 1}}],
    "x-death count an array": lambda q: [{"queue": q, "reason": "rejected", "count": [1]}],
    "x-death count bytes": lambda q: [{"queue": q, "reason": "rejected", "count": b"\xff\xfe"}],
    "x-death count a timestamp": lambda q: [{"queue": q, "reason": "rejected", "count": datetime(2020, 1, 1)}],
    "x-death an int": lambda q: 5,
    "x-death a float": lambda q: 1.5,
    "x-death a bool": lambda q: True,
    "x-death a decimal": lambda q: Decimal("1.5"),
    "x-death a timestamp": lambda q: datetime(2020, 1, 1),
    "x-death a string": lambda q: "abc",
    "x-death a table": lambda q: {"queue": q, "reason": "rejected", "count": 3},
    "x-death an array of scalars": lambda q: ["abc", 5, None],
    "x-death routing-keys an int": lambda q: [{"queue": q, "reason": "expired", "count": 1, "routing-keys": 5}],
    "x-death routing-keys a float": lambda q: [{"queue": q, "reason": "expired", "count": 1, "routing-keys": 1.5}],
    "x-death routing-keys a bool": lambda q: [{"queue": q, "reason": "expired", "count": 1, "routing-keys": True}],
    "x-death routing-keys a table": lambda q: [{"queue": q, "reason": "expired", "count": 1,
                                                "routing-keys": {"a": 1}}],
    "x-death routing-keys a string": lambda q: [{"queue": q, "reason": "expired", "count": 1,
                                                 "routing-keys": "abc"}],
    "x-death routing-keys [int]": lambda q: [{"queue": q, "reason": "expired", "count": 1, "routing-keys": [7]}],
}

#: Wrong types in the library's own headers: no crash, no loss (handled or archived).
ODD_LIBRARY_HEADERS = {
    f"{name} = {label}": (name, value)
    for name in ("kombu-events-attempts", "kombu-events-redeliveries", "kombu-events-routing-key")
    for label, value in [("bytes", b"\xff\x01"), ("a table", {"a": [1]}), ("an array", [1, 2]), ("a float", 2.5),
                         ("2**63-1", 2**63 - 1), ("-2**63", -2**63), ("None", None), ("a decimal", Decimal("-1.5")),
                         ("a timestamp", datetime(2030, 1, 1)), ("'abc'", "abc"), ("300 bytes", "r" * 300)]
}

#: kombu decompresses a body whose headers say ``compression`` before any callback of ours.
COMPRESSION = {"application/x-gzip": "application/x-gzip", "zlib": "zlib", "unknown": "no-such-compression",
               "a table": {"a": 1}, "an int": 5}


def probes(fuzzer: Fuzzer, marker_dir: Path) -> list[Sent]:
    """Every named shape at least once, beside the random ones."""
    sent = []
    for route in ("fz.json", "fz.raw"):
        queue = fuzzer.queues[route]
        for shape, make in UNREADABLE_X_DEATH.items():
            sent.append(json_probe(fuzzer, shape, route, application_headers={"x-death": make(queue)}))
            sent[-1].tags.add("unreadable-x-death")
        for shape, (name, value) in ODD_LIBRARY_HEADERS.items():
            sent.append(json_probe(fuzzer, shape, route, application_headers={name: value}))
        for label, value in COMPRESSION.items():
            sent.append(json_probe(fuzzer, f"compression header {label}", route,
                                   application_headers={"compression": value}))
        sent.append(json_probe(fuzzer, "~1 MB body", route, body=json.dumps({"blob": "y" * 1_000_000}).encode()))
        sent.append(json_probe(fuzzer, "header key not UTF-8", route, application_headers={b"\xff\xfe": 1}))
        sent.append(json_probe(fuzzer, "JSON array 5,000 deep", route, body=nested_json(b"[", b"]", 5000)))
        sent.append(json_probe(fuzzer, "JSON object 5,000 deep", route, body=nested_json(b'{"a":', b"}", 5000, b"1")))
        sent[-2].tags.add("deep-json")
        sent[-1].tags.add("deep-json")
    # kombu inflates such a body before our callback sees it; retries and the archive must still carry the
    # bytes published (a handler that always fails: retried, then archived).
    gzipped = zlib.compress(json.dumps({"probe": "gzip"}).encode())
    sent.append(json_probe(fuzzer, "compression header with a body that is gzip", body=gzipped, behaviour="fail",
                           application_headers={"compression": "application/x-gzip"}))
    bombs = [(open, str(marker_dir / "opened"), "w"), (os.system, f"touch {marker_dir / 'system'}")]
    for content_type in ("application/x-python-serialize", "application/x-python-serialize; charset=binary",
                         "APPLICATION/X-PYTHON-SERIALIZE", None):
        for fn, *args in bombs:
            body = pickle.dumps(_Bomb(fn, *args), protocol=2)
            sent.append(json_probe(fuzzer, f"pickle bomb {fn.__name__} as {content_type}", body=body,
                                   content_type=content_type, content_encoding="binary"))
            sent[-1].tags.add("pickle-bomb")
    for fn, *args in bombs:  # the raw handler gets these bytes: nothing may unpickle them on the way
        body = pickle.dumps(_Bomb(fn, *args), protocol=2)
        sent.append(json_probe(fuzzer, f"pickle bomb {fn.__name__} to the raw handler", "fz.raw", body=body,
                               content_type="application/x-python-serialize"))
    return sent


def hand_encoded(fuzzer: Fuzzer) -> list[Sent]:
    """Frames RabbitMQ accepts that py-amqp cannot write (or writes only by accident)."""
    bad = b"\xff\xfe\xc3("
    shapes: list[tuple[str, dict[str, Any]]] = [
        (f"{name} not UTF-8", {name: bad})
        for name in ("content_type", "content_encoding", "correlation_id", "reply_to", "type", "app_id",
                     "cluster_id")
    ] + [
        ("header timestamp in year 10000", {"application_headers": {"t": timestamp_field(253402300800)}}),
        ("header timestamp 2**40 s", {"application_headers": {"t": timestamp_field(2**40)}}),
        ("header timestamp 2**64-1 s", {"application_headers": {"t": timestamp_field(2**64 - 1)}}),
        ("tables nested 2,000 deep", {"application_headers": {"deep": nested_tables(2000)}}),
        ("arrays nested 5,000 deep", {"application_headers": {"deep": nested_arrays(5000)}}),
        ("arrays nested 500 deep", {"application_headers": {"deep": nested_arrays(500)}}),
        ("x-death: arrays nested 2,000 deep", {"application_headers": {"x-death": nested_arrays(2000)}}),
        ("field types py-amqp never writes (b B s u i I f x L)", {"application_headers": {
            "b": Field(b"b", b"\xff"), "B": Field(b"B", b"\xff"), "s": Field(b"s", struct.pack(">h", -3)),
            "u": Field(b"u", b"\xff\xff"), "i": Field(b"i", b"\xff\xff\xff\xff"),
            "I": Field(b"I", b"\xff\xff\xff\xff"), "f": Field(b"f", struct.pack(">f", 1.5)),
            "x": Field(b"x", struct.pack(">I", 3) + b"\x00\x01\xff"), "L": Field(b"L", struct.pack(">q", -1)),
            "kombu-events-attempts": Field(b"x", struct.pack(">I", 1) + b"\x01")}}),
        ("header value not UTF-8", {"application_headers": {"v": Field(b"S", struct.pack(">I", 2) + b"\xff\xfe")}}),
        ("header key not UTF-8", {"application_headers": {b"\xc3(": 1}}),
        ("the same header key twice", {"application_headers": Field(b"F", table_bytes(
            b"\x15kombu-events-attempts" + field_bytes(1) + b"\x15kombu-events-attempts" + field_bytes("abc")))}),
    ]
    sent = []
    for route in ("fz.json", "fz.raw"):
        for shape, properties in shapes:
            sent.append(json_probe(fuzzer, shape, route, **properties))
        for shape in ("header table at the frame size limit", "header table 300 bytes below the frame size limit"):
            probe = json_probe(fuzzer, shape, route, application_headers={"big": ""})
            # A header frame's payload: 12 octets of class, weight and body size, then the properties.
            used = 12 + len(encode_properties(dict(probe.properties, message_id=probe.message_id)))
            room = fuzzer.frame_max - 8 - used
            probe.properties["application_headers"] = {"big": "h" * (room - (300 if "below" in shape else 0))}
            sent.append(probe)
    for probe in sent:
        probe.hand_encoded = True
    return sent


# -- publishing, waiting, accounting ----------------------------------------------------------------

def connect(broker_url: str) -> amqp.Connection:
    url = urlsplit(broker_url)
    connection = amqp.Connection(f"{url.hostname or 'localhost'}:{url.port or PORT}",
                                 userid=unquote(url.username or "guest"), password=unquote(url.password or "guest"),
                                 virtual_host=unquote(url.path[1:]) or "/")
    connection.connect()
    return connection


def frame_max(broker_url: str) -> int:
    connection = connect(broker_url)
    try:
        return connection.frame_max
    finally:
        connection.close()


def publish(broker_url: str, exchange: str, messages: list[Sent]) -> None:
    """Publish with py-amqp itself, mandatory and confirmed one by one."""
    returned: list[Any] = []
    connection = connect(broker_url)
    try:
        channel = connection.channel()
        channel.confirm_select()
        channel.events["basic_return"].add(lambda *args: returned.append(args))
        for sent in messages:
            channel.basic_publish(sent.message(), exchange=exchange, routing_key=sent.routing_key, mandatory=True)
    finally:
        connection.close()
    assert not returned, f"unroutable: {returned[:3]}"


def failure_lines(worker: Worker) -> list[str]:
    """Log lines saying the worker is dying, keeps a message unacked for good, or keeps reconnecting."""
    lines = worker.log.splitlines()
    signs = ("CRITICAL", "Unrecoverable error", "left unacked")
    found = [line for line in lines if any(sign in line for sign in signs)]
    reconnects = [line for line in lines if "Connection to broker lost" in line]
    return found + (reconnects[:3] if len(reconnects) > 5 else [])  # one or two: someone restarted the broker


def excerpt(log: str, line: str, keep: int = 14) -> str:
    """``line`` and the end of the traceback under it."""
    lines = log.splitlines()
    start = lines.index(line) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("[20")), len(lines))
    trace = lines[start:end]
    return "\n".join([line] + (["    ..."] if len(trace) > keep else []) + trace[-keep:])


def check_worker(worker: Worker, context: str) -> None:
    lines = failure_lines(worker)
    if worker.proc.poll() is not None or lines:
        log = worker.log
        status = "still running" if worker.proc.poll() is None else f"exited with {worker.proc.returncode}"
        said = "\n".join(excerpt(log, line) for line in lines[:5]) if lines else log[-3000:]
        raise AssertionError(f"{context}: the worker is {status}; its log says:\n{said}")


def busy_queues(project: Project) -> dict[str, tuple[int, int, int]]:
    """Queues of the service other than the archive holding a message, ready or unacked (the archive, a stream,
    is not read here: drain_archive reads it, with the total decoder)."""
    archive = f"{project.service}.archive"
    counts = queue_counts(project.broker_url)
    mine = [name for name in counts if name.startswith(project.service + ".") and name != archive]
    return {name: counts[name] for name in mine if counts[name][0] + counts[name][1]}


def drain_archive(project: Project, archived: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """What the archive holds now, in ``archived`` (by message id; each copy once: the archive is a stream, read,
    never changed); bodies stay bytes."""
    with total_property_decoder():
        messages = get_messages(project.broker_url, f"{project.service}.archive")
    archived.clear()
    for message in messages:
        archived.setdefault(message.properties.get("message_id"), []).append(message)
    return archived


@dataclass
class Result:
    handled: set[str]
    archived: dict[str, list[Any]]
    duplicates: int


def settle(project: Project, worker: Worker, messages: list[Sent], context: str) -> Result:
    """Wait (bounded) until every message is handled or archived and the service's queues are empty."""
    keys = {m.handled_key: m.message_id for m in messages}
    sent = {m.message_id for m in messages}
    archived: dict[str, list[Any]] = {}
    started = time.monotonic()
    idle_since = None
    while True:
        check_worker(worker, context)
        busy = busy_queues(project)
        records = project.records()
        handled = {keys[r["key"]] for r in records if r["key"] in keys}
        now = time.monotonic()
        idle_since = None if busy else idle_since or now
        if not busy:
            drain_archive(project, archived)
            if sent <= handled | set(archived) and not busy_queues(project):
                return Result(handled, archived, len(records) - len(handled))
        if now - started > SETTLE_TIMEOUT_S or (idle_since is not None and now - idle_since > IDLE_S):
            drain_archive(project, archived)
            missing = sent - handled - set(archived)
            lost = [m for m in messages if m.message_id in missing]
            described = "\n".join(f"  {m.message_id!r}: {m.shape}" for m in lost)
            shared = sorted(set.intersection(*(set(m.properties) for m in lost))) if lost else []
            strangers = [r for r in records if r["key"] not in keys]
            why = f"every queue empty for {IDLE_S:g} s" if not busy else f"not settled after {SETTLE_TIMEOUT_S:g} s"
            raise AssertionError(
                f"{context}: {why}: {len(missing)} of {len(sent)} messages neither handled nor archived "
                f"(properties all of them have: {shared}; handler calls for bodies never sent: {strangers[:5]}); "
                f"queues holding messages (ready, unacked, consumers): {busy}\n{described[:6000]}"
                f"\n--- log tail ---\n{worker.log[-2000:]}")
        time.sleep(0.5)


def body_of(message: Any) -> bytes:
    return message.body if isinstance(message.body, bytes) else message.body.encode()  # py-amqp: empty is ''


def reason_of(message: Any) -> Any:
    return (message.properties.get("application_headers") or {}).get("kombu-events-reason")


def assert_accounted(project: Project, worker: Worker, messages: list[Sent], result: Result, context: str) -> None:
    by_id = {m.message_id: m for m in messages}
    sent = set(by_id)
    archived = set(result.archived)
    print(f"\n{context}: sent {len(sent)}, handled {len(result.handled)}, archived {len(archived & sent)}, "
          f"duplicate handler calls {result.duplicates}, archive copies {sum(map(len, result.archived.values()))}")

    assert archived <= sent, f"{context}: archived ids never sent: {sorted(archived - sent)[:10]}"
    assert sent == result.handled | archived  # settle() returned only once this held
    both = sorted(result.handled & archived)
    assert not both, f"{context}: handled successfully and archived too: " + "; ".join(
        f"{i!r} ({by_id[i].shape})" for i in both[:10])
    no_reason = [i for i, copies in result.archived.items() for m in copies
                 if not isinstance(reason_of(m), str) or not reason_of(m).strip()]
    assert not no_reason, f"{context}: archived without a kombu-events-reason: {no_reason[:10]}"
    rewritten = [f"{i!r} ({by_id[i].shape}): {by_id[i].body[:20]!r} -> {body_of(m)[:20]!r}"
                 for i, copies in result.archived.items() for m in copies if body_of(m) != by_id[i].body]
    assert not rewritten, f"{context}: archived with another body than published: " + "; ".join(rewritten[:5])
    not_bytes = project.records(key="not-bytes")
    assert not not_bytes, f"{context}: handlers got bodies that are not the published bytes: {not_bytes[:5]}"
    assert busy_queues(project) == {}, f"{context}: queues still hold messages: {busy_queues(project)}"
    assert worker.proc.poll() is None, f"{context}: the worker exited with {worker.proc.returncode}"
    assert failure_lines(worker) == [], f"{context}: {failure_lines(worker)[:10]}"


def probe_problems(messages: list[Sent], result: Result) -> list[str]:
    """What the named probes must end as: pickles archived, deep JSON archived at once, an unreadable
    x-death archived with a reason naming it (the issue's words). Every problem, not just the first."""
    problems = []
    for sent in messages:
        archived = result.archived.get(sent.message_id)
        where = f"{sent.shape} ({sent.routing_key})"
        if not sent.tags & {"pickle-bomb", "unreadable-x-death"} and not (
                "deep-json" in sent.tags and sent.routing_key.startswith("fz.json.")):
            continue
        if not archived:
            problems.append(f"{where}: handled, not archived")
            continue
        headers = archived[0].properties["application_headers"]
        reason = str(headers.get("kombu-events-reason"))
        if "deep-json" in sent.tags and (headers.get("kombu-events-attempts") != 1 or "gave up" in reason):
            problems.append(f"{where}: retried before it was archived, not undecodable: {reason!r}")
        elif "deep-json" in sent.tags and not ("json" in reason.lower() or "decod" in reason.lower()):
            problems.append(f"{where}: the reason does not say it is undecodable: {reason!r}")
        if "unreadable-x-death" in sent.tags and "x-death" not in reason:
            problems.append(f"{where}: the reason does not name x-death: {reason!r}")
    return problems


# -- the tests ------------------------------------------------------------------------------------

def start(make_project: Any, pool: str, concurrency: int) -> tuple[Project, Worker]:
    project = make_project(APP)
    worker = project.worker(pool=pool, concurrency=concurrency).wait_ready()
    return project, worker


@pytest.mark.parametrize("pool, concurrency", POOLS)
def test_random_messages_are_each_handled_or_archived(make_project, tmp_path, pool, concurrency):
    context = f"fuzz pool={pool} seed={SEED} (KOMBU_EVENTS_FUZZ_SEED={SEED} reproduces it)"
    print(f"\n{context}")
    started = time.monotonic()
    project, worker = start(make_project, pool, concurrency)
    fuzzer = Fuzzer(random.Random(f"{SEED}:{pool}"), project.service, frame_max(project.broker_url))
    markers = tmp_path / "markers"
    markers.mkdir()
    messages = probes(fuzzer, markers) + [fuzzer.message() for _ in range(COUNT)]
    fuzzer.rng.shuffle(messages)
    assert len({m.message_id for m in messages}) == len(messages)

    publish(project.broker_url, project.exchange, messages)
    result = settle(project, worker, messages, context)
    assert_accounted(project, worker, messages, result, context)

    assert list(markers.iterdir()) == [], f"{context}: a pickled body was unpickled: {list(markers.iterdir())}"
    problems = probe_problems(messages, result)
    assert not problems, f"{context}:\n" + "\n".join(problems)
    print(f"{context}: {time.monotonic() - started:.1f} s")


@pytest.mark.parametrize("pool, concurrency", POOLS)
def test_frames_py_amqp_cannot_write_are_each_handled_or_archived(make_project, pool, concurrency):
    context = f"hand-encoded pool={pool}"
    started = time.monotonic()
    project, worker = start(make_project, pool, concurrency)
    fuzzer = Fuzzer(random.Random(f"{SEED}:{pool}:hand"), project.service, frame_max(project.broker_url))
    messages = hand_encoded(fuzzer)

    publish(project.broker_url, project.exchange, messages)
    result = settle(project, worker, messages, context)
    assert_accounted(project, worker, messages, result, context)
    print(f"{context}: {time.monotonic() - started:.1f} s")
