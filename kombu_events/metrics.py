"""Prometheus metrics, where users import them: ``from kombu_events.metrics import PrometheusMetrics``.

The code lives in :mod:`kombu_events.integrations.metrics`, beside the other optional integrations.
"""
from __future__ import annotations

from .integrations.metrics import PrometheusMetrics

__all__ = ["PrometheusMetrics"]
