"""Fakes the worker's parts are tested with: a pool that keeps its jobs, a settler that records."""
from __future__ import annotations

from typing import Any


class Pool:
    """Keeps each job (fn, args, callback, error_callback); the test plays the pool's answer."""

    limit = 1

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, ...]] = []

    def apply_async(self, fn, args, callback, error_callback):
        self.jobs.append((fn, args, callback, error_callback))


class Settles:
    """Records what is settled (message id, result) and held (message id, reason)."""

    acks = None

    def __init__(self) -> None:
        self.settled: list[tuple[str, Any]] = []
        self.held: list[tuple[str, str]] = []

    def settle(self, route, delivery, message, result) -> None:
        self.settled.append((delivery.message_id, result))

    def hold(self, route, delivery, message, outcome, step) -> None:
        self.held.append((delivery.message_id, step.reason))
