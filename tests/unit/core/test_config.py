"""core/config.py: defaults, precedence, validation and the broker URL."""
from __future__ import annotations

import re
from types import SimpleNamespace

import celery
import pytest

from kombu_events.core.backoff import Constant, Exponential
from kombu_events.core.config import ENV, Settings, auto_prefetch, broker_url, resolve_settings
from kombu_events.errors import ConfigurationError


def test_defaults():
    s = resolve_settings("billing", conf=None, environ={})
    assert s == Settings(service="billing")
    assert (s.service, s.exchange, s.max_retries, s.delay_levels, s.delay_unit_ms) == ("billing", "events", 5, 16, 1000)
    assert s.archive_ttl_ms == 7 * 24 * 3600 * 1000
    assert s.archive_max_length == 100_000
    assert (s.prefetch_count, s.queue_type, s.accept_content, s.traceback_limit) == (
        None, "classic", ("application/json",), 2000)
    assert s.backoff == Exponential(max_delay_ms=3_600_000)
    assert s.max_delay_ms == 65_535 * 1000
    assert s.max_queue_bytes == 255 - 2 * 16


@pytest.mark.parametrize("queues, expected", [
    (0, 100), (1, 100), (5, 100), (6, 83), (10, 50), (25, 20), (50, 10), (51, 10), (500, 10), (10_000, 10)])
def test_an_unset_prefetch_count_shares_500_in_flight_between_many_queues(queues, expected):
    assert auto_prefetch(queues) == expected
    assert Settings(service="s").prefetch_per_queue(queues) == expected


@pytest.mark.parametrize("queues", [1, 50, 500])
def test_a_prefetch_count_set_is_used_whatever_the_number_of_queues(queues):
    assert Settings(service="s", prefetch_count=100).prefetch_per_queue(queues) == 100
    assert Settings(service="s", prefetch_count=3).prefetch_per_queue(queues) == 3


@pytest.mark.parametrize(
    "setting, variable", sorted(ENV.items()),
)
def test_precedence_kwargs_over_conf_over_env_over_defaults(setting, variable):
    default = getattr(Settings(service="s"), setting)
    assert getattr(resolve_settings("s", conf={}, environ={}), setting) == default
    env = {variable: "7"}
    assert getattr(resolve_settings("s", conf={}, environ=env), setting) == 7
    conf = {f"kombu_events_{setting}": 8}
    assert getattr(resolve_settings("s", conf=conf, environ=env), setting) == 8
    assert getattr(resolve_settings("s", conf=conf, environ=env, **{setting: 9}), setting) == 9
    # None means "not given": the next source still applies
    assert getattr(resolve_settings("s", conf=conf, environ=env, **{setting: None}), setting) == 8


def test_env_variable_names_are_the_seeds():
    assert ENV == {
        "max_retries": "AMQP_EVENTS_MAX_RETRIES",
        "archive_ttl_ms": "AMQP_EVENTS_ARCHIVED_MESSAGE_TTL",
        "archive_max_length": "AMQP_EVENTS_ARCHIVED_QUEUE_LENGTH",
        "archive_max_bytes": "KOMBU_EVENTS_ARCHIVE_MAX_BYTES",
    }


def test_empty_env_variable_is_unset():
    assert resolve_settings("s", environ={"AMQP_EVENTS_MAX_RETRIES": ""}).max_retries == 5


def test_settings_without_env_variable_come_from_conf_and_kwargs():
    conf = {"kombu_events_delay_levels": 8, "kombu_events_queue_type": "quorum",
            "kombu_events_accept_content": ["application/json", "application/x-msgpack"]}
    s = resolve_settings("s", conf=conf, environ={}, prefetch_count=10)
    assert (s.delay_levels, s.queue_type, s.prefetch_count) == (8, "quorum", 10)
    assert s.accept_content == ("application/json", "application/x-msgpack")


def test_celery_conf_works_as_conf():
    app = celery.Celery("cfg", broker="memory://", set_as_current=False)
    app.conf.update(kombu_events_max_retries=2, kombu_events_delay_unit_ms=500)
    s = resolve_settings("s", conf=app.conf, environ={"AMQP_EVENTS_MAX_RETRIES": "9"})
    assert (s.max_retries, s.delay_unit_ms) == (2, 500)


def test_environ_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("AMQP_EVENTS_ARCHIVED_QUEUE_LENGTH", "42")
    assert resolve_settings("s").archive_max_length == 42


