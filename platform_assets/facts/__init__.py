"""Fact processors: ``step`` (a block of new base rows) and ``reload`` (a whole table again).

May import: ``lineage``, ``resources``, ``platform_assets.core``."""
