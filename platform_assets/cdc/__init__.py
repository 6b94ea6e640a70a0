"""CDC replicas: a replicator's units (``replicator``, with the shared types in ``units``), the
MERGE that applies a batch (``apply``), schema changes (``ddl``), what Delta records of the
replicas' positions beyond their commits (``positions``) and the run loop (``run``).

May import: ``lineage``, ``resources``, ``platform_assets.core``."""
