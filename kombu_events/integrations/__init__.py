"""Optional integrations: Prometheus (metrics, exporter, liveness), OpenTelemetry tracing, Sentry."""
