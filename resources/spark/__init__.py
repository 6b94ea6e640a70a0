"""Spark: sessions (``session``: local, Connect, cluster; Dagster's ``LazyPySparkResource``), the
local Spark Connect server (``server``) and a standalone cluster (``cluster``).

May import: ``lineage``, ``resources.core``, ``resources.storage``."""
