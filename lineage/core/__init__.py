"""Shared pure vocabulary: errors, durations, positions, checks and partition keys.

May import: nothing else of ``lineage`` (the standard library and pydantic only)."""
