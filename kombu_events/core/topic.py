"""AMQP topic matching as RabbitMQ does it: which binding keys a routing key matches; no I/O.

Both keys are split into words on ``.``; the empty key has no words at all (``a.`` has
two, the second empty). In a binding key ``*`` matches exactly one word and ``#``
zero or more, so ``a.#`` matches ``a`` while ``a.*`` does not, and ``#`` matches
every routing key, the empty one included.
"""
from __future__ import annotations

__all__ = ["words", "matches"]


def words(key: str) -> list[str]:
    """The words of a routing or binding key (none for the empty key)."""
    return key.split(".") if key else []


def matches(binding_key: str, routing_key: str) -> bool:
    """Whether a topic exchange routes ``routing_key`` to a queue bound with ``binding_key``.

    Runs the binding key as a small automaton over the routing key's words: linear in
    their product, where the obvious backtracking is exponential in the number of ``#``.
    """
    pattern = words(binding_key)
    states = _closure(pattern, {0})
    for word in words(routing_key):
        following = set()
        for i in states:
            if i == len(pattern):
                continue
            if pattern[i] == "#":
                following.add(i)  # '#' takes this word and may take more
            elif pattern[i] in ("*", word):
                following.add(i + 1)
        states = _closure(pattern, following)
        if not states:
            return False
    return len(pattern) in states


def _closure(pattern: list[str], states: set[int]) -> set[int]:
    """``states`` plus every position reached by letting each '#' there take no word."""
    found = set(states)
    todo = list(states)
    while todo:
        i = todo.pop()
        if i < len(pattern) and pattern[i] == "#" and i + 1 not in found:
            found.add(i + 1)
            todo.append(i + 1)
    return found
