"""An end-to-end demo: ``python -m kombu_events.demo`` runs a worker and publishes to it."""
