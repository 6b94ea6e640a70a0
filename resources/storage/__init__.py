"""The warehouse: paths and object-store settings (``warehouse``); JVM-free reads of Delta tables:
the log itself (``delta_log``: versions, transactions, commit statistics), a version's snapshot and
its properties (``snapshot``), what the log's statistics say (``statistics``), what happened since a
version and how to read one whose files were vacuumed (``history``), positions, marks, block ends
and bad rows (``positions``), snapshots opened ahead of a planner tick (``prefetch``), late rows
(``late_rows``), all re-exported for callers by ``delta_meta``; rows of tables with deletion vectors
or column mapping (``delta_read``); a view's join index, the base sorted by a join column
(``join_index``); Tidemark's own tables (``meta_tables``; a CDC replicator's
positions, ``cdc_positions``) and table maintenance (``maintenance``; its cleanup of files and log,
``cleanup``; a table's state and a maintenance's report as data, ``health``).

May import: ``lineage``, ``resources.core``."""
