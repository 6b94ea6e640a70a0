"""The step and reload processors on Spark + Delta: the design's "How a step runs".

A step of a topic:

1. take the topic's lock in the offset store (one run per topic; a second gets
   :class:`TopicLockedError` naming the holder);
2. if a block is pending (planned, not committed) redo exactly it; otherwise ask the planner,
   find the block's end from the data and store ``next`` and ``seq`` *before* writing;
3. if the destination's Delta log already records the transaction ``(tidemark:<topic>, seq)``
   the data landed before a crash: skip to 5;
4. ``before`` SQL, the transforms over the ``block`` view, one Delta append carrying
   ``txnAppId=tidemark:<topic>``, ``txnVersion=seq`` (Delta itself refuses a second copy);
5. per-block statistics from the commit's own file statistics into ``etl.log`` (idempotent
   too), ``after`` SQL, then ``last := next`` in the offset store, and release the lock.

A crash anywhere leaves either nothing, or a Delta commit the retry recognises: every base
row's output lands exactly once.
"""

from __future__ import annotations

import datetime as dt
import importlib
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lineage.errors import OffsetError, ProcessingError, TidemarkError, TopicLockedError
from lineage.planner import Decision, TableMark, TopicState, lag_seconds, plan_topic
from lineage.positions import Block, Position
from lineage.spec import Lineage, Processor, Topic, Transform
from platform_assets import protocol, spark_io
from platform_assets.faults import crashpoint
from platform_assets.protocol import data_app_id
from resources import delta_meta
from resources.lease import LeaseKeeper
from resources.meta_tables import (
    META_TABLES,
    LogEntry,
    publish_lineage,
    quarantine_rows,
    write_etl_log,
)
from resources.offset_sql import make_owner, open_offset_store
from resources.offsets import STATE_FAILED, OffsetRecord, OffsetStore
from resources.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


__all__ = ["Engine", "LagRow", "OpenBlock", "Planned", "StepResult", "data_app_id"]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


@dataclass(frozen=True)
class StepResult:
    """What one call of :meth:`Engine.run_topic` did."""

    topic: str
    processed: bool
    reason: str  # why it waited, or what it did
    block: Block | None = None
    rows: int = 0  # rows written to the destination by this block
    base_rows: int = 0
    bad_rows: int = 0
    delta_version: int | None = None
    duration_s: float = 0.0
    recovered: bool = False  # the data had landed before a crash; only the offset caught up
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Planned:
    """A block fixed in the offset store (or why there is none)."""

    block: Block | None
    reason: str
    retry: bool = False  # planned earlier: its data may already have landed
    base_rows: int = -1  # -1: not counted yet
    bad_rows: int = 0
    source_version: int | None = None  # the base snapshot the block reads
    warnings: tuple[str, ...] = ()  # e.g. late-row detection could not read removed commits


@dataclass
class OpenBlock:
    """A block (or a rebuild) prepared under its topic's lock and not yet written: the output
    DataFrame is built (lazily, nothing computed yet) or the data is known to have landed
    before a crash. :meth:`Engine.finish` writes it, logs it, commits the offsets and releases
    the lock; :meth:`Engine.abandon` only releases. The offset IO manager receives this object
    as the asset's output."""

    topic: Topic
    planned: Planned
    started: float
    seq: int
    out: DataFrame | None = None  # None: nothing to write (the data landed before a crash)
    landed: delta_meta.CommitStats | None = None
    base_mark: Position | None = None  # reload: the base's newest position (its new ``last``)
    result: StepResult | None = None  # set by finish()

    @property
    def block(self) -> Block | None:
        return self.planned.block


@dataclass(frozen=True)
class LagRow:
    topic: str
    processor: str
    last: Position | None
    next: Position | None
    source_max: Position | None
    lag_s: float | None
    state: str
    owner: str
    reason: str
    warning: str = ""  # e.g. late-row detection incomplete


@dataclass(frozen=True)
class _Look:
    """A step topic's look at its base table: the record, the decision made on it and the base
    snapshot it read. Taken by :meth:`Engine.plan_block` before the lock, and reused under the
    lock if the record is unchanged."""

    rec: OffsetRecord
    decision: Decision
    base: delta_meta.TableSnapshot


