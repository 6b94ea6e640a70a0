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
   added to the view by one MERGE (:func:`platform_assets.views.additive.added_source`). Either way one Delta commit
   carrying ``txnAppId``/``txnVersion`` and the unit's bounds in ``userMetadata``;
3. ``etl.log`` (strategy, reason, rows inserted/updated/deleted, keys re-derived) before the
   offset commit, which moves ``last`` and every input's offset together.

Re-deriving a key from the full inputs makes a unit idempotent: a retry, a restated range
(``offsets reset``) or an input change applied twice gives the same view.

This module runs a unit (open, derive, write, log, commit) and the full recompute; the planning is
:mod:`~platform_assets.views.plan`'s, the strategies are :mod:`~platform_assets.views.reverse`,
:mod:`~platform_assets.views.additive` and :mod:`~platform_assets.views.row_wise`, and what a unit
carries between them :mod:`~platform_assets.views.work`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from lineage.core.errors import ProcessingError, first_line
from lineage.spec.model import LateRows, Topic, TopicSpec
from lineage.views.refresh import CLUSTER_FILES, CLUSTER_ROWS, Strategy, choose, cluster_column
from platform_assets.core import blocks, driver_writes, faults, keyed_merge, protocol, spark_io, table_reads
from platform_assets.core.protocol import OpenBlock, Planned, StepResult, data_app_id
from platform_assets.views import driver_unit
from platform_assets.views.additive import (
    added_source,
    additive,
    additive_fingerprint,
    additive_types,
    why_not_added,
)
from platform_assets.views.plan import MergeLook, merge_look, plan_locked
from platform_assets.views.reverse import (
    changed_rows,
    moved,
    narrow,
    prune,
    removed,
    removed_fallback,
    reverse_join,
)
from platform_assets.views.row_wise import NotInViewError, appends, found_in_view, rederive
from platform_assets.views.work import LOCAL_KEYS, PRESENT, MergeWork, refuse_strict
from resources.state.offsets import OffsetRecord
from resources.storage import delta_log, delta_meta
from resources.storage.meta_tables import write_etl_log

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from platform_assets.core.context import UnitContext

__all__ = ["MergeLook", "MergeProcessor", "MergeWork"]

log = logging.getLogger(__name__)


