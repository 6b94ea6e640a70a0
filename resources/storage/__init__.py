"""The warehouse: paths and object-store settings (``warehouse``); JVM-free reads of Delta tables:
the log itself (``delta_log``: versions, transactions, commit statistics), positions, marks, block
ends and late rows (``delta_meta``), rows of tables with deletion vectors or column mapping
(``delta_read``); Tidemark's own tables (``meta_tables``; a CDC replicator's positions,
``cdc_positions``) and table maintenance (``maintenance``; its cleanup of files and log, ``cleanup``; a table's state
and a maintenance's report as data, ``health``).

May import: ``lineage``, ``resources.core``."""
