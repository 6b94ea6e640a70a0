"""The additive strategy of a merge view (``additive``: a count and sums per group): a unit
re-derives nothing, it adds the transform's signed contributions over the rows that moved (new and
late rows, rows joining a changed reference row at its old and its new version) to the view's
groups by one MERGE (:func:`added_source`), where the view holds exactly what its own definition
built (:func:`why_not_added`, :func:`additive_fingerprint`) and the declaration can hold
(:func:`additive_types`). The contributions of a changed input are :func:`platform_assets.views.reverse.moved`'s."""

from __future__ import annotations

import dataclasses
import datetime
import functools
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from lineage.core.errors import ProcessingError
from lineage.core.positions import Position
from lineage.spec.model import AdditiveSpec, Topic
from lineage.views.refresh import Strategy
from platform_assets.core import spark_io, table_reads
from platform_assets.core.keyed_merge import TargetFilter
from platform_assets.views import reverse
from platform_assets.views.work import LOCAL_KEYS, MergeWork, newest_commit
from resources.storage import delta_meta, delta_read

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from platform_assets.core.context import UnitContext


def additive(topic: Topic) -> AdditiveSpec:
    """The topic's ``additive`` declaration (an error for a topic without one)."""
    if topic.spec.additive is None:
        raise ProcessingError(f"topic '{topic.name}' ({topic.where}) is not additive")
    return topic.spec.additive


def additive_fingerprint(topic: Topic) -> str:
    """What an additive view's rows are sums of: its key, declaration and transforms (text), hashed.
    Recorded in every unit's commit; a unit adds only to a view its own definition built."""
    import hashlib

    add = additive(topic)
    parts = [",".join(topic.spec.key), add.count, ",".join(add.sums),
             *(t.sql or (t.path.read_text() if t.path is not None and t.path.is_file() else t.ref) for t in topic.transforms)]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def additive_types(topic: Topic, out: DataFrame) -> dict[str, str]:
    """The SQL types of an additive view's columns (its transform's output ``out``), after checking
    that the declaration can hold: every column is a key or declared additive, the count is an
    integer and every sum an integer or a decimal (sums of floating-point numbers drift when kept by
    adding and subtracting)."""
    from pyspark.sql.types import DecimalType, IntegralType

    spec, add = topic.spec, additive(topic)
    fields = {f.name: f.dataType for f in out.schema.fields}
    where = f"topic '{topic.name}' ({topic.where}), additive"
    missing = [c for c in add.columns if c not in fields]
    if missing:
        raise ProcessingError(f"{where}: {', '.join(missing)} not in the transform's output ({', '.join(fields)})")
    other = [c for c in fields if c not in spec.key and c not in add.columns]
    if other:
        raise ProcessingError(f"{where}: the transform's column(s) {', '.join(other)} are neither key nor count nor sums; "
                              f"an additive view holds only its key and sums over base rows (add them to sums, or "
                              f"remove 'additive')")
    bad = [f"{c} ({fields[c].simpleString()})" for c in add.columns
           if not isinstance(fields[c], IntegralType | DecimalType) or (c == add.count and not isinstance(fields[c], IntegralType))]
    if bad:
        raise ProcessingError(f"{where}: {', '.join(bad)} must be an integer (count) or an integer or decimal (sums): a "
                              f"floating-point sum kept by adding and subtracting drifts from a recompute; cast it to "
                              f"DECIMAL in the transform")
    return {c: fields[c].simpleString() for c in add.columns}


