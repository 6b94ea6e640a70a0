"""The cdc processor: a replicator keeps Delta replicas of source tables, exactly once (issue 10).

One unit, under the replicator's lock (the shared offset-store lease; every replica's record is
locked by the same owner):

1. **reconcile** every replica's record with its Delta log (a store that is behind, restored or lost
   is caught up from the LSN the newest commit records);
2. **snapshot** tables never copied: a consistent snapshot at LSN ``S`` (the source's), written with
   the table's txn and ``S`` in ``userMetadata``; from then on only transactions committed after
   ``S`` apply to it;
3. **stream**: whole transactions after the lowest applied LSN, read up to ``maxstep`` wanted row
   changes. The unit's bounds — its number, the source position it reads up to, the numbers of
   its changes — are fixed in the replicator's record before anything is written, so a retry reads
   exactly the same transactions. Per table the batch's net effect lands in **one Delta MERGE**
   (:mod:`platform_assets.cdc.apply`) carrying ``txnAppId=tidemark:<replica>``/``txnVersion`` and
   the applied LSN; schema changes captured in the stream are applied in order (:mod:`cdc_ddl`);
4. statistics to ``etl.log``, the offset commits, and only then the source is **acknowledged** up
   to the lowest LSN every replica (paused ones too) has applied: a lost offset store or a slot
   acknowledged late never loses or doubles a change.

**Parked replicas** (a source that can, PostgreSQL): a paused replica gets a slot of its own, a copy
of the main slot made while the main slot is still at or before the replica's position. From then
on the main slot is read and acknowledged without it, so no unit of the others decodes the WAL the
pause holds (the server decodes a slot's WAL from its restart position on every read). Resumed, the
replica catches up from its parked slot, one ``maxstep`` read per unit up to where the main slot is
acknowledged, then the parked slot is dropped and the replica follows the main slot again.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from lineage.cdc import columns as cdc_columns
from lineage.cdc.changes import (
    BatchError,
    Column,
    DdlChange,
    DdlKind,
    Numbered,
    TableSchema,
    Transaction,
    format_lsn,
    lsn_position,
    number,
    reduce_keyed,
    reduce_multiset,
)
from lineage.cdc.replicas import Scd
from lineage.core.errors import OffsetError, TidemarkError, first_line
from lineage.core.positions import ZERO_TS, Position
from lineage.spec.model import Replicator
from platform_assets.cdc import apply as cdc_apply
from platform_assets.cdc import ddl as cdc_ddl
from platform_assets.cdc import scd1 as cdc_scd1
from platform_assets.cdc.apply import Commit, Layout
from platform_assets.cdc.positions import Positions
from platform_assets.cdc.units import (
    ACTIVE_STATES,
    DROPPED,
    FAILING,
    PAUSED,
    REPLICATING,
    SNAPSHOTTING,
    CdcResult,
    ChangeSource,
    ColumnarSource,
    Table,
    applied_lsn,
    state_word,
)
from platform_assets.core import faults, locks, spark_io
from resources.core.settings import whole_number_setting
from resources.spark.session import make_active, sibling_sessions
from resources.state.lease import LeaseKeeper
from resources.state.offsets import OffsetRecord
from resources.storage import cdc_positions, delta_log, delta_meta
from resources.storage.meta_tables import LogEntry, write_etl_log
from resources.storage.warehouse import local_dir as warehouse_dir

if TYPE_CHECKING:

    from platform_assets.core.context import UnitContext

PROCESSOR = "cdc"
log = logging.getLogger(__name__)


SPILL_DIR = "_tidemark_spill"  # under a local warehouse: <warehouse>/_tidemark_spill/<replicator>/unit-<ns>/


def spill_rows_setting() -> int:
    """Changes a unit's columnar read holds in memory before it spills them to Parquet
    (``$TIDEMARK_CDC_SPILL_ROWS``, default 1,000,000)."""
    return whole_number_setting("TIDEMARK_CDC_SPILL_ROWS", 1_000_000, "changes")


APPLY_THREADS_ENV = "TIDEMARK_CDC_APPLY_THREADS"
#: A unit read change by change lands its replicas at once up to this many changes (their MERGE
#: sources are built at the same time); a columnar read up to ``cdc_apply.BROADCAST_BYTES`` of Arrow.
TOGETHER_CHANGES = 1_000_000


def apply_threads_setting() -> int:
    """How many replicas' MERGEs of one unit run at once (``$TIDEMARK_CDC_APPLY_THREADS``, default 3;
    1: one after another). Different replicas never conflict: each is its own Delta table, with its
    own txn id and offset record."""
    return whole_number_setting(APPLY_THREADS_ENV, 3, "replicas")


class StaleReplicaError(TidemarkError):
    """A replica's Delta log moved under the unit (another writer's commit took the txn version it
    planned, or came after what it reconciled): the unit is run again from what the log records."""


def retryable(exc: BaseException) -> bool:
    """A failure that may pass by itself (the source is down or busy), as opposed to one that needs a fix."""
    text = str(exc)
    return isinstance(exc, ConnectionError | TimeoutError | StaleReplicaError) or type(exc).__name__ == "OperationalError" or any(
        s in text for s in ("cannot connect", "cannot open a replication connection", "is in use by process",
                            "replication stream of slot", "Connection refused", "server closed the connection",
                            "INVALID_HANDLE.SESSION_CLOSED", "INVALID_HANDLE.SESSION_NOT_FOUND"))


@dataclass(frozen=True)
class Run:
    """One replica's changes in a unit: their sequence numbers, how many, the oldest commit time, the
    source position they reach, and ``land``, which applies them in one commit and returns the counts."""

    first: int
    last: int
    count: int
    oldest: dt.datetime
    lsn: int
    land: Callable[[Commit], dict[str, int]]


class ReplicatorUnit:
    """Runs units of one replicator in a unit context (:class:`~platform_assets.core.context.UnitContext`,
    which the Engine satisfies)."""

    def __init__(self, engine: UnitContext, rep: Replicator, source: ChangeSource, *, positions_every_s: float = 0.0) -> None:
        self.engine, self.rep, self.spec, self.source = engine, rep, rep.spec, source
        self.owner = engine.owner
        self.tables: dict[str, Table] = {}
        self.paused: dict[str, str] = {}  # replicas paused while the unit looked at the source's schemas
        #: replica -> record: replicas following the main slot whose source table is no longer in the
        #: source's catalog (renamed or dropped since the last unit): :meth:`_find_gone`
        self.gone: dict[str, OffsetRecord] = {}
        self._stream_schemas: dict[str, TableSchema] = {}  # the tables' schemas as the unit's read saw them
        self._horizon: int | None = None  # the WAL insert position when the gone replicas were found
        self._held: set[str] = set()  # records this unit locked besides its tables' (released at its end)
        warehouse = engine.settings.warehouse
        # where a read too big to hold spills: beside the tables, where Spark reads (also a remote Spark on a
        # shared mount); not a table (no _delta_log). A local path or file: URI; elsewhere (an object store) a
        # read is held in memory.
        local = warehouse_dir(warehouse)
        self._spill_dir = None if local is None else local / SPILL_DIR / rep.spec.name
        self._threads = apply_threads_setting()  # a bad setting fails the unit before it reads anything
        #: what Delta records of the replicas beyond their commits (``etl.cdc_positions__<name>``)
        self.positions = Positions(engine.settings, rep.spec.name, positions_every_s)
        self._local = threading.local()  # the Spark session of a thread applying a replica (_apply_tables)
        self._lock = threading.RLock()  # the unit's result and tables, updated by those threads

    @property
    def spark(self) -> Any:
        """The Spark session of this thread: its own when :meth:`_apply_tables` runs replicas at once."""
        return getattr(self._local, "spark", None) or self.engine.spark

    # ------------------------------------------------------------------ state
    def _record(self, key: str, note: str) -> OffsetRecord:
        return locks.acquire(self.engine.store, key, self.owner, processor=PROCESSOR, note=note)

    def layout(self, schema: TableSchema) -> Layout:
        opts = self.spec.table_options(schema.table)
        key, scd = opts.key, opts.scd
        key_cols = tuple(key) or schema.key
        missing = [k for k in key_cols if schema.column(k) is None]
        if missing:
            raise TidemarkError(f"replicator '{self.spec.name}' ({self.rep.where}): key {missing} of {schema.table} is "
                                f"not a column (columns: {', '.join(schema.names)})")
        if not key_cols and scd is Scd.TYPE2:
            raise TidemarkError(f"replicator '{self.spec.name}': {schema.table} has no key, so it is replicated as a "
                                f"multiset; scd 2 needs a key (set options: {{{schema.table}: {{key: [...]}}}})")
        return Layout(schema, key_cols, scd, opts.deletes, opts.change_feed, opts.deletion_vectors)

    def table(self, schema: TableSchema) -> Table:
        replica = self.spec.replica(schema.table)
        other = next((t for t in self.tables.values() if t.replica == replica and t.source != schema.table), None)
        if other is not None:
            raise TidemarkError(f"replicator '{self.spec.name}': source tables {other.source} and {schema.table} both map "
                                f"to replica {replica}; exclude one of them")
        path = self.engine.settings.table_path(replica)
        rec = self._reconcile(replica, path, self._record(replica, f"replica of {schema.table}"))
        if state_word(rec) == DROPPED and self.source.snapshots:
            # its table was dropped (renamed away, left the selection) and is in the source again: the
            # replica follows the table there now, copied from a snapshot (overwritten: its Delta history
            # keeps what it held). (Debezium lists every table it has seen, dropped ones too.)
            rec = self.engine.store.reset(replica, Position.zero(), who=self.owner,
                                          reason=f"{schema.table} is in the source again: copied again")
            self.engine.store.set_state(replica, self.owner, SNAPSHOTTING)
            rec = self.engine.store.get(replica) or rec
            log.info("replicator %s: %s is in the source again; replica %s will be copied again", self.spec.name,
                     schema.table, replica)
        table = self.tables[schema.table] = Table(schema.table, replica, path, self.layout(schema), rec,
                                                  from_start=not self.source.snapshots)
        snap = delta_meta.TableSnapshot.open(path) if table.applied is not None else None
        have = cdc_apply.columns_of(snap.table) if snap is not None else {}
        if snap is not None and have:  # the replica exists
            self._properties(table, snap)
            problem = cdc_ddl.alter(self, table, schema, have)  # columns the source has now and the replica lacks
            if problem and state_word(rec) != PAUSED:
                why = f"paused: {problem}; fix the replica's column type or re-copy it: tidemark cdc resume {replica} --resync"
                self.engine.store.set_state(replica, self.owner, why)
                table.rec = self.engine.store.get(replica) or rec
                self.paused[replica] = why
        return table

    def _properties(self, t: Table, snap: delta_meta.TableSnapshot) -> None:
        """The replica's change feed and deletion vectors (``snap``: its table now) set as its options
        say (``change_feed``, ``deletion_vectors``), when they were set otherwise (deletion vectors
        not set: turned on once the replica outgrows the driver's MERGE, by
        :func:`~platform_assets.cdc.apply.ensure_replica`). Deletion vectors turned off are dropped as a table
        feature (Delta rewrites the files that have one), so ``deltalake``'s pyarrow dataset path
        (``to_pandas``) reads the replica again."""
        if snap.table is None:
            return
        spark = self.engine.spark
        if delta_meta.change_feed_enabled(snap) != t.layout.change_feed:
            value = str(t.layout.change_feed).lower()
            spark.sql(f"ALTER TABLE delta.`{t.path}` SET TBLPROPERTIES ('{cdc_apply.CHANGE_FEED}' = '{value}')")
            log.info("replicator %s: replica %s: %s = %s (change_feed)", self.spec.name, t.replica, cdc_apply.CHANGE_FEED, value)
        if t.layout.deletion_vectors is None:  # not set: see cdc_apply.ensure_replica
            return
        done = spark_io.set_deletion_vectors(spark, t.path, t.layout.deletion_vectors, snap)
        if done:
            log.info("replicator %s: replica %s: %s (deletion_vectors: %s)", self.spec.name, t.replica, done,
                     str(t.layout.deletion_vectors).lower())

    def _reconcile(self, replica: str, path: str, rec: OffsetRecord) -> OffsetRecord:
        """The record caught up with what Delta records: the replica's log, then the replicator's
        positions table (a position past its newest commit, reached with nothing to write, and a
        paused or dropped state), both the truth where the store is behind (lost or restored)."""
        caught = self._reconcile_log(replica, path, rec)
        behind = caught is not rec or rec.seq == 0
        return self._reconcile_positions(replica, caught, behind=behind)

    def _reconcile_positions(self, replica: str, rec: OffsetRecord, *, behind: bool) -> OffsetRecord:
        """``rec`` moved to the position the positions table records for ``replica``, when it is past the
        record's (the replica had nothing before it: the slot may be acknowledged past its newest commit);
        with the recorded state (paused, dropped) where the store was behind. A replica to be copied
        (no position) or with a unit pending is left as it is."""
        got = self.positions.recorded
        recorded, applied = got.lsn.get(replica), applied_lsn(rec)
        if recorded is None or applied is None or rec.pending or recorded < applied:
            return rec
        if recorded > applied:
            behind = True
            rec = self._no_changes(replica, rec, recorded,
                                   note=f"caught up from {self.positions.table}: complete up to {format_lsn(recorded)}")
        state = got.state.get(replica, "")
        if behind and state and state_word(state) not in ACTIVE_STATES and rec.state != state:
            self.engine.store.set_state(replica, self.owner, state)
            rec = self.engine.store.get(replica) or rec
        return rec

    def _reconcile_log(self, replica: str, path: str, rec: OffsetRecord) -> OffsetRecord:
        """The record caught up with what the replica's Delta log records."""
        store, app = self.engine.store, f"tidemark:{replica}"
        seq = delta_log.recorded_txn(path, app)
        if seq <= rec.seq and not (rec.pending and seq == rec.seq):
            return rec
        try:
            commit = delta_log.find_txn_commit(path, app, seq, hint=rec.delta_version)
        except delta_log.CommitUnavailableError:  # removed by log retention: refused below, saying what to run
            commit = None
        meta = commit.user_metadata if commit else {}
        if commit is not None and "lsn" in meta:
            self.positions.committed(replica, int(meta["lsn"]))
        if commit is None or "lsn" not in meta:
            raise OffsetError(f"replica {replica} ({path}): its Delta log records unit {seq} but not the source position "
                              f"it applied (commit removed by log retention?); re-copy it: tidemark cdc resume {replica} "
                              f"--resync")
        if rec.pending and seq == rec.seq:  # landed, the offset commit was lost: finish it
            return store.commit(replica, self.owner, seq=seq, last=rec.last, next=rec.next or rec.last, rows=commit.rows,
                                state=REPLICATING, note="landed before a crash", delta_version=commit.version)
        return store.recover(replica, who=self.owner, expected_seq=rec.seq, seq=seq, last=lsn_position(int(meta["lsn"])),
                             rows=commit.rows, run=commit.timestamp, state=REPLICATING, source_version=None,
                             delta_version=commit.version, inputs={"changes": int((meta.get("changes") or [0, 0])[1])},
                             note=f"caught up from the Delta log: unit {seq} applied "
                                                                f"{format_lsn(int(meta['lsn']))}")

    def commit_meta(self, unit: int, lsn: int, **extra: Any) -> str:
        return json.dumps({"replicator": self.spec.name, "processor": PROCESSOR, "unit": unit, "lsn": lsn,
                           "lsn_text": format_lsn(lsn), "run_id": self.engine.run_id, "owner": self.owner, **extra})

    # ------------------------------------------------------------------ one unit
    def run_once(self) -> CdcResult:
        started = time.monotonic()
        key = self.spec.state_key
        rec = self._record(key, f"replicator {self.spec.name}")
        lease = LeaseKeeper(self.engine.store, key, self.owner).start()
        try:
            rec = self._recover_own(rec, self.positions.load())
            self.source.ensure_setup()
            for schema in self.source.tables().values():
                self.table(schema)
            self._find_gone()
            result = CdcResult(self.spec.name, rec.seq, "caught up", paused=dict(self.paused))
            self._park()
            self._snapshots(result, lease)
            if result.snapshots:
                result.reason = f"copied {len(result.snapshots)} table(s) from a consistent snapshot"
            self._stream(rec, result, lease)
            self._catch_up(result, lease)
            result.duration_s = round(time.monotonic() - started, 3)
            self.engine.store.set_state(key, self.owner, REPLICATING)
            return result
        except Exception as exc:
            self.engine.store.set_state(key, self.owner, f"{FAILING}: {first_line(exc)[:400]}")
            raise
        finally:
            lease.stop()
            for replica in {t.replica for t in self.tables.values()} | self._held:
                self.engine.store.release(replica, self.owner)
            self.engine.store.release(key, self.owner)

    def _snapshots(self, result: CdcResult, lease: LeaseKeeper) -> None:
        todo = [t for t in self.tables.values() if t.applied is None and t.active]
        if not todo or not self.source.snapshots:
            return
        store, spark = self.engine.store, self.engine.spark
        with self.source.snapshot() as snap:
            for t in todo:
                if t.rec.pending:  # a snapshot interrupted before it landed: copy again at this snapshot
                    t.rec = store.reset(t.replica, t.rec.last, who=self.owner, reason="snapshot interrupted: copied again")
                seq = t.rec.seq + 1
                t.rec = store.plan(t.replica, self.owner, last=t.rec.last, next=lsn_position(snap.lsn), seq=seq,
                                   source_version=None)
                lease.check()
                try:
                    rows = cdc_apply.write_snapshot(spark, t.path, t.layout, snap.rows(t.source),
                                                    Commit(f"tidemark:{t.replica}", seq,
                                                           self.commit_meta(seq, snap.lsn, kind="snapshot", key=list(t.layout.key))))
                except BatchError as exc:  # a value its replica cannot hold: this replica waits, the others go on
                    self._pause(t, f"copying it failed: {exc}", result)
                    continue
                faults.crashpoint("cdc-written")
                self.positions.committed(t.replica, snap.lsn)
                self._log(t, seq, "snapshot", {"rows": rows}, rows, lag=None)
                t.rec = store.commit(t.replica, self.owner, seq=seq, last=t.rec.last, next=lsn_position(snap.lsn), rows=rows,
                                     state=REPLICATING, note=f"snapshot at {format_lsn(snap.lsn)}: {rows} rows")
                result.snapshots[t.replica] = rows

    def _wanted(self, table: str, lsn: int) -> bool:
        t = self.tables.get(table)
        if t is None:
            gone = self.gone.get(self.spec.replica(table))
            if gone is not None:  # left the catalog: its changes up to its rename or drop
                return lsn > (applied_lsn(gone) or 0)
            return self.spec.selects(table)  # a table new to the replicator: all its changes
        return t.active and not t.parked and t.applied is not None and lsn > t.applied

    # ------------------------------------------------------------------ replicas whose table left
    def _find_gone(self) -> None:
        """Replicas of this replicator that follow the main slot but whose source table the catalog no
        longer lists: renamed or dropped since the last unit (or no longer selected). Their rename or
        drop is in the stream after their position, so the unit reads from there (:meth:`_stream_unit`)
        and applies it to them (:meth:`_apply_table`); one whose stream holds neither is retired by
        :meth:`_settle_gone`. Parked replicas are :meth:`_park`'s. A source without snapshots
        (Debezium) lists every table it has seen."""
        if not self.source.snapshots:
            return
        src: Any = self.source
        have = {t.replica for t in self.tables.values()}
        parked = set(src.parked()) if hasattr(src, "parked") else set()
        records = self.engine.store.list()
        known = {rec.topic for rec in records}
        for replica in sorted(set(self.positions.recorded.lsn) - known - have):  # a lost store: the positions table lists it
            path = self.engine.settings.table_path(replica)
            records.append(self._reconcile(replica, path, self._record(replica, "replica of a table that left the "
                                                                                "source's catalog")))
            self._held.add(replica)
        for rec in records:
            if (rec.processor == PROCESSOR and self.spec.holds(rec.topic) and rec.topic not in have
                    and state_word(rec) in ACTIVE_STATES and applied_lsn(rec) is not None
                    and not (parked and src.parked_slot(rec.topic) in parked)):
                self.gone[rec.topic] = self._record(rec.topic, "replica of a table that left the source's catalog")
                self._held.add(rec.topic)
        if self.gone and hasattr(src, "wal_insert_lsn"):
            # a rename or drop the catalog no longer shows is in the WAL before here, flushed or not yet
            # (synchronous_commit off): a read that ends before it has not seen them all
            self._horizon = src.wal_insert_lsn()

    def _gone_table(self, source_table: str, first: Any) -> Table | None:
        """The unit's table for a replica in :attr:`gone` whose source table ``source_table`` has
        changes or a schema change (``first``, its first run) in this unit's read; None: not one."""
        replica = self.spec.replica(source_table)
        if replica not in self.gone:
            return None
        path = self.engine.settings.table_path(replica)
        ddl = first[0] if isinstance(first, tuple) else None
        schema = self._stream_schemas.get(source_table)
        if schema is None and ddl is not None and ddl.schema is not None:  # a rename: the new name's columns
            schema = TableSchema(source_table, ddl.schema.columns, ddl.schema.key)
        if schema is None:  # a drop and nothing before it: the replica's columns will do
            cols = cdc_apply.replica_columns(path)
            schema = TableSchema(source_table, tuple(Column(n, typ) for n, typ in cols.items()))
            opts = self.spec.table_options(source_table)
            layout = Layout(schema, (), Scd.TYPE1, opts.deletes, opts.change_feed, opts.deletion_vectors)
            t = self.tables[source_table] = Table(source_table, replica, path, layout, self.gone.pop(replica))
            return t
        key = self._recorded_key(replica, path)
        if key is None and not schema.key and not self.spec.table_options(source_table).key:
            # replica identity FULL (the stream flags every column) and a replica written before its
            # commits recorded the key: a multiset has its copy column; a keyed replica's key is not known
            if cdc_apply.COPY not in cdc_apply.replica_columns(path):
                raise TidemarkError(
                    f"replicator '{self.spec.name}': {source_table} left the source's catalog (renamed or dropped) and "
                    f"the key of its replica {replica} cannot be told: its replica identity is FULL and the replica's "
                    f"commits do not record it (written before Tidemark recorded keys there); set it in the "
                    f"replicator's options ({source_table}: {{key: [...]}}) and run again")
            key = ()
        schema = TableSchema(source_table, schema.columns, schema.key if key is None else key)
        del self.gone[replica]
        return self.table(schema)

    def _recorded_key(self, replica: str, path: str) -> tuple[str, ...] | None:
        """The key the replica's last commit records (``key`` in its ``userMetadata``); None: none."""
        app = f"tidemark:{replica}"
        seq = delta_log.recorded_txn(path, app)
        try:
            commit = delta_log.find_txn_commit(path, app, seq) if seq else None
        except delta_log.CommitUnavailableError:
            return None
        key = (commit.user_metadata if commit else {}).get("key")
        return tuple(key) if isinstance(key, list) else None

    def _settle_gone(self, upto: int, caught_up: bool) -> None:
        """After a unit's read up to ``upto``: replicas in :attr:`gone` whose rename or drop it did not
        hold. Read to the server's end (``caught_up``), there is none to wait for: retired, kept as they
        are; else moved to ``upto`` (they had nothing before it), to look further next unit."""
        store = self.engine.store
        for replica, rec in list(self.gone.items()):
            if caught_up and (self._horizon is None or upto + 1 >= self._horizon):  # (read through upto: ReadResult.end)
                why = (f"dropped: its source table is no longer in the source's catalog or selection, and no rename or "
                       f"drop of it was seen after {format_lsn(applied_lsn(rec) or 0)}; the replica is kept as it was "
                       f"(copied again if its table comes back)")
                store.set_state(replica, self.owner, why)
                log.warning("replicator %s: replica %s %s", self.spec.name, replica, why)
                del self.gone[replica]
            elif (applied_lsn(rec) or 0) < upto and not rec.pending:
                self.gone[replica] = self._no_changes(replica, rec, upto)

    @property
    def _gone_positions(self) -> list[int]:
        """Where the replicas in :attr:`gone` stand (their rename or drop comes after)."""
        return [applied_lsn(r) or 0 for r in self.gone.values()]

    # ------------------------------------------------------------------ parked replicas
    def _park(self) -> None:
        """Paused replicas onto slots of their own; parked slots no longer needed dropped; a replica
        whose place on the server is gone (its parked slot dropped while the main slot moved on)
        paused, asking for a new copy, instead of following the main slot past changes it lacks."""
        if not hasattr(self.source, "park"):
            return
        src: Any = self.source
        store = self.engine.store
        slots = src.parked()
        confirmed = src.position().confirmed_flush
        for t in self.tables.values():
            has = src.parked_slot(t.replica) in slots
            if state_word(t.rec) == DROPPED or (has and t.applied is None):  # gone, or to be copied again
                if has:
                    src.unpark(t.replica)
                continue
            if t.applied is None:
                continue
            if not has and t.applied < confirmed:
                why = (f"paused: its changes after {format_lsn(t.applied)} are no longer kept by the server (the main slot "
                       f"is at {format_lsn(confirmed)} and its parked slot is gone); copy it again: tidemark cdc resume "
                       f"{t.replica} --resync")
                if t.rec.state != why:
                    store.set_state(t.replica, self.owner, why)
                    t.rec = store.get(t.replica) or t.rec
                    self.paused[t.replica] = why
                    log.error("replicator %s: replica %s %s", self.spec.name, t.replica, why)
                t.parked = True  # holds nothing back and reads nothing until copied again
                continue
            if not t.active and not has:
                why = src.park(t.replica, t.applied)
                has = why is None
                if has:
                    log.info("replicator %s: paused replica %s parked on slot %s at %s", self.spec.name, t.replica,
                             src.parked_slot(t.replica), format_lsn(t.applied))
                else:
                    log.warning("replicator %s: paused replica %s is not parked (%s); it holds the main slot back, and "
                                "every read decodes the WAL since its position", self.spec.name, t.replica, why)
            t.parked = has
        self._drop_orphans(src, set(slots) - {src.parked_slot(t.replica) for t in self.tables.values()})

    def _drop_orphans(self, src: Any, orphans: set[str]) -> None:
        """Parked slots of replicas whose source table left the source (dropped, renamed, deselected)
        while they were paused: the slot goes (it would hold WAL forever) and the replica is marked
        dropped, kept as it is."""
        if not orphans:
            return
        store = self.engine.store
        for rec in store.list():
            slot = src.parked_slot(rec.topic)
            if rec.processor != PROCESSOR or slot not in orphans:
                continue
            why = (f"dropped: its source table left the source while it was paused (its parked slot "
                   f"{slot} removed); the replica is kept as it was")
            try:
                store.acquire(rec.topic, self.owner)
                store.set_state(rec.topic, self.owner, why)
            finally:
                store.release(rec.topic, self.owner)
            src.unpark(rec.topic)
            log.warning("replicator %s: replica %s %s", self.spec.name, rec.topic, why)

    def _catch_up(self, result: CdcResult, lease: LeaseKeeper) -> None:
        """A resumed parked replica: one read of its parked slot up to where the main slot is
        acknowledged, applied like any unit; there, its parked slot goes and it rejoins. Numbered
        above every number the replicator gave out, so a later unit's replay numbers alike."""
        src: Any = self.source
        store = self.engine.store
        for t in [t for t in self.tables.values() if t.parked and t.active and t.applied is not None]:
            lease.check()
            target = src.position().confirmed_flush
            start, slot = t.applied, src.parked_slot(t.replica)
            if start < target:
                try:
                    txs = src.read(start, upto=target, max_changes=self.spec.maxstep, slot=slot,
                                   wanted=lambda table, lsn, t=t, start=start: table == t.source and lsn > start)
                except Exception as exc:
                    if retryable(exc):
                        raise
                    self._pause(t, f"reading its parked slot {slot} failed: {first_line(exc)[:300]}", result)
                    continue
                upto = max(int(getattr(txs, "end", 0) or 0), txs[-1].lsn if txs else 0)
                if txs:
                    own = store.get(self.spec.state_key)
                    first = max([own.inputs.get("changes", 0) if own else 0]
                                + [t2.rec.inputs.get("changes", 0) for t2 in self.tables.values()]) + 1
                    seq_of = {id(n.change): n for n in number(txs, first)}
                    self._apply_table(t.source, self._split(txs).get(t.source, []), result.unit, seq_of, result)
                    result.reason = f"replica {t.replica} catching up from its parked slot up to {format_lsn(upto)}"
                if not t.active or t.applied is None:
                    continue  # paused again, or to be copied again
                self._advance(upto, [t])
                if self._durable(idle=not txs):
                    src.ack(t.applied, slot=slot)
            if t.applied >= target and self._durable(idle=False):  # (then the main slot is acknowledged past it)
                src.unpark(t.replica)
                t.parked = False
                log.info("replicator %s: replica %s caught up from its parked slot; follows the main slot again",
                         self.spec.name, t.replica)

    def _stream(self, rec: OffsetRecord, result: CdcResult, lease: LeaseKeeper) -> None:
        if self._spill_dir is not None:  # under the replicator's lock: what is there was left by a killed unit
            shutil.rmtree(self._spill_dir, ignore_errors=True)
        try:
            self._stream_unit(rec, result, lease)
        finally:
            if self._spill_dir is not None:
                shutil.rmtree(self._spill_dir, ignore_errors=True)

    def _stream_unit(self, rec: OffsetRecord, result: CdcResult, lease: LeaseKeeper) -> None:
        store = self.engine.store
        key = self.spec.state_key
        active = [t.applied for t in self.tables.values() if t.applied is not None and t.active and not t.parked]
        active += self._gone_positions  # their rename or drop is after there
        after = min(active) if active else 0  # paused replicas hold the acknowledgement back, not the reading
        txs: list[Transaction] | None = None
        if rec.pending:  # a unit planned before a crash: exactly its transactions again, numbered alike
            result.redone = True
            unit, upto = rec.seq, int(rec.source_version or 0)
            first = (rec.inputs_next or {}).get("first", rec.inputs.get("changes", 0) + 1)
            cols = self._read_columns(after, upto=upto, max_changes=10**12)
            if cols is None:
                txs = self.source.read(after, upto=upto, max_changes=10**12, wanted=self._wanted)
            transactions = cols.transactions if cols is not None else len(txs or [])
        else:
            cols = self._read_columns(after, max_changes=self.spec.maxstep)
            if cols is None:
                txs = self.source.read(after, max_changes=self.spec.maxstep, wanted=self._wanted)
                # the source holds nothing more of the selection up to ``end`` (PostgreSQL: also past skipped WAL)
                upto = max(int(getattr(txs, "end", 0) or 0), txs[-1].lsn if txs else 0)
                transactions, rows = len(txs), sum(t.rows for t in txs)
            else:
                upto, transactions, rows = cols.lsn, cols.transactions, cols.rows
            if not transactions:
                self._settle_gone(upto, bool(getattr(txs, "caught_up", False)))
                self._advance(upto)
                result.acked = self._ack(upto, idle=True)
                return
            unit = rec.seq + 1
            first = max([rec.inputs.get("changes", 0)] + [t.rec.inputs.get("changes", 0) for t in self.tables.values()]) + 1
            rec = store.plan(key, self.owner, last=rec.last, next=Position(ZERO_TS, unit), seq=unit, source_version=upto,
                             inputs_next={"changes": first + rows - 1, "first": first})
            faults.crashpoint("cdc-planned")
        result.unit, result.transactions = unit, transactions
        runs = self._column_runs(cols, first) if cols is not None else None
        if runs is None and txs is None:  # the columns hold what only the Python path reduces: the same transactions
            txs = self.source.read(after, upto=upto, max_changes=10**12, wanted=self._wanted)
        self._stream_schemas = dict(getattr(txs, "schemas", None) or {})
        lease.check()
        if runs is not None:
            # (a spilled effect is a plan of the unit's session; a big read's MERGE sources, built at once, add up)
            self._apply_tables([(name, [run]) for name, run in runs.items()], unit, {}, result,
                               together=not cols.spilled and cols.nbytes <= cdc_apply.BROADCAST_BYTES)
        else:
            seq_of = {id(n.change): n for n in number(txs or [], first)}
            self._apply_tables(list(self._split(txs or []).items()), unit, seq_of, result,
                               together=sum(len(tx.changes) for tx in txs or []) <= TOGETHER_CHANGES)
        store.commit(key, self.owner, seq=unit, last=rec.last, next=rec.next or rec.last, rows=result.changes,
                     note=f"unit {unit}: {transactions} transactions up to {format_lsn(upto)}")
        self._settle_gone(upto, not result.redone and bool(getattr(txs, "caught_up", False)))
        self._advance(upto)
        faults.crashpoint("cdc-committed")
        result.acked = self._ack(upto, idle=False)
        result.reason = f"unit {unit}: {transactions} transactions, {result.changes} changes up to {format_lsn(upto)}"

    # ------------------------------------------------------------------ changes as columns
    def _read_columns(self, after: int, *, upto: int | None = None, max_changes: int) -> Any:
        """The source's columnar read (``read_columns``) when it has one and every replica reading
        changes is a keyed SCD1 replica (the layout :mod:`lineage.cdc.columns` reduces); None: the
        Python path (:meth:`ChangeSource.read`) reads this unit."""
        if getattr(self.source, "read_columns", None) is None or self.gone:  # (a bench sets it to None: the Python
            return None  # path; a replica whose table left the catalog takes its rename or drop on that path too)
        read = cast(ColumnarSource, self.source).read_columns
        wanted_after: dict[str, int | None] = {}
        for t in self.tables.values():  # :meth:`_wanted` as positions
            on = t.active and not t.parked and t.applied is not None
            if on and (t.layout.multiset or t.layout.scd is not Scd.TYPE1):
                return None
            wanted_after[t.source] = t.applied if on else None
        spill_dir = None if self._spill_dir is None else self._spill_dir / f"unit-{time.time_ns()}"
        return read(after, upto=upto, max_changes=max_changes, wanted_after=wanted_after, spill_dir=spill_dir,
                    spill_rows=spill_rows_setting())

    def _column_runs(self, cols: cdc_columns.ColumnRead, first: int) -> dict[str, Run] | None:
        """Per source table, its changes of a columnar read reduced on columns (in Spark for a table
        spilled to Parquet), numbered from ``first`` in source order as :func:`lineage.cdc.changes.number`
        numbers them; None when a table's changes need the Python path
        (:class:`lineage.cdc.columns.NotColumnar`, or an error it reports its own way)."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        runs: dict[str, Run] = {}
        try:
            for name, part in cols.by_table().items():
                t = self.tables[name]
                rows = part.append_column(cdc_columns.SEQ, pc.add(part[cdc_columns.ROW], first))
                self._check_columns(t, rows.column_names)
                effect = cdc_columns.reduce_scd1(rows, t.layout.key, t.layout.schema.names, table=name)
                runs[name] = Run(rows[cdc_columns.SEQ][0].as_py(), rows[cdc_columns.SEQ][-1].as_py(), rows.num_rows,
                                 pc.min(rows[cdc_columns.TIME]).as_py(), rows[cdc_columns.LSN][-1].as_py(),
                                 functools.partial(self._land_columns, t, effect))
            for name, spilled in (cols.spilled or {}).items():
                t = self.tables[name]
                self._check_columns(t, pq.read_schema(spilled.path).names)
                df = cdc_scd1.spilled_effect(self.engine.spark, spilled, t.layout, first, table=name)
                runs[name] = Run(first + spilled.first_row, first + spilled.last_row, spilled.count,
                                 spilled.oldest or ZERO_TS, spilled.lsn, functools.partial(self._land_spilled, t, df, spilled))
        except (cdc_columns.NotColumnar, BatchError) as exc:
            log.info("replicator %s: reduced change by change (%s)", self.spec.name, exc)
            return None
        return runs

    @staticmethod
    def _check_columns(t: Table, have: list[str]) -> None:
        missing = [c for c in (*t.layout.schema.names, *map(cdc_columns.before, t.layout.key)) if c not in have]
        if missing:
            raise cdc_columns.NotColumnar(f"{t.source}: the read holds no column {', '.join(missing)}")

    def _land_spilled(self, t: Table, effect: Any, spilled: cdc_columns.Spilled, commit: Commit) -> dict[str, int]:
        cdc_scd1.apply_scd1_spilled(self.engine.spark, t.path, t.layout, effect, commit)
        return spilled.counts

    def _land_columns(self, t: Table, effect: cdc_columns.ColumnEffect, commit: Commit) -> dict[str, int]:
        cdc_scd1.apply_scd1_columns(self.spark, t.path, t.layout, effect, commit)
        return effect.counts

    def _apply_tables(self, jobs: list[tuple[str, list[Any]]], unit: int, seq_of: dict[int, Any], result: CdcResult,
                      *, together: bool) -> None:
        """Every source table's runs of a unit (:meth:`_apply_table`): up to :func:`apply_threads_setting`
        replicas at once, each thread on a Spark session of its own (a MERGE's txn settings are the
        session's), when ``together`` and no run carries a schema change (those, runs spilled to
        Parquet, whose effect is a plan of the unit's session, and big reads, whose MERGE sources
        would be built at once, go one after another on it). The order between replicas never
        mattered: each lands in its own commit with its own txn id and offset record, and a unit
        redone after a crash reads, per replica, only what it has not applied. Failures are raised
        after the others finished, one that needs a fix before one that may pass by itself (each is
        logged); an interrupt cancels the replicas not started and waits for the running ones.
        One caller at a time per engine session (the sibling sessions are the engine's)."""
        threads = min(self._threads, len(jobs))
        if threads < 2 or not together or any(isinstance(seg, tuple) for _, segs in jobs for seg in segs):
            for source_table, segments in jobs:
                self._apply_table(source_table, segments, unit, seq_of, result)
            return
        free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for session in sibling_sessions(self.engine.spark, self.engine.settings, threads):
            free.put(session)

        def work(source_table: str, segments: list[Any]) -> None:
            self._local.spark = free.get()
            make_active(self._local.spark)
            try:
                self._apply_table(source_table, segments, unit, seq_of, result)
            finally:
                free.put(self._local.spark)
                self._local.spark = None

        pool = ThreadPoolExecutor(threads, thread_name_prefix=f"tidemark-cdc-{self.spec.name}")
        try:
            futures = [pool.submit(work, name, segments) for name, segments in jobs]
            errors = [exc for f in futures if (exc := f.exception()) is not None]
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        if errors:
            errors.sort(key=lambda e: retryable(e) and not isinstance(e, OffsetError))  # a fix first
            for exc in errors[1:]:
                log.error("replicator %s: unit %d: a replica failed too: %s", self.spec.name, unit, first_line(exc))
            raise errors[0]

    def _apply_table(self, source_table: str, segments: list[Any], unit: int, seq_of: dict[int, Any],
                     result: CdcResult) -> None:
        """One source table's runs of changes and its DDL changes, in order; a failure that needs a fix pauses it."""
        t = self.tables.get(source_table)
        try:
            for seg in segments:
                if isinstance(seg, tuple):
                    if t is None:
                        with self._lock:
                            t = self._gone_table(source_table, seg)
                    t = cdc_ddl.apply(self, t, seg[0], seg[1].lsn, result)
                    if t is None or not t.active or t.applied is None or seg[0].kind is DdlKind.RENAME:
                        # paused, dropped, or new: copied by the next unit's snapshot; renamed: later changes
                        # under this name are another table's (one renamed into it: the next unit copies it)
                        break
                    continue
                if t is None:
                    with self._lock:
                        schema = self.source.tables().get(source_table)
                        t = self.table(schema) if schema is not None else self._gone_table(source_table, seg)
                        if t is None:  # renamed to a name of the same replica ("Foo" -> foo): its changes go there
                            same = self.spec.replica(source_table)
                            t = next((t2 for t2 in self.tables.values() if t2.replica == same), None)
                    if t is None:  # left the catalog, without a replica to bring up to its drop: nothing to keep
                        log.info("replicator %s: %s is no longer in the source; its changes in unit %d are skipped",
                                 self.spec.name, source_table, unit)
                        break
                cdc_apply.ensure_replica(self.spark, t.path, t.layout)
                run = seg if isinstance(seg, Run) else self._python_run(t, [seq_of[id(c)] for c, _tx in seg], seg[-1][1])
                self._apply(t, unit, run, result)
        except Exception as exc:
            if t is None or retryable(exc) or isinstance(exc, OffsetError):
                raise
            self._pause(t, f"applying its changes failed: {first_line(exc)[:300]}", result)

    def _pause(self, t: Table, problem: str, result: CdcResult) -> None:
        """A failure that needs a fix: this replica stops (nothing after it applied or acknowledged), the
        others go on; its state says why and what to run."""
        why = f"paused: {problem}; after fixing it: tidemark cdc resume {t.replica} (or --resync to copy it again)"
        self.engine.store.set_state(t.replica, self.owner, why)
        t.rec = self.engine.store.get(t.replica) or t.rec
        with self._lock:
            result.paused[t.replica] = why
            counts = result.tables.setdefault(t.replica, {})
            counts["failed"] = counts.get("failed", 0) + 1
        log.error("replicator %s: replica %s %s", self.spec.name, t.replica, why)

    def _advance(self, upto: int, tables: list[Table] | None = None) -> None:
        """Replicas with nothing more up to ``upto`` are there: their records move without a write
        (default: every replica following the main slot)."""
        for t in tables if tables is not None else [t for t in self.tables.values() if not t.parked]:
            if t.active and t.applied is not None and t.applied < upto and not t.rec.pending:
                t.rec = self._no_changes(t.replica, t.rec, upto)

    def _no_changes(self, replica: str, rec: OffsetRecord, upto: int, *, note: str = "no changes") -> OffsetRecord:
        """``replica``'s record (``rec``) moved to ``upto`` without a write: it had nothing before it."""
        store = self.engine.store
        rec = store.plan(replica, self.owner, last=rec.last, next=lsn_position(upto), seq=rec.seq + 1, source_version=None)
        return store.commit(replica, self.owner, seq=rec.seq, last=rec.last, next=lsn_position(upto), rows=0,
                            state=REPLICATING, note=note)

    def _split(self, txs: list[Transaction]) -> dict[str, list[Any]]:
        """Per source table, in order: runs of ``(RowChange, Transaction)`` separated by its DDL changes."""
        out: dict[str, list[Any]] = {}
        for tx in txs:
            for ch in tx.changes:
                segs = out.setdefault(ch.table, [])
                if isinstance(ch, DdlChange):
                    segs.append((ch, tx))
                    continue
                if not segs or isinstance(segs[-1], tuple):
                    segs.append([])
                segs[-1].append((ch, tx))
        return out

    def _python_run(self, t: Table, changes: list[Numbered], last_tx: Transaction) -> Run:
        """A replica's run of changes as Python objects (:mod:`lineage.cdc.changes`'s reductions)."""

        def land(commit: Commit) -> dict[str, int]:
            spark = self.spark
            if t.layout.multiset:
                effect = reduce_multiset(changes, t.layout.schema)
                cdc_apply.apply_multiset(spark, t.path, t.layout, effect, commit)
                return effect.counts
            keyed = reduce_keyed(changes, t.layout.schema, t.layout.key, history=t.layout.scd is Scd.TYPE2)
            (cdc_apply.apply_scd2 if t.layout.scd is Scd.TYPE2 else cdc_scd1.apply_scd1)(spark, t.path, t.layout, keyed, commit)
            return keyed.counts

        return Run(changes[0].seq, changes[-1].seq, len(changes), min(n.commit_time for n in changes), last_tx.lsn, land)

    def _apply(self, t: Table, unit: int, run: Run, result: CdcResult) -> None:
        store = self.engine.store
        lsn = run.lsn
        if t.rec.pending and t.rec.next != lsn_position(lsn):  # planned with other bounds and never landed
            t.rec = store.reset(t.replica, t.rec.last, who=self.owner, reason="unit re-planned after a crash")
        redo = t.rec.pending
        if redo:  # planned before a crash and not landed: exactly it again
            seq = t.rec.seq
        else:
            seq = t.rec.seq + 1
            t.rec = store.plan(t.replica, self.owner, last=t.rec.last, next=lsn_position(lsn), seq=seq, source_version=None,
                               inputs_next={"changes": run.last})
        commit = Commit(f"tidemark:{t.replica}", seq, self.commit_meta(unit, lsn, changes=[run.first, run.last],
                                                                      key=list(t.layout.key)))
        if not redo and delta_log.recorded_txn(t.path, commit.app_id) >= seq:
            raise self._stale(t, seq, lsn, "before its write")
        try:
            counts = run.land(commit)
        except BatchError as exc:
            raise TidemarkError(f"replica {t.replica}: {exc}") from None
        faults.crashpoint("cdc-written")
        landed = delta_log.find_txn_commit(t.path, commit.app_id, seq)
        if landed is None or int(landed.user_metadata.get("lsn", -1)) != lsn:  # Delta skipped it: the version was taken
            raise self._stale(t, seq, lsn, "after its write")
        self.positions.committed(t.replica, lsn)
        lag = (dt.datetime.now(dt.UTC).replace(tzinfo=None) - run.oldest).total_seconds()
        self._log(t, seq, "apply", counts, run.count, lag=lag, commit=landed)
        t.rec = store.commit(t.replica, self.owner, seq=seq, last=t.rec.last, next=lsn_position(lsn), rows=run.count,
                             state=REPLICATING, note=f"unit {unit}: {run.count} changes up to {format_lsn(lsn)}")
        with self._lock:
            result.changes += run.count
            totals = result.tables.setdefault(t.replica, {})
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
            result.lag_s = max(result.lag_s or 0.0, lag)

    def _stale(self, t: Table, seq: int, lsn: int, when: str) -> StaleReplicaError:
        """The replica's log records txn version ``seq`` (or a later one) for another write than this
        unit's up to ``lsn``: a writer the unit did not reconcile with (a killed unit's MERGE that still
        ran on a Spark Connect server, with the offset store lost meanwhile). Nothing of this unit counts
        for the replica; the next unit reconciles with the log and reads what it lacks."""
        app = f"tidemark:{t.replica}"
        recorded = delta_log.recorded_txn(t.path, app)
        got = delta_log.find_txn_commit(t.path, app, recorded)
        theirs = (got.user_metadata if got else {}).get("lsn_text", "?")
        return StaleReplicaError(f"replica {t.replica}: {when}, its Delta log records txn version "
                                 f"{recorded} (up to {theirs}) of another "
                                 f"writer, not this unit's version {seq} up to {format_lsn(lsn)}; the unit runs again "
                                 f"from what the log records")

    def _log(self, t: Table, seq: int, strategy: str, counts: dict[str, int], rows: int, *, lag: float | None,
             commit: delta_log.CommitStats | None = None) -> None:
        commit = commit or delta_log.find_txn_commit(t.path, f"tidemark:{t.replica}", seq)
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
        write_etl_log(self.engine.settings, LogEntry(
            topic=t.replica, ts=now, rows=rows, max_id=None, min_ts=None, max_ts=None, nulls={}, run_id=self.engine.run_id,
            processor=PROCESSOR, seq=seq, last=str(t.applied or 0), next=str((commit.user_metadata if commit else {}).get("lsn")),
            base_rows=rows, bad_rows=0, delta_version=commit.version if commit else None, duration_s=0.0, max_lag=lag,
            strategy=strategy, detail=f"replicator {self.spec.name}, source table {t.source}", changes=dict(counts)))

    def _ack(self, upto: int, *, idle: bool) -> int | None:
        """Acknowledge the source up to the lowest position every kept replica (paused ones too,
        unless parked on a slot of their own) applied; nothing while a replica waits for its first
        copy. Every replica parked: up to ``upto``, where the read ended. Only once Delta records
        every such position (:meth:`_durable`); an ``idle`` unit within the positions table's
        interval acknowledges nothing."""
        kept = [t for t in self.tables.values() if t.applied is not None and state_word(t.rec) != DROPPED]
        held = [t.applied for t in kept if not t.parked and t.applied is not None]
        held += self._gone_positions  # their rename or drop not read yet
        if not kept or any(t.applied is None and t.active for t in self.tables.values()):
            return None
        if not self._durable(idle=idle):
            return None
        lsn = min(held) if held else upto
        self.source.ack(lsn)
        faults.crashpoint("cdc-acked")
        return lsn

    # ------------------------------------------------------------------ positions in Delta
    def _recover_own(self, rec: OffsetRecord, got: cdc_positions.Recorded) -> OffsetRecord:
        """The replicator's record caught up with its unit number and change counter as the positions
        table records them (a lost or restored store would number units and changes again)."""
        if rec.pending or got.unit <= rec.seq:
            return rec
        return self.engine.store.recover(
            self.spec.state_key, who=self.owner, expected_seq=rec.seq, seq=got.unit, last=Position(ZERO_TS, got.unit),
            rows=0, run=None, state=REPLICATING, source_version=None, delta_version=got.version,
            inputs={"changes": got.changes},
            note=f"caught up from {self.positions.table}: unit {got.unit}")

    def _positions(self) -> dict[str, tuple[int, str]]:
        """Per replica the position up to which it is complete and its state, as this unit leaves them
        (replicas it did not look at keep what the table held)."""
        got = self.positions.recorded
        out = {r: (lsn, got.state.get(r, "")) for r, lsn in got.lsn.items()}
        for replica, rec in [(t.replica, t.rec) for t in self.tables.values()] + list(self.gone.items()):
            lsn = applied_lsn(rec)
            if lsn is None:
                out.pop(replica, None)  # to be copied (again): nothing to recover
            else:  # (the state of a replica that follows its source is not kept: only a pause or a drop)
                out[replica] = (lsn, REPLICATING if state_word(rec) in ACTIVE_STATES else rec.state)
        return out

    def _durable(self, *, idle: bool) -> bool:
        """Whether Delta records, for every replica, the position its record says it is complete up to,
        so the slot may be acknowledged up to there (:meth:`Positions.durable`: writes the positions
        table when it must; an ``idle`` unit at most every few seconds)."""
        own = self.engine.store.get(self.spec.state_key)
        changes = max([own.inputs.get("changes", 0) if own else 0]
                      + [t.rec.inputs.get("changes", 0) for t in self.tables.values()])
        return self.positions.durable(self._positions(), idle=idle, unit=own.seq if own else 0, changes=changes)
