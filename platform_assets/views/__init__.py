"""Materialized views: the merge processor (``merge``), the pinned inputs of a unit (``inputs``),
the ``exact`` check (``verify``) and the operations outside a unit (``operate``).

May import: ``lineage``, ``resources``, ``platform_assets.core``."""
