"""The planner: what each topic should do next, from its offsets, dependencies and delays.

May import: ``lineage.core``, ``lineage.spec``."""
