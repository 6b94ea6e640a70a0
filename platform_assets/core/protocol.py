"""The commit protocol every processor lands its work through (DESIGN.md, "One commit protocol").

1. A unit of work (a block, a rebuild) gets its sequence number and bounds in the offset store
   before anything is written.
2. The Delta commit that lands it describes itself: ``txnAppId=tidemark:<topic>``,
   ``txnVersion=<seq>`` and ``userMetadata`` with every bound the next unit starts from
   (:func:`commit_metadata`).
3. The offset store is an index of the Delta log, never its master: :func:`reconcile` catches a
   store that is behind, restored from a backup or lost up with what the log records, logged as
   ``recover``; where the log cannot tell (the commit was removed by log retention, rows the
   topic never wrote), it refuses and says what to run.
4. Statistics go to ``etl.log`` before the offset commit (:func:`log_entry`, from
   :func:`block_figures`).

This module holds the units' types (:class:`Planned`, :class:`OpenBlock`, :class:`StepResult`),
2, 3 and 4; a processor (``step.py``, ``reload.py``) plugs in through :class:`UnitProcessor`, and
the engine (``engine.py``) takes the lock, reconciles and dispatches.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lineage.core.errors import OffsetError
from lineage.core.positions import Block, Position
from lineage.spec.model import Processor, Topic
from platform_assets.core import spark_io
from resources.state.offsets import STATE_COMMITTED, STATE_RELOADED, OffsetRecord, OffsetStore
from resources.storage import delta_log, delta_meta
from resources.storage.meta_tables import LogEntry

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


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
    """A unit fixed in the offset store before anything is written (or why there is none)."""

    block: Block | None
    reason: str
    retry: bool = False  # planned earlier: its data may already have landed
    base_rows: int = -1  # -1: not counted yet
    bad_rows: int = 0
    source_version: int | None = None  # the base snapshot the unit reads
    warnings: tuple[str, ...] = ()  # e.g. late-row detection could not read removed commits
    #: A retried unit whose base snapshot lost files to OPTIMIZE + VACUUM: how its rows are read instead.
    snapshot: delta_meta.SnapshotRead | None = None


@dataclass
class OpenBlock:
    """A unit (a block, a rebuild) prepared under its topic's lock and not yet written: the output
    DataFrame is built (lazily, nothing computed yet) or the data is known to have landed
    before a crash. :meth:`Engine.finish` writes it, logs it, commits the offsets and releases
    the lock; :meth:`Engine.abandon` only releases. The offset IO manager receives this object
    as the asset's output."""

    topic: Topic
    planned: Planned
    started: float
    seq: int
    out: DataFrame | None = None  # None: nothing to write (the data landed before a crash)
    landed: delta_log.CommitStats | None = None
    base_mark: Position | None = None  # reload: the base's newest position (its new ``last``)
    merge: Any = None  # merge: the unit's strategy and MERGE source (platform_assets.views.work.MergeWork)
    result: StepResult | None = None  # set by finish()

    @property
    def block(self) -> Block | None:
        return self.planned.block


class Phases:
    """Where a unit's time goes, in seconds per phase (``lock``, ``plan``, ``spark``, ``transform``,
    ``write``, ``log``, ``after``, ``commit``), recorded in the unit's result and materialization
    metadata so a slow block shows which part was slow. Phases nest; each counts only its own
    time (a Spark session started inside ``transform`` counts as ``spark``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []  # per open phase: time spent in phases nested inside it

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        self._inner.append(0.0)
        try:
            yield
        finally:
            took = time.monotonic() - t0
            inner = self._inner.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + took - inner
            if self._inner:
                self._inner[-1] += took

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.seconds.items()}


class UnitProcessor(Protocol):
    """What a processor implements; the engine holds the lock around both calls."""

    def open(self, topic: Topic, rec: OffsetRecord, seq: int | None) -> OpenBlock | StepResult:
        """Plan (or find the pending) unit and build its output; a :class:`StepResult` when there is
        nothing to do."""
        ...

    def finish(self, opened: OpenBlock) -> StepResult:
        """Land the unit exactly once, log its statistics, commit its offsets."""
        ...


def data_app_id(topic: str) -> str:
    """The Delta ``txnAppId`` of a topic's data commits."""
    return f"tidemark:{topic}"


