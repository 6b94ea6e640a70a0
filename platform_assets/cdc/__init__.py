"""CDC replicas: a replicator's units (``replicator``, with the shared types in ``units``), the
replica layouts and the MERGEs that apply a batch (``apply``; keyed SCD1 replicas, from the driver
where small: ``scd1``), schema changes (``ddl``), what Delta records of the
replicas' positions beyond their commits (``positions``) and the run loop (``run``).

May import: ``lineage``, ``resources``, ``platform_assets.core``."""
