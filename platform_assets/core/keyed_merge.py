"""A unit's rows MERGEd into a view by key (:func:`merge`), written once as :class:`Clauses`
(:func:`rows_clauses`: re-derived rows replace the view's; :func:`add_clauses`: an additive view's
groups grow by the unit's contributions) and run by either engine:

* from the driver by ``deltalake`` (:func:`merge_small`), for a
  view of at most :data:`SMALL_VIEW_ROWS` rows and a source of at most
  :data:`~platform_assets.core.spark_io.SMALL_BLOCK_ROWS` rows. A Spark MERGE first rebuilds the
  view's state at its newest version and copies its source, eight or nine Spark jobs and about
  three seconds for a unit of a few dozen rows (docs/benchmarks.md, stop 68); ``deltalake`` reads
  the log and merges in tens of milliseconds;
* else Spark's Delta ``MERGE`` (:func:`platform_assets.core.spark_io.run_merge`).

The commit is the same either way: one commit carrying the unit's ``txn`` and ``userMetadata``, the
view's change data feed written (``deltalake`` writes ``_change_data`` files as Spark does), the
row counts in ``operationMetrics`` (:func:`resources.storage.delta_log.commit_stats` reads both
engines' names). The clauses are SQL both read: backquoted names, ``IS [NOT] DISTINCT FROM`` (Spark's
``<=>``), every comparison in parentheses (DataFusion's parser binds ``IS DISTINCT FROM`` looser than
``AND``/``OR``) and ``CAST`` to Spark's type names, which DataFusion reads too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lineage.core.errors import first_line
from platform_assets.core import driver_writes, spark_io, table_reads
from platform_assets.core.spark_io import quote
from resources.storage import delta_meta
from resources.storage.warehouse import storage_options

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

#: A view of at most this many rows is MERGEd from the driver (delta-rs rewrites the files holding
#: the keys; at 1M rows in one file that took 0.5 s here). Read at call time.
SMALL_VIEW_ROWS = 1_000_000


@dataclass(frozen=True)
class Clauses:
    """A MERGE of source ``s`` into target ``t`` on ``key`` (null-safe): ``delete`` (a predicate:
    matched rows it holds for are deleted), ``update`` (predicate and ``column -> expression``:
    matched rows it holds for are updated), ``insert`` (the same for unmatched source rows)."""

    key: tuple[str, ...]
    delete: str | None
    update: tuple[str, dict[str, str]] | None
    insert: tuple[str, dict[str, str]]

    def on(self, target_filter: str = "") -> str:
        """The join condition, with ``target_filter`` (Spark SQL on ``t``) when given."""
        on = " AND ".join(f"(t.{quote(k)} IS NOT DISTINCT FROM s.{quote(k)})" for k in self.key)
        return on + (f" AND ({target_filter})" if target_filter else "")

    def spark_sql(self, dest: str, target_filter: str = "") -> str:
        """The ``MERGE`` statement for Spark, its source named ``{source}``."""
        sql = f"MERGE INTO delta.`{dest}` t USING {{source}} s ON {self.on(target_filter)}\n"
        if self.delete:
            sql += f"WHEN MATCHED AND ({self.delete}) THEN DELETE\n"
        if self.update:
            when, sets = self.update
            sql += f"WHEN MATCHED AND ({when}) THEN UPDATE SET " + ", ".join(f"t.{quote(c)} = {e}" for c, e in sets.items()) + "\n"
        when, values = self.insert
        return sql + (f"WHEN NOT MATCHED AND ({when}) THEN INSERT ({', '.join(map(quote, values))}) "
                      f"VALUES ({', '.join(values.values())})")


def rows_clauses(key: list[str], columns: list[str], present: str, delete_missing: bool) -> Clauses:
    """Re-derived rows (``present`` true) replace the view's rows of their key where any column
    differs (an unchanged row is not rewritten, so the change feed shows only real changes) or are
    inserted; keys whose ``present`` is null are deleted (``delete_missing``)."""
    values = [c for c in columns if c not in key]
    differs = " OR ".join(f"(t.{quote(c)} IS DISTINCT FROM s.{quote(c)})" for c in values)
    mark = f"s.{quote(present)}"
    return Clauses(tuple(key), f"{mark} IS NULL" if delete_missing else None,
                   (f"{mark} AND ({differs})", {c: f"s.{quote(c)}" for c in values}) if values else None,
                   (mark, {c: f"s.{quote(c)}" for c in columns}))


def add_clauses(key: list[str], count: str, sums: list[str], types: dict[str, str], delete_missing: bool) -> Clauses:
    """An additive view's groups grow by the source's (per key: the change of ``count`` and of each
    of ``sums``); a group whose count reaches 0 is deleted (``delete_missing``), a new group with a
    positive count inserted, a group whose every change is 0 not rewritten. Results are cast to
    ``types`` (the view's column types, Spark's names)."""
    cols = [count, *sums]
    n = quote(count)
    return Clauses(
        tuple(key), f"(t.{n} + s.{n}) <= 0" if delete_missing else None,
        (" OR ".join(f"(s.{quote(c)} <> 0)" for c in cols),
         {c: f"CAST((coalesce(t.{quote(c)}, 0) + s.{quote(c)}) AS {types[c]})" for c in cols}),
        (f"(s.{n} > 0)", {**{k: f"s.{quote(k)}" for k in key}, **{c: f"CAST(s.{quote(c)} AS {types[c]})" for c in cols}}))


def merge(spark: SparkSession, clauses: Clauses, source: DataFrame, dest: str, *, app_id: str, seq: int, meta: str,
          target_filter: str = "", in_hand: bool = False) -> None:
    """One commit of ``clauses`` with ``source`` into the view at ``dest``, idempotent by ``(app_id,
    seq)`` and carrying ``meta`` as its ``userMetadata``: from the driver where it may be
    (:func:`merge_small`), else a Spark MERGE (``target_filter``: a predicate on ``t`` that every
    row of a key in ``source`` satisfies, so that Delta skips the files it excludes; ``in_hand``:
    see :func:`~platform_assets.core.spark_io.run_merge`)."""
    if merge_small(clauses, source, dest, app_id=app_id, seq=seq, meta=meta, max_rows=SMALL_VIEW_ROWS):
        return
    spark_io.run_merge(spark, clauses.spark_sql(dest, target_filter), source, app_id=app_id, seq=seq, meta=meta,
                       in_hand=in_hand)


def merge_small(clauses: Clauses, source: DataFrame, dest: str, *, app_id: str, seq: int, meta: str,
                max_rows: int) -> bool:
    """Commit ``clauses`` with ``source`` into the table at ``dest`` from the driver, by
    ``deltalake``'s MERGE, as the unit ``(app_id, seq)`` with ``meta`` as its ``userMetadata``.
    False, having written nothing, where Spark must: a table of more than ``max_rows`` rows, a
    source of more than :data:`~platform_assets.core.spark_io.SMALL_BLOCK_ROWS` rows or without the
    table's columns, :func:`~platform_assets.core.driver_writes.table_refusal`,
    ``$TIDEMARK_DIRECT_IO=off``, or a MERGE ``deltalake`` refused (said in the log: a type it cannot
    compare, a concurrent commit; Spark's MERGE of the same unit is skipped by its ``txn`` if this
    one did land). A unit the table recorded already is not written again."""
    from deltalake import DeltaTable

    if not table_reads.direct_io_on():
        return False
    snap = delta_meta.TableSnapshot.open(dest)
    table = snap.table
    if table is None or snap.row_count is None or snap.row_count > max_rows or driver_writes.table_refusal(snap) is not None:
        return False
    if driver_writes.recorded(table, app_id, seq):  # landed before: nothing to compute
        return True
    rows = driver_writes.cast_to(source.limit(spark_io.SMALL_BLOCK_ROWS + 1).toArrow(), table, only=False)
    if rows is None or rows.num_rows > spark_io.SMALL_BLOCK_ROWS:
        return False
    target = DeltaTable(dest, storage_options=storage_options(dest))
    builder = target.merge(rows, predicate=clauses.on(), source_alias="s", target_alias="t",
                           commit_properties=driver_writes.unit_commit(app_id, seq, meta))
    if clauses.delete:
        builder = builder.when_matched_delete(predicate=clauses.delete)
    if clauses.update:
        builder = builder.when_matched_update(updates=clauses.update[1], predicate=clauses.update[0])
    builder = builder.when_not_matched_insert(updates=clauses.insert[1], predicate=clauses.insert[0])
    try:
        builder.execute()
        if not driver_writes.recorded(target, app_id, seq):  # a MERGE that changes nothing commits nothing; Spark's still commits
            target.create_write_transaction([], mode="append", schema=target.schema(),
                                            commit_properties=driver_writes.unit_commit(app_id, seq, meta))
    except Exception as exc:  # noqa: BLE001 - Spark's MERGE of the same unit follows (skipped if this one landed)
        log.warning("unit %s of %s: deltalake's MERGE into %s failed, so Spark's runs instead: %s", seq, app_id, dest,
                    first_line(exc)[:300])
        return False
    return True
