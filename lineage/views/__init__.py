"""Materialized views, pure: the refresh strategy and its cost estimate (``refresh``).

May import: ``lineage.core``, ``lineage.spec``."""
