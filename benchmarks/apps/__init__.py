"""Celery apps the benchmark workers run, configured through ``KEB_*`` environment variables."""
