"""Migrations of the inbox and outbox tables."""
