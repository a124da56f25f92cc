"""Benchmark suite of kombu-events: run ``python -m benchmarks`` against the local RabbitMQ."""
