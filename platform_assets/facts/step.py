"""The step processor: a topic's base table, block by block (the design's "How a step runs").

Under the topic's lock (taken, and the record reconciled with the Delta log, by the engine):

1. if a block is pending (planned, not committed) redo exactly it; otherwise ask the planner,
   find the block's end from the data (JVM-free, on one snapshot of the base) and store
   ``next`` and ``seq`` *before* writing; rows no block can take are quarantined;
2. if the destination's Delta log already records ``(tidemark:<topic>, seq)`` the data landed
   before a crash: skip to 4;
3. ``before`` SQL, the transforms over the ``block`` view (the base at the planned snapshot), one
   Delta append carrying ``txnAppId``/``txnVersion`` and the self-describing ``userMetadata``;
4. the block's figures into ``etl.log``, ``after`` SQL, then ``last := next``.

A crash anywhere leaves either nothing, or a Delta commit the retry recognises: every base
row's output lands exactly once.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lineage.core.errors import ProcessingError
from lineage.core.positions import Block
from lineage.planning.planner import Decision
from lineage.spec.model import Topic
from platform_assets.core import blocks, driver_writes, faults, protocol, spark_io, table_reads
from platform_assets.core.protocol import OpenBlock, Planned, StepResult, data_app_id
from resources.state.offsets import OffsetRecord
from resources.storage import delta_log, delta_meta
from resources.storage.meta_tables import write_etl_log

if TYPE_CHECKING:
    from platform_assets.core.context import UnitContext


@dataclass(frozen=True)
class Look:
    """A step topic's look at its base table: the record, the decision made on it and the base
    snapshot it read. Taken before the lock, and reused under the lock if the record is unchanged."""

    rec: OffsetRecord
    decision: Decision
    base: delta_meta.TableSnapshot


def pending(rec: OffsetRecord) -> Planned:
    """The block planned in ``rec`` and not committed: the next run redoes exactly it."""
    block = Block(rec.topic, rec.seq, rec.last, rec.next)  # type: ignore[arg-type]
    return Planned(block, f"retry block {rec.seq}", retry=True, source_version=rec.source_version)


class StepProcessor:
    """Plans, opens and lands the blocks of step topics for one engine (its :class:`UnitContext`);
    :meth:`Engine.plan_block` plans a block outside a unit, under the lock it takes."""

    def __init__(self, engine: UnitContext) -> None:
        self.engine = engine

    # ----------------------------------------------------------------- planning
    def look(self, topic: Topic, rec: OffsetRecord) -> Look:
        """Open the base table once and decide whether the topic may plan a block on it. Only the
        decision needs the base's mark, so it is exact only where the decision depends on it."""
        # never older than the version the record's last block was planned on (a snapshot the
        # planner's tick opened before another process committed a block)
        base = delta_meta.TableSnapshot.open(self.engine.path(topic.spec.base), at_least=rec.source_version)
        decision, _ = self.engine.decide(topic, rec, mark=delta_meta.table_mark(base, newer_than=rec.last))
        return Look(rec, decision, base)

    def plan_locked(self, topic: Topic, rec: OffsetRecord, look: Look | None = None, *, release: bool = False,
                    flush: bool = True) -> Planned:
        """With the topic's lock held: the pending block, or plan the next one (JVM-free) on one
        snapshot of the base table, which the block then reads. ``look``: what was seen just
        before taking the lock, reused if the record is unchanged. ``release``: a new block is
        planned with the lock released in the same transaction (the caller releases it otherwise).
        ``flush=False``: the plan does not wait for the disk (see :meth:`OffsetStore.plan`)."""
        eng = self.engine
        if rec.pending:
            return pending(rec)
        if look is None or (look.rec.last, look.rec.seq, look.rec.next) != (rec.last, rec.seq, rec.next):
            look = self.look(topic, rec)
        base, decision = look.base, look.decision
        bad_rows, warnings = blocks.quarantine(eng, topic, rec, base)
        if not decision.ready:
            return Planned(None, decision.reason, bad_rows=bad_rows, warnings=warnings)
        found = eng.block_end(topic, rec, decision, base)
        if found.end is None:
            return Planned(None, decision.limit, bad_rows=bad_rows, warnings=warnings)
        seq = protocol.next_seq(rec, eng.path(topic.spec.destination), topic.name)
        rec = eng.store.plan(topic.name, eng.owner, last=rec.last, next=found.end, seq=seq, source_version=found.version,
                             release=release, flush=flush)
        return Planned(Block(topic.name, seq, rec.last, found.end), f"block {seq}", base_rows=found.rows,
                       bad_rows=bad_rows, source_version=found.version, warnings=warnings)

    # ----------------------------------------------------------------- processing
    def open(self, topic: Topic, rec: OffsetRecord, seq: int | None) -> OpenBlock | StepResult:
        """Block ``seq`` (it must be the pending block), or with ``seq=None`` the pending block or a
        newly planned one, prepared up to the write."""
        if seq is None:
            with self.engine.phases.timed("plan"):
                planned = self.plan_locked(topic, rec)
            if planned.block is None:
                return StepResult(topic.name, False, planned.reason, bad_rows=planned.bad_rows)
            return self._open(topic, planned)
        if rec.pending and rec.seq == seq:
            return self._open(topic, pending(rec))
        if not rec.pending and 0 < seq <= rec.seq:
            return StepResult(topic.name, False, f"block {seq} already committed (topic is at block {rec.seq})")
        state = f"block {rec.seq} pending" if rec.pending else f"last committed block {rec.seq}"
        raise ProcessingError(
            f"topic '{topic.name}': block {seq} is not planned ({state}); plan the next block with: tidemark plan {topic.name}"
        )

    def _open(self, topic: Topic, planned: Planned) -> OpenBlock:
        """Find out whether the block landed before a crash, else run ``before`` SQL and build the
        transform's output over the block's snapshot."""
        eng = self.engine
        started = time.monotonic()
        block = planned.block
        if block is None:
            raise ProcessingError(f"topic '{topic.name}': nothing to process ({planned.reason})")
        faults.crashpoint("planned")
        landed = (delta_log.find_txn_commit(eng.path(topic.spec.destination), data_app_id(topic.name), block.seq)
                  if planned.retry else None)
        out = None
        if landed is None:
            if planned.retry and planned.source_version is not None:
                planned = self.reroute(topic, planned)
            with eng.phases.timed("transform"):
                eng.register_tables(topic)
                block_df = blocks.block_df(eng, topic.spec.base, block, planned.source_version, planned.snapshot)
                spark_io.run_statements(eng.spark, topic, "before")
                out = spark_io.transform(eng.spark, topic, block_df, tables=self._joined(topic),
                                         paths={t: eng.path(t) for t in topic.spec.depends_on})
            faults.crashpoint("transformed")
        return OpenBlock(topic, planned, started, block.seq, out=out, landed=landed)

    def _joined(self, topic: Topic) -> dict[str, str]:
        """The other inputs the block's SQL reads (``depends_on`` after the base), pinned at their
        newest versions as temporary views (:func:`table_reads.pin_inputs`): read as one version,
        from its files where it is plain, not through Spark's state of a table that changed since the
        last block. An input without a table yet is left to the catalog (its error names it)."""
        eng = self.engine
        versions = {t: v for t in topic.spec.depends_on[1:]
                    if (v := delta_meta.TableSnapshot.open(eng.path(t)).version) is not None}
        # one name per topic: a unit of another topic on this session cannot replace them before this
        # block's output is written (Spark Connect resolves a view when the write runs)
        return table_reads.pin_inputs(eng, topic, versions, "tm_step_in_" + re.sub(r"\W", "_", topic.name), [])

    def finish(self, opened: OpenBlock) -> StepResult:
        eng = self.engine
        topic, planned, block = opened.topic, opened.planned, opened.block
        if block is None:
            raise ProcessingError(f"topic '{topic.name}': block {opened.seq} was opened without bounds")
        spec = topic.spec
        dest = eng.path(spec.destination)
        app_id = data_app_id(topic.name)
        landed = opened.landed
        recovered = landed is not None  # written before a crash: only the offset must catch up
        observed: spark_io.BlockObservation | spark_io.Counted | None = None
        if landed is None:
            if opened.out is None:
                raise ProcessingError(f"topic '{topic.name}': block {block.seq} has no output to write")
            meta = protocol.commit_metadata(topic, block.seq, last=block.last, next_=block.next,
                                            source_version=planned.source_version, run_id=eng.run_id, owner=eng.owner)
            with eng.phases.timed("write"):
                observed = driver_writes.write_unit(opened.out, dest, mode="append", options={"mergeSchema": "true"},
                                                    input_rows=planned.base_rows, app_id=app_id, seq=block.seq, meta=meta,
                                                    one_file=True)
                eng.register(spec.destination)
                landed = delta_log.find_txn_commit(dest, app_id, block.seq)
            if landed is None:
                raise ProcessingError(f"topic '{topic.name}': block {block.seq} was written but its commit is not in {dest}/_delta_log")
        faults.crashpoint("written")
        with eng.phases.timed("log"):
            base_rows = planned.base_rows
            if base_rows < 0:
                try:
                    base_rows = delta_meta.count_block(eng.path(spec.base), block.last, block.next, planned.source_version)
                except delta_meta.RemovedDataError:  # landed before a crash, its snapshot vacuumed since: a figure lost
                    base_rows = 0
            entry = protocol.log_entry(topic, block.seq, block.last.to_text(), block.next.to_text(), landed, base_rows=base_rows,
                                       bad_rows=planned.bad_rows, duration=time.monotonic() - opened.started,
                                       figures=protocol.block_figures(dest, landed, observed, eng.run_id), run_id=eng.run_id,
                                       now=eng.clock())
            write_etl_log(eng.settings, entry)
        faults.crashpoint("logged")
        if spec.after:
            with eng.phases.timed("after"):
                eng.register_tables(topic)
                blocks.block_df(eng, spec.base, block, planned.source_version, planned.snapshot)
                spark_io.run_statements(eng.spark, topic, "after")
        note = f"rows={landed.rows} delta_version={landed.version}" + (" (recovered after crash)" if recovered else "")
        with eng.phases.timed("commit"):
            eng.store.commit(topic.name, eng.owner, seq=block.seq, last=block.last, next=block.next, rows=landed.rows,
                             note=note, delta_version=landed.version)
        faults.crashpoint("committed")
        return StepResult(topic.name, True, f"block {block.seq}", block=block, rows=landed.rows, base_rows=base_rows,
                          bad_rows=planned.bad_rows, delta_version=landed.version, duration_s=time.monotonic() - opened.started,
                          recovered=recovered, stats={**protocol.stats_dict(entry), "warnings": list(planned.warnings)})

    def reroute(self, topic: Topic, planned: Planned) -> Planned:
        """``planned`` (a block planned earlier, to be read at the base snapshot it was planned on)
        with the route to that snapshot's rows when OPTIMIZE and VACUUM removed its files since
        (see :func:`resources.storage.history.snapshot_read`); this topic stops, saying what to run,
        when no route is exact."""
        block = planned.block
        if block is None or planned.source_version is None:
            return planned
        try:
            route = delta_meta.snapshot_read(self.engine.path(topic.spec.base), planned.source_version, block.last, block.next)
        except delta_meta.RemovedDataError as exc:
            raise ProcessingError(
                f"topic '{topic.name}': block {block.seq} was planned on {topic.spec.base} version {planned.source_version} and "
                f"cannot be read as planned: {exc}. Nothing of it was written. To plan it again on {topic.spec.base} as it is "
                f"now, run: tidemark offsets reset {topic.name} --to {block.last.to_text()} --reason '...'"
            ) from None
        return dataclasses.replace(planned, snapshot=route) if route.rerouted else planned