@pytest.mark.parametrize(
    "kwargs, setting, valid",
    [
        ({"max_retries": -1}, "max_retries", "0 .. 10000"),
        ({"max_retries": 10_001}, "max_retries", "0 .. 10000"),
        ({"max_retries": "3"}, "max_retries", "0 .. 10000"),
        ({"max_retries": True}, "max_retries", "0 .. 10000"),
        ({"max_retries": 2.5}, "max_retries", "0 .. 10000"),
        ({"delay_levels": 0}, "delay_levels", "1 .. 32"),
        ({"delay_levels": 33}, "delay_levels", "1 .. 32"),
        ({"delay_unit_ms": 0}, "delay_unit_ms", "1 .. 86400000"),
        ({"archive_ttl_ms": -1}, "archive_ttl_ms", "0 .. 4294967295"),
        ({"archive_ttl_ms": 2**32}, "archive_ttl_ms", "0 .. 4294967295"),
        ({"archive_max_length": -1}, "archive_max_length", "0 .. 2147483647"),
        ({"archive_max_bytes": -1}, "archive_max_bytes", "0 .. 9007199254740992"),
        ({"archive_max_bytes": 2**53 + 1}, "archive_max_bytes", "0 .. 9007199254740992"),
        ({"prefetch_count": 0}, "prefetch_count", "1 .. 65535"),
        ({"prefetch_count": 65_536}, "prefetch_count", "1 .. 65535"),
        ({"traceback_limit": -1}, "traceback_limit", "0 .. 60000"),
        ({"queue_type": "lazy"}, "queue_type", "classic, quorum"),
        ({"queue_type": "Quorum"}, "queue_type", "classic, quorum"),
        ({"quorum_initial_group_size": 0}, "quorum_initial_group_size", "1 .. 999"),
        ({"django_connections": "never"}, "django_connections='never'", "close, max_age, off"),
        ({"django_connections": False}, "django_connections=False", "close, max_age, off"),
        ({"exchange": ""}, "exchange", "non-empty string"),
        ({"exchange": "events.*"}, "exchange", "letters, digits"),
        ({"exchange": "events.#"}, "exchange", "letters, digits"),
        ({"exchange": "my events"}, "exchange", "letters, digits"),
        ({"accept_content": "application/json"}, "accept_content", "non-empty list of content types"),
        ({"accept_content": ()}, "accept_content", "non-empty list of content types"),
        ({"backoff": "fast"}, "backoff", "Exponential"),
        ({"max_retry": 3}, "max_retry", "valid: accept_content, archive_max_bytes, archive_max_length"),
    ],
)
def test_invalid_settings_name_the_setting_and_what_is_valid(kwargs, setting, valid):
    with pytest.raises(ConfigurationError) as info:
        resolve_settings("s", conf=None, environ={}, **kwargs)
    assert setting in str(info.value)
    assert valid in str(info.value)


@pytest.mark.parametrize(
    "service, valid",
    [("", "non-empty string"), ("bill*", "letters, digits"), ("bill ing", "letters, digits"),
     ("s" * 201, "at most 200 bytes")],
)
def test_invalid_service(service, valid):
    with pytest.raises(ConfigurationError) as info:
        resolve_settings(service, environ={})
    assert str(info.value).startswith("service")
    assert valid in str(info.value)


@pytest.mark.parametrize(
    "variable, setting, raw, valid",
    [
        ("AMQP_EVENTS_MAX_RETRIES", "max_retries", "five", "0 .. 10000"),
        ("AMQP_EVENTS_MAX_RETRIES", "max_retries", "2.5", "0 .. 10000"),
        ("AMQP_EVENTS_MAX_RETRIES", "max_retries", "-1", "0 .. 10000"),
        ("AMQP_EVENTS_ARCHIVED_MESSAGE_TTL", "archive_ttl_ms", "1h", "0 .. 4294967295"),
        ("AMQP_EVENTS_ARCHIVED_QUEUE_LENGTH", "archive_max_length", "lots", "0 .. 2147483647"),
    ],
)
def test_invalid_env_values_name_the_setting_and_range(variable, setting, raw, valid):
    with pytest.raises(ConfigurationError) as info:
        resolve_settings("s", environ={variable: raw})
    message = str(info.value)
    assert setting in message
    assert valid in message
    if not raw.lstrip("-").isdigit():
        assert variable in message and repr(raw) in message


class _Unbounded:
    """A user's own policy with no cap (Exponential refuses an infinite max_delay_ms itself)."""

    max_delay_ms = float("inf")

    def delay_ms(self, *, retry, rand=None):
        return 1000.0 * 2 ** retry


def test_backoff_cap_beyond_the_ladder_raises():
    # 4 levels of 1 s hold at most 15 s
    assert Settings(service="s", delay_levels=4, backoff=Exponential(max_delay_ms=15_000)).max_delay_ms == 15_000
    for policy in (Exponential(max_delay_ms=15_001), Constant(every_ms=20_000), _Unbounded()):
        with pytest.raises(ConfigurationError) as info:
            Settings(service="s", delay_levels=4, backoff=policy)
        message = str(info.value)
        assert "backoff max_delay_ms" in message
        assert "at most 15000 ms" in message
        assert "raise delay_levels" in message


@pytest.mark.parametrize(
    "levels, unit_ms, cap", [(4, 1000, 15_000), (12, 1000, 3_600_000), (16, 1000, 3_600_000), (3, 10, 70)],
)
def test_default_backoff_is_clamped_to_the_ladder(levels, unit_ms, cap):
    s = Settings(service="s", delay_levels=levels, delay_unit_ms=unit_ms)
    assert s.backoff.max_delay_ms == cap
    assert s.backoff.max_delay_ms <= s.max_delay_ms


