"""One table's state as maintenance sees it (:class:`Health`), what a consumer needs of it
(:class:`Need`) and what a maintenance did (:class:`Report`), with the thresholds that decide what
is due. Pure data: no reads, no writes; ``maintenance`` (which reads a table's health and maintains
it) and ``cleanup`` import it. May import ``lineage.core``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lineage.core.durations import format_size

#: A table needs a checkpoint when this many commits follow the last one (Spark writes one every 10;
#: ``deltalake`` writers every 100; readers replay every JSON commit after it).
CHECKPOINT_AFTER_COMMITS = 20
#: A data file below this size counts as small (blocks of a few hundred rows write kilobytes).
SMALL_FILE_BYTES = 16 * 1024 * 1024
#: Compaction's target file size.
TARGET_FILE_BYTES = 128 * 1024 * 1024
#: Such a table is clustered again (Z-order by ``cluster_by``) once a file is this many times its target.
OVERSIZED = 4
#: A table needs compaction from this many small files on (fewer cost less than the rewrite).
COMPACT_FROM_SMALL_FILES = 16
#: A table's deletion vectors are purged (the files they mark rewritten without the deleted rows,
#: Spark's ``REORG TABLE ... APPLY (PURGE)``) once they mark this share of its rows deleted: until
#: then every reader reads those rows and drops them. (Delta's OPTIMIZE rewrites a file from 5 %
#: deleted on: ``spark.databricks.delta.optimize.maxDeletedRowsRatio``.)
PURGE_FROM_DELETED_SHARE = 0.05


@dataclass(frozen=True)
class Need:
    """A consumer's claim on a table: it reads ``version`` or later."""

    version: int
    who: str  # the topic (or replicator) that needs it
    why: str  # which of its offsets, e.g. "input offset", "late-row check from base version"
    files: bool = True  # False: only the commit (the log entry) is needed, not the version's data files

    def describe(self) -> str:
        return f"v{self.version} for {self.who}: {self.why}"


