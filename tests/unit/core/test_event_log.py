"""A log of events (core/event_log.py): what ``events.log(...)`` accepts and refuses, the name and stream it gets,
``x-max-age`` exactly as asked, the segment size, and its stream in the service's topology."""
from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import example, given, strategies as st

from kombu_events.core.config import resolve_settings
from kombu_events.core.event_log import (
    AGE_SEGMENT_BYTES,
    MAX_SEGMENT_BYTES,
    MIN_SEGMENT_BYTES,
    EventLog,
    check_unique,
    event_log,
    log_queue,
    max_age,
    max_age_s,
    segment_bytes,
)
from kombu_events.core.topology import build_topology
from kombu_events.errors import ConfigurationError, KombuEventsError

DAY = timedelta(days=1)


# -- what events.log(...) accepts ----------------------------------------------------------------------------

def test_a_log_gets_its_name_from_its_first_key_and_its_stream_from_the_service():
    log = event_log("billing", ("orders.#", "payments.*"), keep=timedelta(days=90))
    assert log == EventLog("orders", "billing.log.orders", ("orders.#", "payments.*"), 90 * 86_400, None)
    assert log.queue == log_queue("billing", "orders")


@pytest.mark.parametrize(("key", "name"), [
    ("orders.#", "orders"), ("orders.*.created", "orders.created"), ("#", "all"), ("*.*", "all"),
    ("orders", "orders"), ("a.b.c", "a.b.c"),
])
def test_the_default_name_is_the_first_key_without_its_wildcards(key, name):
    assert event_log("s", (key,), keep=DAY).name == name


def test_name_overrides_the_default():
    assert event_log("s", ("orders.#",), keep=DAY, name="history").queue == "s.log.history"


@pytest.mark.parametrize(("keys", "options", "says"), [
    ((), {"keep": DAY}, "at least one binding key"),
    (("orders.#",), {}, "no retention"),
    (("orders.#",), {"keep": None, "max_bytes": None}, "no retention"),
    (("orders.x*",), {"keep": DAY}, "a wildcard must be a whole word"),
    (("",), {"keep": DAY}, "binding key must be a non-empty string"),
    ((7,), {"keep": DAY}, "binding key must be a non-empty string"),
    (("orders.#",), {"keep": 3600}, "must be a datetime.timedelta"),
    (("orders.#",), {"keep": timedelta(0)}, "whole seconds, at least 1"),
    (("orders.#",), {"keep": timedelta(seconds=-5)}, "whole seconds, at least 1"),
    (("orders.#",), {"keep": timedelta(seconds=1.5)}, "whole seconds"),
    (("orders.#",), {"max_bytes": 0}, "max_bytes of a log must be a positive number of bytes"),
    (("orders.#",), {"max_bytes": -1}, "positive number of bytes"),
    (("orders.#",), {"max_bytes": True}, "positive number of bytes"),
    (("orders.#",), {"max_bytes": 1.5e9}, "positive number of bytes"),
    (("orders.#",), {"keep": DAY, "name": "a b"}, "whitespace"),
    (("orders.#",), {"keep": DAY, "name": "x.#"}, "wildcard"),
    (("orders.#",), {"keep": DAY, "name": ""}, "non-empty string"),
    (("orders.#",), {"keep": DAY, "name": "n" * 250}, "bytes long"),
])
def test_bad_input_is_refused_with_a_clear_error(keys, options, says):
    with pytest.raises(ConfigurationError, match=says.replace(".", r"\.").replace("*", r"\*")):
        event_log("billing", keys, **options)


def test_configuration_errors_are_kombu_events_errors():
    with pytest.raises(KombuEventsError):
        event_log("billing", ("orders.#",))


def test_two_logs_of_one_name_are_refused():
    first = event_log("s", ("orders.#",), keep=DAY)
    check_unique(event_log("s", ("orders.#",), keep=DAY, name="other"), [first])
    with pytest.raises(ConfigurationError, match=r"two logs are named 'orders'.*give one of them name="):
        check_unique(event_log("s", ("orders.*",), keep=DAY), [first])


# -- x-max-age -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("seconds", "text"), [
    (90 * 86_400, "90D"), (36 * 3600, "36h"), (600, "10m"), (601, "601s"), (1, "1s"), (86_400, "1D"),
    (90, "90s"), (3600 * 25, "25h"),
])
def test_max_age_is_the_largest_exact_unit(seconds, text):
    assert max_age(seconds) == text
    assert max_age_s(text) == seconds


