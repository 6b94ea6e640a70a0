"""CDC, pure: change events and their net-effect reductions (``changes``: Python objects;
``columns``: the same reductions on Arrow columns) and the replicators' config (``replicas``).

May import: ``lineage.core``."""
