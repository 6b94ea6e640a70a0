"""Cheap facts about Delta tables' rows without a JVM, through the ``deltalake`` package: the names
the rest of Tidemark uses, re-exported from the modules that hold them, one concern each:

- :mod:`resources.storage.snapshot`: a version's snapshot (:class:`TableSnapshot`), its properties
  (change data feed, deletion vectors), :class:`RemovedDataError`;
- :mod:`resources.storage.statistics`: what the log's statistics say (the greatest id, a merge
  unit's sizes);
- :mod:`resources.storage.history`: what the log says happened since a version, how to read a
  version whose files were vacuumed, what changed in a view's inputs;
- :mod:`resources.storage.positions`: high-water positions, the end of the next block, the rows in
  one, null rows;
- :mod:`resources.storage.prefetch`: many snapshots opened at once ahead of a planner tick;
- :mod:`resources.storage.late_rows`: rows that arrived after their place was processed.

The log itself (versions, transactions, commit statistics) is :mod:`resources.storage.delta_log`;
rows of tables with deletion vectors or column mapping go through :mod:`resources.storage.delta_read`.
Planner sensors and ``tidemark lag`` use this, so they stay fast and never start Spark.

The names here are bindings: code in those modules looks its helpers up in its own module, so a
test that replaces one patches the module that defines it.

May import: the modules above; it holds no code of its own.
"""

from __future__ import annotations

from resources.storage.history import (
    SnapshotRead,
    input_change,
    missing_commits,
    missing_files,
    snapshot_read,
)
from resources.storage.late_rows import LateRows, late_detection_warning, late_rows
from resources.storage.positions import (
    BlockEnd,
    bad_position_rows,
    count_block,
    count_upto,
    every_row_upto,
    files_in_range,
    find_block_end,
    freshness,
    table_mark,
)
from resources.storage.prefetch import (
    KEPT_SECONDS,
    KEPT_TABLES,
    PREFETCH_ROWS,
    max_id,
    prefetch_threads,
    prefetched,
)
from resources.storage.snapshot import (
    DeletionVectors,
    RemovedDataError,
    TableSnapshot,
    change_feed_enabled,
    deletion_vectors,
)
from resources.storage.statistics import STATS_SLACK, unit_sizes, widened

__all__ = [
    "KEPT_SECONDS",
    "KEPT_TABLES",
    "PREFETCH_ROWS",
    "STATS_SLACK",
    "BlockEnd",
    "DeletionVectors",
    "LateRows",
    "RemovedDataError",
    "SnapshotRead",
    "TableSnapshot",
    "bad_position_rows",
    "change_feed_enabled",
    "count_block",
    "count_upto",
    "deletion_vectors",
    "every_row_upto",
    "files_in_range",
    "find_block_end",
    "freshness",
    "input_change",
    "late_detection_warning",
    "late_rows",
    "max_id",
    "missing_commits",
    "missing_files",
    "prefetch_threads",
    "prefetched",
    "snapshot_read",
    "table_mark",
    "unit_sizes",
    "widened",
]
