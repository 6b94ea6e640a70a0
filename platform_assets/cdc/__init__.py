"""CDC replicas: a replicator's units (``replicator``, with the shared types in ``units``), the
MERGE that applies a batch (``apply``), schema changes (``ddl``) and the run loop (``run``).

May import: ``lineage``, ``resources``, ``platform_assets.core``."""
