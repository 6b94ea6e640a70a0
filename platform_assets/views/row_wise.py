"""The row-wise strategy of a merge view (``row_wise``: every view row comes from one base row):
the affected keys' rows are the transform over the base rows the unit found, not the full base
narrowed to those keys (:func:`rederive`), and a unit of new base rows only appends them
(:func:`appends`). The lookup in the view: a view that holds every base column as it is has the
base rows joining a changed reference row in its own rows, found there (pruned by its clustering)
instead of by a scan of the base (:func:`found_in_view`, :func:`copies_base`), and checked against
the transform over them (:class:`NotInViewError` when they differ)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lineage.core.errors import ProcessingError
from lineage.core.positions import Position
from lineage.spec.model import Topic
from lineage.views.refresh import cluster_column
from platform_assets.core import spark_io, table_reads
from platform_assets.views import in_hand, reverse
from platform_assets.views.work import LOCAL_KEYS, PART, PRESENT, MergeWork, holds_as_committed, newest_commit
from resources.storage import delta_meta

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from platform_assets.core.context import UnitContext

#: Column metadata that marks a base column, to see which view columns the transform copies from it.
BASE_COLUMN = "tidemark_base_column"


class NotInViewError(Exception):
    """The rows a row-wise unit found in the view are not the transform over their base columns."""


def rederive(eng: UnitContext, topic: Topic, work: MergeWork, *, everything: DataFrame, pinned: dict[str, str],
             tag: str, out_of: Callable[[str, DataFrame, dict[str, str]], DataFrame], moved_only: bool) -> None:
    """A row-wise view (``row_wise``): the affected keys' new rows are the transform's output over
    the base rows the unit found (new, late, joining a changed row; ``work.rows``), not the full
    base narrowed to those keys, and their old rows (the keys they leave) the transform over the
    rows joining a changed row at the versions the view applied (``work.left``). Exact when every
    view row comes from one base row and rows of different base rows have different keys. What
    the unit can see of that is checked: the transform makes no row from the other inputs alone,
    and, evaluated over the rows found split in two parts (by ``id``; the union of the parts is
    the same rows when the view is row-wise), gives no key twice, which an aggregate or a key
    that does not tell base rows apart would. ``checks: {verify_sample: N}`` and ``tidemark
    verify`` compare with a recompute.

    ``moved_only``: the unit has no new or late base rows, so the view's rows of the affected
    keys are exactly the old rows (a key names its base row), and their clustering column's
    values prune the MERGE without reading the view (``work.held``)."""
    from pyspark.sql import functions as F

    spec, spark = topic.spec, eng.spark
    key = list(spec.key)
    work.source, work.key_rows = None, None
    # a base row can be found twice: new and joining a changed row, or joining changed rows of two inputs
    found = functools.reduce(lambda a, b: a.unionByName(b), [r for _, r in work.rows]).dropDuplicates(["pos", "id"])
    found = work.temp_view(f"tm_found_{tag}", found)
    parts = [("even", found.where("id % 2 = 0"), pinned), ("odd", found.where("id % 2 <> 0"), pinned),
             ("alone", everything.where("false"), pinned)]
    if work.left is not None:
        parts.append(("old", work.left[1], work.left[2]))
    # computed once and kept in Spark: any number of rows, every column type, and no timestamp
    # through Python's local time (the rows are written as they are)
    every = functools.reduce(lambda a, b: a.unionByName(b), [
        out_of(f"tm_{name}", rows, tables).withColumn(PART, F.lit(name))
        for name, rows, tables in parts]).localCheckpoint(eager=True)
    # the unit's checks, its row count, keys and MERGE source: in the driver when the rows are few
    # (in_hand: one collect of the rows computed above), else in one Spark action over them
    local = in_hand.collected(every) if in_hand.binary_strings(every.schema) else None
    in_view = None if local is None or work.found is None else in_hand.collected(work.found)
    if local is not None and (work.found is None or in_view is not None and in_hand.comparable(local, in_view)):
        got = in_hand.checks(local, key, PART, in_view)
    else:
        local = None
        got = _checks(every, key, found=work.found, view_types=work.view_types)
    if got["alone"]:
        raise ProcessingError(
            f"topic '{topic.name}' ({topic.where}): row_wise, but its transform makes rows from "
            f"{', '.join(spec.depends_on[1:]) or 'its other inputs'} without any base row (e.g. an outer join "
            f"keeping a reference row without base rows), so a view row does not always come from one base row; "
            f"remove 'row_wise' from the topic")
    if work.found is not None:
        _found_checked(work, got["differ"])
    out = every.where(F.col(PART).isin("even", "odd")).drop(PART)
    if got["twice"]:
        first = got["most"]
        raise ProcessingError(
            f"topic '{topic.name}' ({topic.where}): row_wise, but over the unit's base rows taken in two "
            f"parts the transform gives key ({', '.join(repr(first[k]) for k in key)}) of {', '.join(key)} to "
            f"{got['most_n']} rows ({got['twice']} key(s) more than once): a view row comes from several base "
            f"rows (an aggregate) or the key does not tell base rows apart; fix the key or remove 'row_wise' "
            f"from the topic")
    col = cluster_column(spec, work.columns)
    if moved_only and col is not None:
        if local is not None:
            work.held = in_hand.distinct_values(in_hand.part(local, PART, "old"), col, reverse.NARROW_VALUES)
        else:
            _, held = spark_io.small_local(spark, every.where(F.col(PART) == "old").select(spark_io.quote(col)).distinct(),
                                           reverse.NARROW_VALUES)
            work.held = None if held is None else [r[0] for r in held]
    if local is not None:  # the MERGE's keys and source, so that it needs no Spark job before deltalake's
        made, old = in_hand.part(local, PART, "even", "odd"), in_hand.part(local, PART, "old")
        work.key_rows = in_hand.key_rows([old, made], key, LOCAL_KEYS)
        work.source = in_hand.merge_source(made, old, key, PRESENT)
    if work.left is not None:
        work.affected.append((work.left[0], every.where(F.col(PART) == "old").select(*key)))
    work.rederived = out
    work.affected.append(("; ".join(label for label, _ in work.rows) + " (re-derived alone: row_wise)",
                          out.select(*key)))
    work.strategy = dataclasses.replace(work.strategy, reason=f"{work.strategy.reason}; row_wise: {got['rows']} rows "
                                                              f"re-derived from the base rows found, not from the "
                                                              f"full base")


def appends(eng: UnitContext, topic: Topic, work: MergeWork, last: Position) -> bool:
    """Whether a row-wise unit of new base rows only can append its rows instead of MERGEing
    them: its keys name base rows after ``last``, which the view holds none of when its newest
    commit, the newest of the table but for rewrites (:func:`holds_as_committed`), is this topic's with ``next`` at ``last`` (not a range
    restated by ``offsets reset``, not a view another writer changed since), and the rows have
    the view's column types (a MERGE casts, an append would not)."""
    if work.rederived is None or work.strategy.reverse or work.late_rows or not append_point(eng, topic, work, last):
        return False
    return work.view_types == {f.name: f.dataType for f in work.rederived.schema.fields}