class MergeProcessor:
    """Plans, opens and lands the units of merge topics for one engine (its :class:`UnitContext`)."""

    def __init__(self, engine: UnitContext) -> None:
        self.engine = engine

    # ----------------------------------------------------------------- planning (no JVM: views.plan)
    def look(self, topic: Topic, rec: OffsetRecord) -> MergeLook:
        """What changed in ``topic``'s inputs since ``rec`` (:func:`platform_assets.views.plan.merge_look`)."""
        return merge_look(self.engine, topic, rec)

    def plan_locked(self, topic: Topic, rec: OffsetRecord) -> Planned:
        """With the lock held: the pending unit, or fix the next one (bounds and every input's version;
        :func:`platform_assets.views.plan.plan_locked`)."""
        return plan_locked(self.engine, topic, rec)

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

    def _build(self, topic: Topic, rec: OffsetRecord, planned: Planned) -> tuple[DataFrame | None, MergeWork]:
        """The unit's strategy and its output: the whole view (full) or the MERGE source
        (incremental); None for a unit run in the driver (its rows are ``work.source``)."""
        from pyspark.sql import functions as F

        spec = topic.spec
        full, work = self.derive(topic, rec, planned, in_driver=True)
        if full is None:  # the unit ran in the driver (driver_unit)
            return None, work
        if not work.strategy.incremental:
            if work.built:  # a recompute as plain as a rebuild can be (clustering it would cost a shuffle of every row)
                return full, work
            rows = delta_meta.TableSnapshot.open(self.engine.path(spec.base), planned.source_version).row_count
            return _clustered(full, spec, rows), work
        key = list(spec.key)
        if work.rederived is not None and planned.block is not None and appends(self.engine, topic, work, planned.block.last):
            work.append = True
            work.strategy = dataclasses.replace(work.strategy, reason=f"{work.strategy.reason}; appended: the view holds "
                                                                      f"no row of base rows after its last")
            return work.rederived, work
        if work.adds:
            try:
                added = added_source(self.engine, topic, work)
            except Exception as exc:
                if not (work.strategy.reverse and removed(exc)):
                    raise
                removed_fallback(topic, work, exc)
                return full, work
            if added is not None:
                return added, work
        every_key = functools.reduce(lambda a, b: a.unionByName(b), [k for _, k in work.affected]).distinct()
        if work.source is not None and work.rederived is not None:  # a row-wise unit's rows in the driver (in_hand)
            work.prune = prune(self.engine, topic, work, key, work.key_rows)
            # the Spark MERGE's source, computed only if it runs (rows of a local checkpoint)
            return spark_io.rows_of_keys(every_key, work.rederived.withColumn(PRESENT, F.lit(True)), key), work
        try:
            keys, key_rows = spark_io.small_local(self.engine.spark, every_key, LOCAL_KEYS)
        except Exception as exc:
            if not (work.strategy.reverse and removed(exc)):
                raise
            removed_fallback(topic, work, exc)
            return full, work
        rederived = (spark_io.semi_join(narrow(full, key, key_rows), keys, key) if work.rederived is None
                     else work.rederived).withColumn(PRESENT, F.lit(True))
        work.prune = prune(self.engine, topic, work, key, key_rows)
        return spark_io.rows_of_keys(keys, rederived, key), work

    def derive(self, topic: Topic, rec: OffsetRecord, planned: Planned,
               in_driver: bool = False) -> tuple[DataFrame | None, MergeWork]:
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

        Nothing is computed yet; the caller drops ``work.views`` when done. ``in_driver``: a unit of
        new base rows only may run in the driver instead (:func:`platform_assets.views.driver_unit.in_driver`;
        then no view is returned and ``work.source`` holds its rows)."""
        eng, spec = self.engine, topic.spec
        block = planned.block
        if block is None or rec.inputs_next is None:
            raise ProcessingError(f"topic '{topic.name}': unit {rec.seq} has no planned bounds")
        dest = eng.path(spec.destination)
        done = rec.inputs.get(spec.base)
        base = delta_meta.TableSnapshot.open(eng.path(spec.base), planned.source_version)
        late = delta_meta.LateRows(pa.table({}))
        if spec.late_rows is LateRows.REDERIVE and done is not None and not block.last.is_zero():
            late = blocks.late_rows(topic, base, done, block.last)
        changes = tuple(delta_meta.input_change(t, eng.path(t), rec.inputs.get(t), upto=rec.inputs_next.get(t))
                        for t in spec.depends_on[1:])
        view = delta_meta.TableSnapshot.open(dest)
        built = bool(rec.inputs) and view.version is not None
        base_rows = planned.base_rows if planned.base_rows >= 0 else delta_meta.count_block(
            eng.path(spec.base), block.last, block.next, planned.source_version)
        sizes = delta_meta.unit_sizes(base, view, changes, spec) if built else None

        def chosen(by_cost: bool) -> Strategy:
            got = choose(spec, built=built, base_rows=base_rows, base_columns=base.columns, late_rows=late.rows.num_rows,
                         changes=changes, python_transform=topic.python, sizes=sizes, by_cost=by_cost)
            if spec.additive is not None and got.incremental and (why := why_not_added(topic, dest, block.last)):
                return Strategy(False, f"full recompute because {why}", fallback=True)
            return got

        strategy = chosen(True)
        work = MergeWork(strategy, changes, late.rows.num_rows, built=built, view=view)
        if in_driver:
            if (driven := driver_unit.in_driver(eng, topic, rec, planned, work, base)) is not None:
                return None, driven
            # the estimate prices Spark's incremental unit; one in the driver costs far less than it says
            if not strategy.incremental and strategy.estimate is not None and (alt := chosen(False)).incremental:
                trial = MergeWork(dataclasses.replace(alt, reason=f"{alt.reason}; not the full recompute the estimate "
                                                                  f"chose: the unit runs in the driver"),
                                  changes, late.rows.num_rows, built=built, view=view)
                if (driven := driver_unit.in_driver(eng, topic, rec, planned, trial, base)) is not None:
                    return None, driven
        eng.register_tables(topic)
        spark = eng.spark
        tag = uuid.uuid4().hex[:10]
        pinned = work.pin(eng, topic, {t: v for t, v in rec.inputs_next.items() if t != spec.base}, f"tm_in_{tag}")
        everything = self._base(spark, topic, planned, upto=True)
        full = spark_io.transform(spark, topic, work.temp_view(f"tm_all_{tag}", everything), view=work.views[-1],
                                  tables=pinned, paths={t: eng.path(t) for t in spec.depends_on})
        work.columns = list(full.columns)
        if spec.additive is not None:
            work.types = additive_types(topic, full)
            work.nullable = frozenset(f.name for f in full.schema.fields if f.nullable and f.name in spec.additive.sums)
        if not strategy.incremental:
            return full, work
        target = table_reads.schema_of(spark, dest)
        work.view_types = {f.name: f.dataType for f in target.fields}
        added = [c for c in full.columns if c not in target.names]
        gone = [c for c in target.names if c not in full.columns]
        if added or gone:  # the transform's columns changed: every row must be recomputed
            why = f"the transform's columns changed (added: {', '.join(added) or '-'}; removed: {', '.join(gone) or '-'})"
            work.strategy = Strategy(False, f"full recompute because {why}", fallback=True)
            refuse_strict(topic, work.strategy)
            return full, work
        key = list(spec.key)
        missing = [k for k in key if k not in full.columns]
        if missing:
            raise ProcessingError(f"topic '{topic.name}' ({topic.where}): key column(s) {', '.join(missing)} are not in the "
                                  f"transform's output ({', '.join(full.columns)})")

        def out_of(name: str, rows: DataFrame, tables: dict[str, str]) -> DataFrame:
            return spark_io.transform(spark, topic, work.temp_view(f"{name}_{tag}", rows), view=work.views[-1],
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

        if spec.additive is not None and not strategy.reverse:  # with a reverse join: at both versions (reverse.moved)
            work.alone = [out_of("tm_none", everything.where("false"), pinned)]
        if block.next > block.last:
            joining(f"{base_rows} new base rows", "tm_new", self._base(spark, topic, planned, upto=False))
        ids, late_ids = None, [int(i) for i in late.rows.column("id").to_pylist()] if late.rows.num_rows else []
        if late_ids:
            ids = spark.createDataFrame([(i,) for i in late_ids], "id bigint")
            late_df = self._base(spark, topic, planned, upto=True, last_only=True).join(ids, "id", "left_semi")
            joining(f"{late.rows.num_rows} late base rows", "tm_late", late_df)
        found_rows, found_keys = list(work.rows), list(work.affected)  # before the reverse join adds to them

        def reverse(base_snapshot: delta_meta.TableSnapshot | None) -> None:
            """The keys (or rows) of the changed inputs: a row-wise view looks for the base rows joining
            a changed row in itself when it may (``base_snapshot``: the base as planned), else the base is scanned."""
            changed = changed_rows(eng, topic, work)
            if spec.row_wise and base_snapshot is not None and found_in_view(
                    eng, topic, work, changed, last=block.last, everything=everything, base=base_snapshot, pinned=pinned,
                    tag=tag):
                return
            reverse_join(eng, topic, work, changed, last=block.last, end=block.next, base=base, everything=everything,
                         pinned=pinned, tag=tag, keys_of=keys_of)

        def row_wise() -> None:
            rederive(eng, topic, work, everything=everything, pinned=pinned, tag=tag, out_of=out_of,
                     moved_only=block.next <= block.last and not late.rows.num_rows)

        if strategy.reverse:
            try:
                held = self._base(spark, topic, planned, upto=True, last_only=True)
                if spec.additive is not None:
                    moved(eng, topic, work, held=held if ids is None else held.join(ids, "id", "left_anti"), base=base,
                          last=block.last, late_ids=late_ids,
                          pinned=pinned, tag=tag, out_of=out_of)
                else:
                    reverse(base)
            except Exception as exc:
                if not removed(exc):
                    raise
                removed_fallback(topic, work, exc)
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
                if not (strategy.reverse and removed(exc)):
                    raise
                removed_fallback(topic, work, exc)
        return full, work

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
            if opened.out is None and not work.driver:
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
                    # (a unit run in the driver: its rows as a Spark source only if deltalake cannot write them)
                    out = opened.out if opened.out is not None else functools.partial(_from_driver, eng.spark, work)
                    if work.adds or (work.driver and spec.additive is not None):
                        add = additive(topic)
                        keyed_merge.merge(eng.spark, keyed_merge.add_clauses(list(spec.key), add.count, add.sums, work.types,
                                                                             spec.delete_missing),
                                          out, dest, app_id=app_id, seq=block.seq, meta=meta,
                                          target_filter=work.prune, rows=work.source,
                                          cluster_by=cluster_column(spec, work.columns))
                    elif work.append:
                        if not (work.source is not None and work.driver and driver_writes.commit_arrow(
                                work.source, dest, mode="append", app_id=app_id, seq=block.seq, meta=meta)):
                            driver_writes.write_unit(out() if callable(out) else out, dest, mode="append", options={},
                                                     input_rows=planned.base_rows, app_id=app_id, seq=block.seq, meta=meta)
                    elif work.strategy.incremental:
                        keyed_merge.merge(eng.spark, keyed_merge.rows_clauses(list(spec.key), work.columns, PRESENT,
                                                                              spec.delete_missing),
                                          out, dest, app_id=app_id, seq=block.seq, meta=meta,
                                          target_filter=work.prune, rows=work.source,
                                          in_hand=work.rederived is not None,  # rows of a local checkpoint
                                          cluster_by=cluster_column(spec, work.columns))
                    else:
                        whole = out() if callable(out) else out
                        held = work.view.row_count if work.view is not None and work.view.table is not None else None
                        if not driver_writes.overwrite_small(whole, dest, expected_rows=held, app_id=app_id, seq=block.seq,
                                                             meta=meta):  # a small view's recompute: from the driver
                            spark_io.save_unit(
                                whole.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
                                .option("delta.enableChangeDataFeed", "true")  # (deletion vectors as the spec says)
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


def _from_driver(spark: SparkSession, work: MergeWork) -> DataFrame:
    """A unit's rows computed in the driver, as a Spark source (where ``deltalake`` cannot write them)."""
    if work.source is None:
        raise ProcessingError("a unit run in the driver without its rows")
    return spark.createDataFrame(work.source)


def _clustered(full: DataFrame, spec: TopicSpec, base_rows: int | None) -> DataFrame:
    """The initial build range-partitioned by the view column of its first ``join_keys`` into files
    of ~``CLUSTER_ROWS`` rows: the rows a few input rows map to then share a few files, so a reverse
    join's MERGE (copy-on-write) rewrites those files, not every file. Small views stay as they are.
    Later full recomputes are plain (a shuffle of every row would cost more than the recompute)."""
    col = cluster_column(spec, full.columns)
    files = min(CLUSTER_FILES, (base_rows or 0) // CLUSTER_ROWS)
    return full.repartitionByRange(files, col) if col is not None and files > 1 else full
