"""Bounded untrusted input: max_body_bytes, capped decompression, deep JSON, accept_content, publishers=."""
from __future__ import annotations

import bz2
import json
import lzma
import pickle
import zlib

import celery
import pytest

from kombu_events import Events, Exponential, Retry
from kombu_events.core import decision
from kombu_events.core.codec import JSON, MAX_BODY_BYTES, decode, decompress
from kombu_events.core.config import resolve_settings
from kombu_events.core.delivery import Delivery
from kombu_events.core.event import Event
from kombu_events.core.handlers import check_publishers
from kombu_events.errors import ConfigurationError, DecodeError
from kombu_events.middleware.base import Hooks
from kombu_events.testing import StubEvents
from kombu_events.worker.screening import screen

METHODS = [("application/x-gzip", zlib.compress), ("zlib", zlib.compress), ("bzip2", bz2.compress),
           ("application/x-bz2", bz2.compress), ("xz", lzma.compress), ("application/x-lzma", lzma.compress)]


# -- the setting ----------------------------------------------------------------------------------


def test_max_body_bytes_defaults_to_rabbitmq_4s_max_message_size():
    assert MAX_BODY_BYTES == 16 * 1024 * 1024
    assert resolve_settings("billing", conf=None, environ={}).max_body_bytes == MAX_BODY_BYTES


def test_max_body_bytes_comes_from_celery_conf_and_keywords():
    assert resolve_settings("b", conf={"kombu_events_max_body_bytes": 1000}, environ={}).max_body_bytes == 1000
    assert resolve_settings("b", conf={"kombu_events_max_body_bytes": 1000}, environ={},
                            max_body_bytes=2000).max_body_bytes == 2000


@pytest.mark.parametrize("value", [0, -1, 2**31, 1.5, "16MiB", True])
def test_an_invalid_max_body_bytes_names_the_setting_and_its_range(value):
    with pytest.raises(ConfigurationError, match=r"max_body_bytes must be an integer within 1 \.\. 2147483647"):
        resolve_settings("b", conf=None, environ={}, max_body_bytes=value)


# -- decompression, capped ------------------------------------------------------------------------


@pytest.mark.parametrize("method, compress", METHODS)
def test_a_body_that_inflates_to_the_limit_is_inflated(method, compress):
    assert decompress(compress(b"x" * 1000), method, max_bytes=1000) == b"x" * 1000


@pytest.mark.parametrize("method, compress", METHODS)
def test_a_body_that_inflates_beyond_the_limit_is_refused_naming_it(method, compress):
    with pytest.raises(DecodeError, match=r"inflates beyond max_body_bytes=999 "):
        decompress(compress(b"x" * 1000), method, max_bytes=999)


@pytest.mark.parametrize("method, compress", METHODS)
def test_a_bomb_stops_at_the_limit_without_inflating_it_all(method, compress, monkeypatch):
    bomb = compress(b"\0" * (64 * 1024 * 1024))  # 64 MiB of zeros, a few kB compressed
    with pytest.raises(DecodeError, match="inflates beyond max_body_bytes=1024"):
        decompress(bomb, method, max_bytes=1024)


@pytest.mark.parametrize("method, compress", METHODS)
def test_a_truncated_or_garbled_body_is_a_decode_error(method, compress):
    with pytest.raises(DecodeError, match="does not decompress"):
        decompress(compress(b"hello world" * 10)[:-6], method)
    with pytest.raises(DecodeError, match="does not decompress"):
        decompress(b"not compressed at all", method)


def test_concatenated_streams_inflate_as_the_one_shot_functions_do():
    assert decompress(bz2.compress(b"a") + bz2.compress(b"b"), "bzip2") == bz2.decompress(
        bz2.compress(b"a") + bz2.compress(b"b"))
    assert decompress(lzma.compress(b"a") + lzma.compress(b"b") + b"junk", "xz") == b"ab"
    assert decompress(zlib.compress(b"a") + b"junk", "zlib") == b"a"


@pytest.mark.parametrize("compression", ["snappy", None, ["zlib"]])
def test_an_unknown_method_is_a_decode_error(compression):
    with pytest.raises(DecodeError, match="does not decompress as"):
        decompress(zlib.compress(b"{}"), compression)


def test_a_method_that_cannot_be_inflated_in_pieces_is_refused(monkeypatch):
    from kombu import compression as kombu_compression

    monkeypatch.setitem(kombu_compression._decoders, "application/x-custom", lambda body: body * 1000)
    with pytest.raises(DecodeError, match="'application/x-custom' cannot be inflated within a bound"):
        decompress(b"abc", "application/x-custom")


# -- JSON nesting, content types ----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [10_000, 1_000_000])
def test_json_nested_deeper_than_the_parser_allows_is_undecodable(depth):
    with pytest.raises(DecodeError, match="RecursionError"):
        decode(b"[" * depth + b"]" * depth, JSON, None, frozenset({JSON}))


def test_json_nested_200_deep_decodes():
    assert decode(b"[" * 200 + b"]" * 200, JSON, None, frozenset({JSON})) is not None


@pytest.mark.parametrize("content_type, body", [
    ("application/x-python-serialize", pickle.dumps({"n": 1})),
    ("application/x-yaml", b"n: 1\n"),
    ("application/yaml", b"n: 1\n"),
])
def test_pickle_and_yaml_are_archived_by_default(content_type, body):
    app = celery.Celery("proj", broker="memory://", set_as_current=False)
    events = Events(app, "billing")
    calls = []

    @events.handler("orders.#")
    def audit(payload):
        calls.append(payload)

    stub = StubEvents(events)
    stub.publish("orders.1", body, content_type=content_type)
    stub.join()
    assert calls == []
    [archived] = stub.archived
    assert archived.outcome.kind == decision.UNDECODABLE and "is not accepted" in archived.reason


