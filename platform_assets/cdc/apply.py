"""What a change batch does to a Delta replica, in one Delta MERGE (issue 10, seed 004 "Target").

The net effect of the batch is computed by :mod:`lineage.cdc.changes` (latest change per key, key changes
followed through before-images, TOAST values carried, multiset copies counted); here it becomes a
local relation and one ``MERGE`` carrying the unit's ``txnAppId``/``txnVersion`` and
``userMetadata`` (:func:`platform_assets.core.spark_io.run_merge`), so a replayed unit never applies
twice. Replica layouts (besides the source's columns):

* SCD1 (default): ``_sequence_num`` (the last change applied to the row), ``_commit_ts`` (its
  source commit time), with ``deletes: soft`` also ``_deleted``;
* SCD2: ``_sequence_num``, ``_valid_from``, ``_valid_to`` (null: current), ``_is_current``;
* no key: ``_copy`` (1..n among identical rows: the multiset's copies), ``_sequence_num``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from lineage.cdc import columns as cdc_columns
from lineage.cdc.changes import UNKNOWN, BatchEffect, MultisetEffect, TableSchema, key_identity
from lineage.cdc.columns import arrow_type, column_array
from lineage.cdc.replicas import Deletes, Scd
from platform_assets.core import spark_io
from platform_assets.core.spark_io import quote

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

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


@dataclass(frozen=True)
class Layout:
    """How a source table is kept: its key (empty: a multiset), SCD type and deletes."""

    schema: TableSchema
    key: tuple[str, ...]
    scd: Scd = Scd.TYPE1
    deletes: Deletes = Deletes.HARD
    change_feed: bool = True
    #: None: on (the replicator's default for a replica it creates); an existing replica's own
    #: setting is kept by the replicator, not here
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
        vectors as configured; deletion vectors not set: on, for the replica this creates)."""
        return {**REPLICA_PROPERTIES, CHANGE_FEED: str(self.change_feed).lower(),
                DELETION_VECTORS: str(self.deletion_vectors is not False).lower()}


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
    """Create the replica (empty, with its properties) when it does not exist; True if created."""
    from resources.storage.delta_log import open_table

    if open_table(path) is not None:  # JVM-free, and works over Spark Connect too
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


# ------------------------------------------------------------------ keyed replicas (SCD1, SCD2)


def _ts(v: dt.datetime) -> dt.datetime:
    return v.replace(tzinfo=dt.UTC) if v.tzinfo is None else v


