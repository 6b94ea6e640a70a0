"""The engine: runs a validated lineage against a warehouse, an offset store and (lazily) Spark.

It owns what every processor shares: the SparkSession, the offset store, the topic's lock (with
its lease kept alive while a unit is open), the reconciliation of the store with the Delta log
(:mod:`platform_assets.core.protocol`) before anything is planned, the planner's decision and the lag
table. The processors plug in through :class:`protocol.UnitProcessor`: step
(:mod:`platform_assets.facts.step`) and reload (:mod:`platform_assets.facts.reload`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lineage.core.errors import OffsetError, ProcessingError, TidemarkError, TopicLockedError
from lineage.core.positions import Position
from lineage.planning.planner import Decision, TableMark, TopicState, lag_seconds, plan_topic
from lineage.spec.model import Lineage, Processor, Topic
from platform_assets.core import blocks, protocol, spark_io, table_reads
from platform_assets.core.protocol import OpenBlock, Planned, StepResult, UnitProcessor, data_app_id
from platform_assets.facts.reload import ReloadProcessor
from platform_assets.facts.step import StepProcessor, pending
from platform_assets.views import driver_unit
from platform_assets.views.merge import MergeProcessor
from resources.core.settings import Settings
from resources.state.lease import LeaseKeeper
from resources.state.offset_sql import make_owner, open_settings_store
from resources.state.offsets import STATE_FAILED, OffsetRecord, OffsetStore
from resources.storage import delta_log, delta_meta, meta_tables
from resources.storage.meta_tables import (
    META_TABLES,
    publish_lineage,
)
from resources.storage.warehouse import check_warehouse

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


__all__ = ["Engine", "LagRow", "OpenBlock", "Planned", "StepResult", "data_app_id"]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


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
    offset_ages: dict[str, float | None] = field(default_factory=dict)  # input -> seconds since the data its offset covers

    @property
    def offset_age_s(self) -> float | None:
        """The oldest input offset's age (Datapipe's ``offset_age_seconds``)."""
        ages = [a for a in self.offset_ages.values() if a is not None]
        return max(ages) if ages else None


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
        table_reads.direct_io_on()  # a bad $TIDEMARK_DIRECT_IO is refused before anything runs,
        driver_unit.enabled()  # and a bad $TIDEMARK_DRIVER_SQL
        self.settings = settings
        self.lineage = lineage
        check_warehouse(settings.warehouse)  # an object store that cannot be reached fails here, naming the fix
        self.store = store or open_settings_store(settings)
        self._spark = spark
        self._owns_spark = spark is None
        self._look_ahead: list[str] = []  # destinations committed to since the last look-ahead
        self._spark_factory = spark_factory
        self.owner = owner or make_owner()
        self.clock = clock
        self.run_id = uuid.uuid4().hex[:12]
        self._registered: set[str] = set()
        self._open: dict[str, OpenBlock] = {}  # opened blocks not finished yet, by topic
        self._leases: dict[str, LeaseKeeper] = {}  # heartbeats of the locks open_block took, by topic
        self.phases = protocol.Phases()  # of the unit being processed (reset by open_block)
        self.step = StepProcessor(self)
        self.merge = MergeProcessor(self)
        self._processors: dict[Processor, UnitProcessor] = {Processor.STEP: self.step, Processor.RELOAD: ReloadProcessor(self),
                                                            Processor.MERGE: self.merge}

    # ----------------------------------------------------------------- resources
    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            from pyspark.sql import SparkSession

            from resources.spark.session import build_spark_session, running_sessions

            active = SparkSession.getActiveSession()
            if active is not None:  # e.g. a host process's session: use it, never stop it
                self._spark, self._owns_spark = active, False
            else:
                # getOrCreate returns a session the process has already (another thread's, a
                # host's): this engine did not start it and must not stop it on close
                before = running_sessions()
                with self.phases.timed("spark"):
                    self._spark = (self._spark_factory or (lambda: build_spark_session(self.settings)))()
                self._owns_spark = not any(self._spark is s for s in before)
        return self._spark

    def close(self) -> None:
        """Release the locks of blocks opened and never finished (a run that failed between
        the two), stop the SparkSession if this engine started it, close the offset store."""
        for opened in list(self._open.values()):
            self.abandon(opened)
        self._start_look_aheads()
        if self._spark is not None and self._owns_spark:
            spark_io.stop_session(self._spark)
            self._spark = None
        self.store.close()

    def path(self, table: str) -> str:
        src = self.lineage.sources.get(table)
        return self.settings.table_path(table, src.spec.path if src else None)

    def register_tables(self, topic: Topic | None = None) -> None:
        """Make the existing tables of the lineage readable by name (``stage.orders``) in
        Spark SQL, as external tables over their Delta locations: every table, or with ``topic``
        those its SQL names (all of them when it has a Python transform, which may read any). A
        name taken in the catalog by a table Tidemark did not register is a
        :class:`ProcessingError`, never dropped. Registering costs catalog round trips per table
        (a few hundred ms each over Spark Connect), so a block registers only what it reads."""
        tables = [*self.lineage.tables(), *META_TABLES]
        if topic is not None:
            tables = spark_io.tables_read(topic, tables)
        for table in tables:
            self.register(table)

    def register(self, table: str) -> None:
        """Make ``table`` readable by name (see :meth:`register_tables`)."""
        if table in self._registered:
            return
        # Never drops a table Tidemark did not register (see spark_io.register_table).
        path = self.path(table)
        exists = delta_log.open_table(path) is not None
        spark_io.register_table(self.spark, table, path if exists else None)
        if exists:
            self._registered.add(table)

    def processor(self, topic: Topic) -> UnitProcessor:
        return self._processors[topic.spec.processor]

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
            explicit = start is not None
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
            else:
                rec = self.reconcile(topic, rec)
                return rec if explicit else self._reset_again(topic, rec)
        return self.reconcile(topic, rec)

    def reconcile(self, topic: Topic, rec: OffsetRecord) -> OffsetRecord:
        """``rec`` caught up with the destination's Delta log (see :func:`protocol.reconcile`). A
        topic locked by another run is left to that run, which reconciles under its lock."""
        try:
            return protocol.reconcile(self.store, topic, self.path(topic.spec.destination), rec, who=self.owner,
                                      logged=self._logged(topic))
        except TopicLockedError:
            return rec

    def _logged(self, topic: Topic) -> Callable[[], int]:
        """The newest unit of ``topic`` that ``etl.log`` records, asked only when the store is behind."""
        return functools.partial(meta_tables.logged_seq, self.settings, topic.name)

    def reset_offsets(self, topic: Topic, to: Position, reason: str, *, late_from_now: bool = False) -> OffsetRecord:
        """Move the topic's ``last`` to ``to`` (the one explicit, logged way backwards); block
        numbers continue above what the Delta log records, so a reset also settles a store whose
        newest commit the log no longer holds. ``late_from_now``: look for late rows only among
        rows the base gets from its current version on (for when the files or commits that would
        show earlier ones were removed by VACUUM or log retention)."""
        self.store.get(topic.name) or self.ensure_offsets(topic, to)
        seq = protocol.recorded_seq(self.path(topic.spec.destination), topic.name)
        late_from = None
        if late_from_now:
            base = delta_log.open_table(self.path(topic.spec.base))
            if base is None:
                raise ProcessingError(f"topic '{topic.name}': base {topic.spec.base} does not exist at {self.path(topic.spec.base)}")
            late_from = {topic.spec.base: int(base.version())}
        rec = self.store.reset(topic.name, to, who=self.owner, reason=reason, seq=seq, late_from=late_from)
        # in Delta too: a store lost before the topic's next unit gets the reset back (:meth:`_reset_again`)
        meta_tables.record_reset(self.settings, topic.name, to.to_text(), seq, late_from, self.owner, reason, self.clock())
        return rec

    def _reset_again(self, topic: Topic, rec: OffsetRecord) -> OffsetRecord:
        """A record rebuilt from the Delta log (the store lost) with the topic's newest reset applied
        again when no unit landed since (``etl.offset_resets``): the log alone would undo it."""
        reset = meta_tables.last_reset(self.settings, topic.name)
        if reset is None or rec.pending or int(reset["seq"]) < rec.seq:
            return rec
        to = Position.parse(reset["last"])
        if to == rec.last:
            return rec
        late_from = json.loads(reset["late_from"]) if reset["late_from"] else None
        return self.store.reset(topic.name, to, who=self.owner, seq=int(reset["seq"]), late_from=late_from,
                                reason=f"the reset of {reset['ts']:%Y-%m-%d %H:%M:%S} by {reset['who']} applied again "
                                       f"(etl.offset_resets; the offset store had lost it): {reset['reason']}")

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
        blocks = spec.processor is not Processor.RELOAD  # step and merge read the base by (pos, id)
        if mark is None:
            mark = delta_meta.table_mark(self.path(spec.base), positions=blocks)
        if (not blocks and mark.version is not None and rec.source_version is not None
                and mark.version > rec.source_version and mark.data_version is None):
            # a reload rebuilds on a data change, not on a compaction of its base
            mark = dataclasses.replace(mark, data_version=delta_log.data_version(
                self.path(spec.base), mark.version, rec.source_version))
        deps = {d: self.freshness(d) for d in spec.depends_on[1:]} if blocks else {}
        state = TopicState(rec.last, rec.next, rec.seq, rec.run, rec.source_version)
        return plan_topic(spec, state, mark, deps, now or self.clock(), base_produced=bool(self.lineage.producers(spec.base))), mark

    def block_end(self, topic: Topic, rec: OffsetRecord, decision: Decision,
                  base: delta_meta.TableSnapshot | None = None) -> delta_meta.BlockEnd:
        """The end of the next block the data allows under ``decision``'s cutoff, and its rows."""
        if decision.cutoff is None:
            return delta_meta.BlockEnd(None, 0, None)
        return delta_meta.find_block_end(base or self.path(topic.spec.base), rec.last, decision.cutoff, topic.spec.maxstep)

    def lag(self) -> list[LagRow]:
        """Every topic's position, lag and why it waits; read-only (a store behind the Delta log is
        reported, not caught up)."""
        out = []
        now = self.clock()
        for topic in self.lineage.topics.values():
            rec = self.store.get(topic.name)
            if rec is None:
                out.append(LagRow(topic.name, topic.spec.processor.value, None, None, None, None, "not started", "", "no offsets yet (first run initialises them)"))
                continue
            try:
                out.append(self._lag_row(topic, rec, now))
            except (TidemarkError, OSError) as exc:  # one topic's problem is a line of the table, never the end of it
                out.append(LagRow(topic.name, rec.processor, rec.last, rec.next, None, None, rec.state, rec.owner,
                                  f"error: {type(exc).__name__}: {exc}"))
        return out

    def _lag_row(self, topic: Topic, rec: OffsetRecord, now: dt.datetime) -> LagRow:
        landed = protocol.recorded_seq(self.path(topic.spec.destination), topic.name)
        if landed > rec.seq:  # read-only: say it; the next run under the lock catches the store up
            return LagRow(topic.name, rec.processor, rec.last, rec.next, None, None, rec.state, rec.owner,
                          f"offset store behind the Delta log: block {landed} landed, the store is at block "
                          f"{rec.seq}; the next run catches it up (recover)")
        step = topic.spec.processor is Processor.STEP
        snap = delta_meta.TableSnapshot.open(self.path(topic.spec.base)) if step else None  # opened once
        decision, base = self.decide(topic, rec, now, mark=delta_meta.table_mark(snap) if snap is not None else None)
        reason = decision.reason
        if topic.spec.processor is Processor.MERGE and not rec.pending:
            reason = self.merge.look(topic, rec).reason
        elif decision.ready and not decision.retry and step:
            found = self.block_end(topic, rec, decision, snap)
            reason = f"ready: next block {found.rows} rows up to {found.end}" if found.end else decision.limit
        lag = None if rec.last.is_zero() else lag_seconds(rec.last, base.max_position)
        warning = ""
        if topic.spec.processor is Processor.STEP and rec.source_version is not None and base.version is not None:
            missing = delta_meta.missing_commits(self.path(topic.spec.base), rec.source_version, base.version)
            warning = delta_meta.late_detection_warning(topic.spec.base, missing)
        ages = self.offset_ages(topic, rec)
        return LagRow(topic.name, rec.processor, rec.last, rec.next, base.max_position, lag, rec.state, rec.owner,
                      reason, warning, ages)

    def offset_ages(self, topic: Topic, rec: OffsetRecord) -> dict[str, float | None]:
        """Seconds since the data each input's offset covers: a step topic's base by ``last``; a
        merge topic's every input (see :func:`blocks.offset_ages`); none for a reload."""
        if topic.spec.processor is Processor.MERGE:
            return blocks.offset_ages(self, topic, rec.last, dict(rec.inputs))
        if topic.spec.processor is Processor.STEP and not rec.last.is_zero():
            return {topic.spec.base: round((self.clock() - rec.last.pos).total_seconds(), 3)}
        return {}

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

    def _acquire(self, topic: Topic, *, known: bool = False) -> OffsetRecord:
        """Take the topic's lock, then catch the record up with the Delta log under it.
        ``known``: the caller has seen the topic's record (no need to look whether one exists)."""
        if not known and self.store.get(topic.name) is None:
            self.ensure_offsets(topic)
        rec = self.store.acquire(topic.name, self.owner)
        try:
            return protocol.reconcile(self.store, topic, self.path(topic.spec.destination), rec, who=self.owner,
                                      logged=self._logged(topic))
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
                            on_result: Callable[[StepResult], None] | None = None,
                            on_error: Callable[[str, TidemarkError], None] | None = None) -> list[StepResult]:
        """Run topics in dependency order, each until it waits, and repeat while any made
        progress (a producer's new blocks can make its consumers ready). ``on_error``: a topic
        that fails with a :class:`TidemarkError` is reported to it and left out from then on,
        and the others go on (without it, the error is raised)."""
        names = [n for n in self.lineage.topics if topics is None or n in topics]
        results: list[StepResult] = []
        waiting: dict[str, str] = {}  # topic -> the wait reason last reported
        progress = True
        while progress and len(results) < max_blocks:
            progress = False
            for name in list(names):
                while len(results) < max_blocks:
                    try:
                        r = self.run_topic(name)
                    except TidemarkError as exc:
                        if on_error is None:
                            raise
                        on_error(name, exc)
                        names.remove(name)
                        break
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

    def plan_block(self, name: str, *, durable: bool = True) -> Planned:
        """Fix the next block of step topic ``name`` in the offset store without processing it
        (or return the block already pending). Never starts Spark. ``durable=False``: the plan
        does not wait for the disk; call ``store.sync()`` before anything acts on it."""
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
                return pending(rec)
            look = self.step.look(topic, rec)
            if not look.decision.ready:
                return Planned(None, look.decision.reason)
        locked_rec = self._acquire(topic, known=True)
        try:
            planned = self.step.plan_locked(topic, locked_rec, look, release=True, flush=durable)
        except BaseException:
            self._release(topic, None)
            raise
        if planned.block is None or planned.retry:  # a new block was planned with the lock released at once
            self._release(topic, None)
        return planned

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
        self._start_look_aheads()
        topic = self.lineage.topic(name)
        self.phases = protocol.Phases()
        with self.phases.timed("lock"):
            rec = self._acquire(topic)
        self._leases[topic.name] = LeaseKeeper(self.store, topic.name, self.owner).start()
        try:
            opened = self.processor(topic).open(topic, rec, seq)
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
            result = self.processor(opened.topic).finish(opened)
        except BaseException as exc:
            self._release(opened.topic, exc)
            raise
        if result.delta_version is not None and not result.recovered:
            self._look_ahead.append(self.path(opened.topic.spec.destination))
        with self.phases.timed("commit"):
            self._release(opened.topic, None)
        result.stats["phases_s"] = self.phases.rounded()
        opened.result = result
        return result

    def _start_look_aheads(self) -> None:
        """Have the Spark Connect server compute, in the background, the Delta state that the next
        write to each table committed to since the last call will look its txn up in
        (:func:`spark_io.look_ahead_txn_state`). Started when the next unit opens or the engine
        closes, not at the commit: the rest of the unit (its log, its metadata, Dagster's events)
        then does not share the cores with it (a Dagster run's engine closes when the run ends)."""
        dests, self._look_ahead = list(dict.fromkeys(self._look_ahead)), []
        if self._spark is not None:
            for dest in dests:
                spark_io.look_ahead_txn_state(self._spark, dest)

    def abandon(self, opened: OpenBlock, failure: BaseException | None = None) -> None:
        """Release an opened block's lock without writing (its offsets stay planned: a retry
        redoes the same block)."""
        if self._open.pop(opened.topic.name, None) is opened:
            self._release(opened.topic, failure)