def append_point(eng: UnitContext, topic: Topic, work: MergeWork, last: Position) -> bool:
    """Whether the view holds no row of base rows after ``last``: its newest commit, the newest of
    the table as the unit found it (``work.view``) but for rewrites, is this topic's with ``next`` at ``last``."""
    dest = eng.path(topic.spec.destination)
    commit = newest_commit(topic, dest)
    return not (commit is None or work.view is None or not holds_as_committed(commit, work.view.version, dest)
                or commit.user_metadata.get("next") != last.to_text())


def found_in_view(eng: UnitContext, topic: Topic, work: MergeWork, changed: list[reverse.Changed], *,
                  last: Position, everything: DataFrame, base: delta_meta.TableSnapshot, pinned: dict[str, str],
                  tag: str) -> bool:
    """For a reverse join of a row-wise view: whether the base rows joining one of ``changed`` were
    found in the view (:func:`_in_view`); then their old and new rows are derived with the unit's
    other rows (:func:`rederive`: ``work.left``, ``work.rows``) and checked there (``work.found``).
    False: the unit scans the base (:func:`platform_assets.views.reverse.reverse_join`)."""
    from pyspark.sql import functions as F

    found = _in_view(eng, topic, work, last, everything, base, changed, pinned, tag)
    if found is None:
        return False
    # the rows up to ``next`` are those and the block's, which the unit re-derives anyway
    moved_old = found.select(*[F.col(spark_io.quote(c)) for c in everything.columns])
    before, left, joined = reverse.before(eng, topic, work, pinned, tag)
    work.found = found
    work.left = (f"{left}, found in the view", moved_old, before)
    work.rows.append((f"{joined}, found in the view", moved_old))
    return True