def why_not_added(topic: Topic, dest: str, last: Position) -> str:
    """Why an additive view cannot take contributions now ("" when it can): it must hold exactly
    the base rows up to ``last``, made by this transform and declaration, or adding would count
    rows twice (a range restated by ``offsets reset``) or mix two definitions (an edited
    transform, ``additive`` declared on a view built without it). Read from the newest commit
    of the topic in the view's log (its ``next`` and :func:`additive_fingerprint`)."""
    commit = newest_commit(topic, dest)
    if commit is None:
        return "the view's newest commit of this topic cannot be read, so what it holds is unknown to an additive unit"
    meta = commit.user_metadata
    if meta.get("additive") != additive_fingerprint(topic):
        return ("the view was not built by this transform and additive declaration (its newest commit, version "
                f"{commit.version}, was made {'by another one' if meta.get('additive') else 'without additive'})")
    if meta.get("next") != last.to_text():
        return (f"the view holds base rows up to {meta.get('next')}, not {last.to_text()} (a restated range: adding "
                f"would count rows twice)")
    return ""


def added_source(eng: UnitContext, topic: Topic, work: MergeWork) -> DataFrame | None:
    """An additive unit's MERGE source: per affected group, the sum of the contributions (the
    groups rows join, minus the groups they leave), collected. None when the contributions
    cannot be added exactly or are too many groups to collect; then their groups are re-derived
    from the full base (``work.affected``). Not exactly: SQL's ``sum`` skips nulls and is null
    over only nulls, so a contribution holding a null cannot be subtracted, and a sum that
    reaches 0 as rows leave its group may really be null (:func:`zero_sums`)."""
    from pyspark.sql import functions as F

    spec, spark = topic.spec, eng.spark
    add = additive(topic)
    key = list(spec.key)
    signed = [out.select(*[F.col(spark_io.quote(k)) for k in key],
                         *[(F.col(spark_io.quote(c)) if sign > 0 else -F.col(spark_io.quote(c))).alias(c)
                           for c in add.columns],
                         *[F.col(spark_io.quote(c)).isNull().cast("int").alias(f"_tm_null_{i}")
                           for i, c in enumerate(add.columns)],
                         F.lit(int(sign < 0)).alias("_tm_minus"), F.lit(int(alone)).alias("_tm_alone"))
              for sign, out, alone in [*((sign, out, False) for _, sign, out in work.contributions),
                                       *((1, out, True) for out in work.alone)]]
    delta = functools.reduce(lambda a, b: a.unionByName(b), signed).groupBy(*key).agg(
        *[F.sum(F.col(spark_io.quote(c))).alias(c) for c in add.columns],
        F.greatest(*[F.max(f"_tm_null_{i}") for i in range(len(add.columns))], F.lit(0)).alias("_tm_nulls"),
        F.max("_tm_minus").alias("_tm_minus"), F.max("_tm_alone").alias("_tm_alone"))
    # collected once as Arrow: the rows for the checks below, and the MERGE's source as it is (in_hand)
    local = delta.limit(LOCAL_KEYS + 1).toArrow()
    rows = local.to_pylist() if local.num_rows <= LOCAL_KEYS else None
    # a local relation (else, where Spark cannot take the values from Arrow, computed again if read)
    in_spark = None if rows is None else spark_io.from_arrow(spark, local, delta.schema)
    groups = delta if in_spark is None else in_spark
    if rows is not None and any(r["_tm_alone"] for r in rows):
        raise ProcessingError(
            f"topic '{topic.name}' ({topic.where}): additive, but its transform makes rows from "
            f"{', '.join(topic.spec.depends_on[1:]) or 'its other inputs'} without any base row (e.g. an outer join "
            f"keeping a reference row "
            f"without base rows), so the view is not a sum over base rows; remove 'additive' from the topic")
    why = (f"more than {LOCAL_KEYS} groups" if rows is None else
           "a null in a sum column" if any(r["_tm_nulls"] for r in rows) else
           f"{zero} group(s) whose sum reaches 0 as rows leave (a sum over only nulls is null)"
           if (zero := zero_sums(eng, topic, rows, work.nullable)) else "")
    if rows is None or why:
        work.affected = [(f"groups of {', '.join(label for label, _, _ in work.contributions)}",
                          groups.select(*key))]
        work.contributions = []
        work.strategy = Strategy(True, f"{work.strategy.reason}; its groups re-derived from the full base "
                                       f"({why} in the moved rows' contributions)", reverse=work.strategy.reverse,
                                 estimate=work.strategy.estimate)
        return None
    work.strategy = dataclasses.replace(work.strategy, reason=f"{work.strategy.reason}; additive: {len(rows)} groups "
                                                              f"changed by the moved rows' contributions")
    work.prune = groups_filter(rows, key)
    internal = ["_tm_nulls", "_tm_minus", "_tm_alone"]
    work.source = local.drop_columns(internal)
    return groups.drop(*internal)


