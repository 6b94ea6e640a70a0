"""How to reach the outside world: Spark sessions, the offset store, Delta metadata, settings."""