def commit_metadata(topic: Topic, seq: int, *, next_: Position | None, source_version: int | None,
                    run_id: str, owner: str, last: Position | None = None, **extra: Any) -> str:
    """The ``userMetadata`` of a unit's Delta commit: enough to rebuild the topic's offset record
    from the log alone (``next`` = the topic's new ``last``, the base version it read, and a merge
    unit's per-input offsets in ``inputs``)."""
    meta: dict[str, Any] = {"topic": topic.name, "processor": topic.spec.processor.value, "seq": seq,
                            "base": topic.spec.base, "source_version": source_version, "run_id": run_id, "owner": owner,
                            **extra}
    if last is not None:
        meta["last"] = last.to_text()
    if next_ is not None:
        meta["next"] = next_.to_text()
    return json.dumps(meta)


@dataclass(frozen=True)
class Landed:
    """What the destination's Delta log says the topic landed last."""

    seq: int  # the newest txnVersion recorded for the topic (0: none)
    commit: delta_log.CommitStats | None  # the commit that recorded it


def recorded_seq(dest: str, topic: str) -> int:
    return delta_log.recorded_txn(dest, data_app_id(topic))


def next_seq(rec: OffsetRecord, dest: str, topic: str) -> int:
    """The number of a topic's next unit: above the store's and above what the Delta log records
    (Delta silently skips a write whose txnVersion it has recorded). Reconciliation under the lock
    makes them equal; reading the log again here guards the write itself."""
    return max(rec.seq, recorded_seq(dest, topic)) + 1


def _retention_refusal(topic: Topic, dest: str, seq: int, rec: OffsetRecord | None) -> OffsetError:
    where = "the offset store has no record" if rec is None else f"the offset store is at block {rec.seq}"
    fix = (f"tidemark offsets init {topic.name} --start POSITION" if rec is None
           else f"tidemark offsets reset {topic.name} --to POSITION --reason '...'")
    return OffsetError(
        f"topic '{topic.name}': {where}, but the Delta log of {topic.spec.destination} ({dest}) records block {seq} "
        f"of this topic, and the commit that wrote it was removed by log retention, so where that block ended is "
        f"unknown. Tidemark does not guess. Decide where the topic continues (the (pos, id) after which base rows "
        f"are still to be processed) and run: {fix} (the block numbers continue above {seq})"
    )


def landed(topic: Topic, dest: str, rec: OffsetRecord | None) -> Landed:
    """The topic's newest landed unit according to the Delta log, with its commit when the store
    does not know it yet. Raises ``OffsetError`` when that commit is gone from the log."""
    seq = recorded_seq(dest, topic.name)
    if seq == 0 or (rec is not None and seq <= rec.seq):
        return Landed(seq, None)
    hint = rec.delta_version if rec is not None else None
    try:
        commit = delta_log.find_txn_commit(dest, data_app_id(topic.name), seq, hint=hint)
    except delta_log.CommitUnavailableError:
        raise _retention_refusal(topic, dest, seq, rec) from None
    if commit is None:  # recorded but no commit carries it: not written by Tidemark's protocol
        raise _retention_refusal(topic, dest, seq, rec)
    return Landed(seq, commit)


