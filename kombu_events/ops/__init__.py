"""What operators run against the broker, and what they hand to others: archive, migrate, status and health
inspection, the topology drawing, the AsyncAPI document (with its JSON Schema and YAML writers)."""
