"""The Django app ``kombu_events.django``: add it to ``INSTALLED_APPS`` for the inbox and outbox tables' migrations."""
