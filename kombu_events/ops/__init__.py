"""What operators run against the broker: archive, migrate, status and health inspection, the topology drawing."""
