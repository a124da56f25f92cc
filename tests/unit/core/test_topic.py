"""core/topic.py: RabbitMQ's topic matching, checked against a brute-force reference and the tutorial's table."""
from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import example, given, settings, strategies as st

from kombu_events.core.topic import matches, words


def reference(binding_key: str, routing_key: str) -> bool:
    """Try every way of giving the '#' words 0, 1, 2, ... routing words; '*' takes exactly one."""
    pattern = binding_key.split(".") if binding_key != "" else []
    key = routing_key.split(".") if routing_key != "" else []
    hashes = pattern.count("#")
    spare = len(key) - (len(pattern) - hashes)
    if spare < 0:
        return False
    for counts in itertools.product(range(spare + 1), repeat=hashes):
        if sum(counts) != spare:
            continue
        taken = iter(counts)
        expanded = [w for word in pattern for w in (["*"] * next(taken) if word == "#" else [word])]
        if all(p in ("*", k) for p, k in zip(expanded, key)):
            return True
    return False


# Few distinct words, so that literal words collide; empty words; wildcards (literal words in a routing key).
KEY = st.lists(st.sampled_from(["a", "b", "", "*", "#", "ab"]), max_size=6).map(".".join)


@settings(max_examples=3000, deadline=None)
@given(KEY, KEY)
@example("a.#", "a")
@example("#", "")
@example("*", "")
@example("", "")
@example("a.*", "a")
@example("#.#", "")
@example("*.#", "")
@example("#.*", ".")
def test_matches_like_the_reference(binding_key, routing_key):
    assert matches(binding_key, routing_key) is reference(binding_key, routing_key)


@pytest.mark.parametrize("key, expected", [
    ("", []), ("a", ["a"]), ("a.b", ["a", "b"]), ("a.", ["a", ""]), (".", ["", ""]), (".a", ["", "a"]),
    ("a..b", ["a", "", "b"]),
])
def test_words_split_on_dots_and_the_empty_key_has_none(key, expected):
    assert words(key) == expected


@pytest.mark.parametrize("binding_key, routing_key, expected", [
    # The three rules the issue names, and their neighbours.
    ("a.#", "a", True), ("a.#", "a.b.c", True), ("a.#", "b", False), ("a.#", "ab", False),
    ("#", "", True), ("#", "a", True), ("#", "a.b.c", True), ("#", ".", True),
    ("a.*", "a", False), ("a.*", "a.b", True), ("a.*", "a.b.c", False), ("a.*", "a.", True),
    ("*", "", False), ("*", "a", True), ("*", ".", False), ("", "", True), ("", "a", False),
    ("#.a", "a", True), ("a.#.b", "a.b", True), ("a.#.b", "a.x.y.b", True), ("#.#", "", True),
    ("*.#", "", False), ("#.*", "a", True), ("a.*.#", "a", False), ("a.*.#", "a.b", True),
    # Wildcards are only wildcards in binding keys.
    ("a.b", "a.*", False), ("a.*", "a.#", True), ("a.#", "a.*", True), ("a", "#", False),
    # RabbitMQ's tutorial 5 ("Topics").
    ("*.orange.*", "quick.orange.rabbit", True), ("*.*.rabbit", "quick.orange.rabbit", True),
    ("lazy.#", "lazy.orange.elephant", True), ("*.orange.*", "quick.orange.fox", True),
    ("*.*.rabbit", "quick.orange.fox", False), ("lazy.#", "lazy.brown.fox", True),
    ("*.orange.*", "quick.brown.fox", False), ("*.orange.*", "orange", False),
    ("*.orange.*", "quick.orange.new.rabbit", False), ("lazy.#", "lazy.orange.new.rabbit", True),
    ("*.*.rabbit", "lazy.orange.new.rabbit", False),
])
def test_examples(binding_key, routing_key, expected):
    assert matches(binding_key, routing_key) is expected


def test_many_hashes_do_not_backtrack_exponentially():
    started = time.perf_counter()
    assert not matches("#." * 60 + "z", "a." * 120 + "b")
    assert matches("#." * 60 + "b", "a." * 120 + "b")
    assert time.perf_counter() - started < 1.0
