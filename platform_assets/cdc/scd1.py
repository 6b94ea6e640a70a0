"""What a change batch does to a keyed SCD1 replica (:mod:`platform_assets.cdc.apply` has the
layouts, SCD2 and multisets): the net effect of the batch, reduced change by change
(:func:`apply_scd1`), on columns (:func:`apply_scd1_columns`) or in Spark from a spill
(:func:`apply_scd1_spilled`), lands in one commit: a MERGE of :func:`scd1_clauses` from the driver
(``deltalake``) where the replica is small, else Spark's (:func:`merge_effect`), or an append where
only new keys come (:func:`append_new_keys`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from lineage.cdc import columns as cdc_columns
from lineage.cdc.changes import UNKNOWN, BatchEffect
from lineage.cdc.columns import arrow_type
from lineage.cdc.replicas import Deletes
from platform_assets.cdc import apply as cdc_apply
from platform_assets.cdc.apply import (
    COMMIT_TS,
    DELETED,
    PRESENT,
    SEQ,
    UNKNOWN_COLS,
    Commit,
    Layout,
)
from platform_assets.core import driver_writes, keyed_merge, spark_io
from platform_assets.core.spark_io import quote

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


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
        rows.append((*[None if values.get(c) is UNKNOWN else values.get(c) for c in names], eff.seq, cdc_apply.ts(eff.commit_time),
                     eff.present, *(eff.origin if unknown and eff.origin else [None] * len(layout.key)), unknown))
    tbl = cdc_apply.arrow_table(cols + key_types, [r[:-1] for r in rows]).append_column(
        UNKNOWN_COLS, pa.array([r[-1] for r in rows], type=pa.list_(pa.string())))
    if effect.truncated_at is None and not unknown_any and new_keys_only(path, layout, tbl):
        append_new_keys(spark, path, layout, tbl, commit)
        return
    filled = None
    if unknown_any:  # values to carry from the replica: Spark joins them in
        filled = cdc_apply.origin_fill(spark, cdc_apply.merge_source(spark, tbl), path, layout, unknown_any, current_only=False)
    merge_effect(spark, path, layout, tbl.drop_columns([UNKNOWN_COLS, *(n for n, _ in key_types)]), commit,
                 truncated_at=effect.truncated_at, spark_source=filled)


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
    merge_effect(spark, path, layout, source, commit)


def merge_effect(spark: SparkSession, path: str, layout: Layout, source: pa.Table, commit: Commit, *,
                 truncated_at: int | None = None, spark_source: DataFrame | None = None) -> None:
    """One commit of :func:`scd1_clauses` with ``source`` (the effect's rows, in the driver) into
    the replica: from the driver where it may be (:func:`~platform_assets.core.keyed_merge.merge_arrow`,
    a replica of at most :data:`~platform_assets.cdc.apply.SMALL_REPLICA_ROWS` rows), else Spark's
    MERGE, with the source's key ranges in its condition (:func:`ranges_filter`; not with a
    TRUNCATE). ``spark_source``: the same rows as Spark computes them, with values carried from
    the replica: Spark's MERGE of those."""
    clauses = scd1_clauses(layout, truncated_at)
    rows = source  # (the driver's MERGE takes every replica column from its source; its clauses set _deleted)
    if layout.deletes is Deletes.SOFT and DELETED not in source.column_names:
        rows = source.append_column(DELETED, pa.repeat(pa.scalar(False), source.num_rows))
    if spark_source is None and keyed_merge.merge_arrow(clauses, rows, path, app_id=commit.app_id, seq=commit.version,
                                                        meta=commit.meta, max_rows=cdc_apply.SMALL_REPLICA_ROWS):
        return
    # (Delta copies this source before its two passes, as by default: without the copy it reads the local
    # relation twice, and 1M events onto 5M rows took 41.9-47.4 s in the MERGE against 31.4 s; bench/cdc_apply.py)
    spark_io.run_merge(spark, clauses.spark_sql(path, ranges_filter(layout, source) if truncated_at is None else ""),
                       cdc_apply.merge_source(spark, source) if spark_source is None else spark_source,
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
    spark_io.run_merge(spark, scd1_clauses(layout, None).spark_sql(path), source, app_id=commit.app_id,
                       seq=commit.version, meta=commit.meta)


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
    carrying the unit's txn id and metadata as the MERGE's would (a replay lands nothing twice);
    from the driver where it may be (:func:`~platform_assets.core.driver_writes.commit_arrow`)."""
    from pyspark.sql import functions as F  # noqa: N812

    rows = source.filter(pc.fill_null(source.column(PRESENT), False)).select([n for n, _ in layout.columns() if n != DELETED])
    if layout.deletes is Deletes.SOFT:
        rows = rows.append_column(DELETED, pa.array([False] * rows.num_rows, pa.bool_()))
    if driver_writes.commit_arrow(rows, path, mode="append", app_id=commit.app_id, seq=commit.version, meta=commit.meta):
        return
    frame = cdc_apply.local_frame(spark, rows)
    cols = [F.col(quote(n)).cast(t).alias(n) for n, t in layout.columns()]
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


def ranges_filter(layout: Layout, source: pa.Table) -> str:
    """The source's key ranges (:func:`key_ranges`) as a condition on the replica's rows, for a
    MERGE's ``ON`` (not with a TRUNCATE: its clause is about the rows no source row matches,
    wherever they are)."""
    return " AND ".join(f"t.{quote(k)} BETWEEN {lo} AND {hi}" for k, lo, hi in key_ranges(layout, source))


def scd1_clauses(layout: Layout, truncated_at: int | None) -> keyed_merge.Clauses:
    """The MERGE of an SCD1 effect (source ``s``: the source's columns, ``_sequence_num``, ``_commit_ts``
    and ``_tm_present``): a key's newer state replaces the replica's, an absent one deletes it
    (``deletes: soft``: marks it), a TRUNCATE removes every row it saw."""
    names = [c.name for c in layout.schema.columns]
    soft = layout.deletes is Deletes.SOFT
    present, seq, ts = (f"s.{quote(c)}" for c in (PRESENT, SEQ, COMMIT_TS))
    newer = f"({seq} > t.{quote(SEQ)})"
    sets = {**{c: f"s.{quote(c)}" for c in names if c not in layout.key}, SEQ: seq, COMMIT_TS: ts,
            **({DELETED: "false"} if soft else {})}
    gone: keyed_merge.Action = {DELETED: "true", SEQ: seq, COMMIT_TS: ts} if soft else None
    insert = {**{c: f"s.{quote(c)}" for c in names}, SEQ: seq, COMMIT_TS: ts, **({DELETED: "false"} if soft else {})}
    by_source: tuple[tuple[str, keyed_merge.Action], ...] = ()
    if truncated_at is not None:
        by_source = ((f"t.{quote(SEQ)} < {truncated_at}", {DELETED: "true"} if soft else None),)
    return keyed_merge.Clauses(layout.key, ((f"(NOT {present}) AND {newer}", gone), (f"{present} AND {newer}", sets)),
                               (present, insert), by_source, null_safe=False)
