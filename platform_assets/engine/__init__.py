"""The runner (``runner``): lock, lease, reconciliation, planning and dispatch of a lineage's
topics to their processors.

May import: ``lineage``, ``resources``, ``platform_assets.{core,facts,views}``."""
