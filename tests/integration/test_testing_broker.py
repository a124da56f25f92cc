"""The test kit against the real RabbitMQ: throw-away vhosts, the events_broker fixture, and topic routing
as the broker does it (the stub's matcher, checked against RabbitMQ itself)."""
from __future__ import annotations

import itertools
import urllib.error
from urllib.parse import quote, unquote, urlsplit

import amqp
import pytest
from kombu import Connection

from kombu_events.core import topic
from kombu_events.testing import temporary_vhost

from .harness import _management

pytestmark = pytest.mark.integration

pytest_plugins = ["pytester"]


def vhost_of(url: str) -> str:
    return unquote(urlsplit(url).path[1:])


def vhost_exists(broker_url: str, name: str) -> bool:
    try:
        _management(broker_url, f"vhosts/{quote(name, safe='')}")
        return True
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise


def round_trip(url: str) -> bytes:
    """Declare, publish (confirmed) and consume one message in the URL's vhost; return its body."""
    with Connection(url) as conn:
        channel = conn.channel()
        channel.confirm_select()
        channel.queue_declare("kit.probe", durable=True, auto_delete=False)
        channel.basic_publish(amqp.Message(b"hello"), exchange="", routing_key="kit.probe", mandatory=True)
        message = channel.basic_get("kit.probe", no_ack=True)
        return bytes(message.body)


def test_a_temporary_vhost_is_usable_and_deleted_afterwards(broker_url):
    with temporary_vhost(broker_url) as url:
        name = vhost_of(url)
        assert name.startswith("kev-") and vhost_exists(broker_url, name)
        assert urlsplit(url).hostname == urlsplit(broker_url).hostname
        assert round_trip(url) == b"hello"
    assert not vhost_exists(broker_url, name)


def test_a_temporary_vhost_is_deleted_when_the_block_fails(broker_url):
    with pytest.raises(RuntimeError, match="test failed"), temporary_vhost(broker_url) as url:
        assert vhost_exists(broker_url, vhost_of(url))
        raise RuntimeError("test failed")
    assert not vhost_exists(broker_url, vhost_of(url))


INNER = """
pytest_plugins = ["kombu_events.testing"]

def test_uses_the_broker(events_broker):
    with open("url.txt", "w") as fh:
        fh.write(events_broker)
    from kombu import Connection
    with Connection(events_broker) as conn:
        conn.default_channel.queue_declare("kit.inner", durable=True, auto_delete=False)

def test_fails_with_the_broker(events_broker):
    with open("failed-url.txt", "w") as fh:
        fh.write(events_broker)
    assert False, "a failing test"
"""


def test_the_events_broker_fixture_gives_each_test_a_vhost_and_deletes_it(pytester, broker_url, monkeypatch):
    monkeypatch.setenv("CI", "true")  # an unreachable broker must fail the inner run, not skip it
    monkeypatch.setenv("KOMBU_EVENTS_TEST_BROKER", broker_url)
    pytester.makepyfile(INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    urls = [(pytester.path / name).read_text() for name in ("url.txt", "failed-url.txt")]
    assert len({vhost_of(url) for url in urls}) == 2
    for url in urls:
        assert vhost_of(url).startswith("kev-")
        assert not vhost_exists(broker_url, vhost_of(url)), "deleted after the test, failed or not"


def test_the_events_broker_fixture_skips_without_a_broker_unless_ci(pytester, monkeypatch):
    monkeypatch.setenv("KOMBU_EVENTS_TEST_BROKER", "amqp://guest:guest@127.0.0.1:1//")
    monkeypatch.setenv("KOMBU_EVENTS_TEST_MANAGEMENT", "http://127.0.0.1:1")
    pytester.makepyfile(INNER)
    monkeypatch.setenv("CI", "")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(skipped=2)
    monkeypatch.setenv("CI", "true")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(errors=2)


# -- topic routing: the stub's matcher against RabbitMQ's topic exchange --------------------------

BINDING_KEYS = ["a.#", "#", "a.*", "*", "*.*", "#.a", "a.#.b", "*.#", "#.*", "a..b", "a.", ".", "a.*.#", "#.#",
                "a.b", "a", "*.b.*", "#.b.#"]
WORDS = ["a", "b", ""]
ROUTING_KEYS = sorted({".".join(words) for n in range(4) for words in itertools.product(WORDS, repeat=n)}
                      | {"a.b.c.b", "x.a", "a.x.y.b"})


def test_the_topic_matcher_routes_as_rabbitmq_does(events_broker):
    with Connection(events_broker) as conn:
        channel = conn.channel()
        channel.exchange_declare("kit.topic", "topic", durable=False)
        for index, binding_key in enumerate(BINDING_KEYS):
            channel.queue_declare(f"q{index}", durable=True, auto_delete=False)
            channel.queue_bind(f"q{index}", "kit.topic", binding_key)
        channel.confirm_select()
        for routing_key in ROUTING_KEYS:
            channel.basic_publish(amqp.Message(b""), exchange="kit.topic", routing_key=routing_key)
        for index, binding_key in enumerate(BINDING_KEYS):
            got = []
            while (message := channel.basic_get(f"q{index}", no_ack=True)) is not None:
                got.append(message.delivery_info["routing_key"])
            expected = [k for k in ROUTING_KEYS if topic.matches(binding_key, k)]
            assert got == expected, f"binding key {binding_key!r}"