def _in_view(eng: UnitContext, topic: Topic, work: MergeWork, last: Position, everything: DataFrame,
             base: delta_meta.TableSnapshot, changed_rows: list[reverse.Changed],
             pinned: dict[str, str], tag: str) -> DataFrame | None:
    """A row-wise view that holds every base column under its own name and type, and a row of
    every base row up to ``last``, has the base rows joining a changed row in its own rows: read
    there, a filter on the view's clustering column skips by the files' statistics every file
    that holds none, where the base (ordered by position, not by join value) is read whole.
    Returns the view's rows that match (every column; computed once, kept in Spark), or None
    when the view cannot stand in for the base or would be read whole: a changed input does not
    join on the view's clustering column; it or the base has deletion vectors; its key is not
    made of base columns (a base row could have two view rows); it has another column type,
    or a column type without equality; the unit has late rows; the view's newest commit is not
    this topic's unit up to ``last`` (another writer, a restated range); its row count, from
    the Delta log, differs from the base's rows up to ``last`` (an inner join or a filter
    dropped rows); the transform does not copy every base column as it is (:func:`copies_base`:
    a view column computed from it would hold other values, and a row whose join column was
    computed would not be found). What neither can show, the unit checks over the rows it found
    (:func:`_checks`): the transform over their base columns, at the versions the view
    applied, gives back exactly those rows (a transform edited since the rows were written
    fails it)."""
    from pyspark.sql.types import MapType

    spec, view = topic.spec, work.view
    if work.late_rows or view is None or view.table is None:
        return None
    col = cluster_column(spec, work.columns)  # what the view's files are clustered by
    if col is None or any(col not in cols for _, cols, _ in changed_rows):  # it would read the view whole
        return None
    if any(work.view_types.get(f.name) != f.dataType for f in everything.schema.fields) or any(
            isinstance(t, MapType) for t in work.view_types.values()):
        return None
    dest = eng.path(spec.destination)
    commit = newest_commit(topic, dest)
    if commit is None or not holds_as_committed(commit, view.version, dest) or commit.user_metadata.get("next") != last.to_text():
        return None
    if not set(spec.key) <= set(everything.columns):  # a key of base columns: a view row per base row at most
        return None
    held = view.row_count
    if held is None or delta_meta.deletion_vectors(view).feature or held != delta_meta.count_upto(base, last):
        return None
    if not copies_base(eng.spark, topic, everything, pinned, f"tm_probe_{tag}", work.views):
        return None
    # one changed input of one join column, its values collected: only the view files that may hold
    # them are read, found from the log JVM-free (Delta's reader would first rebuild the view's state)
    rows = table_reads.read_version(eng.spark, dest, view.version, holding=reverse.listed(changed_rows))
    return reverse.matching_any(rows, changed_rows).localCheckpoint(eager=True)