def _origin_fill(spark: SparkSession, source: DataFrame, path: str, layout: Layout, unknown_any: bool,
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


def apply_scd1(spark: SparkSession, path: str, layout: Layout, effect: BatchEffect, commit: Commit) -> None:
    names = [c.name for c in layout.schema.columns]
    cols = [(c.name, c.type) for c in layout.schema.columns] + [(SEQ, "bigint"), (COMMIT_TS, "timestamp"),
                                                                  (PRESENT, "boolean")]
    key_types = [(f"_tm_o_{k}", layout.schema.column(k).type) for k in layout.key]  # type: ignore[union-attr]
    rows, unknown_any = [], False
    for eff in effect.effects.values():
        values = eff.values or dict(zip(layout.key, eff.key, strict=True))
        unknown = eff.unknown if eff.present else []
        unknown_any = unknown_any or bool(unknown)
        rows.append((*[None if values.get(c) is UNKNOWN else values.get(c) for c in names], eff.seq, _ts(eff.commit_time),
                     eff.present, *(eff.origin if unknown and eff.origin else [None] * len(layout.key)), unknown))
    tbl = arrow_table(cols + key_types, [r[:-1] for r in rows]).append_column(
        UNKNOWN_COLS, pa.array([r[-1] for r in rows], type=pa.list_(pa.string())))
    if effect.truncated_at is None and not unknown_any and new_keys_only(path, layout, tbl):
        append_new_keys(spark, path, layout, tbl, commit)
        return
    source = _origin_fill(spark, merge_source(spark, tbl), path, layout, unknown_any, current_only=False)
    spark_io.run_merge(spark, _scd1_sql(path, layout, effect.truncated_at, key_ranges(layout, tbl)), source,
                       app_id=commit.app_id, seq=commit.version, meta=commit.meta)


def apply_scd1_columns(spark: SparkSession, path: str, layout: Layout, effect: cdc_columns.ColumnEffect, commit: Commit) -> None:
    """:func:`apply_scd1` for an effect reduced on columns (:func:`lineage.cdc.columns.reduce_scd1`):
    the same MERGE, its source the effect's rows as they are (no value to fill from the replica)."""
    rows = effect.rows
    source = pa.table({**{c.name: rows[c.name].cast(arrow_type(c.type)) for c in layout.schema.columns},
                       SEQ: rows[cdc_columns.SEQ], COMMIT_TS: rows[cdc_columns.TIME].cast(arrow_type("timestamp")),
                       PRESENT: rows[cdc_columns.PRESENT]})
    if new_keys_only(path, layout, source):
        append_new_keys(spark, path, layout, source, commit)
        return
    # (Delta copies this source before its two passes, as by default: without the copy it reads the local
    # relation twice, and 1M events onto 5M rows took 41.9-47.4 s in the MERGE against 31.4 s; bench/cdc_apply.py)
    spark_io.run_merge(spark, _scd1_sql(path, layout, None, key_ranges(layout, source)), merge_source(spark, source),
                       app_id=commit.app_id, seq=commit.version, meta=commit.meta)


def spilled_effect(spark: SparkSession, spilled: cdc_columns.Spilled, layout: Layout, first: int, *, table: str) -> DataFrame:
    """:func:`lineage.cdc.columns.reduce_scd1` in Spark, over a table's changes spilled to Parquet
    (a read too big to hold): the last touch of every key, numbered ``first + _tm_row``. Raises
    :class:`~lineage.cdc.columns.NotColumnar` and :class:`~lineage.cdc.changes.BatchError` as it does (one
    aggregate over the file, before anything is written)."""
    from functools import reduce

    from pyspark.sql import Window
    from pyspark.sql import functions as F  # noqa: N812

    from lineage.cdc.changes import BatchError, Op

    c = cdc_columns
    df = spark.read.parquet(spilled.path).where(F.col(c.ROW) < spilled.rows_below)
    op = F.col(c.OP)
    is_upd, is_del = op == Op.UPDATE.value, op == Op.DELETE.value
    sets = (op == Op.INSERT.value) | is_upd
    has_before = F.coalesce(F.col(c.HAS_BEFORE), F.lit(False))
    same_key = reduce(lambda a, b: a & b, [F.col(quote(k)).eqNullSafe(F.col(quote(c.before(k)))) for k in layout.key])
    clears = is_del | (is_upd & has_before & ~same_key)
    flags = {"delete without a before-image": is_del & ~has_before,
             **{f"a null value of key column {k!r}": sets & F.col(quote(k)).isNull() for k in layout.key},
             **{f"a before-image without key column {k!r}": clears & F.col(quote(c.before(k))).isNull() for k in layout.key}}
    found = df.agg(*[F.max(cond.cast("int")).alias(f"f{i}") for i, cond in enumerate(flags.values())]).first()
    bad = [what for i, what in enumerate(flags) if found is not None and found[f"f{i}"] == 1]
    if bad and bad[0] == "delete without a before-image":
        raise BatchError(f"{table}: a DELETE without a before-image (the source sent no old key)")
    if bad:
        raise c.NotColumnar(bad[0])
    names = [col.name for col in layout.schema.columns]
    seq = (F.col(c.ROW) + F.lit(first)).alias(c.SEQ)
    set_rows = df.where(sets).select(*[F.col(quote(n)) for n in names], seq, F.col(c.TIME), F.lit(True).alias(PRESENT))
    cleared = df.where(clears).select(
        *[(F.col(quote(c.before(col.name))) if col.name in layout.key else F.lit(None).cast(col.type)).alias(col.name)
          for col in layout.schema.columns], seq, F.col(c.TIME), F.lit(False).alias(PRESENT))
    last = Window.partitionBy(*[F.col(quote(k)) for k in layout.key]).orderBy(F.col(c.SEQ).desc())
    return (set_rows.unionByName(cleared).withColumn("_tm_rank", F.row_number().over(last))
            .where(F.col("_tm_rank") == 1).drop("_tm_rank"))


def apply_scd1_spilled(spark: SparkSession, path: str, layout: Layout, effect: DataFrame, commit: Commit) -> None:
    """:func:`apply_scd1_columns` for an effect :func:`spilled_effect` computed in Spark: the same MERGE."""
    from pyspark.sql import functions as F  # noqa: N812

    source = effect.select(*[F.col(quote(col.name)).cast(col.type).alias(col.name) for col in layout.schema.columns],
                           F.col(cdc_columns.SEQ).alias(SEQ), F.col(cdc_columns.TIME).cast("timestamp").alias(COMMIT_TS),
                           F.col(PRESENT))
    spark_io.run_merge(spark, _scd1_sql(path, layout, None), source, app_id=commit.app_id, seq=commit.version,
                       meta=commit.meta)


#: Key column types whose values the Delta log's file statistics hold exactly (see :func:`new_keys_only`).
INTEGER_TYPES = frozenset({"tinyint", "smallint", "int", "bigint"})


def new_keys_only(path: str, layout: Layout, source: pa.Table) -> bool:
    """Whether no row of the replica at ``path`` can share a key with a row of ``source`` (an SCD1
    MERGE's source, :data:`PRESENT` per row): its first key column is an integer whose lowest value in
    ``source`` is above the highest of every replica file, by the Delta log's statistics (read
    without a JVM; a file without them, or any doubt, answers False). The MERGE of such a source
    would only insert its present rows: serial keys of new rows (an orders or history table), the
    common case of OLTP tables. With deletion vectors or soft deletes the statistics still count
    the rows marked, so the answer stays safe."""
    from resources.storage.delta_log import open_table
    from resources.storage.delta_meta import TableSnapshot

    first = layout.schema.column(layout.key[0]) if layout.key else None
    if first is None or source.num_rows == 0 or first.type not in INTEGER_TYPES:
        return False
    low = pc.min(source.column(layout.key[0])).as_py()
    snap = TableSnapshot(path, open_table(path))  # the newest version, never one read ahead earlier
    if low is None or snap.table is None:
        return False
    try:
        files = snap.files
    except Exception:  # noqa: BLE001 - a log this reader cannot list: the MERGE decides
        return False
    if files.num_rows == 0:
        return True
    high = f"max.{layout.key[0]}"
    if high not in files.column_names or files[high].null_count:
        return False
    top = pc.max(files[high]).as_py()
    return isinstance(top, int) and low > top


def append_new_keys(spark: SparkSession, path: str, layout: Layout, source: pa.Table, commit: Commit) -> None:
    """What the SCD1 MERGE does with a source :func:`new_keys_only` vouches for, as one append (no
    scan of the replica): its present rows, in the replica's columns and types, in one commit
    carrying the unit's txn id and metadata as the MERGE's would (a replay lands nothing twice)."""
    from pyspark.sql import functions as F  # noqa: N812

    rows = source.filter(pc.fill_null(source.column(PRESENT), False))
    frame = local_frame(spark, rows.select([n for n, _ in layout.columns() if n != DELETED]))
    cols = [(F.lit(False) if n == DELETED else F.col(quote(n))).cast(t).alias(n) for n, t in layout.columns()]
    spark_io.save_unit(frame.select(*cols).write.format("delta").mode("append"), path, app_id=commit.app_id,
                       seq=commit.version, meta=commit.meta)


def key_ranges(layout: Layout, source: pa.Table) -> list[tuple[str, str, str]]:
    """``(column, lowest, highest)`` of each key column of a MERGE's source, as exact SQL literal text
    (:func:`spark_io.sql_literal`: integers, decimals, dates, printable strings; a column of another type is
    left out). Every replica row a source row matches has its key in these ranges, so adding them to
    the MERGE's condition changes no match, and Delta skips by the files' statistics every replica
    file whose keys lie outside: a unit that changes recent keys (new rows, fresh rows updated)
    reads and rewrites only the files holding them, not the whole replica."""
    out: list[tuple[str, str, str]] = []
    if source.num_rows == 0:
        return out
    for k in layout.key:
        bounds = pc.min_max(source.column(k))
        lo, hi = spark_io.sql_literal(bounds["min"].as_py()), spark_io.sql_literal(bounds["max"].as_py())
        if lo is not None and hi is not None:
            out.append((k, lo, hi))
    return out


def _scd1_sql(path: str, layout: Layout, truncated_at: int | None, ranges: Sequence[tuple[str, str, str]] = ()) -> str:
    """The MERGE of an SCD1 effect (source ``s``: the source's columns, ``_sequence_num``, ``_commit_ts``
    and ``_tm_present``): a key's newer state replaces the replica's, an absent one deletes it
    (``deletes: soft``: marks it), a TRUNCATE removes every row it saw. ``ranges``
    (:func:`key_ranges`) join the condition, except with a TRUNCATE (its clause is about the rows
    no source row matches, wherever they are)."""
    names = [c.name for c in layout.schema.columns]
    on = " AND ".join([f"t.{quote(k)} = s.{quote(k)}" for k in layout.key]
                      + ([f"t.{quote(k)} BETWEEN {lo} AND {hi}" for k, lo, hi in ranges] if truncated_at is None else []))
    soft = layout.deletes is Deletes.SOFT
    non_key = [c for c in names if c not in layout.key]
    sets = ", ".join([f"t.{quote(c)} = s.{quote(c)}" for c in non_key] + [f"t.{SEQ} = s.{SEQ}", f"t.{COMMIT_TS} = s.{COMMIT_TS}"]
                     + ([f"t.{DELETED} = false"] if soft else []))
    insert_cols = names + [SEQ, COMMIT_TS] + ([DELETED] if soft else [])
    insert_vals = [f"s.{quote(c)}" for c in names + [SEQ, COMMIT_TS]] + (["false"] if soft else [])
    gone = (f"UPDATE SET t.{DELETED} = true, t.{SEQ} = s.{SEQ}, t.{COMMIT_TS} = s.{COMMIT_TS}" if soft else "DELETE")
    sql = (f"MERGE INTO delta.`{path}` t USING {{source}} s ON {on}\n"
           f"WHEN MATCHED AND NOT s.{PRESENT} AND s.{SEQ} > t.{SEQ} THEN {gone}\n"
           f"WHEN MATCHED AND s.{PRESENT} AND s.{SEQ} > t.{SEQ} THEN UPDATE SET {sets}\n"
           f"WHEN NOT MATCHED AND s.{PRESENT} THEN INSERT ({', '.join(map(quote, insert_cols))}) "
           f"VALUES ({', '.join(insert_vals)})")
    if truncated_at is not None:
        trunc = f"UPDATE SET t.{DELETED} = true" if soft else "DELETE"
        sql += f"\nWHEN NOT MATCHED BY SOURCE AND t.{SEQ} < {truncated_at} THEN {trunc}"
    return sql


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
                     _ts(versions[0][2]), False, False))
        unknowns.append([])
        for i, (values, seq, at, _xid) in enumerate(versions):
            if values is None:
                continue
            until = _ts(versions[i + 1][2]) if i + 1 < len(versions) else None
            unknown = [c for c, v in values.items() if v is UNKNOWN]
            rows.append((*[None if values.get(c) is UNKNOWN else values.get(c) for c in names], *[None] * len(layout.key),
                         *(eff.origin if unknown and eff.origin else [None] * len(layout.key)), seq, _ts(at), until,
                         until is None, True))
            unknowns.append(unknown)
    tbl = arrow_table(cols, rows).append_column(UNKNOWN_COLS, pa.array(unknowns, type=pa.list_(pa.string())))
    source = _origin_fill(spark, merge_source(spark, tbl), path, layout, any(unknowns), current_only=True)
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
