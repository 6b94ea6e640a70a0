"""Table maintenance (``tables``): OPTIMIZE, VACUUM and checkpoints of the tables Tidemark writes, and
the purge of their deletion vectors on Spark (``purge``).

May import: ``lineage``, ``resources``, ``platform_assets.core``."""
