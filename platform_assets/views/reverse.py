"""The reverse join of a merge view: for each changed input with ``join_keys``, the base rows
joining one of its changed rows (its change feed's before and after images,
:func:`changed_rows`), evaluated with the input at the version the view applied (the groups they
leave) and at the new one (the groups they join): affected keys (:func:`reverse_join`) or, for an
additive view, signed contributions (:func:`moved`). A previous version that cannot be read any
more makes the unit a full recompute (:func:`removed_fallback`).

Also the literal lists that keep a unit's reads small: the changed rows matched by a list Delta's
data skipping uses (:func:`matching_any`), the re-derivation narrowed to the affected keys
(:func:`narrow`) and the MERGE's target pruned by the view's clustering column (:func:`prune`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from lineage.core.errors import first_line
from lineage.core.positions import Position
from lineage.spec.model import Topic
from lineage.views.refresh import Strategy, cluster_column
from platform_assets.core import blocks, spark_io, table_reads
from platform_assets.core.keyed_merge import TargetFilter
from platform_assets.views.work import LOCAL_KEYS, MergeWork, refuse_strict

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from platform_assets.core.context import UnitContext
    from resources.storage.delta_meta import TableSnapshot

#: Up to this many distinct values of a key column narrow the re-derivation by a literal list.
NARROW_VALUES = 5_000
#: Up to this many changed values of a single join column filter the view by a literal list, which
#: Delta's data skipping uses (a semi join reads every file).
IN_LIST = 1_000

#: An input's changed rows: their join values under the base's column names, the base columns, and
#: the rows if collected (None: too many).
Changed = tuple["DataFrame", list[str], list[Any] | None]


def changed_rows(eng: UnitContext, topic: Topic, work: MergeWork) -> list[Changed]:
    """Per input changed by reverse join: its changed rows' join values (change feed, before
    and after images) under the base's column names, the base columns, and the rows if collected."""
    spark, spec = eng.spark, topic.spec
    by_table = {c.table: c for c in work.changes}
    out: list[Changed] = []
    for table in work.strategy.reverse:
        pairs, c = spec.join_keys[table], by_table[table]
        got = table_reads.changed_values(spark, eng.path(table), (c.old or 0) + 1, c.new, {i: b for b, i in pairs.items()},
                                         LOCAL_KEYS) if c.new is not None and len(set(pairs.values())) == len(pairs) else None
        if got is not None:  # read JVM-free
            out.append((got[0], list(pairs), got[1]))
            continue
        feed = (spark.read.format("delta").option("readChangeFeed", "true")
                .option("startingVersion", (c.old or 0) + 1).option("endingVersion", c.new).load(eng.path(table)))
        changed, values = spark_io.small_local(spark, feed.select(*[feed[i].alias(b) for b, i in pairs.items()])
                                               .distinct(), LOCAL_KEYS)
        out.append((changed, list(pairs), values))
    return out


def moved(eng: UnitContext, topic: Topic, work: MergeWork, *, held: DataFrame, base: TableSnapshot, last: Position,
          late_ids: Collection[int], pinned: dict[str, str], tag: str,
          out_of: Callable[[str, DataFrame, dict[str, str]], DataFrame]) -> None:
    """An additive view's contributions of the changed inputs (see :meth:`MergeProcessor.derive`) into
    ``work.contributions``: the base rows the view holds (``held``: up to ``last`` in the base as
    planned, ``base``, late rows, ``late_ids``, left out: they are added whole) that join a changed
    row, once with the inputs at the versions the view applied (their old groups, subtracted) and
    once at the new versions (their new groups, added). Rows after ``last`` are the block's, added
    at the new versions already."""
    changed = changed_rows(eng, topic, work)
    rows = _scanned(eng, base, changed, last, held, late_ids)
    if rows is None:
        # computed once (one scan of the base), read by both transforms; kept in Spark, so any
        # number of rows and every column type
        rows = matching_any(held, changed).localCheckpoint(eager=True)
    old, left, joined = before(eng, topic, work, pinned, tag)
    work.contributions.append((left, -1, out_of("tm_left", rows, old)))
    work.contributions.append((joined, 1, out_of("tm_joined", rows, pinned)))
    work.alone = _alone(eng, topic, work, held, tag, [old, pinned])


def _scanned(eng: UnitContext, base: TableSnapshot, changed: list[Changed], end: Position, rows: DataFrame,
             late_ids: Collection[int] = ()) -> DataFrame | None:
    """The base rows of ``rows`` (the base up to ``end``, as Spark reads it) matching a changed row,
    read JVM-free by a filtered scan of the base (:func:`~platform_assets.core.table_reads.rows_matching`)
    where a literal list matches them (:func:`listed`), as a local relation; else None."""
    values = listed(changed)
    return None if values is None else table_reads.rows_matching(eng.spark, base, values, end, rows.schema,
                                                                 exclude_ids=late_ids)


