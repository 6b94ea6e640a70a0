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
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lineage.errors import ProcessingError
from lineage.planner import Decision
from lineage.positions import Block, Position
from lineage.spec import Topic
from platform_assets import faults, protocol, spark_io
from platform_assets.protocol import OpenBlock, Planned, StepResult, data_app_id
from resources import delta_meta
from resources.meta_tables import quarantine_rows, write_etl_log
from resources.offsets import OffsetRecord

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from platform_assets.engine import Engine


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
    """Plans, opens and lands the blocks of step topics for one :class:`Engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # ----------------------------------------------------------------- planning
    def plan(self, topic: Topic) -> Planned:
        """Fix the next block in the offset store without processing it (or return the block
        already pending). Never starts Spark."""
        eng = self.engine
        # Read-only look first: a pending block is all in the record, and a topic that waits
        # (the common cases on a sensor tick) costs no lock and no write. Only planning a new
        # block takes the lock, and reuses the look if the record has not changed meanwhile.
        rec = eng.store.get(topic.name) or eng.ensure_offsets(topic)
        look = None
        if not rec.owner:
            if rec.pending:
                return pending(rec)
            look = self.look(topic, rec)
            if not look.decision.ready:
                return Planned(None, look.decision.reason)
        with eng.locked(topic, record_failure=False) as locked_rec:
            return self.plan_locked(topic, locked_rec, look)

    def look(self, topic: Topic, rec: OffsetRecord) -> Look:
        """Open the base table once and decide whether the topic may plan a block on it. Only the
        decision needs the base's mark, so it is exact only where the decision depends on it."""
        base = delta_meta.TableSnapshot.open(self.engine.path(topic.spec.base))
        decision, _ = self.engine.decide(topic, rec, mark=delta_meta.table_mark(base, newer_than=rec.last))
        return Look(rec, decision, base)

    def plan_locked(self, topic: Topic, rec: OffsetRecord, look: Look | None = None) -> Planned:
        """With the topic's lock held: the pending block, or plan the next one (JVM-free) on one
        snapshot of the base table, which the block then reads. ``look``: what was seen just
        before taking the lock, reused if the record is unchanged."""
        eng = self.engine
        if rec.pending:
            return pending(rec)
        if look is None or (look.rec.last, look.rec.seq, look.rec.next) != (rec.last, rec.seq, rec.next):
            look = self.look(topic, rec)
        base, decision = look.base, look.decision
        bad_rows, warnings = self.quarantine(topic, rec, base)
        if not decision.ready:
            return Planned(None, decision.reason, bad_rows=bad_rows, warnings=warnings)
        found = eng.block_end(topic, rec, decision, base)
        if found.end is None:
            return Planned(None, decision.limit, bad_rows=bad_rows, warnings=warnings)
        seq = protocol.next_seq(rec, eng.path(topic.spec.destination), topic.name)
        rec = eng.store.plan(topic.name, eng.owner, last=rec.last, next=found.end, seq=seq, source_version=found.version)
        return Planned(Block(topic.name, seq, rec.last, found.end), f"block {seq}", base_rows=found.rows,
                       bad_rows=bad_rows, source_version=found.version, warnings=warnings)

    def quarantine(self, topic: Topic, rec: OffsetRecord, base: delta_meta.TableSnapshot) -> tuple[int, tuple[str, ...]]:
        """Quarantine rows of the ``base`` snapshot no block can take: null ``pos``/``id``, and
        rows added since the last planned snapshot with a position at or before ``last`` (late,
        out of order). Returns how many rows are newly quarantined, and a warning when late rows
        could not be looked for in commits the log no longer holds."""
        eng = self.engine
        added = 0
        bad = delta_meta.bad_position_rows(base)
        if bad.num_rows:
            added += quarantine_rows(eng.settings, topic.name, topic.spec.base, bad, eng.clock())
        warnings: tuple[str, ...] = ()
        if rec.source_version is not None and not rec.last.is_zero():
            late = self.late_rows(topic, base, rec.source_version, rec.last)
            if late.rows.num_rows:
                added += quarantine_rows(eng.settings, topic.name, topic.spec.base, late.rows, eng.clock(),
                                         after_version=rec.source_version)
            if late.unreadable:
                warnings = (delta_meta.late_detection_warning(topic.spec.base, late.unreadable),)
        return added, warnings

    def late_rows(self, topic: Topic, base: delta_meta.TableSnapshot, after_version: int, last: Position) -> delta_meta.LateRows:
        """Late rows of ``topic``'s base (see :func:`delta_meta.late_rows`). Where the files or
        commits that would tell were removed and no other route is exact, this topic stops (its
        error says what was removed and what to run); other topics go on."""
        try:
            return delta_meta.late_rows(base, after_version, last)
        except delta_meta.RemovedDataError as exc:
            raise ProcessingError(
                f"topic '{topic.name}': {exc}. Rows of {topic.spec.base} added after version {after_version} at or before the "
                f"topic's last ({last.to_text()}) would be late rows, and Tidemark does not guess which they are. To go on "
                f"without looking for them (any such row stays in {topic.spec.base}, neither processed nor quarantined), run: "
                f"tidemark offsets reset {topic.name} --to {last.to_text()} --late-from-now --reason '...'"
            ) from None

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
        landed = (delta_meta.find_txn_commit(eng.path(topic.spec.destination), data_app_id(topic.name), block.seq)
                  if planned.retry else None)
        out = None
        if landed is None:
            if planned.retry and planned.source_version is not None:
                planned = self.reroute(topic, planned)
            with eng.phases.timed("transform"):
                eng.register_tables(topic)
                block_df = self.block_df(topic.spec.base, block, planned.source_version, planned.snapshot)
                spark_io.run_statements(eng.spark, topic, "before")
                out = spark_io.transform(eng.spark, topic, block_df)
            faults.crashpoint("transformed")
        return OpenBlock(topic, planned, started, block.seq, out=out, landed=landed)

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
        observed = None
        if landed is None:
            if opened.out is None:
                raise ProcessingError(f"topic '{topic.name}': block {block.seq} has no output to write")
            meta = protocol.commit_metadata(topic, block.seq, last=block.last, next_=block.next,
                                            source_version=planned.source_version, run_id=eng.run_id, owner=eng.owner)
            with eng.phases.timed("write"):
                out, observed = spark_io.observe_output(opened.out)
                (out.write.format("delta").mode("append")
                 .option("txnAppId", app_id).option("txnVersion", block.seq)
                 .option("mergeSchema", "true").option("userMetadata", meta)
                 .save(dest))
                eng.register(spec.destination)
                landed = delta_meta.find_txn_commit(dest, app_id, block.seq)
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
                self.block_df(spec.base, block, planned.source_version, planned.snapshot)
                spark_io.run_statements(eng.spark, topic, "after")
        note = f"rows={landed.rows} delta_version={landed.version}" + (" (recovered after crash)" if recovered else "")
        with eng.phases.timed("commit"):
            eng.store.commit(topic.name, eng.owner, seq=block.seq, last=block.last, next=block.next, rows=landed.rows,
                             note=note, delta_version=landed.version)
        faults.crashpoint("committed")
        return StepResult(topic.name, True, f"block {block.seq}", block=block, rows=landed.rows, base_rows=base_rows,
                          bad_rows=planned.bad_rows, delta_version=landed.version, duration_s=time.monotonic() - opened.started,
                          recovered=recovered, stats={**protocol.stats_dict(entry), "warnings": list(planned.warnings)})

    def require_snapshot(self, topic: Topic, planned: Planned) -> None:
        """For a unit planned earlier that reads its base snapshot whole (a merge unit): stop this
        topic, saying what to run, when files of that snapshot were deleted by VACUUM since."""
        block = planned.block
        if block is None or planned.source_version is None:
            return
        try:
            route = delta_meta.snapshot_read(self.engine.path(topic.spec.base), planned.source_version, None, block.next)
            problem = "its data files were compacted and then deleted by VACUUM" if route.rerouted else ""
        except delta_meta.RemovedDataError as exc:
            problem = str(exc)
        if problem:
            raise ProcessingError(
                f"topic '{topic.name}': unit {block.seq} was planned on {topic.spec.base} version {planned.source_version} and "
                f"cannot be read as planned: {problem}. Nothing of it was written. To plan it again on the inputs as they "
                f"are now, run: tidemark offsets reset {topic.name} --to {block.last.to_text()} --reason '...'")

    def reroute(self, topic: Topic, planned: Planned) -> Planned:
        """``planned`` (a block planned earlier, to be read at the base snapshot it was planned on)
        with the route to that snapshot's rows when OPTIMIZE and VACUUM removed its files since
        (see :func:`delta_meta.snapshot_read`); this topic stops, saying what to run, when no
        route is exact."""
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

    def block_df(self, base: str, block: Block, version: int | None,
                 snapshot: delta_meta.SnapshotRead | None = None) -> DataFrame:
        """Rows of ``base`` inside ``(last, next]``, registered as the temp view ``block``.

        The block reads the snapshot it was planned on (Delta time travel to ``version``), so a
        retry sees exactly the same rows and a row that lands later in an already-planned range
        is detected as late instead of silently joining or missing a block. The plain range on
        ``pos`` lets Delta skip files by statistics; the tuple comparison cuts exactly. ``snapshot``:
        that version's files were compacted and deleted by VACUUM, so its rows are read from a newer
        version by id (:func:`delta_meta.snapshot_read`)."""
        from pyspark.sql import functions as F

        spark = self.engine.spark  # F.lit needs an active session
        # Bounds as epoch microseconds: the same instants whatever the session's time zone.
        lp, li = spark_io.ts_literal(block.last.pos), F.lit(block.last.id).cast("bigint")
        np_, ni = spark_io.ts_literal(block.next.pos), F.lit(block.next.id).cast("bigint")
        pos, id_ = F.col("pos"), F.col("id")
        reader = spark.read.format("delta")
        if snapshot is not None:
            version = snapshot.read_version
        if version is not None:
            reader = reader.option("versionAsOf", version)
        df = (reader.load(self.engine.path(base))
              .where((pos >= lp) & (pos <= np_) & id_.isNotNull())  # a row without an id is quarantined instead
              .where(((pos > lp) | (id_ > li)) & ((pos < np_) | (id_ <= ni))))
        if snapshot is not None and snapshot.max_id is not None:
            df = df.where(id_ <= F.lit(snapshot.max_id).cast("bigint"))
        df.createOrReplaceTempView("block")
        return df
