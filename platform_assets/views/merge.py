"""The merge processor: a materialized view kept equal to its transform over the full inputs, at
a cost that follows what changed (issue 9; seeds 001 and 003).

A unit (planned under the topic's lock, landed through :mod:`platform_assets.core.protocol`):

1. bounds fixed before anything is written: the base block ``(last, next]`` by ``(pos, id)``
   (possibly empty) and the Delta version of every input (the per-input offsets, base included:
   its version bounds the late-row search);
2. the strategy (:func:`lineage.views.refresh.choose`): **incremental** — the affected view keys are
   those the transform gives for the block's new (and late) base rows, plus, for each changed input
   with ``join_keys``, the keys of view rows whose join columns match a changed row of that input
   (read from its change data feed: before and after images), both in the current view and in
   the re-derived one; those keys are re-derived from the transform over the full base
   (``block`` = every base row up to ``next``) and MERGEd: changed rows updated, new ones
   inserted, keys no longer produced deleted (``delete_missing``) — or **full**: the view
   recomputed and overwritten. An **additive** view (``additive``: count and sums per group) re-derives
   nothing: the transform over the moved rows only (new and late rows, rows joining a changed
   reference row at its old and its new version) gives signed contributions, summed per group and
   added to the view by one MERGE (:meth:`MergeProcessor._added`). Either way one Delta commit carrying ``txnAppId``/``txnVersion``
   and the unit's bounds in ``userMetadata``;
3. ``etl.log`` (strategy, reason, rows inserted/updated/deleted, keys re-derived) before the
   offset commit, which moves ``last`` and every input's offset together.

Re-deriving a key from the full inputs makes a unit idempotent: a retry, a restated range
(``offsets reset``) or an input change applied twice gives the same view.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import logging
import re
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lineage.core.errors import ProcessingError, first_line
from lineage.core.positions import Block, Position
from lineage.planning.planner import Decision
from lineage.spec.model import AdditiveSpec, LateRows, Topic, TopicSpec
from lineage.views.refresh import CLUSTER_FILES, CLUSTER_ROWS, InputChange, Strategy, choose, cluster_column
from platform_assets.core import blocks, faults, protocol, spark_io
from platform_assets.core.protocol import OpenBlock, Planned, StepResult, data_app_id
from platform_assets.views import inputs as view_inputs
from resources.state.offsets import OffsetRecord
from resources.storage import delta_log, delta_meta
from resources.storage.meta_tables import quarantine_rows, write_etl_log

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from platform_assets.core.context import UnitContext

log = logging.getLogger(__name__)

PART = "_tm_part"  # a row-wise unit's output rows: which part of its base rows made them
PRESENT = "_tm_present"  # marks a re-derived row in the MERGE source (null: the key is no longer produced)
#: Up to this many affected keys (or changed input rows) are collected and joined as a local relation.
LOCAL_KEYS = 200_000
#: Up to this many distinct values of a key column narrow the re-derivation by a literal list.
NARROW_VALUES = 5_000


@dataclass(frozen=True)
class MergeLook:
    """A merge topic's look at its inputs (JVM-free): the base decision, the block's end, late
    rows, and what changed in every other input."""

    rec: OffsetRecord
    decision: Decision
    base: delta_meta.TableSnapshot
    end: Position  # the block's end (== rec.last: no base rows)
    base_rows: int
    late: delta_meta.LateRows
    changes: tuple[InputChange, ...]

    @property
    def ready(self) -> bool:
        return self.end > self.rec.last or self.late.rows.num_rows > 0 or any(c.due for c in self.changes)

    @property
    def reason(self) -> str:
        if self.ready:
            parts = [f"{self.base_rows} new base rows" if self.end > self.rec.last else "",
                     f"{self.late.rows.num_rows} late rows" if self.late.rows.num_rows else "",
                     *(f"{c.table} changed ({c.versions})" for c in self.changes if c.due)]
            return "ready: " + ", ".join(p for p in parts if p)
        return self.decision.reason if not self.decision.ready else self.decision.limit


@dataclass
class MergeWork:
    """What an opened merge unit carries to :meth:`MergeProcessor.finish`."""

    strategy: Strategy
    changes: tuple[InputChange, ...]
    late_rows: int
    columns: list[str] = field(default_factory=list)
    views: list[str] = field(default_factory=list)  # temporary views to drop when done
    built: bool = True  # the view holds a commit of this topic
    #: Incremental: the affected keys by where they come from (label, keys), see MergeProcessor.derive.
    affected: list[tuple[str, DataFrame]] = field(default_factory=list)
    #: Incremental: a predicate on the view's rows (SQL, alias ``t``) that every row of an affected key
    #: satisfies; the MERGE adds it to its condition so Delta reads only the files it may hold ("": none).
    prune: str = ""
    #: The view as the unit was derived (its table None before the first build), read again by the write.
    view: delta_meta.TableSnapshot | None = None
    #: Incremental, additive view: the transform's output over the rows that move, by where they
    #: come from (label, sign, rows): +1 the groups rows join, -1 the groups rows leave.
    contributions: list[tuple[str, int, DataFrame]] = field(default_factory=list)
    #: Additive, a changed input: the transform over no base rows at the old and the new versions
    #: (must be empty: an additive view is a sum over base rows; checked with the contributions).
    alone: list[DataFrame] = field(default_factory=list)
    #: The view columns' SQL types (an additive MERGE casts its sums back to them).
    types: dict[str, str] = field(default_factory=dict)
    #: An additive view's sums that may be null (``sum(x)``; not ``coalesce(sum(x), 0)``).
    nullable: frozenset[str] = frozenset()
    #: Incremental, row-wise view: the base rows to re-derive, by where they come from (label, rows).
    rows: list[tuple[str, DataFrame]] = field(default_factory=list)
    #: Incremental, row-wise view: the transform's output over ``rows`` (every affected key's new row):
    #: the MERGE's rows instead of the full view narrowed to the affected keys.
    rederived: DataFrame | None = None
    #: Incremental, row-wise view of new base rows only, the view holding none of them: the rows are
    #: appended (with the unit's txn id) instead of MERGEd (:meth:`MergeProcessor._appends`).
    append: bool = False
    #: Incremental: the view's column types as the unit found them (name -> Spark type).
    view_types: dict[str, Any] = field(default_factory=dict)
    #: Incremental, row-wise view, a changed input: the keys' old rows are the transform over these
    #: base rows (those up to ``last`` joining a changed row) with these tables (the versions applied).
    left: tuple[str, DataFrame, dict[str, str]] | None = None
    #: Incremental, row-wise view: the values of the view's clustering column in the view's rows of
    #: the affected keys, when the unit knows them without reading the view (None: it reads them).
    held: list[Any] | None = None
    #: Incremental, row-wise view, a changed input: the view's rows whose base columns joined a
    #: changed row, when the unit found them in the view instead of scanning the base (see
    #: :meth:`MergeProcessor._in_view`); checked against the transform over their own base columns.
    found: DataFrame | None = None

    @property
    def adds(self) -> bool:
        """The unit adds contributions to the view's groups (else it MERGEs re-derived rows or overwrites)."""
        return bool(self.contributions) and self.strategy.incremental