@given(st.timedeltas(min_value=timedelta(seconds=1), max_value=timedelta(days=10**6)))
@example(timedelta(days=999_999_999, hours=23, minutes=59, seconds=59))
@example(timedelta(seconds=1))
def test_keep_round_trips_through_x_max_age_and_never_keeps_more_than_asked(keep):
    whole = keep - timedelta(microseconds=keep.microseconds)
    log = event_log("s", ("a.#",), keep=whole)
    text = str(log.queue_arguments()["x-max-age"])
    assert timedelta(seconds=max_age_s(text)) == whole  # exactly: never more, never less
    assert text[:-1].isdigit() and text[-1] in "Dhms" and not text.startswith("0")


@given(st.timedeltas(min_value=timedelta(seconds=1), max_value=timedelta(days=10**4)).filter(
    lambda keep: keep.microseconds != 0))
def test_a_fraction_of_a_second_is_refused_not_rounded(keep):
    with pytest.raises(ConfigurationError, match="whole seconds"):
        event_log("s", ("a.#",), keep=keep)


@pytest.mark.parametrize("text", ["", "90", "D", "0D", "-1D", "1.5h", "90d", "1w", " 1D", "01D"])
def test_max_age_s_refuses_what_rabbitmq_would(text):
    with pytest.raises(ValueError, match="not an x-max-age"):
        max_age_s(text)


def test_max_age_s_reads_years_and_months_as_rabbitmq_does():
    assert max_age_s("1Y") == 365 * 86_400 and max_age_s("2M") == 60 * 86_400


@pytest.mark.parametrize("seconds", [0, -1, 1.5, True, "60"])
def test_max_age_needs_whole_positive_seconds(seconds):
    with pytest.raises(ValueError):
        max_age(seconds)


# -- segments ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("max_bytes", "segment"), [
    (None, AGE_SEGMENT_BYTES), (1, MIN_SEGMENT_BYTES), (4 * 2**20, 2**20), (40_000_000, 10_000_000),
    (10**12, MAX_SEGMENT_BYTES),
])
def test_the_segment_is_a_quarter_of_max_bytes_within_bounds(max_bytes, segment):
    assert segment_bytes(max_bytes) == segment


@given(st.integers(min_value=1, max_value=10**15))
def test_a_log_kept_by_size_holds_at_most_max_bytes_and_one_segment_of_at_most_a_quarter(max_bytes):
    segment = segment_bytes(max_bytes)
    assert MIN_SEGMENT_BYTES <= segment <= MAX_SEGMENT_BYTES
    assert segment <= max(MIN_SEGMENT_BYTES, max_bytes // 4)


def test_the_stream_arguments():
    log = event_log("s", ("a.#",), keep=timedelta(hours=36), max_bytes=10_000_000)
    assert log.queue_arguments() == {"x-queue-type": "stream", "x-max-age": "36h",
                                     "x-max-length-bytes": 10_000_000, "x-stream-max-segment-size-bytes": 2_500_000}
    assert log.describe_retention() == "36h and 10000000 bytes"
    assert "x-max-age" not in event_log("s", ("a.#",), max_bytes=10**9).queue_arguments()


# -- in the topology -----------------------------------------------------------------------------------------

def _topology(*logs: EventLog, **settings):
    return build_topology(resolve_settings("billing", None, exchange="ev", **settings), (), (), logs)


def test_the_stream_is_in_the_topology_with_role_log_and_its_bindings():
    log = event_log("billing", ("orders.#", "payments.*"), keep=timedelta(days=90))
    topology = _topology(log, publish_delay_levels=2)
    [stream] = [q for q in topology.queues if q.name == "billing.log.orders"]
    assert topology.role(stream.name) == "log" and topology.logs == (log,)
    assert stream.durable and stream.queue_arguments == log.queue_arguments()
    assert sorted((b.exchange.name, b.routing_key) for b in stream.bindings) == [
        ("ev", "orders.#"), ("ev", "payments.*"), ("ev.deferred", "*.*.orders.#"), ("ev.deferred", "*.*.payments.*")]
    assert stream not in topology.handler_queues, "no worker consumes a log"
    assert (f"queue billing.log.orders durable=True x-max-age=90D x-queue-type=stream "
            f"x-stream-max-segment-size-bytes={AGE_SEGMENT_BYTES}") in topology.describe()


def test_a_log_is_a_stream_whatever_the_queue_type():
    topology = _topology(event_log("billing", ("a.#",), keep=DAY), queue_type="quorum")
    assert topology.queues[[q.name for q in topology.queues].index("billing.log.a")].queue_arguments[
        "x-queue-type"] == "stream"


def test_without_delayed_publishing_the_stream_binds_the_events_exchange_only():
    topology = _topology(event_log("billing", ("a.#",), keep=DAY), publish_delay_levels=0)
    [stream] = [q for q in topology.queues if topology.role(q.name) == "log"]
    assert [(b.exchange.name, b.routing_key) for b in stream.bindings] == [("ev", "a.#")]