def reconcile(store: OffsetStore, topic: Topic, dest: str, rec: OffsetRecord, *, who: str,
              logged: Callable[[], int] | None = None) -> OffsetRecord:
    """``rec`` caught up with the destination's Delta log: unchanged when the store knows the
    newest landed unit (or is ahead: a block planned and not landed), else ``recover``ed from that
    unit's commit. Never plans from a stale ``last``.

    ``logged``: the newest unit of the topic ``etl.log`` records. A newest landed unit it does not
    record was cut short between its write and its statistics (then its ``after`` SQL did not run
    either): a store that lost it then gets it back as the pending unit, with the bounds its commit
    records, and the unit finishes as after any crash (:func:`_unfinished`)."""
    found = landed(topic, dest, rec)
    if found.commit is None:
        return rec
    commit = found.commit
    meta = commit.user_metadata
    step = topic.spec.processor in (Processor.STEP, Processor.MERGE)  # both move a (pos, id) ``last``
    if step and logged is not None and meta.get("last") and meta.get("next") and logged() < found.seq:
        if rec.owner != who:
            return rec  # left to the run that takes the lock: it finishes the unit
        unfinished = _unfinished(store, topic, rec, found, who=who)
        if unfinished is not None:
            return unfinished
    if step and not meta.get("next"):
        raise _retention_refusal(topic, dest, found.seq, rec)
    last = Position.parse(meta["next"]) if meta.get("next") else rec.last
    if step and last < rec.last:
        raise OffsetError(
            f"topic '{topic.name}': the Delta log records block {found.seq} ending at {last}, before the store's last "
            f"{rec.last} at block {rec.seq}; the store was reset past what landed. Reset it explicitly: "
            f"tidemark offsets reset {topic.name} --to POSITION --reason '...'"
        )
    source_version = meta.get("source_version")
    late = "" if source_version is not None or not step else "; the commit does not say which base version it read, so late rows are detected from the next block on"
    note = (f"caught up from the Delta log: block {found.seq} landed in {topic.spec.destination} version {commit.version} "
            f"(store was at block {rec.seq}{', with block ' + str(rec.seq) + ' pending' if rec.pending else ''}){late}")
    try:
        return store.recover(topic.name, who=who, expected_seq=rec.seq, seq=found.seq, last=max(last, rec.last),
                             rows=commit.rows, run=commit.timestamp, state=STATE_COMMITTED if step else STATE_RELOADED,
                             source_version=int(source_version) if source_version is not None else None,
                             delta_version=commit.version, note=note,
                             inputs={str(k): int(v) for k, v in (meta.get("inputs") or {}).items()})
    except OffsetError:
        fresh = store.get(topic.name)
        if fresh is not None and fresh.seq >= found.seq:  # another process caught it up first
            return fresh
        raise


def _unfinished(store: OffsetStore, topic: Topic, rec: OffsetRecord, found: Landed, *, who: str) -> OffsetRecord | None:
    """The store behind a unit that landed and was not finished (no ``etl.log`` row): the record at
    the unit before it, with that unit planned again exactly as its commit records (``last``, ``next``,
    the base version, a merge unit's inputs), so the redo finds it landed and writes its statistics,
    runs its ``after`` SQL and commits. Only under the topic's lock (None otherwise, or where the
    store's ``last`` is past the commit's: the plain recovery applies)."""
    if found.commit is None:
        return None
    meta = found.commit.user_metadata
    last, nxt = Position.parse(meta["last"]), Position.parse(meta["next"])
    sv = meta.get("source_version")
    source_version = int(sv) if sv is not None else None
    inputs = {str(k): int(v) for k, v in (meta.get("inputs") or {}).items()} or None
    if rec.last > last or rec.pending:
        return None
    note = (f"unit {found.seq} landed in {topic.spec.destination} version {found.commit.version} and was not finished "
            f"(no etl.log row): planned again from its commit to finish it")
    if rec.seq < found.seq - 1:
        rec = store.recover(topic.name, who=who, expected_seq=rec.seq, seq=found.seq - 1, last=last, rows=0, run=None,
                            state=STATE_COMMITTED, source_version=source_version, delta_version=found.commit.version, note=note)
    if rec.seq != found.seq - 1 or rec.last != last:
        return None
    return store.plan(topic.name, who, last=last, next=nxt, seq=found.seq, source_version=source_version,
                      inputs_next=inputs if topic.spec.processor is Processor.MERGE else None)