@dataclass(frozen=True)
class Health:
    """One table's state as maintenance sees it."""

    table: str
    path: str
    version: int | None  # None: no table at ``path``
    files: int = 0
    small_files: int = 0
    binned_bytes: int = 0  # the bytes in files under the target size (those deltalake's compaction rewrites)
    positions: bool = False  # the table has a ``pos`` column (a fact or a source: blocks are ranges of it)
    #: a table kept in small files (``kept_small``): its files over OVERSIZED times the target (a full
    #: recompute or a MERGE that packed the rows it rewrote into a few files)
    oversized_files: int = 0
    bytes: int = 0
    rows: int = 0  # rows in the data files, the ones deletion vectors mark deleted included
    vector_files: int = 0  # data files with a deletion vector
    deleted_rows: int = 0  # rows those vectors mark deleted
    checkpoint: int | None = None  # the newest checkpoint's version
    oldest_log: int | None = None  # the oldest version whose commit is still in the log
    needs: tuple[Need, ...] = ()
    warnings: tuple[str, ...] = ()  # the table's own retention would remove what a consumer needs
    #: the size compaction writes files at (and half of which a file is small below, when it is
    #: not TARGET_FILE_BYTES): a view clustered by its join column keeps small files on purpose
    target_bytes: int = TARGET_FILE_BYTES

    @property
    def exists(self) -> bool:
        return self.version is not None

    @property
    def kept_small(self) -> bool:
        """The table keeps files well under the usual target on purpose (``health``'s ``rows_per_file``)."""
        return self.target_bytes != TARGET_FILE_BYTES

    @property
    def small_bytes(self) -> int:
        """A data file below this size is small."""
        return self.target_bytes // 2 if self.kept_small else SMALL_FILE_BYTES

    @property
    def in_position_order(self) -> bool:
        """Compaction rewrites the whole table ordered by ``pos`` (its row groups then prune a
        planner's range reads by their statistics) instead of binning the files under the target
        size (which deltalake concatenates in no particular order): for a table with positions, not
        kept in small files, whose files under the target hold at least half its bytes, so the
        rewrite costs at most twice the binning it replaces."""
        return self.positions and not self.kept_small and self.binned_bytes * 2 >= self.bytes

    @property
    def deleted_share(self) -> float:
        """The share of the rows in the table's files that deletion vectors mark deleted."""
        return self.deleted_rows / self.rows if self.rows else 0.0

    @property
    def purge_due(self) -> bool:
        """Whether the deletion vectors mark enough rows deleted to be purged (:data:`PURGE_FROM_DELETED_SHARE`)."""
        return bool(self.deleted_rows) and self.deleted_share >= PURGE_FROM_DELETED_SHARE

    @property
    def since_checkpoint(self) -> int | None:
        if self.version is None:
            return None
        return self.version + 1 if self.checkpoint is None else self.version - self.checkpoint

    @property
    def horizon(self) -> Need | None:
        """The oldest version a consumer needs (its commit, at least)."""
        return min(self.needs, key=lambda n: n.version) if self.needs else None

    @property
    def file_horizon(self) -> Need | None:
        """The oldest version whose data files a consumer reads."""
        data = [n for n in self.needs if n.files]
        return min(data, key=lambda n: n.version) if data else None

    def reasons(self) -> list[str]:
        """Why the table needs maintenance (empty: it does not)."""
        out = []
        if self.purge_due:
            out.append(f"{self.deleted_rows} rows ({self.deleted_share:.0%}) marked deleted by deletion vectors in "
                       f"{self.vector_files} file(s) (purged from {PURGE_FROM_DELETED_SHARE:.0%})")
        if self.small_files >= COMPACT_FROM_SMALL_FILES:
            out.append(f"{self.small_files} small files (compaction from {COMPACT_FROM_SMALL_FILES})")
        if self.oversized_files:
            out.append(f"{self.oversized_files} file(s) over {OVERSIZED}x the {format_size(self.target_bytes)} this "
                       f"view is kept in (clustered again by its join column)")
        if (self.since_checkpoint or 0) >= CHECKPOINT_AFTER_COMMITS:
            out.append(f"{self.since_checkpoint} commits since the last checkpoint (one from {CHECKPOINT_AFTER_COMMITS})")
        return out


#: Rewrites the files of a table (its :class:`Health`) that carry a deletion vector, without the rows
#: it marks deleted, in one commit that changes no data (``dataChange: false``); returns what it did
#: (``numFilesRemoved``, ``numFilesAdded``, ``numDeletedRowsRemoved``). ``deltalake`` has no such
#: rewrite (its compaction skips files above the target and bins of one file), so the caller passes
#: one that runs Spark's ``REORG TABLE ... APPLY (PURGE)``.
Purge = Callable[[Health], dict[str, Any]]


@dataclass
class Report:
    """What :func:`maintain` did to one table (or, with ``dry_run``, would do)."""

    table: str
    dry_run: bool = False
    compacted: dict[str, Any] = field(default_factory=dict)  # files removed/added, bytes, by deltalake's optimize
    purged: dict[str, Any] = field(default_factory=dict)  # files rewritten without their deleted rows (a Purge)
    clustered_by: tuple[str, ...] = ()
    in_pos_order: bool = False  # compacted by a rewrite of the whole table in ``pos`` order (Health.in_position_order)
    checkpoint: int | None = None  # the version a checkpoint was written at
    horizon_checkpoint: int | None = None  # a checkpoint written at the consumers' horizon, so older log can go
    vacuumed: list[str] = field(default_factory=list)  # data files deleted
    logs_removed: list[str] = field(default_factory=list)  # log files deleted
    kept: list[str] = field(default_factory=list)  # what was kept and for whom
    skipped: list[str] = field(default_factory=list)  # steps not taken, and why
    seconds: float = 0.0