def before(eng: UnitContext, topic: Topic, work: MergeWork, pinned: dict[str, str],
           tag: str) -> tuple[dict[str, str], str, str]:
    """For a reverse join: the tables the transform reads with every changed input at the version
    the view applied (the others as ``pinned``), and the labels of the rows' old and new groups."""
    by_table, reverse = {c.table: c for c in work.changes}, work.strategy.reverse
    tables = {**pinned, **work.pin(eng, topic, {t: by_table[t].old or 0 for t in reverse}, f"tm_old_{tag}")}
    old = ", ".join(f"{t} version {by_table[t].old}" for t in reverse)
    new = ", ".join(f"{t} version {by_table[t].new}" for t in reverse)
    return tables, f"base rows joining a changed row, before ({old})", f"base rows joining a changed row, after ({new})"


def _alone(eng: UnitContext, topic: Topic, work: MergeWork, base: DataFrame, tag: str,
           tables: list[dict[str, str]]) -> list[DataFrame]:
    """The transform over no base rows (``base``'s columns), once per entry of ``tables``: the rows
    the other inputs make alone (an outer join keeping a reference row without base rows)."""
    nothing = work.temp_view(f"tm_none_{tag}", base.where("false"))
    return [spark_io.transform(eng.spark, topic, nothing, view=work.views[-1], tables=t) for t in tables]


def reverse_join(eng: UnitContext, topic: Topic, work: MergeWork, changed: list[Changed], *, last: Position,
                 end: Position, base: TableSnapshot, everything: DataFrame, pinned: dict[str, str], tag: str,
                 keys_of: Callable[[str, DataFrame, dict[str, str]], DataFrame]) -> None:
    """The affected keys of the changed inputs (see :meth:`MergeProcessor.derive`) into
    ``work.affected`` from a scan of the base (``everything``, the rows up to ``next``) for the
    rows joining one of ``changed`` (:func:`changed_rows`); for a row-wise view, those rows into
    ``work.rows`` and ``work.left`` instead (unless :func:`platform_assets.views.row_wise.found_in_view`
    found them in the view)."""
    spec = topic.spec
    # Base rows joining a changed reference row: those up to ``last`` (what the view holds)
    # left their old groups; those up to ``next`` join their new ones.
    moved_new = _scanned(eng, base, changed, end, everything)
    if moved_new is None:
        # One scan of the base where there were two: the rows up to ``next`` (``end``) are computed
        # once and kept in Spark (any number of rows, every column type, no timestamp through
        # Python's local time), and those up to ``last`` taken from them.
        moved_new = functools.reduce(lambda a, b: a.unionByName(b),
                                     [_matching(everything, rows, cols, values) for rows, cols, values in changed])
        moved_new = moved_new.localCheckpoint(eager=True)
    moved_old = blocks.upto(moved_new, last)
    old, left, joined = before(eng, topic, work, pinned, tag)
    if spec.row_wise:  # their old and new rows are derived with the unit's other rows (row_wise.rederive)
        work.left = (left, moved_old, old)
        work.rows.append((joined, moved_new))
        return
    work.affected.append((left, keys_of("tm_left", moved_old, old)))
    work.affected.append((joined, keys_of("tm_joined", moved_new, pinned)))
    old_alone, new_alone = _alone(eng, topic, work, everything, tag, [old, pinned])
    work.affected.append(("rows of the changed inputs alone (no base row)",
                          new_alone.exceptAll(old_alone).unionByName(old_alone.exceptAll(new_alone)).select(*spec.key)))


def removed(exc: BaseException) -> bool:
    """Whether ``exc`` says a Delta version, change-feed file or data file no longer exists."""
    text = str(exc)
    return any(s in text for s in ("FileNotFound", "DELTA_FILE_NOT_FOUND", "VERSION_NOT_FOUND", "does not exist",
                                   "CHANGE_DATA_NOT_RECORDED", "DELTA_CHANGE_DATA_FILE_NOT_FOUND", "cannot time travel"))


def removed_fallback(topic: Topic, work: MergeWork, exc: BaseException) -> None:
    """The previous version of a changed input, or its change feed, was removed (VACUUM, log
    retention): the rows' old groups are unknown, so only a recompute is exact."""
    work.strategy = Strategy(False, f"full recompute because a previous version of {', '.join(work.strategy.reverse)} "
                                    f"cannot be read ({first_line(exc)[:300]})", fallback=True)
    work.affected.clear()
    work.contributions.clear()
    work.alone.clear()
    work.rows.clear()
    work.left = None
    refuse_strict(topic, work.strategy)


def _matching(view: DataFrame, changed: DataFrame, cols: list[str], rows: list[Any] | None) -> DataFrame:
    """Rows of ``view`` whose ``cols`` match a row of ``changed`` (null-safe); ``rows``: ``changed``'s
    rows when they were collected."""
    cond = _listed(cols, rows)
    return view.where(cond) if cond is not None else spark_io.semi_join(view, changed, cols)