def start_for_new_topic(topic: Topic, dest: str) -> tuple[Position, int, str]:
    """Where a topic without an offset record starts when no start is given: ``(last, seq,
    note)``. From the beginning when its destination holds nothing; a destination whose log
    records blocks of the topic is recovered by :func:`reconcile` (this returns the start the
    record is created with before that). Refuses when the destination has rows that no block
    of this topic wrote: where the topic should continue would be a guess."""
    if topic.spec.processor is Processor.MERGE and recorded_seq(dest, topic.name) == 0:
        snap = delta_meta.TableSnapshot.open(dest)
        if snap.version is not None and snap.files.num_rows:
            raise OffsetError(
                f"topic '{topic.name}': its destination {topic.spec.destination} ({dest}) has rows but its Delta log "
                f"records no unit of topic '{topic.name}' (built by another tool, or before Tidemark). Adopt it as it is "
                f"(see what would be set first): tidemark offsets adopt {topic.name} --dry-run; or start from the "
                f"beginning, which rebuilds it whole: tidemark offsets init {topic.name} --start zero"
            )
    if topic.spec.processor is Processor.STEP and recorded_seq(dest, topic.name) == 0:
        mark = delta_meta.table_mark(dest)
        if mark.max_position is not None:
            raise OffsetError(
                f"topic '{topic.name}': its destination {topic.spec.destination} ({dest}) has rows but its Delta log "
                f"records no block of topic '{topic.name}' (written by another writer, or before Tidemark); where the "
                f"topic should start would be a guess. Say where, e.g. after the destination's newest row: "
                f"tidemark offsets init {topic.name} --start {mark.max_position.to_text()}  (or --start zero to process "
                f"the whole base table into it)"
            )
    return Position.zero(), 0, "new topic: from the beginning"


# ------------------------------------------------------------------ 4. statistics


def block_figures(dest: str, commit: delta_log.CommitStats, observed: spark_io.BlockObservation | spark_io.Counted | None,
                  run_id: str) -> spark_io.BlockFigures:
    """Rows and every column's null count of what ``commit`` added: observed during this run's
    write (``run_id`` wrote the commit), else (the data landed before a crash, or another writer's
    commit) read from the commit's Parquet footers. Never the commit's statistics: Delta collects
    those for the first 32 columns only, so a check on a later column could never fail. The one
    exception: when those files were compacted and deleted by VACUUM before the retry, the
    statistics are all that is left (rows exact; null counts for the columns they cover)."""
    if observed is not None and commit.user_metadata.get("run_id") == run_id:
        return observed.figures()
    try:
        rows, nulls = delta_log.commit_null_counts(dest, commit)
    except OSError:
        if not delta_meta.missing_files(dest, list(commit.paths)):
            raise
        return spark_io.BlockFigures(commit.rows, dict(commit.null_counts))
    return spark_io.BlockFigures(rows, nulls)


def log_entry(topic: Topic, seq: int, last: str, next_: str, stats: delta_log.CommitStats, *, base_rows: int,
              bad_rows: int, duration: float, figures: spark_io.BlockFigures, run_id: str, now: dt.datetime,
              strategy: str | None = None, detail: str | None = None, changes: dict[str, int] | None = None) -> LogEntry:
    """The ``etl.log`` row of a landed unit."""
    max_id = stats.max_values.get("id")
    return LogEntry(
        topic=topic.name, ts=now, rows=figures.rows,
        max_id=int(max_id) if isinstance(max_id, int | float) else None,
        min_ts=delta_log.parse_stat_ts(stats.min_values.get("pos")),
        max_ts=delta_log.parse_stat_ts(stats.max_values.get("pos")),
        nulls=dict(sorted(figures.nulls.items())), run_id=run_id,  # zeros too: a column here was counted
        processor=topic.spec.processor.value, seq=seq, last=last, next=next_,
        base_rows=base_rows, bad_rows=bad_rows, delta_version=stats.version, duration_s=round(duration, 3),
        strategy=strategy, detail=detail, changes=dict(sorted((changes or {}).items())) if changes is not None else None,
    )


def stats_dict(entry: LogEntry) -> dict[str, Any]:
    """A unit's figures as the checks and the materialization metadata read them."""
    return {"rows": entry.rows, "max_id": entry.max_id, "min_ts": entry.min_ts, "max_ts": entry.max_ts,
            "max_lag": entry.max_lag, "nulls": entry.nulls, "delta_version": entry.delta_version}
