"""Table maintenance (``tables``): OPTIMIZE, VACUUM and checkpoints of the tables Tidemark writes.

May import: ``lineage``, ``resources``, ``platform_assets.core``."""