def _pending(rec: OffsetRecord) -> Planned:
    """The block planned in ``rec`` and not committed: the next run redoes exactly it."""
    block = Block(rec.topic, rec.seq, rec.last, rec.next)  # type: ignore[arg-type]
    return Planned(block, f"retry block {rec.seq}", retry=True, source_version=rec.source_version)


class Engine:
    """Runs a validated lineage against a warehouse, an offset store and (lazily) Spark."""

    def __init__(
        self,
        settings: Settings,
        lineage: Lineage,
        store: OffsetStore | None = None,
        *,
        spark: SparkSession | None = None,
        spark_factory: Callable[[], SparkSession] | None = None,
        owner: str | None = None,
        clock: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        self.settings = settings
        self.lineage = lineage
        self.store = store or open_offset_store(settings.offsets_url, create_dir=settings.offsets_defaulted())
        self._spark = spark
        self._owns_spark = spark is None
        self._spark_factory = spark_factory
        self.owner = owner or make_owner()
        self.clock = clock
        self.run_id = uuid.uuid4().hex[:12]
        self._registered: set[str] = set()
        self._open: dict[str, OpenBlock] = {}  # opened blocks not finished yet, by topic
        self._leases: dict[str, LeaseKeeper] = {}  # heartbeats of the locks open_block took, by topic

    # ----------------------------------------------------------------- resources
    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            from pyspark.sql import SparkSession

            active = SparkSession.getActiveSession()
            if active is not None:  # e.g. a host process's session: use it, never stop it
                self._spark, self._owns_spark = active, False
            elif self._spark_factory is not None:
                self._spark = self._spark_factory()
            else:
                from resources.spark import build_spark_session

                self._spark = build_spark_session(self.settings)
        return self._spark

    def close(self) -> None:
        """Release the locks of blocks opened and never finished (a run that failed between
        the two), stop the SparkSession if this engine started it, close the offset store."""
        for opened in list(self._open.values()):
            self.abandon(opened)
        if self._spark is not None and self._owns_spark:
            self._spark.stop()
            self._spark = None
        self.store.close()

    def path(self, table: str) -> str:
        src = self.lineage.sources.get(table)
        return self.settings.table_path(table, src.spec.path if src else None)

    def register_tables(self) -> None:
        """Make every existing table of the lineage readable by name (``stage.orders``) in
        Spark SQL, as external tables over their Delta locations. A name taken in the catalog by a
        table Tidemark did not register is a :class:`ProcessingError`, never dropped."""
        for table in (*self.lineage.tables(), *META_TABLES):
            self._register(table)

    def _register(self, table: str) -> None:
        if table in self._registered:
            return
        # Never drops a table Tidemark did not register (see spark_io.register_table).
        path = self.path(table)
        exists = delta_meta.open_table(path) is not None
        spark_io.register_table(self.spark, table, path if exists else None)
        if exists:
            self._registered.add(table)

    def publish_lineage(self) -> bool:
        return publish_lineage(self.settings, self.lineage)

    # ----------------------------------------------------------------- offsets and planning
    def ensure_offsets(self, topic: Topic, start: Position | None = None) -> OffsetRecord:
        """The topic's offset record, caught up with the destination's Delta log.

        A topic without a record gets one: at ``start`` if given (block numbers still continue
        above what the log records), else from the log (a lost store is rebuilt from the commit of
        the topic's newest block: ``last``, ``seq``, base version), else from the beginning when
        the destination holds nothing of anyone. Where the log cannot answer, ``OffsetError``
        says what to run, and no record is created."""
        rec = self.store.get(topic.name)
        dest = self.path(topic.spec.destination)
        if rec is None:
            if start is not None:
                seq = protocol.recorded_seq(dest, topic.name)
                note = "explicit start" + (f"; block numbers continue above {seq}, recorded in the Delta log" if seq else "")
            else:
                protocol.landed(topic, dest, None)  # refuses before a record exists if the log cannot answer
                start, seq, note = protocol.start_for_new_topic(topic, dest)
            try:
                rec = self.store.init(topic.name, start, topic.spec.processor.value, who=self.owner, note=note, seq=seq)
            except OffsetError:
                existing = self.store.get(topic.name)  # another process initialised it first
                if existing is None:
                    raise
                rec = existing
        return self.reconcile(topic, rec)

    def reconcile(self, topic: Topic, rec: OffsetRecord) -> OffsetRecord:
        """``rec`` caught up with the destination's Delta log (see :func:`protocol.reconcile`). A
        topic locked by another run is left to that run, which reconciles under its lock."""
        try:
            return protocol.reconcile(self.store, topic, self.path(topic.spec.destination), rec, who=self.owner)
        except TopicLockedError:
            return rec

    def reset_offsets(self, topic: Topic, to: Position, reason: str) -> OffsetRecord:
        """Move the topic's ``last`` to ``to`` (the one explicit, logged way backwards); block
        numbers continue above what the Delta log records, so a reset also settles a store whose
        newest commit the log no longer holds."""
        self.store.get(topic.name) or self.ensure_offsets(topic, to)
        seq = protocol.recorded_seq(self.path(topic.spec.destination), topic.name)
        return self.store.reset(topic.name, to, who=self.owner, reason=reason, seq=seq)

    def freshness(self, table: str) -> dt.datetime | None:
        """The position ``table`` is fresh up to: the least ``last`` of the topics producing it
        (a rebuilt table without positions: as of its newest commit), or for a source its newest
        ``pos`` (without a ``pos`` column: its newest commit; ``freshness: static``: always)."""
        producers = self.lineage.producers(table)
        if producers:
            lasts = []
            for p in producers:
                rec = self.store.get(p.name)
                if rec is not None and rec.last.is_zero() and rec.seq and p.spec.processor is Processor.RELOAD:
                    lasts.append(delta_meta.freshness(self.path(table)) or rec.last.pos)
                    continue
                if rec is None or rec.last.is_zero():
                    return None
                lasts.append(rec.last.pos)
            return min(lasts)
        src = self.lineage.sources.get(table)
        if src is not None and src.spec.freshness == "static":
            return dt.datetime.max
        return delta_meta.freshness(self.path(table))

    def decide(self, topic: Topic, rec: OffsetRecord | None = None, now: dt.datetime | None = None,
               mark: TableMark | None = None) -> tuple[Decision, TableMark]:
        """``mark``: the base table's mark when the caller has it already."""
        rec = rec or self.ensure_offsets(topic)
        spec = topic.spec
        if mark is None:
            mark = delta_meta.table_mark(self.path(spec.base), positions=spec.processor is Processor.STEP)
        deps = {d: self.freshness(d) for d in spec.depends_on[1:]} if spec.processor is Processor.STEP else {}
        state = TopicState(rec.last, rec.next, rec.seq, rec.run, rec.source_version)
        return plan_topic(spec, state, mark, deps, now or self.clock(), base_produced=bool(self.lineage.producers(spec.base))), mark

    def block_end(self, topic: Topic, rec: OffsetRecord, decision: Decision,
                  base: delta_meta.TableSnapshot | None = None) -> delta_meta.BlockEnd:
        """The end of the next block the data allows under ``decision``'s cutoff, and its rows."""
        if decision.cutoff is None:
            return delta_meta.BlockEnd(None, 0, None)
        return delta_meta.find_block_end(base or self.path(topic.spec.base), rec.last, decision.cutoff, topic.spec.maxstep)

    def lag(self) -> list[LagRow]:
        out = []
        now = self.clock()
        for topic in self.lineage.topics.values():
            rec = self.store.get(topic.name)
            if rec is None:
                out.append(LagRow(topic.name, topic.spec.processor.value, None, None, None, None, "not started", "", "no offsets yet (first run initialises them)"))
                continue
            decision, base = self.decide(topic, rec, now)
            reason = decision.reason
            if decision.ready and not decision.retry and topic.spec.processor is Processor.STEP:
                found = self.block_end(topic, rec, decision)
                reason = f"ready: next block {found.rows} rows up to {found.end}" if found.end else decision.limit
            lag = None if rec.last.is_zero() else lag_seconds(rec.last, base.max_position)
            warning = ""
            if topic.spec.processor is Processor.STEP and rec.source_version is not None and base.version is not None:
                missing = delta_meta.missing_commits(self.path(topic.spec.base), rec.source_version, base.version)
                warning = delta_meta.late_detection_warning(topic.spec.base, missing)
            out.append(LagRow(topic.name, rec.processor, rec.last, rec.next, base.max_position, lag, rec.state, rec.owner,
                              reason, warning))
        return out

    # ----------------------------------------------------------------- locking
    @contextmanager
    def locked(self, topic: Topic, *, record_failure: bool = True) -> Iterator[OffsetRecord]:
        rec = self._acquire(topic)
        try:
            yield rec
        except BaseException as exc:
            self._release(topic, exc if record_failure else None)
            raise
        self._release(topic, None)

    def _acquire(self, topic: Topic) -> OffsetRecord:
        """Take the topic's lock, then catch the record up with the Delta log under it."""
        if self.store.get(topic.name) is None:
            self.ensure_offsets(topic)
        rec = self.store.acquire(topic.name, self.owner)
        try:
            return protocol.reconcile(self.store, topic, self.path(topic.spec.destination), rec, who=self.owner)
        except BaseException as exc:
            self._release(topic, exc)  # the refusal shows in the topic's state (tidemark lag)
            raise

    def _release(self, topic: Topic, failure: BaseException | None) -> None:
        """Release the topic's lock; a failure (an ``Exception``, not an interrupt) is recorded
        in the topic's state first, so ``tidemark lag`` shows why the topic stopped."""
        try:
            if isinstance(failure, Exception):
                try:
                    self.store.set_state(topic.name, self.owner, f"{STATE_FAILED}: {type(failure).__name__}: {failure}"[:500])
                except TidemarkError:
                    pass
        finally:
            keeper = self._leases.pop(topic.name, None)
            if keeper is None or keeper.stop():  # a lock taken over is not ours to release
                self.store.release(topic.name, self.owner)

    # ----------------------------------------------------------------- processing
    def run_topic(self, name: str) -> StepResult:
        """Process at most one block (step) or one rebuild (reload) of topic ``name``."""
        opened = self.open_block(name)
        return opened if isinstance(opened, StepResult) else self.finish(opened)

    def run_until_caught_up(self, topics: list[str] | None = None, *, max_blocks: int = 10_000,
                            on_result: Callable[[StepResult], None] | None = None) -> list[StepResult]:
        """Run topics in dependency order, each until it waits, and repeat while any made
        progress (a producer's new blocks can make its consumers ready)."""
        names = [n for n in self.lineage.topics if topics is None or n in topics]
        results: list[StepResult] = []
        waiting: dict[str, str] = {}  # topic -> the wait reason last reported
        progress = True
        while progress and len(results) < max_blocks:
            progress = False
            for name in names:
                while len(results) < max_blocks:
                    r = self.run_topic(name)
                    if not r.processed:
                        if waiting.get(name) != r.reason:  # report a wait once, not every pass
                            waiting[name] = r.reason
                            results.append(r)
                            if on_result:
                                on_result(r)
                        break
                    waiting.pop(name, None)
                    results.append(r)
                    if on_result:
                        on_result(r)
                    progress = True
                    if self.lineage.topic(name).spec.processor is Processor.RELOAD:
                        break
        return results

    def _quarantine(self, topic: Topic, rec: OffsetRecord, base: delta_meta.TableSnapshot) -> tuple[int, tuple[str, ...]]:
        """Quarantine rows of the ``base`` snapshot no block can take: null ``pos``/``id``, and
        rows added since the last planned snapshot with a position at or before ``last`` (late,
        out of order). Returns how many rows are newly quarantined, and a warning when late rows
        could not be looked for in commits the log no longer holds."""
        added = 0
        bad = delta_meta.bad_position_rows(base)
        if bad.num_rows:
            added += quarantine_rows(self.settings, topic.name, topic.spec.base, bad, self.clock())
        warnings: tuple[str, ...] = ()
        if rec.source_version is not None and not rec.last.is_zero():
            late = delta_meta.late_rows(base, rec.source_version, rec.last)
            if late.rows.num_rows:
                added += quarantine_rows(self.settings, topic.name, topic.spec.base, late.rows, self.clock(),
                                         after_version=rec.source_version)
            if late.unreadable:
                warnings = (delta_meta.late_detection_warning(topic.spec.base, late.unreadable),)
        return added, warnings

    def _plan_locked(self, topic: Topic, rec: OffsetRecord, look: _Look | None = None) -> Planned:
        """With the topic's lock held: the pending block, or plan the next one (JVM-free) on one
        snapshot of the base table, which the block then reads. ``look``: what was seen just
        before taking the lock, reused if the record is unchanged."""
        spec = topic.spec
        if rec.pending:
            return _pending(rec)
        if look is None or (look.rec.last, look.rec.seq, look.rec.next) != (rec.last, rec.seq, rec.next):
            look = self._look(topic, rec)
        base, decision = look.base, look.decision
        bad_rows, warnings = self._quarantine(topic, rec, base)
        if not decision.ready:
            return Planned(None, decision.reason, bad_rows=bad_rows, warnings=warnings)
        found = self.block_end(topic, rec, decision, base)
        if found.end is None:
            return Planned(None, decision.limit, bad_rows=bad_rows, warnings=warnings)
        # The Delta log outranks the store: a lost or restored store must never reuse a
        # txnVersion that Delta has recorded (Delta would silently skip the write).
        seq = max(rec.seq, delta_meta.recorded_txn(self.path(spec.destination), data_app_id(topic.name))) + 1
        rec = self.store.plan(topic.name, self.owner, last=rec.last, next=found.end, seq=seq, source_version=found.version)
        return Planned(Block(topic.name, seq, rec.last, found.end), f"block {seq}", base_rows=found.rows,
                       bad_rows=bad_rows, source_version=found.version, warnings=warnings)

    def _look(self, topic: Topic, rec: OffsetRecord) -> _Look:
        """Open the base table once and decide whether a step topic may plan a block on it. Only
        the decision needs the base's mark, so it is exact only where the decision depends on it."""
        base = delta_meta.TableSnapshot.open(self.path(topic.spec.base))
        decision, _ = self.decide(topic, rec, mark=delta_meta.table_mark(base, newer_than=rec.last))
        return _Look(rec, decision, base)

    def plan_block(self, name: str) -> Planned:
        """Fix the next block of step topic ``name`` in the offset store without processing it
        (or return the block already pending). Never starts Spark."""
        topic = self.lineage.topic(name)
        if topic.spec.processor is not Processor.STEP:
            raise ProcessingError(f"topic '{name}' is a {topic.spec.processor.value} topic: only step topics have blocks")
        # Read-only look first: a pending block is all in the record, and a topic that waits
        # (the common cases on a sensor tick) costs no lock and no write. Only planning a new
        # block takes the lock, and reuses the look if the record has not changed meanwhile.
        rec = self.store.get(topic.name) or self.ensure_offsets(topic)
        look = None
        if not rec.owner:
            if rec.pending:
                return _pending(rec)
            look = self._look(topic, rec)
            if not look.decision.ready:
                return Planned(None, look.decision.reason)
        with self.locked(topic, record_failure=False) as locked_rec:
            return self._plan_locked(topic, locked_rec, look)

    def run_block(self, name: str, seq: int) -> StepResult:
        """Process block ``seq`` of topic ``name``: the pending block, exactly as planned. A block
        already committed is a no-op (a retried partition whose data landed)."""
        opened = self.open_block(name, seq)
        return opened if isinstance(opened, StepResult) else self.finish(opened)

    def open_block(self, name: str, seq: int | None = None) -> OpenBlock | StepResult:
        """Take topic ``name``'s lock and prepare its next piece of work: block ``seq`` (it must be
        the pending block), or with ``seq=None`` the pending block or a newly planned one (step),
        or a rebuild (reload). Returns a :class:`StepResult` (lock released) when there is nothing
        to do, else an :class:`OpenBlock` that still holds the lock: pass it to :meth:`finish`
        (or :meth:`abandon`)."""
        topic = self.lineage.topic(name)
        rec = self._acquire(topic)
        self._leases[topic.name] = LeaseKeeper(self.store, topic.name, self.owner).start()
        try:
            opened = self._open_locked(topic, rec, seq)
        except BaseException as exc:
            self._release(topic, exc)
            raise
        if isinstance(opened, StepResult):
            self._release(topic, None)
        else:
            self._open[topic.name] = opened
        return opened

    def finish(self, opened: OpenBlock) -> StepResult:
        """Write an opened block exactly once, log it, commit the offsets, release the lock."""
        if self._open.pop(opened.topic.name, None) is not opened:
            raise ProcessingError(f"topic '{opened.topic.name}': block {opened.seq} is not open in this engine")
        try:
            self._leases[opened.topic.name].check()  # never write once another run took the topic over
            block = opened.block
            result = self._finish_reload(opened) if block is None else self._finish_step(opened, block)
        except BaseException as exc:
            self._release(opened.topic, exc)
            raise
        self._release(opened.topic, None)
        opened.result = result
        return result

    def abandon(self, opened: OpenBlock, failure: BaseException | None = None) -> None:
        """Release an opened block's lock without writing (its offsets stay planned: a retry
        redoes the same block)."""
        if self._open.pop(opened.topic.name, None) is opened:
            self._release(opened.topic, failure)

    def _open_locked(self, topic: Topic, rec: OffsetRecord, seq: int | None) -> OpenBlock | StepResult:
        if topic.spec.processor is Processor.RELOAD:
            return self._open_reload(topic, rec)
        if seq is None:
            planned = self._plan_locked(topic, rec)
            if planned.block is None:
                return StepResult(topic.name, False, planned.reason, bad_rows=planned.bad_rows)
            return self._open_step(topic, planned)
        if rec.pending and rec.seq == seq:
            return self._open_step(topic, _pending(rec))
        if not rec.pending and 0 < seq <= rec.seq:
            return StepResult(topic.name, False, f"block {seq} already committed (topic is at block {rec.seq})")
        state = f"block {rec.seq} pending" if rec.pending else f"last committed block {rec.seq}"
        raise ProcessingError(
            f"topic '{topic.name}': block {seq} is not planned ({state}); plan the next block with: tidemark plan {topic.name}"
        )

    def _open_step(self, topic: Topic, planned: Planned) -> OpenBlock:
        """Steps 3-4 up to the write: find out whether the block landed before a crash, else run
        ``before`` SQL and build the transform's output over the block's snapshot."""
        started = time.monotonic()
        block = planned.block
        if block is None:
            raise ProcessingError(f"topic '{topic.name}': nothing to process ({planned.reason})")
        crashpoint("planned")
        landed = delta_meta.find_txn_commit(self.path(topic.spec.destination), data_app_id(topic.name), block.seq) if planned.retry else None
        out = None
        if landed is None:
            self.register_tables()
            block_df = self._block_df(topic.spec.base, block, planned.source_version)
            self._run_sql(topic, "before", block)
            out = self._transform(topic, block_df)
            crashpoint("transformed")
        return OpenBlock(topic, planned, started, block.seq, out=out, landed=landed)

    def _finish_step(self, opened: OpenBlock, block: Block) -> StepResult:
        topic, planned = opened.topic, opened.planned
        spec = topic.spec
        dest = self.path(spec.destination)
        app_id = data_app_id(topic.name)
        landed = opened.landed
        recovered = landed is not None  # written before a crash: only the offset must catch up
        observed = None
        if landed is None:
            if opened.out is None:
                raise ProcessingError(f"topic '{topic.name}': block {block.seq} has no output to write")
            out, observed = spark_io.observe_output(opened.out)
            meta = protocol.commit_metadata(topic, block.seq, last=block.last, next_=block.next,
                                            source_version=planned.source_version, run_id=self.run_id, owner=self.owner)
            (out.write.format("delta").mode("append")
             .option("txnAppId", app_id).option("txnVersion", block.seq)
             .option("mergeSchema", "true").option("userMetadata", meta)
             .save(dest))
            self._register(spec.destination)
            landed = delta_meta.find_txn_commit(dest, app_id, block.seq)
            if landed is None:
                raise ProcessingError(f"topic '{topic.name}': block {block.seq} was written but its commit is not in {dest}/_delta_log")
        crashpoint("written")
        base_rows = planned.base_rows
        if base_rows < 0:
            base_rows = delta_meta.count_block(self.path(spec.base), block.last, block.next, planned.source_version)
        entry = self._log_entry(topic, block.seq, block.last.to_text(), block.next.to_text(), landed, base_rows,
                                planned.bad_rows, time.monotonic() - opened.started,
                                figures=self._block_figures(dest, landed, observed))
        write_etl_log(self.settings, entry)
        crashpoint("logged")
        if spec.after:
            self.register_tables()
            self._block_df(spec.base, block, planned.source_version)
            self._run_sql(topic, "after", block)
        note = f"rows={landed.rows} delta_version={landed.version}" + (" (recovered after crash)" if recovered else "")
        self.store.commit(topic.name, self.owner, seq=block.seq, last=block.last, next=block.next, rows=landed.rows, note=note,
                          delta_version=landed.version)
        crashpoint("committed")
        return StepResult(topic.name, True, f"block {block.seq}", block=block, rows=landed.rows, base_rows=base_rows,
                          bad_rows=planned.bad_rows, delta_version=landed.version, duration_s=time.monotonic() - opened.started,
                          recovered=recovered, stats={**_stats_dict(entry), "warnings": list(planned.warnings)})

    def _open_reload(self, topic: Topic, rec: OffsetRecord) -> OpenBlock | StepResult:
        started = time.monotonic()
        decision, base = self.decide(topic, rec)
        if not decision.ready:
            return StepResult(topic.name, False, decision.reason)
        self.register_tables()
        # The rebuild reads the base at the version the decision was made on.
        reader = self.spark.read.format("delta")
        if base.version is not None:
            reader = reader.option("versionAsOf", base.version)
        base_df = reader.load(self.path(topic.spec.base))
        base_df.createOrReplaceTempView("block")
        self._run_sql(topic, "before", None)
        out = self._transform(topic, base_df)
        seq = max(rec.seq, protocol.recorded_seq(self.path(topic.spec.destination), topic.name)) + 1
        return OpenBlock(topic, Planned(None, f"reload {seq}", source_version=base.version), started, seq,
                         out=out, base_mark=base.max_position or Position.zero())

    def _finish_reload(self, opened: OpenBlock) -> StepResult:
        topic, seq = opened.topic, opened.seq
        spec = topic.spec
        dest = self.path(spec.destination)
        if opened.out is None:
            raise ProcessingError(f"topic '{topic.name}': reload {seq} has no output to write")
        source_version = opened.planned.source_version
        mark = opened.base_mark or Position.zero()
        # The rebuild's number is its txnVersion: never skipped (every rebuild gets a new number),
        # but the log then says which rebuild of which base version the table holds, so a lost
        # store is rebuilt from it like a step topic's.
        meta = protocol.commit_metadata(topic, seq, next_=None if mark.is_zero() else mark, source_version=source_version,
                                        run_id=self.run_id, owner=self.owner)
        app_id = data_app_id(topic.name)
        out, observed = spark_io.observe_output(opened.out)
        (out.write.format("delta").mode("overwrite").option("overwriteSchema", "true")
         .option("txnAppId", app_id).option("txnVersion", seq).option("userMetadata", meta).save(dest))
        self._register(spec.destination)
        committed = delta_meta.find_txn_commit(dest, app_id, seq)
        if committed is None:
            raise ProcessingError(f"topic '{topic.name}': reload {seq} was written but its commit is not in {dest}/_delta_log")
        crashpoint("written")
        entry = self._log_entry(topic, seq, "", "" if mark.is_zero() else mark.to_text(), committed, -1, 0,
                                time.monotonic() - opened.started, figures=self._block_figures(dest, committed, observed))
        write_etl_log(self.settings, entry)  # statistics before the offset commit, as a step's
        self._run_sql(topic, "after", None)
        self.store.commit_reload(topic.name, self.owner, seq=seq, mark=mark, rows=committed.rows,
                                 source_version=source_version, note=f"rows={committed.rows} delta_version={committed.version}",
                                 delta_version=committed.version)
        return StepResult(topic.name, True, f"reload {seq}", rows=committed.rows, delta_version=committed.version,
                          duration_s=time.monotonic() - opened.started, stats=_stats_dict(entry))

    # ----------------------------------------------------------------- Spark pieces
    def _block_df(self, base: str, block: Block, version: int | None) -> DataFrame:
        """Rows of ``base`` inside ``(last, next]``, registered as the temp view ``block``.

        The block reads the snapshot it was planned on (Delta time travel to ``version``), so a
        retry sees exactly the same rows and a row that lands later in an already-planned range
        is detected as late instead of silently joining or missing a block. The plain range on
        ``pos`` lets Delta skip files by statistics; the tuple comparison cuts exactly."""
        from pyspark.sql import functions as F

        spark = self.spark  # F.lit needs an active session
        # Bounds as epoch microseconds: the same instants whatever the session's time zone.
        lp, li = spark_io.ts_literal(block.last.pos), F.lit(block.last.id).cast("bigint")
        np_, ni = spark_io.ts_literal(block.next.pos), F.lit(block.next.id).cast("bigint")
        pos, id_ = F.col("pos"), F.col("id")
        reader = spark.read.format("delta")
        if version is not None:
            reader = reader.option("versionAsOf", version)
        df = (reader.load(self.path(base))
              .where((pos >= lp) & (pos <= np_) & id_.isNotNull())  # a row without an id is quarantined instead
              .where(((pos > lp) | (id_ > li)) & ((pos < np_) | (id_ <= ni))))
        df.createOrReplaceTempView("block")
        return df

    def _run_sql(self, topic: Topic, which: str, block: Block | None) -> None:
        for i, stmt in enumerate(getattr(topic.spec, which), 1):
            try:
                self.spark.sql(stmt)
            except Exception as exc:
                raise ProcessingError(f"topic '{topic.name}' ({topic.where}): {which} statement {i} failed: {_first_line(exc)}\n  {stmt}") from exc

    def _transform(self, topic: Topic, block_df: DataFrame) -> DataFrame:
        outs = [self._one_transform(topic, t, block_df) for t in topic.transforms]
        out = outs[0]
        for other in outs[1:]:
            out = out.unionByName(other, allowMissingColumns=True)
        return out

    def _one_transform(self, topic: Topic, t: Transform, block_df: DataFrame) -> DataFrame:
        from pyspark.sql import DataFrame as SparkDataFrame

        try:
            if t.python is not None:
                module, func = t.python
                result = getattr(importlib.import_module(module), func)(block_df)
                if not isinstance(result, SparkDataFrame) and not hasattr(result, "write"):
                    raise ProcessingError(f"{t.ref} returned {type(result).__name__}, not a Spark DataFrame")
                return result
            return self.spark.sql(t.sql)  # type: ignore[arg-type]
        except ProcessingError:
            raise
        except Exception as exc:
            raise ProcessingError(f"topic '{topic.name}' ({topic.where}): transform {t.ref} failed: {_first_line(exc)}") from exc

    def _block_figures(self, dest: str, commit: delta_meta.CommitStats,
                       observed: spark_io.BlockObservation | None) -> spark_io.BlockFigures:
        """Rows and every column's null count of what ``commit`` added: observed during this
        engine's write, else (the data landed before a crash, or another writer's commit) read
        from the commit's Parquet footers. Never the commit's statistics: Delta collects those
        for the first 32 columns only, so a check on a later column could never fail."""
        if observed is not None and commit.user_metadata.get("run_id") == self.run_id:
            return observed.figures()
        rows, nulls = delta_meta.commit_null_counts(dest, commit)
        return spark_io.BlockFigures(rows, nulls)

    def _log_entry(self, topic: Topic, seq: int, last: str, next_: str, stats: delta_meta.CommitStats,
                   base_rows: int, bad_rows: int, duration: float, *, figures: spark_io.BlockFigures) -> LogEntry:
        max_id = stats.max_values.get("id")
        return LogEntry(
            topic=topic.name, ts=self.clock(), rows=figures.rows,
            max_id=int(max_id) if isinstance(max_id, int | float) else None,
            min_ts=delta_meta.parse_stat_ts(stats.min_values.get("pos")),
            max_ts=delta_meta.parse_stat_ts(stats.max_values.get("pos")),
            nulls=dict(sorted(figures.nulls.items())), run_id=self.run_id,  # zeros too: a column here was counted
            processor=topic.spec.processor.value, seq=seq, last=last, next=next_,
            base_rows=base_rows, bad_rows=bad_rows, delta_version=stats.version, duration_s=round(duration, 3),
        )


def _stats_dict(entry: LogEntry) -> dict[str, Any]:
    return {"rows": entry.rows, "max_id": entry.max_id, "min_ts": entry.min_ts, "max_ts": entry.max_ts,
            "max_lag": entry.max_lag, "nulls": entry.nulls, "delta_version": entry.delta_version}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