# -- screening --------------------------------------------------------------------------------------


DELIVERY = Delivery("billing.audit", "orders.7.created", b"x" * 100, {"user_id": "orders"})


def test_a_body_larger_than_max_body_bytes_is_undecodable_at_screening():
    assert screen(DELIVERY, Hooks(), max_body_bytes=100) is None
    outcome = screen(DELIVERY, Hooks(), max_body_bytes=99)
    assert outcome == decision.Outcome(decision.UNDECODABLE, "body of 100 bytes is larger than max_body_bytes=99")


@pytest.mark.parametrize("properties, userid, reason", [
    ({"user_id": "orders"}, None, None),
    ({"user_id": "billing-worker"}, "billing-worker", None),  # a retry the worker republished
    ({"user_id": "mallory"}, "billing-worker",
     "published by user_id 'mallory', not one of the handler's publishers (orders, shop)"),
    ({}, None, "published by a publisher that set no user_id, not one of the handler's publishers (orders, shop)"),
    ({}, "billing-worker", "published by a publisher that set no user_id"),
])
def test_publishers_refuses_other_users_at_screening(properties, userid, reason):
    outcome = screen(DELIVERY._replace(properties=properties), Hooks(), publishers=frozenset({"orders", "shop"}),
                     userid=userid)
    if reason is None:
        assert outcome is None
    else:
        assert outcome is not None and outcome.kind == decision.REFUSED and outcome.reason.startswith(reason)


def test_a_refused_publisher_is_archived_at_once():
    decided = decision.decide(decision.Outcome(decision.REFUSED, "published by ..."), attempt=1, max_retries=5,
                              backoff=Exponential(), max_delay_ms=10_000, lost_delay_ms=1000)
    assert decided == decision.Decision("archive", reason="published by ...")


@pytest.mark.parametrize("value", ["orders", b"orders", set(), [""], [1], 42])
def test_invalid_publishers_are_refused_at_registration(value):
    with pytest.raises(ConfigurationError, match="publishers must"):
        check_publishers(value)
    events = Events(celery.Celery("proj", broker="memory://", set_as_current=False), "billing")
    with pytest.raises(ConfigurationError, match="publishers must"):
        events.handler("orders.#", publishers=value)


def test_event_says_who_published():
    event = Event({}, "k", "q", 1, properties={"user_id": "orders", "app_id": "shop-api"})
    assert (event.user_id, event.app_id) == ("orders", "shop-api")
    assert (Event({}, "k", "q", 1).user_id, Event({}, "k", "q", 1).app_id) == (None, None)


# -- the stub behaves as the worker ---------------------------------------------------------------


def _service(**settings):
    app = celery.Celery("proj", broker="amqp://billing-worker:secret@localhost//", set_as_current=False)
    return Events(app, "billing", delay_unit_ms=100, delay_levels=8,
                  backoff=Exponential(base_ms=200, max_delay_ms=1000), **settings)


def test_the_stub_runs_a_publishers_handler_only_for_those_users_and_its_own_retries():
    events = _service()
    seen = []

    @events.handler("orders.#", publishers={"orders"}, bind=True)
    def audit(event):
        seen.append((event.payload["n"], event.user_id, event.attempt))
        if event.payload["n"] == 2 and event.attempt == 1:
            raise Retry(delay=0.2)

    stub = StubEvents(events)
    assert stub.userid == "billing-worker"
    stub.publish("orders.1", {"n": 1}, properties={"user_id": "orders", "app_id": "shop"})
    stub.publish("orders.2", {"n": 2}, properties={"user_id": "orders"})
    stub.publish("orders.3", {"n": 3}, properties={"user_id": "mallory"})
    stub.publish("orders.4", {"n": 4})
    stub.join()
    stub.advance(5)
    assert seen == [(1, "orders", 1), (2, "orders", 1), (2, "billing-worker", 2)]
    assert [(s.outcome.kind, s.reason) for s in stub.archived] == [
        (decision.REFUSED, "published by user_id 'mallory', not one of the handler's publishers (orders)"),
        (decision.REFUSED, ("published by a publisher that set no user_id, not one of the handler's publishers "
                            "(orders)"))]


def test_the_stub_archives_a_body_over_max_body_bytes_without_running_the_handler():
    events = _service(max_body_bytes=1000)
    calls = []

    @events.handler("orders.#")
    def audit(payload):
        calls.append(payload)

    stub = StubEvents(events)
    stub.publish("orders.1", {"pad": "x" * 2000})
    stub.publish("orders.2", json.dumps({"pad": "x" * 2000}).encode(), content_type=JSON,
                 headers={"compression": "application/x-gzip"})  # not compressed: too large as received
    bomb = zlib.compress(json.dumps({"pad": "x" * 5000}).encode())
    stub.publish("orders.3", bomb, content_type=JSON, headers={"compression": "application/x-gzip"})
    stub.publish("orders.4", {"n": 4})
    stub.join()
    assert calls == [{"n": 4}]
    reasons = [s.reason for s in stub.archived]
    assert reasons[0].startswith("body of 2") and reasons[0].endswith("bytes is larger than max_body_bytes=1000")
    assert reasons[1].startswith("body of 2")
    assert reasons[2] == (f"body of {len(bomb)} bytes inflates beyond max_body_bytes=1000 "
                          f"(compression 'application/x-gzip')")
