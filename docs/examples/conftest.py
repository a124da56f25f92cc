pytest_plugins = ["kombu_events.testing"]  # the fixtures events_stub and events_broker
