"""What a replicator unit works with, shared by the replicator (:mod:`platform_assets.cdc.replicator`) and the
schema changes it applies (:mod:`platform_assets.cdc.ddl`): the replicated tables, a unit's result,
the source protocols, and :class:`ReplicaHost`, what ``cdc_ddl`` needs of the unit it works for
(docs/layout.md, circle 4). Plain types: this module imports neither of the two."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lineage.cdc.changes import TableSchema, Transaction
from platform_assets.cdc.apply import Layout
from resources.state.offsets import OffsetRecord

if TYPE_CHECKING:
    from pathlib import Path

    import pyarrow as pa
    from pyspark.sql import SparkSession

    from lineage.cdc.columns import ColumnRead
    from lineage.cdc.replicas import ReplicatorSpec
    from resources.state.offsets import OffsetStore

SNAPSHOTTING, REPLICATING, PAUSED, DROPPED = "snapshotting", "replicating", "paused", "dropped"
FAILING = "failing"  # the replicator's own record, after a unit failed
#: the state words of a replica that follows its source (any other: paused, dropped)
ACTIVE_STATES = (SNAPSHOTTING, REPLICATING, "committed", "planned", "new", "reset")  # (reset: a crash left it between
# the offset store's reset and the state that follows it; its position says what comes next)


class Snapshot(Protocol):
    lsn: int

    def rows(self, table: str, batch_rows: int = 50_000) -> Iterator[pa.RecordBatch]: ...


class ChangeSource(Protocol):
    """What the replicator needs of a source (``resources.cdc.postgres``, ``resources.cdc.debezium``)."""

    snapshots: bool

    def ensure_setup(self) -> None: ...
    def tables(self) -> dict[str, TableSchema]: ...
    def snapshot(self) -> AbstractContextManager[Snapshot]: ...
    def read(self, after: int, *, upto: int | None = None, max_changes: int = 100_000,
             wanted: Callable[[str, int], bool] | None = None) -> list[Transaction]: ...
    def ack(self, lsn: int) -> None: ...
    def close(self) -> None: ...


class ColumnarSource(ChangeSource, Protocol):
    """A source that can also read a span as Arrow columns (both sources can): ``read_columns``
    returns a :class:`lineage.cdc.columns.ColumnRead`, or None when the span holds what only
    ``read()`` carries. ``spill_dir``/``spill_rows``: where and past how many changes a read spills
    to Parquet as it streams; a source that holds its read whole (Debezium's files, already bounded
    by ``max_changes``) takes and ignores them."""

    def read_columns(self, after: int, *, upto: int | None = None, max_changes: int = 100_000,
                     wanted_after: Mapping[str, int | None], spill_dir: Path | None = None,
                     spill_rows: int = 1_000_000) -> ColumnRead | None: ...


def applied_lsn(rec: OffsetRecord) -> int | None:
    """The source position a replica's record says it applied (None: never, a snapshot is due)."""
    return None if rec.last.is_zero() else rec.last.id


def state_word(rec: OffsetRecord | str | None) -> str:
    """The first word of a replica's state (``paused: why ...`` -> ``paused``), from its record or
    the state itself."""
    state = rec if isinstance(rec, str) else (rec.state if rec else SNAPSHOTTING)
    return state.split(":", 1)[0].strip()


@dataclass
class Table:
    """A replicated table in this unit."""

    source: str
    replica: str
    path: str
    layout: Layout
    rec: OffsetRecord
    from_start: bool = False  # a source without snapshots: a new replica takes every change from the start
    parked: bool = False  # paused (or catching up after a pause) on a slot of its own, not the main one

    @property
    def applied(self) -> int | None:
        found = applied_lsn(self.rec)
        return 0 if found is None and self.from_start else found

    @property
    def active(self) -> bool:
        return state_word(self.rec) in ACTIVE_STATES


@dataclass
class CdcResult:
    replicator: str
    unit: int
    reason: str
    transactions: int = 0
    changes: int = 0
    tables: dict[str, dict[str, int]] = field(default_factory=dict)  # replica -> counts
    snapshots: dict[str, int] = field(default_factory=dict)  # replica -> rows copied
    paused: dict[str, str] = field(default_factory=dict)  # replica -> why
    acked: int | None = None
    lag_s: float | None = None  # oldest applied source commit -> its replica commit
    duration_s: float = 0.0
    redone: bool = False  # it finished a unit planned before a crash (perhaps with nothing left to write)

    @property
    def processed(self) -> bool:
        return bool(self.tables or self.snapshots)


class ReplicaContext(Protocol):
    """What the schema changes use of the Engine: the offset store and the Spark session."""

    @property
    def store(self) -> OffsetStore: ...
    @property
    def spark(self) -> SparkSession: ...


class ReplicaHost(Protocol):
    """The unit that schema changes are applied for (``cdc.ReplicatorUnit`` satisfies it)."""

    @property
    def engine(self) -> ReplicaContext: ...
    @property
    def owner(self) -> str: ...
    @property
    def spec(self) -> ReplicatorSpec: ...
    @property
    def source(self) -> ChangeSource: ...
    @property
    def tables(self) -> dict[str, Table]:
        """The unit's tables by source table."""
        ...

    def table(self, schema: TableSchema) -> Table:
        """The unit's table for a source table's schema (its replica created, reconciled, columns added)."""
        ...

    def commit_meta(self, unit: int, lsn: int, **extra: Any) -> str:
        """The ``userMetadata`` of a replica commit at source position ``lsn``."""
        ...