def test_check_delay():
    s = Settings(service="s", delay_levels=2, delay_unit_ms=100)
    s.check_delay("d", 300)
    for bad in (301, float("inf"), float("nan")):
        with pytest.raises(ConfigurationError, match=r"^d=.*at most 300 ms"):
            s.check_delay("d", bad)


@pytest.mark.parametrize("levels", [1, 16, 32])
def test_max_queue_bytes_leaves_room_for_the_ladder_words(levels):
    assert Settings(service="s", delay_levels=levels, delay_unit_ms=1).max_queue_bytes == 255 - 2 * levels


@pytest.mark.parametrize("levels, unit, publish", [(24, 1000, False), (32, 2, False), (17, 65_536, True),
                                                   (7, 24 * 3600 * 1000, True)])
def test_a_ladder_whose_top_ttl_rabbitmq_refuses_is_a_clear_error(levels, unit, publish):
    prefix = "publish_" if publish else ""
    with pytest.raises(ConfigurationError, match=rf"{prefix}delay_levels={levels} with {prefix}delay_unit_ms={unit}: "
                       r"the top level's TTL \(\d+ ms\) is more than RabbitMQ accepts \(4294967295 ms"):
        Settings(service="s", **{f"{prefix}delay_levels": levels, f"{prefix}delay_unit_ms": unit})


@pytest.mark.parametrize("levels, unit", [(23, 1000), (32, 1), (1, 24 * 3600 * 1000)])
def test_the_largest_ladders_rabbitmq_accepts_are_allowed(levels, unit):
    assert Settings(service="s", delay_levels=levels, delay_unit_ms=unit).delay_levels == levels


def _app(url):
    return SimpleNamespace(conf=SimpleNamespace(broker_url=url))


@pytest.mark.parametrize(
    "app, explicit, environ, expected",
    [
        (_app("amqp://app//"), "amqp://explicit//", {"RABBIT_URL": "amqp://env//"}, "amqp://explicit//"),
        (_app("amqp://app//"), None, {"RABBIT_URL": "amqp://env//"}, "amqp://env//"),
        (_app("amqp://app//"), None, {"RABBIT_URL": ""}, "amqp://app//"),
        (_app("amqp://app//"), None, {}, "amqp://app//"),
        (None, None, {"RABBIT_URL": "amqp://env//"}, "amqp://env//"),
        (_app(None), None, {}, "amqp://guest:guest@localhost:5672//"),
        (None, None, {}, "amqp://guest:guest@localhost:5672//"),
    ],
)
def test_broker_url_precedence(app, explicit, environ, expected):
    assert broker_url(app, explicit, environ=environ) == expected


def test_an_unknown_serializer_name_in_accept_content_fails_at_start_up():
    with pytest.raises(ConfigurationError, match=r"accept_content=.*jsonx"):
        Settings(service="billing", accept_content=["jsonx"])


def test_django_connections_is_read_from_celery_conf():
    settings = resolve_settings("s", conf={"kombu_events_django_connections": "max_age"}, environ={})
    assert settings.django_connections == "max_age"
    assert resolve_settings("s", conf=None, environ={}).django_connections == "close"


def test_metrics_settings_default_to_no_endpoint_on_loopback():
    from kombu_events.core.config import MetricsSettings, resolve_metrics_settings

    assert resolve_metrics_settings(None) == MetricsSettings(port=None, host="127.0.0.1", liveness_s=10.0)
    conf = {"kombu_events_metrics_port": 9100, "kombu_events_metrics_host": "0.0.0.0",
            "kombu_events_metrics_liveness_s": 30}
    assert resolve_metrics_settings(conf) == MetricsSettings(9100, "0.0.0.0", 30)
    assert resolve_metrics_settings(conf, port=9200).port == 9200, "the worker's flag wins"


@pytest.mark.parametrize(("conf", "message"), [
    ({"kombu_events_metrics_port": 0}, "kombu_events_metrics_port must be an integer within 1 .. 65535, got 0"),
    ({"kombu_events_metrics_port": "9100"}, "kombu_events_metrics_port must be an integer within 1 .. 65535"),
    ({"kombu_events_metrics_host": ""}, "kombu_events_metrics_host must be a host name or address"),
    ({"kombu_events_metrics_host": "0.0.0.0 "}, "kombu_events_metrics_host must be a host name"),
    ({"kombu_events_metrics_liveness_s": 0.5}, "kombu_events_metrics_liveness_s must be a number of seconds"),
    ({"kombu_events_metrics_liveness_s": 4000}, "within 1 .. 3600, got 4000"),
    ({"kombu_events_metrics_liveness_s": True}, "kombu_events_metrics_liveness_s must be a number"),
])
def test_invalid_metrics_settings_name_the_setting_and_what_is_valid(conf, message):
    from kombu_events.core.config import resolve_metrics_settings

    with pytest.raises(ConfigurationError, match=re.escape(message)):
        resolve_metrics_settings(conf)