class MergeProcessor:
    """Plans, opens and lands the units of merge topics for one engine (its :class:`UnitContext`)."""

    def __init__(self, engine: UnitContext) -> None:
        self.engine = engine

    # ----------------------------------------------------------------- planning (no JVM)
    def look(self, topic: Topic, rec: OffsetRecord) -> MergeLook:
        eng, spec = self.engine, topic.spec
        base = delta_meta.TableSnapshot.open(eng.path(spec.base))
        decision, _ = eng.decide(topic, rec, mark=delta_meta.table_mark(base, newer_than=rec.last))
        end, rows = rec.last, 0
        empty = delta_meta.LateRows(delta_meta.pa.table({}))
        if rec.run is not None and spec.repeat and eng.clock() < rec.run + spec.repeat:  # repeat holds every input
            return MergeLook(rec, decision, base, end, rows, empty, ())
        if decision.ready and not decision.retry:
            found = eng.block_end(topic, rec, decision, base)
            if found.end is not None:
                end, rows = found.end, found.rows
        late = empty
        done = rec.inputs.get(spec.base)
        if spec.late_rows is LateRows.REDERIVE and done is not None and base.version is not None and not rec.last.is_zero():
            late = blocks.late_rows(topic, base, done, rec.last)
        changes = tuple(delta_meta.input_change(t, eng.path(t), rec.inputs.get(t)) for t in spec.depends_on[1:])
        return MergeLook(rec, decision, base, end, rows, late, changes)

    def plan_locked(self, topic: Topic, rec: OffsetRecord) -> Planned:
        """With the lock held: the pending unit, or fix the next one (bounds and every input's version)."""
        eng, spec = self.engine, topic.spec
        if rec.pending:
            return Planned(Block(topic.name, rec.seq, rec.last, rec.next, may_be_empty=True), f"retry unit {rec.seq}", retry=True,  # type: ignore[arg-type]
                           source_version=rec.source_version)
        look = self.look(topic, rec)
        if spec.late_rows is LateRows.REDERIVE:
            bad = delta_meta.bad_position_rows(look.base)
            bad_rows = quarantine_rows(eng.settings, topic.name, spec.base, bad, eng.clock()) if bad.num_rows else 0
            warnings: tuple[str, ...] = ((delta_meta.late_detection_warning(spec.base, look.late.unreadable),)
                                         if look.late.unreadable else ())
        else:
            bad_rows, warnings = blocks.quarantine(eng, topic, rec, look.base)
        if not look.ready or look.base.version is None:
            return Planned(None, look.reason, bad_rows=bad_rows, warnings=warnings)
        inputs = {spec.base: look.base.version, **{c.table: c.new for c in look.changes if c.new is not None}}
        seq = protocol.next_seq(rec, eng.path(spec.destination), topic.name)
        rec = eng.store.plan(topic.name, eng.owner, last=rec.last, next=look.end, seq=seq,
                             source_version=look.base.version, inputs_next=inputs)
        return Planned(Block(topic.name, seq, rec.last, look.end, may_be_empty=True), f"unit {seq}", base_rows=look.base_rows,
                       bad_rows=bad_rows, source_version=look.base.version, warnings=warnings)

    # ----------------------------------------------------------------- the unit
    def open(self, topic: Topic, rec: OffsetRecord, seq: int | None) -> OpenBlock | StepResult:
        eng = self.engine
        if seq is not None and not (rec.pending and rec.seq == seq):
            return StepResult(topic.name, False, f"unit {seq} is not pending (topic is at unit {rec.seq})")
        with eng.phases.timed("plan"):
            planned = self.plan_locked(topic, rec)
            if planned.block is None:
                return StepResult(topic.name, False, planned.reason, bad_rows=planned.bad_rows)
            rec = eng.store.get(topic.name) or rec
            dest = eng.path(topic.spec.destination)
            landed = delta_log.find_txn_commit(dest, data_app_id(topic.name), planned.block.seq) if planned.retry else None
        started = time.monotonic()
        if landed is None and planned.retry:
            blocks.require_snapshot(eng, topic, planned)  # its base snapshot may have lost files to VACUUM
        if landed is not None:
            work = MergeWork(Strategy(False, "landed before a crash"), (), 0)
            return OpenBlock(topic, planned, started, planned.block.seq, landed=landed, merge=work)
        faults.crashpoint("planned")
        with eng.phases.timed("transform"):
            out, work = self._build(topic, rec, planned)
        faults.crashpoint("transformed")
        return OpenBlock(topic, planned, started, planned.block.seq, out=out, merge=work)

    def _build(self, topic: Topic, rec: OffsetRecord, planned: Planned) -> tuple[DataFrame, MergeWork]:
        """The unit's strategy and its output: the whole view (full) or the MERGE source (incremental)."""
        from pyspark.sql import functions as F

        spec = topic.spec
        full, work = self.derive(topic, rec, planned)
        if not work.strategy.incremental:
            if work.built:  # a recompute as plain as a rebuild can be (clustering it would cost a shuffle of every row)
                return full, work
            rows = delta_meta.TableSnapshot.open(self.engine.path(spec.base), planned.source_version).row_count
            return _clustered(full, spec, rows), work
        key = list(spec.key)
        if work.rederived is not None and planned.block is not None and self._appends(topic, work, planned.block.last):
            work.append = True
            work.strategy = dataclasses.replace(work.strategy, reason=f"{work.strategy.reason}; appended: the view holds "
                                                                      f"no row of base rows after its last")
            return work.rederived, work
        if work.adds:
            try:
                added = self._added(topic, work)
            except Exception as exc:
                if not (work.strategy.reverse and _removed(exc)):
                    raise
                self._removed_fallback(topic, work, exc)
                return full, work
            if added is not None:
                return added, work
        try:
            keys, key_rows = spark_io.small_local(self.engine.spark, functools.reduce(
                lambda a, b: a.unionByName(b), [k for _, k in work.affected]).distinct(), LOCAL_KEYS)
        except Exception as exc:
            if not (work.strategy.reverse and _removed(exc)):
                raise
            self._removed_fallback(topic, work, exc)
            return full, work
        rederived = (spark_io.semi_join(narrow(full, key, key_rows), keys, key) if work.rederived is None
                     else work.rederived).withColumn(PRESENT, F.lit(True))
        work.prune = self._prune(topic, work, key, key_rows)
        return spark_io.rows_of_keys(keys, rederived, key), work

    def _added(self, topic: Topic, work: MergeWork) -> DataFrame | None:
        """An additive unit's MERGE source: per affected group, the sum of the contributions (the
        groups rows join, minus the groups they leave), collected. None when the contributions
        cannot be added exactly or are too many groups to collect; then their groups are re-derived
        from the full base (``work.affected``). Not exactly: SQL's ``sum`` skips nulls and is null
        over only nulls, so a contribution holding a null cannot be subtracted, and a sum that
        reaches 0 as rows leave its group may really be null (:meth:`_zero_sums`)."""
        from pyspark.sql import functions as F

        spec, spark = topic.spec, self.engine.spark
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
        groups, rows = spark_io.small_local(spark, delta, LOCAL_KEYS)
        if rows is not None and any(r["_tm_alone"] for r in rows):
            raise ProcessingError(
                f"topic '{topic.name}' ({topic.where}): additive, but its transform makes rows from "
                f"{', '.join(topic.spec.depends_on[1:]) or 'its other inputs'} without any base row (e.g. an outer join "
                f"keeping a reference row "
                f"without base rows), so the view is not a sum over base rows; remove 'additive' from the topic")
        why = (f"more than {LOCAL_KEYS} groups" if rows is None else
               "a null in a sum column" if any(r["_tm_nulls"] for r in rows) else
               f"{zero} group(s) whose sum reaches 0 as rows leave (a sum over only nulls is null)"
               if (zero := self._zero_sums(topic, rows, work.nullable)) else "")
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
        work.prune = " AND ".join(f"({c})" for c in (one_of(f"t.{spark_io.quote(k)}", {r[k] for r in rows}) for k in key)
                                  if c is not None) if len(rows) <= NARROW_VALUES else ""
        return groups.drop("_tm_nulls", "_tm_minus", "_tm_alone")

    def _zero_sums(self, topic: Topic, rows: list[Any], nullable: Collection[str]) -> int:
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
        view = self.engine.spark.read.format("delta").load(self.engine.path(topic.spec.destination))
        local = self.engine.spark.createDataFrame(keys, view.select(*[spark_io.quote(k) for k in key]).schema)
        held = spark_io.semi_join(narrow(view, key, keys), local, key).select(*key, *add.columns)
        now = {tuple(r[k] for k in key): r for r in held.collect()}
        zero = 0
        for r, k in zip(leaving, keys, strict=True):
            t = now.get(k)
            if t is not None and (t[add.count] or 0) + r[add.count] > 0 and any(
                    t[c] is not None and t[c] + r[c] == 0 for c in nullable):
                zero += 1
        return zero

    def _prune(self, topic: Topic, work: MergeWork, key: list[str], key_rows: list[Any] | None) -> str:
        """The values the view's clustering column (:func:`cluster_column`) takes in the view's rows
        of the affected keys, as a predicate on the MERGE's target: exact by construction (read
        from those very rows, which only this unit writes while it holds the topic), and cheap to
        find (two columns of the view, the keys as literals). With it Delta skips, by the files'
        statistics, every file the affected rows are not in, where the MERGE would read them all.
        "" when the keys were not collected, are many, or the values have no exact literal."""
        col = cluster_column(topic.spec, work.columns)
        if not key_rows or len(key_rows) > NARROW_VALUES or col is None or col in key:
            return ""
        if work.held is not None:  # a row-wise unit that only moved rows: their old rows are the view's
            return one_of(f"t.{spark_io.quote(col)}", work.held) or ""
        view = self.engine.spark.read.format("delta").load(self.engine.path(topic.spec.destination))
        held = narrow(view, key, key_rows).select(col).distinct()
        _, rows = spark_io.small_local(self.engine.spark, held, NARROW_VALUES)
        if rows is None:
            return ""
        # FALSE when the view holds none of the keys (all inserts)
        return one_of(f"t.{spark_io.quote(col)}", [r[0] for r in rows]) or ""

    def derive(self, topic: Topic, rec: OffsetRecord, planned: Planned) -> tuple[DataFrame, MergeWork]:
        """The view over the unit's inputs (every input at the version the unit planned) and the
        unit's strategy; for an incremental unit also the affected keys (``MergeWork.affected``, by
        source), by the delta rule (:mod:`lineage.views.refresh`):

        * new and late base rows: the transform's keys over them;
        * a changed input ``R`` (``join_keys``: base column -> ``R``'s column): the base rows whose
          join column matches a changed row of ``R`` (its change feed's before and after images),
          their keys evaluated with ``R`` at its previous version (the groups they leave) and at
          its new one (the groups they join); rows whose reference vanished or appeared included;
        * rows the transform makes from the changed inputs alone (an outer join keeping a
          reference without base rows): the keys whose rows differ between the transform over
          no base rows at the previous and at the new versions.

        Nothing is computed yet; the caller drops ``work.views`` when done."""
        eng, spec = self.engine, topic.spec
        block = planned.block
        if block is None or rec.inputs_next is None:
            raise ProcessingError(f"topic '{topic.name}': unit {rec.seq} has no planned bounds")
        dest = eng.path(spec.destination)
        done = rec.inputs.get(spec.base)
        base = delta_meta.TableSnapshot.open(eng.path(spec.base), planned.source_version)
        late = delta_meta.LateRows(delta_meta.pa.table({}))
        if spec.late_rows is LateRows.REDERIVE and done is not None and not block.last.is_zero():
            late = blocks.late_rows(topic, base, done, block.last)
        changes = tuple(delta_meta.input_change(t, eng.path(t), rec.inputs.get(t), upto=rec.inputs_next.get(t))
                        for t in spec.depends_on[1:])
        view = delta_meta.TableSnapshot.open(dest)
        built = bool(rec.inputs) and view.version is not None
        base_rows = planned.base_rows if planned.base_rows >= 0 else delta_meta.count_block(
            eng.path(spec.base), block.last, block.next, planned.source_version)
        sizes = delta_meta.unit_sizes(base, view, changes, spec) if built else None
        strategy = choose(spec, built=built, base_rows=base_rows, base_columns=base.columns, late_rows=late.rows.num_rows,
                          changes=changes, python_transform=topic.python, sizes=sizes)
        if spec.additive is not None and strategy.incremental and (why := self._not_added(topic, dest, block.last)):
            strategy = Strategy(False, f"full recompute because {why}", fallback=True)
        eng.register_tables(topic)
        spark = eng.spark
        tag = uuid.uuid4().hex[:10]
        work = MergeWork(strategy, changes, late.rows.num_rows, built=built, view=view)
        pinned = self._pin(work, topic, {t: v for t, v in rec.inputs_next.items() if t != spec.base}, f"tm_in_{tag}")
        everything = self._base(spark, topic, planned, upto=True)
        full = spark_io.transform(spark, topic, self._view(spark, work, f"tm_all_{tag}", everything), view=work.views[-1],
                                  tables=pinned, paths={t: eng.path(t) for t in spec.depends_on})
        work.columns = list(full.columns)
        if spec.additive is not None:
            work.types = additive_types(topic, full)
            work.nullable = frozenset(f.name for f in full.schema.fields if f.nullable and f.name in spec.additive.sums)
        if not strategy.incremental:
            return full, work
        target = spark.read.format("delta").load(dest)
        work.view_types = {f.name: f.dataType for f in target.schema.fields}
        added = [c for c in full.columns if c not in target.columns]
        gone = [c for c in target.columns if c not in full.columns]
        if added or gone:  # the transform's columns changed: every row must be recomputed
            why = f"the transform's columns changed (added: {', '.join(added) or '-'}; removed: {', '.join(gone) or '-'})"
            work.strategy = Strategy(False, f"full recompute because {why}", fallback=True)
            self._refuse_strict(topic, work.strategy)
            return full, work
        key = list(spec.key)
        missing = [k for k in key if k not in full.columns]
        if missing:
            raise ProcessingError(f"topic '{topic.name}' ({topic.where}): key column(s) {', '.join(missing)} are not in the "
                                  f"transform's output ({', '.join(full.columns)})")

        def out_of(name: str, rows: DataFrame, tables: dict[str, str]) -> DataFrame:
            return spark_io.transform(spark, topic, self._view(spark, work, f"{name}_{tag}", rows), view=work.views[-1],
                                      tables=tables)

        def keys_of(name: str, rows: DataFrame, tables: dict[str, str]) -> DataFrame:
            return out_of(name, rows, tables).select(*key)

        def joining(label: str, name: str, rows: DataFrame) -> None:
            """Base rows joining their groups at the new versions: their contributions (additive) or keys."""
            if spec.additive is not None:
                work.contributions.append((label, 1, out_of(name, rows, pinned)))
            elif spec.row_wise:
                work.rows.append((label, rows))
            else:
                work.affected.append((label, keys_of(name, rows, pinned)))

        if spec.additive is not None and not strategy.reverse:  # with a reverse join: at both versions (_moved)
            work.alone = [out_of("tm_none", everything.where("false"), pinned)]
        if block.next > block.last:
            joining(f"{base_rows} new base rows", "tm_new", self._base(spark, topic, planned, upto=False))
        ids = None
        if late.rows.num_rows:
            ids = spark.createDataFrame([(int(i),) for i in late.rows.column("id").to_pylist()], "id bigint")
            late_df = self._base(spark, topic, planned, upto=True, last_only=True).join(ids, "id", "left_semi")
            joining(f"{late.rows.num_rows} late base rows", "tm_late", late_df)
        found_rows, found_keys = list(work.rows), list(work.affected)  # before the reverse join adds to them

        def reverse(base_snapshot: delta_meta.TableSnapshot | None) -> None:
            self._reverse(topic, work, last=block.last, everything=everything, pinned=pinned, tag=tag, keys_of=keys_of,
                          base=base_snapshot)

        def row_wise() -> None:
            self._row_wise(topic, work, everything=everything, pinned=pinned, tag=tag, out_of=out_of,
                           moved_only=block.next <= block.last and not late.rows.num_rows)

        if strategy.reverse:
            try:
                held = self._base(spark, topic, planned, upto=True, last_only=True)
                if spec.additive is not None:
                    self._moved(topic, work, held=held if ids is None else held.join(ids, "id", "left_anti"),
                                pinned=pinned, tag=tag, out_of=out_of)
                else:
                    reverse(base)
            except Exception as exc:
                if not _removed(exc):
                    raise
                self._removed_fallback(topic, work, exc)
        if work.rows:
            try:
                try:
                    row_wise()
                except NotInViewError as why:  # the rows found in the view are not what the base would give
                    log.info("topic %s: %s", topic.name, why)
                    work.rows, work.affected, work.left, work.found, work.held = list(found_rows), list(found_keys), \
                        None, None, None
                    work.strategy = dataclasses.replace(work.strategy, reason=f"{work.strategy.reason}; {why}")
                    reverse(None)
                    row_wise()
            except Exception as exc:
                if not (strategy.reverse and _removed(exc)):
                    raise
                self._removed_fallback(topic, work, exc)
        return full, work

    def _row_wise(self, topic: Topic, work: MergeWork, *, everything: DataFrame, pinned: dict[str, str], tag: str,
                  out_of: Callable[[str, DataFrame, dict[str, str]], DataFrame], moved_only: bool) -> None:
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

        spec, spark = topic.spec, self.engine.spark
        key = list(spec.key)
        # a base row can be found twice: new and joining a changed row, or joining changed rows of two inputs
        found = functools.reduce(lambda a, b: a.unionByName(b), [r for _, r in work.rows]).dropDuplicates(["pos", "id"])
        found = self._view(spark, work, f"tm_found_{tag}", found)
        parts = [("even", found.where("id % 2 = 0"), pinned), ("odd", found.where("id % 2 <> 0"), pinned),
                 ("alone", everything.where("false"), pinned)]
        if work.left is not None:
            parts.append(("old", work.left[1], work.left[2]))
        # computed once and kept in Spark: any number of rows, every column type, and no timestamp
        # through Python's local time (the rows are written as they are)
        every = functools.reduce(lambda a, b: a.unionByName(b), [
            out_of(f"tm_{name}", rows, tables).withColumn(PART, F.lit(name))
            for name, rows, tables in parts]).localCheckpoint(eager=True)
        if not every.where(F.col(PART) == "alone").isEmpty():
            raise ProcessingError(
                f"topic '{topic.name}' ({topic.where}): row_wise, but its transform makes rows from "
                f"{', '.join(spec.depends_on[1:]) or 'its other inputs'} without any base row (e.g. an outer join "
                f"keeping a reference row without base rows), so a view row does not always come from one base row; "
                f"remove 'row_wise' from the topic")
        if work.found is not None:
            self._check_found(work, every.where(F.col(PART) == "old").drop(PART))
        out = every.where(F.col(PART).isin("even", "odd")).drop(PART)
        twice = out.groupBy(*[F.col(spark_io.quote(k)) for k in key]).count().where(F.col("count") > 1)
        if first := twice.limit(1).collect():
            raise ProcessingError(
                f"topic '{topic.name}' ({topic.where}): row_wise, but over the unit's base rows taken in two "
                f"parts the transform gives key ({', '.join(repr(first[0][k]) for k in key)}) of {', '.join(key)} to "
                f"{first[0]['count']} rows ({twice.count()} key(s) more than once): a view row comes from several base "
                f"rows (an aggregate) or the key does not tell base rows apart; fix the key or remove 'row_wise' "
                f"from the topic")
        col = cluster_column(spec, work.columns)
        if moved_only and col is not None:
            _, held = spark_io.small_local(spark, every.where(F.col(PART) == "old").select(spark_io.quote(col)).distinct(),
                                           NARROW_VALUES)
            work.held = None if held is None else [r[0] for r in held]
        if work.left is not None:
            work.affected.append((work.left[0], every.where(F.col(PART) == "old").select(*key)))
        work.rederived = out
        work.affected.append(("; ".join(label for label, _ in work.rows) + " (re-derived alone: row_wise)",
                              out.select(*key)))
        work.strategy = dataclasses.replace(work.strategy, reason=f"{work.strategy.reason}; row_wise: {out.count()} rows "
                                                                  f"re-derived from the base rows found, not from the "
                                                                  f"full base")

    def _removed_fallback(self, topic: Topic, work: MergeWork, exc: BaseException) -> None:
        """The previous version of a changed input, or its change feed, was removed (VACUUM, log
        retention): the rows' old groups are unknown, so only a recompute is exact."""
        work.strategy = Strategy(False, f"full recompute because a previous version of {', '.join(work.strategy.reverse)} "
                                        f"cannot be read ({first_line(exc)[:300]})", fallback=True)
        work.affected.clear()
        work.contributions.clear()
        work.alone.clear()
        work.rows.clear()
        work.left = None
        self._refuse_strict(topic, work.strategy)

    def _newest_commit(self, topic: Topic, dest: str) -> delta_log.CommitStats | None:
        """The newest commit of ``topic`` in the view's log (None: none, or it cannot be read)."""
        seq = protocol.recorded_seq(dest, topic.name)
        try:
            return delta_log.find_txn_commit(dest, data_app_id(topic.name), seq) if seq else None
        except delta_log.CommitUnavailableError:
            return None

    def _appends(self, topic: Topic, work: MergeWork, last: Position) -> bool:
        """Whether a row-wise unit of new base rows only can append its rows instead of MERGEing
        them: its keys name base rows after ``last``, which the view holds none of when its newest
        commit, the newest of the table, is this topic's with ``next`` at ``last`` (not a range
        restated by ``offsets reset``, not a view another writer changed since), and the rows have
        the view's column types (a MERGE casts, an append would not)."""
        if work.rederived is None or work.strategy.reverse or work.late_rows:
            return False
        dest = self.engine.path(topic.spec.destination)
        commit = self._newest_commit(topic, dest)
        if (commit is None or work.view is None or commit.version != work.view.version
                or commit.user_metadata.get("next") != last.to_text()):
            return False
        return work.view_types == {f.name: f.dataType for f in work.rederived.schema.fields}

    def _not_added(self, topic: Topic, dest: str, last: Position) -> str:
        """Why an additive view cannot take contributions now ("" when it can): it must hold exactly
        the base rows up to ``last``, made by this transform and declaration, or adding would count
        rows twice (a range restated by ``offsets reset``) or mix two definitions (an edited
        transform, ``additive`` declared on a view built without it). Read from the newest commit
        of the topic in the view's log (its ``next`` and :func:`additive_fingerprint`)."""
        commit = self._newest_commit(topic, dest)
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

    def _changed_rows(self, topic: Topic, work: MergeWork) -> list[tuple[DataFrame, list[str], list[Any] | None]]:
        """Per input changed by reverse join: its changed rows' join values (change feed, before
        and after images) under the base's column names, the base columns, and the rows if collected."""
        spark, spec = self.engine.spark, topic.spec
        by_table = {c.table: c for c in work.changes}
        out: list[tuple[DataFrame, list[str], list[Any] | None]] = []
        for table in work.strategy.reverse:
            pairs, c = spec.join_keys[table], by_table[table]
            feed = (spark.read.format("delta").option("readChangeFeed", "true")
                    .option("startingVersion", (c.old or 0) + 1).option("endingVersion", c.new).load(self.engine.path(table)))
            changed, values = spark_io.small_local(spark, feed.select(*[feed[i].alias(b) for b, i in pairs.items()])
                                                   .distinct(), LOCAL_KEYS)
            out.append((changed, list(pairs), values))
        return out

    def _moved(self, topic: Topic, work: MergeWork, *, held: DataFrame, pinned: dict[str, str], tag: str,
               out_of: Callable[[str, DataFrame, dict[str, str]], DataFrame]) -> None:
        """An additive view's contributions of the changed inputs (see :meth:`derive`) into
        ``work.contributions``: the base rows the view holds (``held``: up to ``last``, late rows
        left out, they are added whole) that join a changed row, once with the inputs at the
        versions the view applied (their old groups, subtracted) and once at the new versions (their
        new groups, added). Rows after ``last`` are the block's, added at the new versions already."""
        moved = _matching_any(held, self._changed_rows(topic, work))
        # computed once (one scan of the base), read by both transforms; kept in Spark, so any
        # number of rows and every column type
        moved = moved.localCheckpoint(eager=True)
        before, left, joined = self._before(topic, work, pinned, tag)
        work.contributions.append((left, -1, out_of("tm_left", moved, before)))
        work.contributions.append((joined, 1, out_of("tm_joined", moved, pinned)))
        work.alone = self._alone(topic, work, held, tag, [before, pinned])

    def _before(self, topic: Topic, work: MergeWork, pinned: dict[str, str],
                tag: str) -> tuple[dict[str, str], str, str]:
        """For a reverse join: the tables the transform reads with every changed input at the version
        the view applied (the others as ``pinned``), and the labels of the rows' old and new groups."""
        by_table, reverse = {c.table: c for c in work.changes}, work.strategy.reverse
        before = {**pinned, **self._pin(work, topic, {t: by_table[t].old or 0 for t in reverse}, f"tm_old_{tag}")}
        old = ", ".join(f"{t} version {by_table[t].old}" for t in reverse)
        new = ", ".join(f"{t} version {by_table[t].new}" for t in reverse)
        return before, f"base rows joining a changed row, before ({old})", f"base rows joining a changed row, after ({new})"

    def _alone(self, topic: Topic, work: MergeWork, base: DataFrame, tag: str,
               tables: list[dict[str, str]]) -> list[DataFrame]:
        """The transform over no base rows (``base``'s columns), once per entry of ``tables``: the rows
        the other inputs make alone (an outer join keeping a reference row without base rows)."""
        spark = self.engine.spark
        nothing = self._view(spark, work, f"tm_none_{tag}", base.where("false"))
        return [spark_io.transform(spark, topic, nothing, view=work.views[-1], tables=t) for t in tables]

    def _reverse(self, topic: Topic, work: MergeWork, *, last: Position, everything: DataFrame,
                 pinned: dict[str, str], tag: str, keys_of: Callable[[str, DataFrame, dict[str, str]], DataFrame],
                 base: delta_meta.TableSnapshot | None) -> None:
        """The affected keys of the changed inputs (see :meth:`derive`) into ``work.affected``.
        ``base``: the base table as planned, when a row-wise unit may look for the base rows joining
        a changed row in the view (:meth:`_in_view`); None: scan the base."""
        from pyspark.sql import functions as F

        spec = topic.spec
        # Base rows joining a changed reference row: those up to ``last`` (what the view holds)
        # left their old groups; those up to ``next`` join their new ones.
        changed_rows = self._changed_rows(topic, work)
        if spec.row_wise and base is not None and (found := self._in_view(topic, work, last, everything, base,
                                                                         changed_rows, pinned, tag)) is not None:
            # the rows up to ``next`` are those and the block's, which the unit re-derives anyway
            moved_old = found.select(*[F.col(spark_io.quote(c)) for c in everything.columns])
            before, left, joined = self._before(topic, work, pinned, tag)
            work.found = found
            work.left = (f"{left}, found in the view", moved_old, before)
            work.rows.append((f"{joined}, found in the view", moved_old))
            return
        moved_new = functools.reduce(lambda a, b: a.unionByName(b),
                                     [_matching(everything, changed, cols, values) for changed, cols, values in changed_rows])
        # One scan of the base where there were two: the rows up to ``next`` are computed once and
        # kept in Spark (any number of rows, every column type, no timestamp through Python's local
        # time), and those up to ``last`` taken from them.
        moved_new = moved_new.localCheckpoint(eager=True)
        moved_old = blocks.upto(moved_new, last)
        before, left, joined = self._before(topic, work, pinned, tag)
        if spec.row_wise:  # their old and new rows are derived with the unit's other rows (_row_wise)
            work.left = (left, moved_old, before)
            work.rows.append((joined, moved_new))
            return
        work.affected.append((left, keys_of("tm_left", moved_old, before)))
        work.affected.append((joined, keys_of("tm_joined", moved_new, pinned)))
        old_alone, new_alone = self._alone(topic, work, everything, tag, [before, pinned])
        work.affected.append(("rows of the changed inputs alone (no base row)",
                              new_alone.exceptAll(old_alone).unionByName(old_alone.exceptAll(new_alone)).select(*spec.key)))

    def _in_view(self, topic: Topic, work: MergeWork, last: Position, everything: DataFrame,
                 base: delta_meta.TableSnapshot, changed_rows: list[tuple[DataFrame, list[str], list[Any] | None]],
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
        (:meth:`_check_found`): the transform over their base columns, at the versions the view
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
        dest = self.engine.path(spec.destination)
        commit = self._newest_commit(topic, dest)
        if commit is None or commit.version != view.version or commit.user_metadata.get("next") != last.to_text():
            return None
        if not set(spec.key) <= set(everything.columns):  # a key of base columns: a view row per base row at most
            return None
        held = view.row_count
        if held is None or delta_meta.deletion_vectors(view).feature or held != delta_meta.count_upto(base, last):
            return None
        if not copies_base(self.engine.spark, topic, everything, pinned, f"tm_probe_{tag}", work.views):
            return None
        rows = self.engine.spark.read.format("delta").option("versionAsOf", view.version).load(dest)
        return _matching_any(rows, changed_rows).localCheckpoint(eager=True)

    def _check_found(self, work: MergeWork, old: DataFrame) -> None:
        """The rows :meth:`_in_view` found against ``old``, the transform over their base columns at
        the versions the view applied, in the view's column types: the same rows, each as often, or
        :class:`NotInViewError` (the unit then scans the base as for any view)."""
        from pyspark.sql import functions as F

        found = work.found
        if found is None:
            return
        again = old.select(*[F.col(spark_io.quote(c)).cast(work.view_types[c]).alias(c) for c in found.columns])
        differ = again.exceptAll(found).unionByName(found.exceptAll(again))
        if not differ.isEmpty():
            raise NotInViewError(
                f"the base rows joining a changed row were looked up in the view, but the transform over its rows' base "
                f"columns does not give those rows back ({differ.count()} row(s) differ), so they were read from the base")
        work.strategy = dataclasses.replace(work.strategy, reason=f"{work.strategy.reason}; the base rows joining a "
                                                                  f"changed row found in the view, not by a scan of "
                                                                  f"the base")

    def _pin(self, work: MergeWork, topic: Topic, versions: dict[str, int], prefix: str) -> dict[str, str]:
        """Temporary views of the inputs ``topic``'s SQL reads, each at the given Delta version:
        lineage table -> view name (for :func:`spark_io.transform`'s ``tables``)."""
        return view_inputs.pin_inputs(self.engine, topic, versions, prefix, work.views)

    def _view(self, spark: SparkSession, work: MergeWork, name: str, df: DataFrame) -> DataFrame:
        df.createOrReplaceTempView(name)
        work.views.append(name)
        return df

    def _base(self, spark: SparkSession, topic: Topic, planned: Planned, *, upto: bool, last_only: bool = False) -> DataFrame:
        """Base rows at the planned version: every row up to ``next`` (``upto``; only those up to
        ``last`` with ``last_only``), else the block's rows ``(last, next]``."""
        block = planned.block
        if block is None:
            raise ProcessingError(f"topic '{topic.name}': a unit without bounds")
        if not upto:
            return blocks.block_df(self.engine, topic.spec.base, block, planned.source_version)
        return blocks.rows_upto(spark, self.engine.path(topic.spec.base), block.last if last_only else block.next,
                         planned.source_version)

    def _verify(self, topic: Topic) -> dict[str, Any]:
        """``checks.verify_sample`` random keys of the view against a recompute (the ``exact`` check)."""
        from platform_assets.views.verify import verify

        try:
            v = verify(self.engine, topic, sample=topic.spec.checks.verify_sample, show=1)
        except Exception as exc:  # noqa: BLE001 - the unit has landed; the check reports the failure
            return {"error": first_line(exc)[:500]}
        example = ", ".join(f"{k}={val!r}" for k, val in zip(v.key, v.examples[0][0], strict=True)) if v.examples else None
        return {"keys": v.keys_compared, "differing": v.differing, "duplicates": v.duplicates, "example": example}

    def _refuse_strict(self, topic: Topic, strategy: Strategy) -> None:
        from lineage.spec.model import Refresh
        from lineage.views.refresh import RefreshRefused

        if topic.spec.refresh is Refresh.STRICT and not strategy.incremental:
            raise RefreshRefused(f"topic '{topic.name}': refresh: incremental_strict refuses a {strategy.reason}")

    def finish(self, opened: OpenBlock) -> StepResult:
        eng = self.engine
        topic, planned, block, work = opened.topic, opened.planned, opened.block, opened.merge
        if block is None or not isinstance(work, MergeWork):
            raise ProcessingError(f"topic '{topic.name}': unit {opened.seq} was opened without bounds")
        spec = topic.spec
        dest = eng.path(spec.destination)
        app_id = data_app_id(topic.name)
        rec = eng.store.get(topic.name)
        inputs = dict(rec.inputs_next or {}) if rec is not None else {}
        landed = opened.landed
        recovered = landed is not None
        if landed is None:
            if opened.out is None:
                raise ProcessingError(f"topic '{topic.name}': unit {block.seq} has no output to write")
            meta = protocol.commit_metadata(topic, block.seq, last=block.last, next_=block.next,
                                            source_version=planned.source_version, run_id=eng.run_id, owner=eng.owner,
                                            inputs=inputs, strategy=work.strategy.name,
                                            **({"additive": additive_fingerprint(topic)} if spec.additive else {}))
            try:
                with eng.phases.timed("write"):
                    if work.view is not None and work.view.table is not None:  # deletion vectors as its option says
                        done = spark_io.set_deletion_vectors(eng.spark, dest, spec.deletion_vectors, work.view)
                        if done:
                            log.info("topic %s: %s (deletion_vectors: %s)", topic.name, done,
                                     str(spec.deletion_vectors).lower())
                    if work.adds:
                        add = additive(topic)
                        spark_io.add_into(eng.spark, opened.out, dest, key=list(spec.key), count=add.count, sums=add.sums,
                                          types=work.types, delete_missing=spec.delete_missing, app_id=app_id,
                                          seq=block.seq, meta=meta, target_filter=work.prune)
                    elif work.append:
                        spark_io.save_unit(opened.out.write.format("delta").mode("append"), dest, app_id=app_id,
                                           seq=block.seq, meta=meta)
                    elif work.strategy.incremental:
                        spark_io.merge_into(eng.spark, opened.out, dest, key=list(spec.key), columns=work.columns,
                                            present=PRESENT, delete_missing=spec.delete_missing, app_id=app_id,
                                            seq=block.seq, meta=meta, target_filter=work.prune)
                    else:
                        spark_io.save_unit(
                            opened.out.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
                            # deletion vectors only when opted in: the deltalake reader (pandas, polars) cannot read them
                            .option("delta.enableChangeDataFeed", "true")
                            .option(spark_io.DELETION_VECTORS, str(spec.deletion_vectors).lower()),
                            dest, app_id=app_id, seq=block.seq, meta=meta)
                    eng.register(spec.destination)
                    landed = delta_log.find_txn_commit(dest, app_id, block.seq)
            finally:
                for view in work.views:
                    eng.spark.catalog.dropTempView(view)
            if landed is None:  # a MERGE with nothing to change still commits; a missing commit is a bug
                raise ProcessingError(f"topic '{topic.name}': unit {block.seq} was written but its commit is not in {dest}/_delta_log")
        faults.crashpoint("written")
        m = landed.metrics
        figures: dict[str, Any] = {
            "strategy": landed.user_metadata.get("strategy", work.strategy.name), "strategy_reason": work.strategy.reason,
            "rows_inserted": m.get("numTargetRowsInserted", m.get("numOutputRows", landed.rows)),
            "rows_updated": m.get("numTargetRowsUpdated", 0), "rows_deleted": m.get("numTargetRowsDeleted", 0),
            "keys_rederived": m.get("numSourceRows"), "late_rows": work.late_rows,
            "reference_rows_changed": {c.table: c.changed_rows for c in work.changes if c.changed},
            "fallback": work.strategy.fallback,
            **({"estimate_incremental_bytes": work.strategy.estimate.incremental,
                "estimate_full_bytes": work.strategy.estimate.full} if work.strategy.estimate is not None else {}),
            "offset_age_s": blocks.offset_ages(eng, topic, block.next, inputs),
        }
        written = int(figures["rows_inserted"] or 0) + int(figures["rows_updated"] or 0)
        with eng.phases.timed("log"):
            entry = protocol.log_entry(topic, block.seq, block.last.to_text(), block.next.to_text(), landed,
                                       base_rows=max(planned.base_rows, 0), bad_rows=planned.bad_rows,
                                       duration=time.monotonic() - opened.started,
                                       figures=spark_io.BlockFigures(written, {}), run_id=eng.run_id, now=eng.clock(),
                                       strategy=str(figures["strategy"]), detail=work.strategy.reason,
                                       changes={k: int(v) for k, v in figures.items()
                                                if k.startswith(("rows_", "keys_", "late_", "estimate_")) and v is not None})
            write_etl_log(eng.settings, entry)
        faults.crashpoint("logged")
        if spec.after:
            with eng.phases.timed("after"):
                spark_io.run_statements(eng.spark, topic, "after")
        with eng.phases.timed("commit"):
            eng.store.commit(topic.name, eng.owner, seq=block.seq, last=block.last, next=block.next, rows=written,
                             note=f"{figures['strategy']}: {work.strategy.reason} delta_version={landed.version}"
                                  + (" (recovered after crash)" if recovered else ""), delta_version=landed.version)
        faults.crashpoint("committed")
        if spec.checks.verify_sample:
            with eng.phases.timed("verify"):
                figures["verify"] = self._verify(topic)
        return StepResult(topic.name, True, f"unit {block.seq} ({figures['strategy']})", block=block, rows=written,
                          base_rows=max(planned.base_rows, 0), bad_rows=planned.bad_rows, delta_version=landed.version,
                          duration_s=time.monotonic() - opened.started, recovered=recovered,
                          stats={**protocol.stats_dict(entry), **figures, "warnings": list(planned.warnings)})


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
        cond = one_of(spark_io.quote(c), values) if len(values) <= NARROW_VALUES else None
        if cond is not None:  # else many values, or a type without exact literal text: the semi join alone
            rows = rows.where(F.expr(cond))
    return rows


def one_of(column: str, values: Collection[Any]) -> str | None:
    """SQL text: ``column`` (as written) equals one of ``values``, a null by ``IS NULL``; ``FALSE``
    for no values. None when a value has no exact literal text (:func:`spark_io.sql_literal`)."""
    texts = [spark_io.sql_literal(v) for v in values if v is not None]
    if None in texts:
        return None
    conds = ([f"{column} IN ({', '.join(t for t in texts if t is not None)})"] if texts else []) \
        + ([f"{column} IS NULL"] if None in values else [])
    return " OR ".join(conds) or "FALSE"


#: Column metadata that marks a base column, to see which view columns the transform copies from it.
BASE_COLUMN = "tidemark_base_column"


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


class NotInViewError(Exception):
    """The rows a row-wise unit found in the view are not the transform over their base columns."""


def _removed(exc: BaseException) -> bool:
    """Whether ``exc`` says a Delta version, change-feed file or data file no longer exists."""
    text = str(exc)
    return any(s in text for s in ("FileNotFound", "DELTA_FILE_NOT_FOUND", "VERSION_NOT_FOUND", "does not exist",
                                   "CHANGE_DATA_NOT_RECORDED", "DELTA_CHANGE_DATA_FILE_NOT_FOUND", "cannot time travel"))


#: Up to this many changed values of a single join column filter the view by a literal list, which
#: Delta's data skipping uses (a semi join reads every file).
IN_LIST = 1_000


def _matching(view: DataFrame, changed: DataFrame, cols: list[str], rows: list[Any] | None) -> DataFrame:
    """Rows of ``view`` whose ``cols`` match a row of ``changed`` (null-safe); ``rows``: ``changed``'s
    rows when they were collected."""
    cond = _listed(cols, rows)
    return view.where(cond) if cond is not None else spark_io.semi_join(view, changed, cols)


def _listed(cols: list[str], rows: list[Any] | None) -> Column | None:
    """A row matches one of ``rows`` (the changed rows, collected) on its single column ``cols``, as
    a literal list Delta's data skipping uses (null-safe); None when not collected, several columns
    or more than :data:`IN_LIST` rows."""
    if len(cols) != 1 or rows is None or len(rows) > IN_LIST:
        return None
    from pyspark.sql import functions as F

    values = [r[0] for r in rows]
    col = F.col(spark_io.quote(cols[0]))
    known = [v for v in values if v is not None]
    cond = col.isin(known) if known else F.lit(False)
    return cond | col.isNull() if len(known) < len(values) else cond


def _matching_any(view: DataFrame, changed: list[tuple[DataFrame, list[str], list[Any] | None]]) -> DataFrame:
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


def _clustered(full: DataFrame, spec: TopicSpec, base_rows: int | None) -> DataFrame:
    """The initial build range-partitioned by the view column of its first ``join_keys`` into files
    of ~``CLUSTER_ROWS`` rows: the rows a few input rows map to then share a few files, so a reverse
    join's MERGE (copy-on-write) rewrites those files, not every file. Small views stay as they are.
    Later full recomputes are plain (a shuffle of every row would cost more than the recompute)."""
    col = cluster_column(spec, full.columns)
    files = min(CLUSTER_FILES, (base_rows or 0) // CLUSTER_ROWS)
    return full.repartitionByRange(files, col) if col is not None and files > 1 else full
