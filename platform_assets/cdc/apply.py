"""What a change batch does to a Delta replica, in one Delta MERGE (issue 10, seed 004 "Target").

The net effect of the batch is computed by :mod:`lineage.cdc.changes` (latest change per key, key changes
followed through before-images, TOAST values carried, multiset copies counted); here it becomes a
local relation and one ``MERGE`` carrying the unit's ``txnAppId``/``txnVersion`` and
``userMetadata`` (:func:`platform_assets.core.spark_io.run_merge`), so a replayed unit never applies
twice (keyed SCD1 replicas: :mod:`platform_assets.cdc.scd1`, from the driver where the replica is
small). Replica layouts (besides the source's columns):

* SCD1 (default): ``_sequence_num`` (the last change applied to the row), ``_commit_ts`` (its
  source commit time), with ``deletes: soft`` also ``_deleted``;
* SCD2: ``_sequence_num``, ``_valid_from``, ``_valid_to`` (null: current), ``_is_current``;
* no key: ``_copy`` (1..n among identical rows: the multiset's copies), ``_sequence_num``.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from lineage.cdc import columns as cdc_columns
from lineage.cdc.changes import UNKNOWN, BatchEffect, MultisetEffect, TableSchema, key_identity
from lineage.cdc.columns import arrow_type, column_array
from lineage.cdc.replicas import Deletes, Scd
from platform_assets.core import spark_io
from platform_assets.core.spark_io import quote

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

SEQ, COMMIT_TS, DELETED, COPY = "_sequence_num", "_commit_ts", "_deleted", "_copy"
VALID_FROM, VALID_TO, CURRENT = "_valid_from", "_valid_to", "_is_current"
PRESENT, UNKNOWN_COLS = cdc_columns.PRESENT, "_tm_unknown"
#: Replica table properties: the change feed for views reading replicas (unless ``change_feed: false``),
#: no deletion vectors (unless ``deletion_vectors: true``) and no type widening until a column widens
#: (the ``deltalake`` reader, and pandas/polars users through it, cannot read tables with either
#: reader feature: see :func:`platform_assets.cdc.ddl.alter`).
CHANGE_FEED = "delta.enableChangeDataFeed"
DELETION_VECTORS = spark_io.DELETION_VECTORS
REPLICA_PROPERTIES = {CHANGE_FEED: "true", DELETION_VECTORS: "false"}
#: set on a replica when a source column widens (int -> bigint, ...): only then
TYPE_WIDENING = "delta.enableTypeWidening"
#: A replica of at most this many rows is MERGEd from the driver by ``deltalake`` (no Spark job: a
#: few thousand changes onto 100,000 rows in a fraction of a second), unless it has deletion vectors
#: (``deltalake`` does not write them); past it, Spark MERGEs, and an unset ``deletion_vectors``
#: turns them on (:func:`ensure_replica`). Read at call time.
SMALL_REPLICA_ROWS = 1_000_000


@dataclass(frozen=True)
class Layout:
    """How a source table is kept: its key (empty: a multiset), SCD type and deletes."""

    schema: TableSchema
    key: tuple[str, ...]
    scd: Scd = Scd.TYPE1
    deletes: Deletes = Deletes.HARD
    change_feed: bool = True
    #: None: off for a replica it creates, turned on once the replica outgrows the driver's MERGE
    #: (:func:`ensure_replica`), never turned off
    deletion_vectors: bool | None = False

    @property
    def multiset(self) -> bool:
        return not self.key

    def extra(self) -> list[tuple[str, str]]:
        """The replica's own columns after the source's, as (name, Spark type)."""
        if self.multiset:
            return [(COPY, "int"), (SEQ, "bigint")]
        if self.scd is Scd.TYPE2:
            return [(SEQ, "bigint"), (VALID_FROM, "timestamp"), (VALID_TO, "timestamp"), (CURRENT, "boolean")]
        return [(SEQ, "bigint"), (COMMIT_TS, "timestamp")] + ([(DELETED, "boolean")] if self.deletes is Deletes.SOFT else [])

    def columns(self) -> list[tuple[str, str]]:
        return [(c.name, c.type) for c in self.schema.columns] + self.extra()

    def properties(self) -> dict[str, str]:
        """The replica's table properties (:data:`REPLICA_PROPERTIES`, the change feed and deletion
        vectors as configured; deletion vectors not set: off, for the replica this creates)."""
        return {**REPLICA_PROPERTIES, CHANGE_FEED: str(self.change_feed).lower(),
                DELETION_VECTORS: str(self.deletion_vectors is True).lower()}


@dataclass(frozen=True)
class Commit:
    """What the Delta commit landing a unit carries."""

    app_id: str
    version: int
    meta: str


# ------------------------------------------------------------------ Spark types <-> Arrow


def arrow_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]]) -> pa.Table:
    """Rows (tuples in ``columns`` order) as an Arrow table typed like the replica."""
    cols: list[list[Any]] = [[] for _ in columns]
    for row in rows:
        for i, v in enumerate(row):
            cols[i].append(v)
    return pa.table({name: column_array(vals, arrow_type(t), f"column {name} ({t})")
                     for (name, t), vals in zip(columns, cols, strict=True)})


def local_frame(spark: SparkSession, table: pa.Table) -> DataFrame:
    """An Arrow table as a Spark local relation (also over Spark Connect, whose ``createDataFrame``
    refuses an empty table without a schema: "Can not infer schema from an empty dataset")."""
    if table.num_rows == 0:
        from pyspark.sql.pandas.types import from_arrow_schema

        return spark.createDataFrame([], schema=from_arrow_schema(table.schema))
    return spark.createDataFrame(table)


#: A MERGE's source up to this size (Arrow bytes) is broadcast to the join with the replica: the
#: replica's rows are then not shuffled (5M rows, 900k changes: the MERGE 36.5 s -> 20.9 s; bench/README.md).
BROADCAST_BYTES = 256 << 20


def merge_source(spark: SparkSession, table: pa.Table) -> DataFrame:
    """The effect of a batch as a MERGE's source: a local relation, broadcast when small enough
    (:data:`BROADCAST_BYTES`; Spark's own threshold, 10 MB, leaves most units to a shuffle)."""
    df = local_frame(spark, table)
    return df.hint("broadcast") if table.nbytes <= BROADCAST_BYTES else df


# ------------------------------------------------------------------ the replica table


def ensure_replica(spark: SparkSession, path: str, layout: Layout) -> bool:
    """Create the replica (empty, with its properties) when it does not exist; True if created. An
    existing replica whose ``deletion_vectors`` is unset gets them once it holds more than
    :data:`SMALL_REPLICA_ROWS` rows (its MERGEs are Spark's from then on: :func:`~platform_assets.cdc.scd1.merge_effect`)."""
    from resources.storage.delta_meta import TableSnapshot, deletion_vectors

    snap = TableSnapshot.open(path)  # JVM-free, and works over Spark Connect too
    if snap.table is not None:
        if (layout.deletion_vectors is None and (snap.row_count or 0) > SMALL_REPLICA_ROWS
                and not deletion_vectors(snap).enabled):
            log.info("replica at %s: %s rows, past %s: %s", path, snap.row_count, SMALL_REPLICA_ROWS,
                     spark_io.set_deletion_vectors(spark, path, True, snap))
        return False
    cols = ", ".join(f"{quote(n)} {t}" for n, t in layout.columns())
    props = ", ".join(f"'{k}' = '{v}'" for k, v in layout.properties().items())
    spark.sql(f"CREATE TABLE IF NOT EXISTS delta.`{path}` ({cols}) USING DELTA TBLPROPERTIES ({props})")
    return True


_DELTA_TYPES = {"long": "bigint", "integer": "int", "short": "smallint", "byte": "tinyint"}


def replica_columns(path: str) -> dict[str, str]:
    """The replica's columns now, name -> Spark SQL type, from its Delta log (no JVM)."""
    from resources.storage.delta_log import open_table

    return columns_of(open_table(path))


def columns_of(table: Any | None) -> dict[str, str]:
    """A replica's columns, name -> Spark SQL type, from its open ``deltalake`` table (None: no table)."""
    if table is None:
        return {}
    out = {}
    for f in table.schema().fields:
        name = str(getattr(f.type, "type", f.type))
        out[f.name] = _DELTA_TYPES.get(name, name)
    return out


def write_snapshot(spark: SparkSession, path: str, layout: Layout, batches: Iterable[pa.RecordBatch], commit: Commit,
                   *, chunk_rows: int = 200_000) -> int:
    """Overwrite the replica with a source snapshot; the last commit carries ``commit`` (earlier chunks
    carry nothing: a crash in between leaves the table SNAPSHOTTING, and the retry overwrites it)."""
    from pyspark.sql import functions as F

    source_cols = [c.name for c in layout.schema.columns]
    extra = layout.extra()
    pending: list[pa.RecordBatch] = []
    rows, first = 0, True

    def flush(last: bool) -> None:
        nonlocal first
        tbl = pa.Table.from_batches(pending) if pending else arrow_table([(c.name, c.type) for c in layout.schema.columns], [])
        df = local_frame(spark, tbl.select(source_cols))
        for name, typ in extra:
            value = {COPY: F.row_number().over(_copy_window(source_cols)), SEQ: F.lit(0), VALID_FROM: F.lit(None),
                     VALID_TO: F.lit(None), CURRENT: F.lit(True), COMMIT_TS: F.lit(None), DELETED: F.lit(False)}[name]
            df = df.withColumn(name, value.cast(typ))
        w = df.write.format("delta").mode("overwrite" if first else "append")
        if first:
            w = w.option("overwriteSchema", "true")
            for k, v in layout.properties().items():  # the table's properties, as ensure_replica sets them
                w = w.option(k, v)
        if last:
            spark_io.save_unit(w, path, app_id=commit.app_id, seq=commit.version, meta=commit.meta)
        else:  # the copy's first writes: a lost commit did not land, so it is tried again
            spark_io.retry_conflicts(lambda: w.save(path))
        first = False
        pending.clear()

    count = 0
    for batch in batches:
        pending.append(batch)
        count += batch.num_rows
        rows += batch.num_rows
        if count >= chunk_rows:
            flush(False)
            count = 0
    flush(True)
    return rows


def _copy_window(cols: list[str]) -> Any:
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    return Window.partitionBy(*[F.col(quote(c)) for c in cols]).orderBy(F.lit(1))


# ------------------------------------------------------------------ keyed replicas (SCD2; SCD1: scd1.py)


def ts(v: dt.datetime) -> dt.datetime:
    return v.replace(tzinfo=dt.UTC) if v.tzinfo is None else v


def origin_fill(spark: SparkSession, source: DataFrame, path: str, layout: Layout, unknown_any: bool,
                 current_only: bool) -> DataFrame:
    """Columns marked unknown (TOAST values the batch never sent) taken from the replica row of the
    effect's origin key, as it is before the MERGE."""
    if not unknown_any:
        return source.drop(UNKNOWN_COLS, *[f"_tm_o_{k}" for k in layout.key])
    from pyspark.sql import functions as F

    target = spark.read.format("delta").load(path)
    if current_only:
        target = target.where(F.col(CURRENT))
    names = [c.name for c in layout.schema.columns]
    o = target.select(*[F.col(quote(c)).alias(f"_tm_v_{c}") for c in names],
                      *[F.col(quote(k)).alias(f"_tm_ok_{k}") for k in layout.key])
    cond = None
    for k in layout.key:
        part = F.col(f"_tm_o_{k}").eqNullSafe(F.col(f"_tm_ok_{k}"))
        cond = part if cond is None else cond & part
    joined = source.join(F.broadcast(o.join(source.select(*[F.col(f"_tm_o_{k}").alias(f"_tm_ok_{k}") for k in layout.key])
                                            .where(F.col(f"_tm_ok_{layout.key[0]}").isNotNull()).distinct(),
                                            [f"_tm_ok_{k}" for k in layout.key], "left_semi")), cond, "left")
    out = [F.when(F.array_contains(F.col(UNKNOWN_COLS), c), F.col(f"_tm_v_{c}")).otherwise(F.col(quote(c))).alias(c)
           for c in names]
    rest = [c for c in source.columns if c not in names and c != UNKNOWN_COLS and not c.startswith("_tm_o_")]
    return joined.select(*out, *rest)


def apply_scd2(spark: SparkSession, path: str, layout: Layout, effect: BatchEffect, commit: Commit) -> None:
    """Every transaction's state of a key becomes a row; the key's current row is closed at the
    first new state's time (a delete or a key change closes it and adds nothing)."""
    names = [c.name for c in layout.schema.columns]
    key_types = [(f"_tm_mk_{k}", layout.schema.column(k).type) for k in layout.key]  # type: ignore[union-attr]
    origin_types = [(f"_tm_o_{k}", t) for k, t in ((k, layout.schema.column(k).type) for k in layout.key)]  # type: ignore[union-attr]
    cols = ([(c.name, c.type) for c in layout.schema.columns] + key_types + origin_types
            + [(SEQ, "bigint"), (VALID_FROM, "timestamp"), (VALID_TO, "timestamp"), (CURRENT, "boolean"), (PRESENT, "boolean")])
    rows: list[tuple[Any, ...]] = []
    unknowns: list[list[str]] = []
    for eff in effect.effects.values():
        versions = eff.versions
        if not versions:
            continue
        # close the replica's current row of this key (match key set), at the first new state's time
        rows.append((*[None] * len(names), *eff.key, *[None] * len(layout.key), versions[0][1], None,
                     ts(versions[0][2]), False, False))
        unknowns.append([])
        for i, (values, seq, at, _xid) in enumerate(versions):
            if values is None:
                continue
            until = ts(versions[i + 1][2]) if i + 1 < len(versions) else None
            unknown = [c for c, v in values.items() if v is UNKNOWN]
            rows.append((*[None if values.get(c) is UNKNOWN else values.get(c) for c in names], *[None] * len(layout.key),
                         *(eff.origin if unknown and eff.origin else [None] * len(layout.key)), seq, ts(at), until,
                         until is None, True))
            unknowns.append(unknown)
    tbl = arrow_table(cols, rows).append_column(UNKNOWN_COLS, pa.array(unknowns, type=pa.list_(pa.string())))
    source = origin_fill(spark, merge_source(spark, tbl), path, layout, any(unknowns), current_only=True)
    on = " AND ".join(f"t.{quote(k)} = s._tm_mk_{k}" for k in layout.key) + f" AND t.{CURRENT}"
    insert_cols = names + [SEQ, VALID_FROM, VALID_TO, CURRENT]
    sql = (f"MERGE INTO delta.`{path}` t USING {{source}} s ON {on}\n"
           f"WHEN MATCHED AND NOT s.{PRESENT} AND s.{SEQ} > t.{SEQ} THEN UPDATE SET t.{VALID_TO} = s.{VALID_TO}, "
           f"t.{CURRENT} = false\n"
           f"WHEN NOT MATCHED AND s.{PRESENT} THEN INSERT ({', '.join(map(quote, insert_cols))}) "
           f"VALUES ({', '.join('s.' + quote(c) for c in insert_cols)})")
    if effect.truncated_at is not None:
        sql += f"\nWHEN NOT MATCHED BY SOURCE AND t.{CURRENT} AND t.{SEQ} < {effect.truncated_at} THEN UPDATE SET t.{CURRENT} = false"
    spark_io.run_merge(spark, sql, source, app_id=commit.app_id, seq=commit.version, meta=commit.meta)


# ------------------------------------------------------------------ replicas without a key (multisets)


def apply_multiset(spark: SparkSession, path: str, layout: Layout, effect: MultisetEffect, commit: Commit) -> None:
    """Copies added or removed per distinct row: the replica's current count of each row the batch
    touched is read first (one query over those rows only), then one MERGE deletes the copies above
    the new count and inserts the missing ones (``_copy`` numbers them)."""
    from pyspark.sql import functions as F

    names = [c.name for c in layout.schema.columns]
    typed = [(c.name, c.type) for c in layout.schema.columns]
    touched = [row for row, d in effect.deltas.items() if d]
    current: dict[tuple[Any, ...], int] = {}
    if touched and effect.truncated_at is None:
        probe = local_frame(spark, arrow_table(typed, touched))
        target = spark.read.format("delta").load(path)
        cond = None
        for c in names:
            part = target[quote(c)].eqNullSafe(probe[quote(c)])
            cond = part if cond is None else cond & part
        counts = target.join(F.broadcast(probe), cond, "left_semi").groupBy(*[quote(c) for c in names]).agg(
            F.max(COPY).alias("n"))
        # by key identity: a NaN collected from Spark is not the batch's NaN object (Spark's <=> and
        # grouping make them one, as key_identity does)
        current = {key_identity(r[c] for c in names): int(r["n"]) for r in counts.collect()}
    rows: list[tuple[Any, ...]] = []
    for row in touched:
        n = current.get(key_identity(row), 0)
        m = max(0, n + effect.deltas[row])
        for copy in range(m + 1, n + 1):
            rows.append((*row, copy, effect.last_seq, False))
        for copy in range(n + 1, m + 1):
            rows.append((*row, copy, effect.last_seq, True))
    if not rows and effect.truncated_at is None:
        rows.append((*[None] * len(names), -1, effect.last_seq, False))  # nothing to change: an empty MERGE still commits
    source = merge_source(spark, arrow_table(typed + [(COPY, "int"), (SEQ, "bigint"), (PRESENT, "boolean")], rows))
    on = " AND ".join(f"t.{quote(c)} <=> s.{quote(c)}" for c in names) + f" AND t.{COPY} = s.{COPY}"
    insert_cols = names + [COPY, SEQ]
    sql = (f"MERGE INTO delta.`{path}` t USING {{source}} s ON {on}\n"
           f"WHEN MATCHED AND NOT s.{PRESENT} THEN DELETE\n"
           f"WHEN NOT MATCHED AND s.{PRESENT} THEN INSERT ({', '.join(map(quote, insert_cols))}) "
           f"VALUES ({', '.join('s.' + quote(c) for c in insert_cols)})")
    if effect.truncated_at is not None:
        sql += "\nWHEN NOT MATCHED BY SOURCE THEN DELETE"
    spark_io.run_merge(spark, sql, source, app_id=commit.app_id, seq=commit.version, meta=commit.meta)
