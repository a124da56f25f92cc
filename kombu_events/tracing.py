"""OpenTelemetry tracing, where users import it: ``from kombu_events.tracing import TracingMiddleware``.

The code lives in :mod:`kombu_events.integrations.tracing`, beside the other optional integrations.
"""
from __future__ import annotations

from .integrations.tracing import ATTEMPT, TracingMiddleware

__all__ = ["TracingMiddleware", "ATTEMPT"]