def groups_filter(rows: list[dict[str, Any]], key: list[str]) -> TargetFilter:
    """What the view's rows of the groups ``rows`` (their keys) satisfy, to prune the MERGE (none
    for more than :data:`~platform_assets.views.reverse.NARROW_VALUES` groups)."""
    return TargetFilter.of({k: {r[k] for r in rows} for k in key}) if len(rows) <= reverse.NARROW_VALUES \
        else TargetFilter()


#: An additive view of at most this many groups is read by ``deltalake`` from the driver where the
#: unit needs some of its groups' values (a Spark read of the view cost six jobs, 0.9 s, at 10M orders).
DRIVER_GROUPS = 1_000_000
#: Key types the driver read of the view takes (others: Spark reads the view; both as Arrow gives the values).
_EXACT_KEYS = (bool, int, str, datetime.date)


def _groups_held(eng: UnitContext, topic: Topic, key: list[str], columns: list[str],
                 keys: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], Any]:
    """The view's rows (``key`` and ``columns``) of the groups ``keys``, by key: read JVM-free by
    ``deltalake`` (every group of a view of at most :data:`DRIVER_GROUPS` rows, keys of plain types),
    else by Spark."""
    dest = eng.path(topic.spec.destination)
    snap = delta_meta.TableSnapshot.open(dest)
    if (table_reads.direct_io_on() and snap.table is not None and snap.row_count is not None
            and snap.row_count <= DRIVER_GROUPS
            and all(v is None or type(v) in _EXACT_KEYS for k in keys for v in k)):
        table = delta_read.read_rows(snap.table, [*key, *columns])
        for i, c in enumerate(key):  # narrowed in Arrow first: only candidate groups become Python rows
            table = table.filter(pc.is_in(table[c], value_set=pa.array({k[i] for k in keys}, table[c].type),
                                          skip_nulls=False))
        wanted = set(keys)
        return {k: r for r in table.to_pylist() if (k := tuple(r[c] for c in key)) in wanted}
    view = eng.spark.read.format("delta").load(dest)
    local = eng.spark.createDataFrame(keys, view.select(*[spark_io.quote(k) for k in key]).schema)
    held = spark_io.semi_join(reverse.narrow(view, key, keys), local, key).select(*key, *columns)
    # as Arrow gives them, as the unit's own rows are (a timestamp in UTC, not in Python's local time)
    return {tuple(r[k] for k in key): r for r in held.toArrow().to_pylist()}


def zero_sums(eng: UnitContext, topic: Topic, rows: list[Any], nullable: Collection[str]) -> int:
    """Groups of ``rows`` (the summed contributions) that rows leave and that keep rows, where a
    sum would become 0: SQL gives null there when the rows left have only nulls in that column,
    which the view's values cannot tell. Reads the view's rows of those groups (their keys as
    literals). Only ``nullable`` sums can be null."""
    add = additive(topic)
    key = list(topic.spec.key)
    leaving = [r for r in rows if r["_tm_minus"]]
    if not leaving or not nullable:
        return 0
    keys = [tuple(r[k] for k in key) for r in leaving]
    now = _groups_held(eng, topic, key, add.columns, keys)
    zero = 0
    for r, k in zip(leaving, keys, strict=True):
        t = now.get(k)
        if t is not None and (t[add.count] or 0) + r[add.count] > 0 and any(
                t[c] is not None and t[c] + r[c] == 0 for c in nullable):
            zero += 1
    return zero
