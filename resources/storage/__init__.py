"""The warehouse: paths and object-store settings (``warehouse``), JVM-free reads of Delta logs
(``delta_meta``), Tidemark's own tables (``meta_tables``; a CDC replicator's positions,
``cdc_positions``) and table maintenance (``maintenance``).

May import: ``lineage``, ``resources.core``."""
