"""``tidemark verify TOPIC``: a materialized view (merge topic) compared with its transform
recomputed from scratch over the very inputs its last unit applied, whole or on a sample of
keys, and the keys that differ. What a user runs the day they doubt a number.

The view is read at the Delta version of its topic's newest commit; the recompute reads the
base at the version and up to the position that commit records (``source_version``, ``next``)
and every other input at its recorded version (``inputs``): the very state the view claims to
equal, so a unit landing meanwhile or an input changing after it cannot make a false alarm.
Floating-point columns are compared with a relative tolerance (sums added in another order
differ in the last bits)."""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lineage.core.errors import ProcessingError
from lineage.core.positions import Position
from lineage.spec.model import Processor, Topic
from platform_assets.core import blocks, spark_io, table_reads
from platform_assets.core.protocol import data_app_id
from resources.storage import delta_log, delta_meta

if TYPE_CHECKING:
    from pyspark.sql import Column

    from platform_assets.core.context import UnitContext

#: Relative tolerance of floating-point columns.
REL_TOL = 1e-9


@dataclass
class Verdict:
    """What ``verify`` found."""

    topic: str
    key: tuple[str, ...]
    against: str  # the state compared, in words
    view_rows: int
    keys_compared: int
    sampled: bool
    differing: int  # keys whose rows differ (missing on either side included)
    examples: list[tuple[tuple[Any, ...], dict[str, Any] | None, dict[str, Any] | None]] = field(default_factory=list)
    duplicates: int = 0  # keys the view holds more than once

    @property
    def ok(self) -> bool:
        return not self.differing and not self.duplicates

    def lines(self) -> list[str]:
        what = f"a sample of {self.keys_compared} keys" if self.sampled else f"{self.keys_compared} keys (the whole view)"
        out = [f"verify {self.topic}: {self.against}", f"  compared {what}; the view holds {self.view_rows} rows"]
        if self.duplicates:
            out.append(f"  DUPLICATE KEYS: {self.duplicates} key(s) of ({', '.join(self.key)}) occur more than once in the view")
        if self.ok:
            out.append("  OK: the view equals its transform recomputed from scratch"
                       + (" on the sampled keys (a sample cannot find keys missing from the view: run without --sample)"
                          if self.sampled else ""))
            return out
        if self.differing:
            out.append(f"  DIFFERS: {self.differing} key(s)" + (f", the first {len(self.examples)}:" if self.examples else ""))
        for key, got, want in self.examples:
            out.append("    " + ", ".join(f"{k}={v!r}" for k, v in zip(self.key, key, strict=True)))
            out.append(f"      view:      {_row(got)}")
            out.append(f"      recompute: {_row(want)}")
        return out


def _row(row: dict[str, Any] | None) -> str:
    return "(no row)" if row is None else ", ".join(f"{k}={v!r}" for k, v in row.items())


