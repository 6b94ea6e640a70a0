"""A unit's rows MERGEd into a view by key (:func:`merge`), written once as :class:`Clauses`
(:func:`rows_clauses`: re-derived rows replace the view's; :func:`add_clauses`: an additive view's
groups grow by the unit's contributions) and run by either engine:

* from the driver by ``deltalake`` (:func:`merge_small`), for a source of at most
  :data:`~platform_assets.core.spark_io.SMALL_BLOCK_ROWS` rows into a view of at most
  :data:`SMALL_VIEW_ROWS` rows, or into a larger view whose :class:`TargetFilter` leaves files of at
  most :data:`FILTERED_VIEW_ROWS` rows by their statistics (delta-rs prunes its scan by the same
  filter and rewrites only those files: 12 files of 50,000 rows in 0.2 s, where Spark's MERGE took
  4-6 s at 10M-50M rows, docs/benchmarks.md). A Spark MERGE first rebuilds the
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

import datetime as dt
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lineage.core.errors import first_line
from platform_assets.core import driver_writes, merge_layout, spark_io, table_reads
from platform_assets.core.spark_io import quote
from resources.storage import delta_meta
from resources.storage.warehouse import storage_options

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

#: A view of at most this many rows is MERGEd from the driver (delta-rs rewrites the files holding
#: the keys; at 1M rows in one file that took 0.5 s here). Read at call time.
SMALL_VIEW_ROWS = 1_000_000
#: A larger view is MERGEd from the driver where the unit's filter leaves files of at most this many
#: rows by their statistics. deltalake packs the rows it rewrote into one or two files whose
#: statistics span the ranges of every file they came from, so after a few units the filter leaves
#: those files too, and more of them each unit until `tidemark maintain` clusters the view again
#: (a file over 4x its target). ``bench/view_wear.py`` (stop 83, 16 units of 10 changed customers
#: on a 10M-row view): at 1,000,000 Spark MERGEd from the fifth unit, 5-14 s each; at this bound
#: every unit ran from the driver, 0.4-1.7 s, the last rewriting 2.5M rows. Read at call time.
FILTERED_VIEW_ROWS = 5_000_000
#: ... and, past :data:`SMALL_VIEW_ROWS` rows, of at most this many bytes: deltalake's MERGE of those
#: 4.2M rows (93 MB of Parquet) peaked at 0.6 GiB in the driver, and a wider view holds more bytes
#: a row. Read at call time.
FILTERED_VIEW_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class TargetFilter:
    """What every target row of a key in a MERGE's source satisfies, as the values its columns
    take there (``(column, values)`` pairs; a None among the values: a null), so that either engine
    skips the files whose statistics exclude them. Exact by construction where the caller builds
    it (the values read from the very rows the unit replaces). Empty: no filter."""

    values: tuple[tuple[str, tuple[Any, ...]], ...] = ()

    @classmethod
    def of(cls, values: Mapping[str, Collection[Any]]) -> TargetFilter:
        """The filter on the columns of ``values`` whose every value has exact literal text (a
        column without is left out: a weaker filter, still true of the rows)."""
        return cls(tuple((c, tuple(vs)) for c, vs in values.items()
                         if spark_io.one_of("x", list(vs)) is not None))

    def sql(self) -> str:
        """The filter as SQL on ``t`` ("" when empty); ``FALSE`` for a column given no values."""
        return " AND ".join(f"({spark_io.one_of(f't.{quote(c)}', vs)})" for c, vs in self.values)

    @property
    def portable(self) -> bool:
        """Whether DataFusion (``deltalake``'s MERGE) reads :meth:`sql` as Spark does: integers,
        booleans, dates and strings without quotes or backslashes (Spark's escapes and decimal
        suffix are its own)."""
        return all(v is None or isinstance(v, (int, dt.date)) and not isinstance(v, dt.datetime)
                   or isinstance(v, str) and "'" not in v and "\\" not in v
                   for _, vs in self.values for v in vs)

    def columns(self) -> dict[str, tuple[Any, ...]]:
        return dict(self.values)


#: No filter: the MERGE reads every file of its target.
NO_FILTER = TargetFilter()


#: What a clause does to the rows it holds for: ``column -> expression`` (``UPDATE SET`` /
#: ``INSERT VALUES``), or None: ``DELETE``.
Action = dict[str, str] | None


@dataclass(frozen=True)
class Clauses:
    """A MERGE of source ``s`` into target ``t`` on ``key`` (null-safe, unless ``null_safe`` is
    False: plain equality, for keys that are never null): ``matched`` (``(predicate, action)`` in
    order: a matched row takes the first whose predicate holds), ``insert`` (predicate and
    ``column -> expression``: unmatched source rows it holds for are inserted; None: none) and
    ``by_source`` (``(predicate, action)`` for target rows no source row matches)."""

    key: tuple[str, ...]
    matched: tuple[tuple[str, Action], ...]
    insert: tuple[str, dict[str, str]] | None
    by_source: tuple[tuple[str, Action], ...] = ()
    null_safe: bool = True

    def on(self, target_filter: str = "") -> str:
        """The join condition, with ``target_filter`` (Spark SQL on ``t``) when given."""
        eq = "IS NOT DISTINCT FROM" if self.null_safe else "="
        on = " AND ".join(f"(t.{quote(k)} {eq} s.{quote(k)})" for k in self.key)
        return on + (f" AND ({target_filter})" if target_filter else "")

    def spark_sql(self, dest: str, target_filter: str = "") -> str:
        """The ``MERGE`` statement for Spark, its source named ``{source}``."""
        def then(action: Action, insert: bool = False) -> str:
            if action is None:
                return "DELETE"
            if insert:
                return f"INSERT ({', '.join(map(quote, action))}) VALUES ({', '.join(action.values())})"
            return "UPDATE SET " + ", ".join(f"t.{quote(c)} = {e}" for c, e in action.items())

        lines = [f"MERGE INTO delta.`{dest}` t USING {{source}} s ON {self.on(target_filter)}"]
        lines += [f"WHEN MATCHED AND ({when}) THEN {then(action)}" for when, action in self.matched]
        if self.insert:
            lines.append(f"WHEN NOT MATCHED AND ({self.insert[0]}) THEN {then(self.insert[1], insert=True)}")
        lines += [f"WHEN NOT MATCHED BY SOURCE AND ({when}) THEN {then(action)}" for when, action in self.by_source]
        return "\n".join(lines)


def rows_clauses(key: list[str], columns: list[str], present: str, delete_missing: bool) -> Clauses:
    """Re-derived rows (``present`` true) replace the view's rows of their key where any column
    differs (an unchanged row is not rewritten, so the change feed shows only real changes) or are
    inserted; keys whose ``present`` is null are deleted (``delete_missing``)."""
    values = [c for c in columns if c not in key]
    differs = " OR ".join(f"(t.{quote(c)} IS DISTINCT FROM s.{quote(c)})" for c in values)
    mark = f"s.{quote(present)}"
    matched: list[tuple[str, Action]] = [(f"{mark} IS NULL", None)] if delete_missing else []
    if values:
        matched.append((f"{mark} AND ({differs})", {c: f"s.{quote(c)}" for c in values}))
    return Clauses(tuple(key), tuple(matched), (mark, {c: f"s.{quote(c)}" for c in columns}))


def add_clauses(key: list[str], count: str, sums: list[str], types: dict[str, str], delete_missing: bool) -> Clauses:
    """An additive view's groups grow by the source's (per key: the change of ``count`` and of each
    of ``sums``); a group whose count reaches 0 is deleted (``delete_missing``), a new group with a
    positive count inserted, a group whose every change is 0 not rewritten. Results are cast to
    ``types`` (the view's column types, Spark's names)."""
    cols = [count, *sums]
    n = quote(count)
    grow: tuple[str, Action] = (" OR ".join(f"(s.{quote(c)} <> 0)" for c in cols),
                                {c: f"CAST((coalesce(t.{quote(c)}, 0) + s.{quote(c)}) AS {types[c]})" for c in cols})
    return Clauses(
        tuple(key), (((f"(t.{n} + s.{n}) <= 0", None),) if delete_missing else ()) + (grow,),
        (f"(s.{n} > 0)", {**{k: f"s.{quote(k)}" for k in key}, **{c: f"CAST(s.{quote(c)} AS {types[c]})" for c in cols}}))


def merge(spark: SparkSession, clauses: Clauses, source: DataFrame | Callable[[], DataFrame], dest: str, *, app_id: str,
          seq: int, meta: str, target_filter: TargetFilter = NO_FILTER, in_hand: bool = False,
          rows: pa.Table | None = None, cluster_by: str | None = None) -> None:
    """One commit of ``clauses`` with ``source`` into the view at ``dest``, idempotent by ``(app_id,
    seq)`` and carrying ``meta`` as its ``userMetadata``: from the driver where it may be
    (:func:`merge_small`; :func:`merge_arrow` when ``rows``, the same rows as ``source``, are in the
    driver already), else a Spark MERGE (``target_filter``: what every row of a key in
    ``source`` satisfies in the view, so that the MERGE skips the files it excludes; ``in_hand``:
    see :func:`~platform_assets.core.spark_io.run_merge`). ``source`` may be a function that makes
    it, called only when it is needed (the rows are ``rows``, in the driver). ``cluster_by``: the
    column the view's files are clustered by, which a MERGE from the driver keeps
    (:func:`~platform_assets.core.merge_layout.resort_merged`)."""
    made = source() if callable(source) and rows is None else source
    driven = (merge_small(clauses, made, dest, app_id=app_id, seq=seq, meta=meta,  # type: ignore[arg-type]
                          max_rows=SMALL_VIEW_ROWS, within=target_filter, held_rows=FILTERED_VIEW_ROWS,
                          cluster_by=cluster_by)
              if rows is None else
              merge_arrow(clauses, rows, dest, app_id=app_id, seq=seq, meta=meta, max_rows=SMALL_VIEW_ROWS,
                          within=target_filter, held_rows=FILTERED_VIEW_ROWS, cluster_by=cluster_by))
    if driven:
        return
    spark_io.run_merge(spark, clauses.spark_sql(dest, target_filter.sql()), made() if callable(made) else made,
                       app_id=app_id, seq=seq, meta=meta, in_hand=in_hand)


def merge_small(clauses: Clauses, source: DataFrame, dest: str, *, app_id: str, seq: int, meta: str,
                max_rows: int, within: TargetFilter = NO_FILTER, held_rows: int | None = None,
                cluster_by: str | None = None) -> bool:
    """Commit ``clauses`` with ``source`` into the table at ``dest`` from the driver, by
    ``deltalake``'s MERGE, as the unit ``(app_id, seq)`` with ``meta`` as its ``userMetadata``.
    False, having written nothing, where Spark must: a source of more than
    :data:`~platform_assets.core.spark_io.SMALL_BLOCK_ROWS` rows, or :func:`merge_arrow` says so
    (``within``, ``held_rows``, ``cluster_by``: see there)."""
    return _merge_driven(clauses, lambda: driver_writes.small_arrow(source), dest, app_id=app_id, seq=seq, meta=meta,
                         max_rows=max_rows, within=within, held_rows=held_rows, cluster_by=cluster_by)


def merge_arrow(clauses: Clauses, rows: pa.Table, dest: str, *, app_id: str, seq: int, meta: str,
                max_rows: int, within: TargetFilter = NO_FILTER, held_rows: int | None = None,
                cluster_by: str | None = None) -> bool:
    """Commit ``clauses`` with ``rows`` (the source, in the driver already) into the table at
    ``dest`` from the driver, by ``deltalake``'s MERGE, as the unit ``(app_id, seq)`` with ``meta``
    as its ``userMetadata``. False, having written nothing, where Spark must: a table of more than
    ``max_rows`` rows (unless ``within``, a filter true of the table's rows of the source's keys,
    leaves files of at most ``held_rows`` rows, default ``max_rows``: it then joins the MERGE's
    condition), a source without
    the table's columns,
    :func:`~platform_assets.core.driver_writes.table_refusal`, ``$TIDEMARK_DIRECT_IO=off``, or a
    MERGE ``deltalake`` refused (said in the log: a type it cannot compare, a concurrent commit;
    Spark's MERGE of the same unit is skipped by its ``txn`` if this one did land). A unit the
    table recorded already is not written again. ``cluster_by``: the column the table's files are
    clustered by; the files the MERGE packed are then written again sorted by it
    (:func:`~platform_assets.core.merge_layout.resort_merged`)."""
    return _merge_driven(clauses, lambda: rows, dest, app_id=app_id, seq=seq, meta=meta, max_rows=max_rows,
                         within=within, held_rows=held_rows, cluster_by=cluster_by)


def _merge_driven(clauses: Clauses, rows: Callable[[], pa.Table | None], dest: str, *, app_id: str, seq: int,
                  meta: str, max_rows: int, within: TargetFilter, held_rows: int | None, cluster_by: str | None) -> bool:
    """:func:`merge_arrow` with the source computed by ``rows`` only where the driver may MERGE and
    the unit has not landed (None: too big for the driver)."""
    driven = _driver_target(dest, max_rows, within, max_rows if held_rows is None else held_rows)
    if driven is None:
        return False
    target, on = driven
    if driver_writes.recorded(target, app_id, seq):  # landed before: nothing to compute
        return True
    source = rows()
    return source is not None and _merge(clauses, source, target, dest, on, app_id=app_id, seq=seq, meta=meta,
                                         cluster_by=cluster_by)


def _driver_target(dest: str, max_rows: int, within: TargetFilter, held_rows: int) -> tuple[Any, str] | None:
    """The table at ``dest`` (its newest version, a ``DeltaTable``) and the MERGE's condition,
    where ``deltalake`` may MERGE into it as Spark would: at most ``max_rows`` rows, or ``within``
    (then part of the condition) leaving files of at most ``held_rows`` rows by their statistics
    (and, where that is more than ``max_rows``, :data:`FILTERED_VIEW_BYTES` bytes);
    :func:`~platform_assets.core.driver_writes.table_refusal` None, direct I/O on. Else None."""
    if not table_reads.direct_io_on():
        return None
    snap = delta_meta.TableSnapshot.open(dest)
    table = snap.table
    if table is None or snap.row_count is None or driver_writes.table_refusal(snap) is not None:
        return None
    on = within.sql() if within.portable else ""  # ("" when empty)
    if snap.row_count <= max_rows:
        return table, on
    held = snap.rows_holding(within.columns()) if on else None
    if held is None or held > held_rows:
        return None
    if held > max_rows and not ((size := snap.bytes_holding(within.columns())) is not None
                                and size <= FILTERED_VIEW_BYTES):
        return None
    return table, on


def _merge(clauses: Clauses, source: pa.Table, table: Any, dest: str, target_filter: str, *, app_id: str, seq: int,
           meta: str, cluster_by: str | None = None) -> bool:
    from deltalake import DeltaTable

    rows = driver_writes.cast_to(source, table, only=False)
    if rows is None:
        return False
    target = DeltaTable(dest, storage_options=storage_options(dest))
    builder = target.merge(rows, predicate=clauses.on(target_filter), source_alias="s", target_alias="t",
                           commit_properties=driver_writes.unit_commit(app_id, seq, meta))
    for when, action in clauses.matched:
        builder = (builder.when_matched_delete(predicate=when) if action is None
                   else builder.when_matched_update(updates=action, predicate=when))
    if clauses.insert:
        builder = builder.when_not_matched_insert(updates=clauses.insert[1], predicate=clauses.insert[0])
    for when, action in clauses.by_source:
        builder = (builder.when_not_matched_by_source_delete(predicate=when) if action is None
                   else builder.when_not_matched_by_source_update(updates=action, predicate=when))
    try:
        builder.execute()
        if not driver_writes.recorded(target, app_id, seq):  # a MERGE that changes nothing commits nothing; Spark's still commits
            target.create_write_transaction([], mode="append", schema=target.schema(),
                                            commit_properties=driver_writes.unit_commit(app_id, seq, meta))
    except Exception as exc:  # noqa: BLE001 - Spark's MERGE of the same unit follows (skipped if this one landed)
        if driver_writes.recorded(DeltaTable(dest, storage_options=storage_options(dest)), app_id, seq):
            log.warning("unit %s of %s: deltalake's MERGE into %s landed, then failed: %s", seq, app_id, dest,
                        first_line(exc)[:300])  # (e.g. a post-commit checkpoint)
            return True
        log.warning("unit %s of %s: deltalake's MERGE into %s failed, so Spark's runs instead: %s", seq, app_id, dest,
                    first_line(exc)[:300])
        return False
    if cluster_by is not None:
        merge_layout.resort_merged(dest, target, cluster_by, app_id=app_id, seq=seq)
    return True
