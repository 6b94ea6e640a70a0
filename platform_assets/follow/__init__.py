"""Continuous mode (issue 55): ``tidemark follow``, one resident process and one Spark session that
run every unit of the lineage the moment it is due (``loop``).

May import: ``lineage``, ``resources``, ``platform_assets.core``, ``platform_assets.engine``,
``platform_assets.cdc``, ``platform_assets.intake``."""