def _listed(cols: list[str], rows: list[Any] | None) -> Column | None:
    """A row matches one of ``rows`` (the changed rows, collected) on its single column ``cols``, as
    a literal list Delta's data skipping uses (null-safe); None when not collected, several columns
    or more than :data:`IN_LIST` rows."""
    values = values_listed(cols, rows)
    if values is None:
        return None
    from pyspark.sql import functions as F

    col = F.col(spark_io.quote(cols[0]))
    known = [v for v in values if v is not None]
    cond = col.isin(known) if known else F.lit(False)
    return cond | col.isNull() if len(known) < len(values) else cond


def values_listed(cols: list[str], rows: list[Any] | None) -> list[Any] | None:
    """The values of the changed rows' single column ``cols`` that :func:`_listed` lists (None: not
    collected, several columns or more than :data:`IN_LIST` rows)."""
    return None if len(cols) != 1 or rows is None or len(rows) > IN_LIST else [r[0] for r in rows]


def listed(changed: list[Changed]) -> dict[str, list[Any]] | None:
    """For a single changed input whose rows :func:`matching_any` matches by a literal list: its
    column and those values (what a row must take to match); else None."""
    if len(changed) != 1:
        return None
    _, cols, rows = changed[0]
    values = values_listed(cols, rows)
    return None if values is None else {cols[0]: values}


def matching_any(view: DataFrame, changed: list[Changed]) -> DataFrame:
    """Rows of ``view`` matching a row of any of ``changed`` (as :func:`_matching`), each row once
    however many it matches (a union of :func:`_matching` would hold it once per input)."""
    from pyspark.sql import functions as F

    if len(changed) == 1:
        return _matching(view, *changed[0])
    cols, out, hits = view.columns, view, []
    for i, (rows_df, on, rows) in enumerate(changed):
        listed = _listed(on, rows)
        if listed is not None:
            hits.append(listed)
            continue
        tag = f"_tm_hit_{i}"
        r = rows_df.select(*[F.col(spark_io.quote(c)).alias(f"{tag}_{j}") for j, c in enumerate(on)]).distinct() \
            .withColumn(tag, F.lit(True))
        out = out.join(r, functools.reduce(lambda a, b: a & b, [out[spark_io.quote(c)].eqNullSafe(r[f"{tag}_{j}"])
                                                                for j, c in enumerate(on)]), "left")
        hits.append(F.col(tag).isNotNull())
    return out.where(functools.reduce(lambda a, b: a | b, hits)).select(*[F.col(spark_io.quote(c)) for c in cols])


def narrow(rows: DataFrame, cols: list[str], keys: list[Any] | None) -> DataFrame:
    """``rows`` filtered to the values each of ``cols`` takes in ``keys`` (the collected key rows;
    None: not collected, ``rows`` as they are). Implied by the semi join on the keys that follows,
    so it changes no result; as literals, Spark pushes it down through the transform wherever that
    is exact (projections, the preserved side of an outer join, grouping columns), so the rows of
    other keys are dropped at the scan instead of joined and aggregated first."""
    from pyspark.sql import functions as F

    if keys is None or not keys:
        return rows
    for i, c in enumerate(cols):
        values = {k[i] for k in keys}
        cond = spark_io.one_of(spark_io.quote(c), values) if len(values) <= NARROW_VALUES else None
        if cond is not None:  # else many values, or a type without exact literal text: the semi join alone
            rows = rows.where(F.expr(cond))
    return rows


def _prune_column(topic: Topic, work: MergeWork, key: list[str], key_rows: list[Any] | None) -> str | None:
    """The view's clustering column :func:`prune` filters the MERGE's target by (None: it does not)."""
    col = cluster_column(topic.spec, work.columns)
    return None if not key_rows or len(key_rows) > NARROW_VALUES or col is None or col in key else col


def prune_reads_view(topic: Topic, work: MergeWork, key: list[str], key_rows: list[Any] | None) -> str | None:
    """The column whose values :func:`prune` reads from the view's rows of the affected keys, by a
    Spark job; None when it reads nothing (no clustering column, too many keys, or the values
    already in hand)."""
    return None if work.held is not None else _prune_column(topic, work, key, key_rows)


def prune(eng: UnitContext, topic: Topic, work: MergeWork, key: list[str], key_rows: list[Any] | None) -> TargetFilter:
    """The values the view's clustering column (:func:`cluster_column`) takes in the view's rows
    of the affected keys, as a filter on the MERGE's target: exact by construction (read
    from those very rows, which only this unit writes while it holds the topic), and cheap to
    find (two columns of the view, the keys as literals). With it either engine skips, by the
    files' statistics, every file the affected rows are not in, where the MERGE would read them
    all. Empty when the keys were not collected, are many, or the values have no exact literal."""
    col = _prune_column(topic, work, key, key_rows)
    if col is None:
        return TargetFilter()
    if work.held is not None:  # a row-wise unit that only moved rows: their old rows are the view's
        return TargetFilter.of({col: work.held})
    view = eng.spark.read.format("delta").load(eng.path(topic.spec.destination))
    held = narrow(view, key, key_rows).select(col).distinct()
    _, rows = spark_io.small_local(eng.spark, held, NARROW_VALUES)
    if rows is None:
        return TargetFilter()
    return TargetFilter.of({col: [r[0] for r in rows]})  # no values: FALSE (the view holds none of the keys)