def verify(engine: UnitContext, topic: Topic, *, sample: int = 0, show: int = 20, seed: int | None = None) -> Verdict:
    """Compare merge topic ``topic``'s view with its recompute (see the module's doc): every key,
    or ``sample`` keys drawn at random from the view; up to ``show`` differing keys in full."""
    from pyspark.sql import functions as F

    eng, spec = engine, topic.spec
    if spec.processor is not Processor.MERGE:
        raise ProcessingError(f"topic '{topic.name}' is a {spec.processor.value} topic; verify compares a materialized view "
                              f"(a merge topic) with its recompute")
    dest = eng.path(spec.destination)
    # The view as it is now (whatever wrote to it since), and the newest unit of the topic in that
    # very snapshot: a unit landing meanwhile cannot make a false alarm.
    snap = delta_meta.TableSnapshot.open(dest)
    now = snap.version
    seq = delta_log.txn_at(dest, now, data_app_id(topic.name)) if now is not None else None
    rec = eng.store.get(topic.name)
    hint = rec.delta_version if rec is not None and rec.seq == seq else None
    commit = delta_log.find_txn_commit(dest, data_app_id(topic.name), seq, hint=hint) if seq else None
    if commit is None:
        raise ProcessingError(f"topic '{topic.name}': {spec.destination} holds no commit of this topic yet (nothing to "
                              f"verify); run it first: tidemark run {topic.name}")
    meta = commit.user_metadata
    inputs = {str(k): int(v) for k, v in (meta.get("inputs") or {}).items()}
    version = meta.get("source_version", inputs.get(spec.base))
    if "next" not in meta:
        raise ProcessingError(f"topic '{topic.name}': commit {commit.version} of {spec.destination} does not say which base "
                              f"rows it covers (no 'next' in its userMetadata)")
    end = Position.parse(str(meta["next"]))
    eng.register_tables(topic)
    spark, tag, views = eng.spark, uuid.uuid4().hex[:10], list[str]()
    try:
        base = blocks.rows_upto(spark, eng.path(spec.base), end, None if version is None else int(version))
        base.createOrReplaceTempView(f"tm_verify_{tag}")
        views.append(f"tm_verify_{tag}")
        pinned = table_reads.pin_inputs(eng, topic, {t: v for t, v in inputs.items() if t != spec.base}, f"tm_verify_in_{tag}",
                                  views)
        want = spark_io.transform(spark, topic, base, view=views[0], tables=pinned,
                                  paths={t: eng.path(t) for t in spec.depends_on})
        got = spark.read.format("delta").option("versionAsOf", now).load(dest)
        key = list(spec.key)
        missing = [k for k in key if k not in want.columns or k not in got.columns]
        if missing:
            raise ProcessingError(f"topic '{topic.name}': key column(s) {', '.join(missing)} are not in both the view and "
                                  f"the transform's output")
        columns = [c for c in want.columns if c not in key]
        extra = sorted(set(got.columns) ^ set(want.columns))
        if extra:
            raise ProcessingError(f"topic '{topic.name}': the view's columns differ from the transform's "
                                  f"({', '.join(extra)}): the next unit recomputes it whole")
        if sample > 0:
            keys = got.select(*key).distinct().orderBy(F.rand(seed)).limit(sample)
            keys, _ = spark_io.small_local(spark, keys, sample)
            # the sample's rows of the view and of the transform, each computed once: the checks
            # below pass over them two or three times (each pass took a scan or the transform again)
            got = spark_io.semi_join(got, keys, key).localCheckpoint(eager=True)
            want = spark_io.semi_join(want, keys, key).localCheckpoint(eager=True)
        dups = got.groupBy(*key).count().where("count > 1").count()
        g = got.withColumn("_tm_g", F.lit(True)).alias("g")
        w = want.withColumn("_tm_w", F.lit(True)).alias("w")
        q = spark_io.quote
        on = [F.col(f"g.{q(k)}").eqNullSafe(F.col(f"w.{q(k)}")) for k in key]
        types = dict(want.dtypes)
        same = [_same(F.col(f"g.{q(c)}"), F.col(f"w.{q(c)}"), types[c]) for c in columns]
        joined = g.join(w, on, "full_outer").select(
            *[F.coalesce(F.col(f"g.{q(k)}"), F.col(f"w.{q(k)}")).alias(f"k{i}") for i, k in enumerate(key)],
            F.struct(*[F.col(f"g.{q(c)}") for c in want.columns]).alias("got"),
            F.struct(*[F.col(f"w.{q(c)}") for c in want.columns]).alias("want"),
            F.col("g._tm_g").isNotNull().alias("has_got"), F.col("w._tm_w").isNotNull().alias("has_want"),
            functools.reduce(lambda a, b: a & b, same, F.lit(True)).alias("same"))
        bad = joined.where(~F.col("has_got") | ~F.col("has_want") | ~F.col("same"))
        figures = joined.agg(F.count(F.lit(1)).alias("keys"),
                             F.count_if(~F.col("has_got") | ~F.col("has_want") | ~F.col("same")).alias("bad")).collect()[0]
        rows = bad.limit(show).collect()
        view_rows = snap.exact_rows  # (by the statistics where they count the rows exactly)
        if view_rows is None:
            view_rows = spark.read.format("delta").option("versionAsOf", now).load(dest).count()
    finally:
        for v in views:
            spark.catalog.dropTempView(v)
    examples = [(tuple(r[f"k{i}"] for i in range(len(key))), r["got"].asDict() if r["has_got"] else None,
                 r["want"].asDict() if r["has_want"] else None) for r in rows]
    versions = ", ".join(f"{t} version {v}" for t, v in sorted(inputs.items()) if t != spec.base)
    against = (f"{spec.destination} version {now} (unit {seq}, committed in version {commit.version}) against its transform over {spec.base}"
               f"{'' if version is None else f' version {version}'} up to {end.to_text()}" + (f", {versions}" if versions else ""))
    return Verdict(topic.name, tuple(key), against, view_rows, int(figures["keys"]), sample > 0, int(figures["bad"]),
                   examples, dups)


def _same(a: Column, b: Column, dtype: str) -> Column:
    """Null-safe equality; floating-point columns within :data:`REL_TOL`."""
    from pyspark.sql import functions as F

    if dtype in ("double", "float"):
        close = F.abs(a - b) <= F.greatest(F.abs(a), F.abs(b)) * REL_TOL
        return (a.isNull() & b.isNull()) | (a.isNotNull() & b.isNotNull() & (a.eqNullSafe(b) | close))
    return a.eqNullSafe(b)