def _checks(every: DataFrame, key: list[str], *, found: DataFrame | None, view_types: dict[str, Any]) -> Any:
    """What :func:`rederive` checks of its rows ``every`` (marked by part, ``PART``), in one Spark
    action: ``rows`` the rows made from the base rows found (parts ``even`` and ``odd``), ``alone``
    the rows made from no base row, ``twice`` the keys given to more than one of the found rows
    (``most``: one of them, ``most_n``: its rows), and, when the unit looked its base rows up in
    the view, ``differ`` the rows in which ``found`` and the transform over their base columns at
    the versions the view applied (part ``old``, in the view's column types) differ, each row as
    often as it occurs (0: the same rows)."""
    from pyspark.sql import functions as F

    part = F.col(PART)
    per_key = every.groupBy(*[F.col(spark_io.quote(k)) for k in key]).agg(
        F.count(F.when(part.isin("even", "odd"), 1)).alias("tm_n"),
        F.count(F.when(part == "alone", 1)).alias("tm_alone"))
    checks = per_key.agg(
        F.coalesce(F.sum("tm_n"), F.lit(0)).alias("rows"), F.coalesce(F.sum("tm_alone"), F.lit(0)).alias("alone"),
        F.count(F.when(F.col("tm_n") > 1, 1)).alias("twice"),
        F.max_by(F.struct(*[F.col(spark_io.quote(k)) for k in key]), F.col("tm_n")).alias("most"),
        F.max("tm_n").alias("most_n"))
    if found is not None:
        cols = [F.col(spark_io.quote(c)) for c in found.columns]
        again = every.where(part == "old").select(
            *[F.col(spark_io.quote(c)).cast(view_types[c]).alias(c) for c in found.columns])
        sign = "_tm_sign"
        counted = again.withColumn(sign, F.lit(1)).unionByName(found.withColumn(sign, F.lit(-1))).groupBy(*cols).agg(
            F.sum(sign).alias(sign))
        checks = checks.crossJoin(counted.agg(F.coalesce(F.sum(F.abs(sign)), F.lit(0)).alias("differ")))
    return checks.collect()[0]


def _found_checked(work: MergeWork, differ: int) -> None:
    """The rows :func:`_in_view` found against the transform over their base columns (``differ``
    rows differ, see :func:`_checks`): the same rows, each as often, or :class:`NotInViewError` (the
    unit then scans the base as for any view)."""
    if differ:
        raise NotInViewError(not_in_view(differ))
    work.strategy = dataclasses.replace(work.strategy, reason=f"{work.strategy.reason}; {FOUND_IN_VIEW}")


#: The reason's words for a unit whose base rows joining a changed row were looked up in the view.
FOUND_IN_VIEW = "the base rows joining a changed row found in the view, not by a scan of the base"


def not_in_view(differ: int) -> str:
    """Why the rows looked up in the view were read from the base after all (``differ`` rows differ)."""
    return (f"the base rows joining a changed row were looked up in the view, but the transform over its rows' base "
            f"columns does not give those rows back ({differ} row(s) differ), so they were read from the base")


def copies_base(spark: SparkSession, topic: Topic, base: DataFrame, tables: dict[str, str], name: str,
                views: list[str]) -> bool:
    """Whether ``topic``'s transform puts every column of ``base`` into its output under its own
    name, as it is: Spark's analysis of the transform over ``base`` with each column marked (column
    metadata) keeps a column's mark only where the output column is that column itself (selected,
    ``b.*``, renamed to itself, through joins); an expression over it (``b.amount * 2 AS amount``,
    a ``CAST``, a ``CASE``) drops the mark. A plan with a ``UNION`` is refused (its output keeps the
    first branch's marks). Planning only: no Spark job. ``name``: the temporary view of the marked
    rows (added to ``views``, dropped with the unit's)."""
    from pyspark.sql import functions as F

    marked = base.select(*[F.col(spark_io.quote(c)).alias(c, metadata={BASE_COLUMN: c}) for c in base.columns])
    marked.createOrReplaceTempView(name)
    views.append(name)
    out = spark_io.transform(spark, topic, marked, view=name, tables=tables)
    marks = {f.name: f.metadata.get(BASE_COLUMN) for f in out.schema.fields}
    if not all(marks.get(c, None) == c for c in base.columns):
        return False
    # a UNION's columns carry the marks of its first branch only, whatever the others compute
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        out.explain(mode="extended")
    return re.search(r"^[\s:+|\-]*Union\b", text.getvalue(), re.M) is None
