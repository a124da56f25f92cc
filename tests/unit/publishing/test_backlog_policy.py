"""publishing/backlog_policy.py: publish-or-store and what a flushed batch settled (pure); publishing/published.py:
the Published result."""
from __future__ import annotations

import json
import pickle

import pytest
from hypothesis import given, strategies as st

from kombu_events.errors import (
    BacklogFullError,
    BrokerUnavailableError,
    ConfigurationError,
    ConfirmTimeoutError,
    EncodeError,
    PublishError,
    UnroutableError,
)
from kombu_events.publishing.backlog_policy import (
    PUBLISH,
    STORE,
    publish_or_store,
    settle_batch,
    storable,
)
from kombu_events.publishing.published import Published


def test_published_is_the_message_id_and_says_where_the_event_is():
    confirmed, stored = Published("m-1"), Published("m-2", stored_locally=True)
    assert confirmed == "m-1" and isinstance(confirmed, str) and not confirmed.stored_locally
    assert stored.stored_locally and stored.message_id == "m-2" and type(stored.message_id) is str
    assert json.dumps({"id": stored}) == '{"id": "m-2"}'
    assert {stored: 1}["m-2"] == 1
    assert repr(stored) == "Published('m-2', stored_locally=True)"
    copy = pickle.loads(pickle.dumps(stored))
    assert copy == "m-2" and copy.stored_locally


@pytest.mark.parametrize(("closed", "pending", "expected"), [
    (True, False, PUBLISH),
    (True, True, STORE),  # an event never overtakes one stored before it
    (False, False, STORE),
    (False, True, STORE),
])
def test_publish_or_store(closed, pending, expected):
    assert publish_or_store(circuit_closed=closed, backlog_pending=pending) == expected


UNROUTABLE = UnroutableError("no queue", exchange="events", routing_key="a.b")


@pytest.mark.parametrize(("error", "expected"), [
    (BrokerUnavailableError("connection refused"), True),
    (ConfirmTimeoutError("not confirmed within 30 s"), True),
    (UNROUTABLE, False),
    (PublishError("nacked by the broker"), False),
    (BacklogFullError("full"), False),
    (EncodeError("not JSON"), False),
    (ConfigurationError("bad"), False),
    (RuntimeError("other"), False),
])
def test_only_an_unreachable_or_silent_broker_sends_an_event_to_the_backlog(error, expected):
    assert storable(error) is expected


def test_settle_batch_sorts_rows_by_the_brokers_answer():
    nack = PublishError("nacked")
    result = settle_batch([1, 2, 3, 4, 5], [None, UNROUTABLE, nack, None, BrokerUnavailableError("gone")])
    assert result.confirmed == (1, 4)
    assert result.rejected == ((2, str(UNROUTABLE)),)
    assert result.kept == (3, 5)
    assert result.error is nack


def test_settle_batch_needs_one_result_per_row():
    with pytest.raises(ValueError, match="2 rows but 1 results"):
        settle_batch([1, 2], [None])


RESULTS = st.sampled_from([None, None, None, UNROUTABLE, PublishError("nacked"), BrokerUnavailableError("x")])


@given(st.lists(RESULTS, max_size=50))
def test_every_row_is_settled_exactly_once_in_order(results):
    seqs = list(range(10, 10 + len(results)))
    batch = settle_batch(seqs, results)
    rejected = [seq for seq, _why in batch.rejected]
    assert sorted(batch.confirmed + tuple(rejected) + batch.kept) == seqs, "each row in exactly one group"
    for group in (list(batch.confirmed), rejected, list(batch.kept)):
        assert group == sorted(group), "each group keeps the batch's order"
    failures = [r for r in results if r is not None and not isinstance(r, UnroutableError)]
    assert batch.error is (failures[0] if failures else None)
