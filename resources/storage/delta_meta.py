"""Cheap facts about Delta tables' rows without a JVM, through the ``deltalake`` package: a
version's snapshot, high-water positions, the end of the next block, null and late rows, how to
read a version whose files were vacuumed, and what changed in a view's inputs. The log itself
(versions, transactions, commit statistics) is :mod:`resources.storage.delta_log`; rows of tables
with deletion vectors or column mapping go through :mod:`resources.storage.delta_read`.

Planner sensors and ``tidemark lag`` use this, so they stay fast and never start Spark.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import datetime as dt
import functools
import json
import os
import re
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from lineage.core.errors import ProcessingError
from lineage.core.positions import Position, to_naive_utc
from lineage.planning.planner import TableMark
from lineage.spec.model import TopicSpec
from lineage.views.refresh import InputChange, Sizes, cluster_column
from resources.storage import delta_log, delta_read
from resources.storage.warehouse import arrow_filesystem, is_object_store

#: Delta truncates timestamp statistics to milliseconds; widen pruning ranges by this much.
STATS_SLACK = dt.timedelta(milliseconds=2)


class TableSnapshot:
    """One version of a Delta table, opened once. Planning a block asks the base table for its
    mark, its null and late rows and the block's end: one snapshot answers all of them, so the
    table and its file list are read once and every answer describes the same version."""

    def __init__(self, path: str, table: Any | None) -> None:
        self.path = path
        self.table = table  # deltalake.DeltaTable; None when there is no table at ``path``
        self.after: dict[Position, pa.Table] = {}  # every row after a position, read ahead (see prefetched)

    @classmethod
    def open(cls, path: str, version: int | None = None, *, at_least: int | None = None) -> TableSnapshot:
        """``path`` at ``version`` (default the newest: inside :func:`prefetched`, the one it opened,
        unless it is older than version ``at_least``)."""
        if version is None and (ready := _PREFETCHED.get()) is not None and path in ready:
            snap = ready[path].result()  # (None: reading it failed; read again here, which says why)
            if snap is not None and (at_least is None or snap.version is None or snap.version >= at_least):
                return snap
        return cls(path, delta_log.open_table(path, version))

    @functools.cached_property
    def version(self) -> int | None:
        return None if self.table is None else int(self.table.version())

    @functools.cached_property
    def columns(self) -> frozenset[str]:
        return frozenset() if self.table is None else frozenset(f.name for f in self.table.schema().fields)

    @functools.cached_property
    def row_count(self) -> int | None:
        """Rows in this version, from the files' statistics (None: no table or no statistics). With
        deletion vectors, the rows before the deletions they mark (the add actions as ``deltalake``
        lists them do not carry the vectors' cardinality): an upper bound."""
        return self._total("num_records")

    @functools.cached_property
    def size_bytes(self) -> int | None:
        """Bytes of this version's data files (None: no table, or the log does not say)."""
        return self._total("size_bytes")

    def _total(self, column: str) -> int | None:
        files = self.files
        if self.table is None or column not in files.column_names:
            return None
        return int(pc.sum(files[column]).as_py() or 0)

    @functools.cached_property
    def native(self) -> bool:
        """Whether ``pyarrow``'s own file systems reach this version's data files: a table at a
        local path or in object storage (see :func:`_native_path`) whose log names its files
        relative to it."""
        return self.table is not None and _native_path(self.path) and (
            self.files.num_rows == 0 or not pc.any(pc.match_substring_regex(self.files["path"], r"://|^/")).as_py())

    @functools.cached_property
    def plain(self) -> bool:
        """Whether this version's rows are its data files read whole as plain Parquet: no deletion
        vectors, column mapping or partition columns, every file reached natively (:attr:`native`)
        by a path that needs no decoding. (Then ``pos``/``id`` are read file by file, without
        deltalake's dataset.)"""
        if self.table is None or not self.native:
            return False
        proto = self.table.protocol()
        if not (proto.min_reader_version == 1
                or (proto.min_reader_version == 3 and set(proto.reader_features or ()) <= _PLAIN_READER_FEATURES)):
            return False
        meta = self.table.metadata()
        if meta.partition_columns or (meta.configuration or {}).get("delta.columnMapping.mode", "none") != "none":
            return False
        return self.files.num_rows == 0 or not pc.any(pc.match_substring(self.files["path"], "%")).as_py()

    @functools.cached_property
    def position_schema(self) -> pa.Schema:
        """``pos`` and ``id`` as the table's schema types them (what its rows are read as)."""
        table: Any = self.table  # (a table: only rows of one are read)
        full = pa.schema(table.schema().to_arrow())
        return pa.schema([full.field(c).remove_metadata() for c in ("pos", "id")])

    @functools.cached_property
    def files(self) -> pa.Table:
        """The data files with their flattened statistics (one row per add action), named by the
        table's column names (with column mapping the log keeps them under physical names)."""
        return pa.table({}) if self.table is None else delta_read.logical_files(self.table, self.physical_names)

    @functools.cached_property
    def physical_names(self) -> dict[str, str]:
        """``{physical name: column name}`` of this version's columns stored under another name
        (column mapping; empty without): :func:`delta_read.physical_names`, read once."""
        return {} if self.table is None else delta_read.physical_names(self.table)

    @functools.cached_property
    def scanned(self) -> bool:
        """Whether this version's rows are read through deltalake's DataFusion reader (column
        mapping or deletion vectors: see :func:`delta_read.needs_scan`)."""
        return self.table is not None and delta_read.needs_scan(self.table)

    @functools.cached_property
    def file_reader(self) -> delta_read.FileReader:
        """Reads chosen data files of this version with its column names (column mapping)."""
        return delta_read.FileReader(self.table, self.physical_names)


#: Reader features that leave a table's data files readable as plain Parquet.
_PLAIN_READER_FEATURES = frozenset({"timestampNtz"})

_PREFETCHED: contextvars.ContextVar[dict[str, concurrent.futures.Future[TableSnapshot | None]] | None] = \
    contextvars.ContextVar("tidemark_prefetched", default=None)


#: Up to this many rows after a position are read ahead by :func:`prefetched` (their ``pos`` and
#: ``id``: 16 bytes a row); more are read when a block's end is looked for, one table at a time.
PREFETCH_ROWS = 20_000


@contextlib.contextmanager
def prefetched(paths: Iterable[str], threads: int | None = None, after: Mapping[str, Collection[Position]] | None = None) -> Iterator[None]:
    """Open the newest snapshot of each of ``paths`` (its log and file list) in ``threads`` threads
    (default :func:`prefetch_threads`) at once, deltalake reading without Python's lock, and let
    :meth:`TableSnapshot.open` return
    those inside the block (waiting for the one it asks for, not for all: a caller that takes the
    tables in the order of ``paths`` works while the later ones are read). For a caller that looks
    at many tables in a row and takes each as it was when its read began: the planner's tick,
    whose block plans read that very version.
    ``after[path]``: positions whose following rows (at most :data:`PREFETCH_ROWS` by the
    statistics) are read ahead too, for :func:`find_block_end`."""
    unique = list(dict.fromkeys(paths))

    def fetch(path: str) -> TableSnapshot | None:
        try:
            snap = TableSnapshot(path, _kept_table(path))
            _ = snap.files, snap.columns
            for last in (after or {}).get(path, ()):
                if 0 < _rows_from(snap.files, last) <= PREFETCH_ROWS:  # (none: no block to end)
                    rows = _rows_after(snap, last, None)
                    if rows is not None:
                        snap.after[last] = rows
        except Exception:  # noqa: BLE001 - read again where it is used, which says what is wrong
            return None
        return snap

    pool = concurrent.futures.ThreadPoolExecutor(max(1, min(threads or prefetch_threads(), len(unique) or 1)))
    ready = {p: pool.submit(fetch, p) for p in unique}
    token = _PREFETCHED.set(ready)
    try:
        yield
    finally:
        _PREFETCHED.reset(token)
        pool.shutdown(wait=True, cancel_futures=True)  # (a caller that left early: reads not begun are not)
        now = time.monotonic()
        with _KEPT_LOCK:
            for path, future in ready.items():
                snap = None if future.cancelled() else future.result()
                if snap is None:
                    continue
                mark = None if snap.version is None else delta_log.commit_mark(path, snap.version)
                if mark is not None and len(_KEPT) < KEPT_TABLES:
                    _KEPT[path] = (snap.table, mark, now)
            for path in [p for p, (_, _, used) in _KEPT.items() if now - used > KEPT_SECONDS]:
                del _KEPT[path]


def prefetch_threads() -> int:
    """Threads for :func:`prefetched`: one per core this process may use, at most 4. Beside the
    planning thread, more threads than cores only contend for the cores and Python's lock: on 2
    cores a tick of 200 topics took 0.85 s with 2 threads against 0.95 s with 4 (and more CPU)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


#: The tables :func:`prefetched` opened, kept for the next time in this process (a code server
#: evaluates the planner every few seconds): brought up to date incrementally (a look for new
#: commits, and those read) instead of read again; at most this many, each for as long as it is
#: used at least every ``KEPT_SECONDS``.
KEPT_TABLES = 1024
KEPT_SECONDS = 900.0
_KEPT: dict[str, tuple[Any, tuple[str, int, int], float]] = {}  # path -> (table, its commit's mark, used at)
_KEPT_LOCK = threading.Lock()


def _kept_table(path: str) -> Any | None:
    """The newest version of the table at ``path``: a kept one brought up to date when its commit
    is still the one it was (not a table dropped and written anew), else opened."""
    with _KEPT_LOCK:
        kept = _KEPT.pop(path, None)  # one user at a time
    if kept is not None:
        table, mark, _ = kept
        try:
            if delta_log.commit_mark(path, int(table.version())) == mark:
                table.update_incremental()
                return table
        except Exception:  # noqa: BLE001 - dropped, or its log cleaned past it: opened anew
            pass
    return delta_log.open_table(path)


def _snapshot(source: str | TableSnapshot) -> TableSnapshot:
    """``source`` if it is a snapshot already, else the newest version of the table at that path."""
    return source if isinstance(source, TableSnapshot) else TableSnapshot.open(source)


def _check_position_columns(snap: TableSnapshot) -> None:
    missing = [c for c in ("pos", "id") if c not in snap.columns]
    if missing:
        raise ProcessingError(
            f"{snap.path}: base table has no {' and no '.join(missing)} column; a step topic's base table needs "
            "'pos TIMESTAMP' and 'id BIGINT' (the row's position)"
        )


def _ts(value: Any) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return to_naive_utc(value)
    return None


def _native_path(path: str) -> bool:
    """Whether ``pyarrow``'s own file systems take the table location ``path`` as
    :func:`arrow_filesystem` gives it: a local path without a scheme, or object storage (not e.g.
    ``file:/x`` or ``file://localhost/x``, on which ``SubTreeFileSystem`` aborts the process)."""
    return is_object_store(path) or re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", path) is None


def _dataset(snap: TableSnapshot, pruning: Any = None) -> Any:
    """``snap``'s table as a ``pyarrow`` dataset (``pruning``: deltalake's file pruning predicate),
    its files read through ``pyarrow``'s own file system rooted at the table instead of
    deltalake's default one, which calls back into Python for every read (~2 ms a table in a
    planner tick). A table whose files pyarrow does not reach that way (:attr:`TableSnapshot.native`)
    keeps the default."""
    table: Any = snap.table  # (callers have looked: there is a table)
    if not snap.native or snap.files.num_rows == 0:
        return table.to_pyarrow_dataset(file_pruning_predicate=pruning)
    fs, root = arrow_filesystem(snap.path)
    return table.to_pyarrow_dataset(file_pruning_predicate=pruning, filesystem=pafs.SubTreeFileSystem(root, fs))


@dataclass(frozen=True)
class _Wanted:
    """Which positioned rows (``pos`` and ``id`` both set) to read: ``pos >= since``, ``(pos, id)``
    after ``after``, ``pos <= upto`` (None: unbounded). As an expression for a dataset scan, and as
    compute kernels on a table read whole (a filter by expression plans an Acero query: ~4x the
    cost on the few thousand rows of a planner tick's file)."""

    since: dt.datetime | None = None
    after: Position | None = None
    upto: dt.datetime | None = None

    def expression(self, schema: pa.Schema) -> pc.Expression:
        """The same rows as an expression over a table of ``schema`` (see :func:`_position_filter`)."""
        pos, pos_type = pc.field("pos"), schema.field("pos").type
        cond = pos.is_valid() & _position_filter(schema, after=self.after)
        if self.since is not None:
            cond = cond & (pos >= pa.scalar(self.since, pos_type))
        if self.upto is not None:
            cond = cond & (pos <= pa.scalar(self.upto, pos_type))
        return cond

    def rows(self, table: pa.Table) -> pa.Table:
        """The rows of ``table`` (columns ``pos`` and ``id``) that are wanted."""
        pos, ids = table["pos"], table["id"]
        mask = pc.and_(pc.is_valid(pos), pc.is_valid(ids))
        if self.since is not None:
            mask = pc.and_(mask, pc.greater_equal(pos, pa.scalar(self.since, pos.type)))
        if self.after is not None:
            lp = pa.scalar(self.after.pos, pos.type)
            mask = pc.and_(mask, pc.or_(pc.greater(pos, lp), pc.and_(
                pc.equal(pos, lp), pc.greater(ids, pa.scalar(self.after.id, ids.type)))))
        if self.upto is not None:
            mask = pc.and_(mask, pc.less_equal(pos, pa.scalar(self.upto, pos.type)))
        return table.filter(mask)  # (null only where pos or id is null: dropped)


def _positions(snap: TableSnapshot, wanted: _Wanted, low: dt.datetime | None = None,
               high: dt.datetime | None = None) -> pa.Table:
    with delta_read.readable(snap.path):
        return _read_positions(snap, wanted, low, high)


def _read_positions(snap: TableSnapshot, wanted: _Wanted, low: dt.datetime | None,
                    high: dt.datetime | None) -> pa.Table:
    """``pos``/``id`` of ``snap``'s rows that are ``wanted``, read only from the files whose
    statistics allow a ``pos`` in ``[low, high]`` (None: unbounded; callers widen the bounds by
    :data:`STATS_SLACK` where they come from rows, not statistics). A plain table's files are read
    one by one as Parquet (~0.5 ms a small file against ~2.5 ms through deltalake's dataset, which
    a planner tick pays per table); any other table, or a file that does not read as its schema
    says, through deltalake's dataset."""
    if snap.plain:
        try:
            return _plain_positions(snap, wanted, low, high)
        except (_NotPlainError, pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            pass  # e.g. a file without an id column: the dataset fills it with nulls
    if snap.scanned:  # (the bounds only prune; the kernels below decide)
        bounds = [*([f"pos >= {delta_read.sql_literal(low)}"] if delta_read.nanosecond_range(low) else []),
                  *([f"pos <= {delta_read.sql_literal(high)}"] if delta_read.nanosecond_range(high) else [])]
        rows = delta_read.scan(snap.table, ["pos", "id"], " AND ".join(bounds) or None)
        return wanted.rows(rows if rows.schema.equals(snap.position_schema) else rows.cast(snap.position_schema))
    pruning = [*([("pos", ">=", _utc(low))] if low else []), *([("pos", "<=", _utc(high))] if high else [])]
    # The expression prunes; the kernels decide. deltalake's dataset gives a file written before the
    # table had an ``id`` column the guarantee ``id >= null``, which lets ``is_valid(id)`` keep its
    # rows (deltalake 1.x, pyarrow 26).
    return wanted.rows(_dataset(snap, pruning or None).to_table(
        columns=["pos", "id"], filter=wanted.expression(snap.position_schema)))


def _plain_positions(snap: TableSnapshot, wanted: _Wanted, low: dt.datetime | None, high: dt.datetime | None) -> pa.Table:

    files, target = snap.files, snap.position_schema
    keep = pa.array([True] * files.num_rows)
    if low is not None and "max.pos" in files.column_names:  # (a file without statistics is read)
        keep = pc.and_(keep, pc.invert(pc.fill_null(pc.less(files["max.pos"], pa.scalar(low, files["max.pos"].type)), False)))
    if high is not None and "min.pos" in files.column_names:
        keep = pc.and_(keep, pc.invert(pc.fill_null(pc.greater(files["min.pos"], pa.scalar(high, files["min.pos"].type)), False)))
    fs = arrow_filesystem(snap.path)[0]
    parts = []
    for rel in pc.filter(files["path"], keep).to_pylist():
        # (a compacted file, in small row groups, is read in those that can hold the range)
        part = delta_read.read_parquet_range(delta_log.join_path(snap.path, rel), fs, ["pos", "id"], "pos", low, high)
        if part.column_names != ["pos", "id"]:
            raise _NotPlainError(rel)  # (a column added to the table after the file was written)
        parts.append(wanted.rows(part if part.schema.equals(target) else part.cast(target)))
    return pa.concat_tables(parts) if parts else target.empty_table()


class _NotPlainError(Exception):
    """A data file that does not read as plain Parquet in the table's schema."""


def table_mark(source: str | TableSnapshot, *, positions: bool = True, newer_than: Position | None = None) -> TableMark:
    """Delta version and newest ``(pos, id)`` of a table (``positions=False``: version only,
    or newest ``pos`` with id 0 when the table has a ``pos`` column).

    ``newer_than``: for a caller that only compares the newest position with this one. When
    the statistics prove a row with an id more than :data:`STATS_SLACK` after it, no rows are
    read and the position is the statistics' newest ``pos`` with id 0, which compares the same."""
    snap = _snapshot(source)
    table, version = snap.table, snap.version
    if table is None:
        return TableMark(None, None, exists=False, location=snap.path)
    if "pos" not in snap.columns:
        return TableMark(None, version)
    files = snap.files
    if files.num_rows == 0 or "max.pos" not in files.column_names:
        return TableMark(None, version)
    max_pos = pc.max(files["max.pos"]).as_py()
    if max_pos is None:
        return TableMark(None, version)
    if not positions or "id" not in snap.columns:
        return TableMark(Position(_ts(max_pos) or max_pos, 0), version)
    # Statistics keep timestamps at millisecond precision: the newest row is at or after floor.
    floor = _minus(_ts(max_pos) or dt.datetime.min, STATS_SLACK)
    if newer_than is not None and floor > newer_than.pos and _ids_known_from(files, floor):
        return TableMark(Position(_ts(max_pos) or max_pos, 0), version)
    # Read the few rows at or after floor to find the exact newest (pos, id).
    rows = _positions(snap, _Wanted(since=floor), low=floor)
    if rows.num_rows == 0:  # the newest rows have no id (bad rows): the newest valid row is older
        rows = _positions(snap, _Wanted())
    if rows.num_rows == 0:
        return TableMark(None, version)
    rows = rows.sort_by([("pos", "descending"), ("id", "descending")])
    return TableMark(Position(_ts(rows["pos"][0].as_py()) or floor, int(rows["id"][0].as_py())), version)


def freshness(source: str | TableSnapshot) -> dt.datetime | None:
    """The position a dependency table is fresh up to: its newest ``pos``, or for a table
    without a ``pos`` column (a reference table) the time of its newest Delta commit, since
    every row it has was there then. None when there is no table or no row yet."""
    snap = _snapshot(source)
    if snap.table is None:
        return None
    if "pos" in snap.columns:
        mark = table_mark(snap, positions=False)
        return mark.max_position.pos if mark.max_position else None
    (newest,) = snap.table.history(1) or [{}]
    stamp = newest.get("timestamp")  # commitInfo timestamp, ms since the epoch (UTC)
    if not isinstance(stamp, int | float):
        return None
    return dt.datetime.fromtimestamp(stamp / 1000, dt.UTC).replace(tzinfo=None)


def _ids_known_from(files: pa.Table, floor: dt.datetime) -> bool:
    """Whether the statistics show no null ``id`` in the files that hold rows at or after
    ``floor`` (a row with a null id has no position, so it cannot be the newest)."""
    if "null_count.id" not in files.column_names:
        return False
    nulls = pc.filter(files["null_count.id"], pc.greater_equal(files["max.pos"], pa.scalar(floor, files["max.pos"].type)))
    return len(nulls) > 0 and pc.max(pc.fill_null(nulls, 1)).as_py() == 0


def _rows_from(files: pa.Table, last: Position) -> float:
    """How many rows the files that may hold rows after ``last`` have, by their statistics
    (infinite when they do not say)."""
    if files.num_rows == 0:
        return 0
    if "max.pos" not in files.column_names or "num_records" not in files.column_names:
        return float("inf")
    maybe = pc.filter(files["num_records"], pc.invert(pc.fill_null(pc.less(files["max.pos"], pa.scalar(
        _minus(last.pos, STATS_SLACK), files["max.pos"].type)), False)))
    return float(pc.sum(pc.fill_null(maybe, 2**62)).as_py() or 0)


def _rows_after(snap: TableSnapshot, last: Position, cutoff: dt.datetime | None) -> pa.Table | None:
    """``pos``/``id`` of the rows of ``snap`` after ``last`` with ``pos <= cutoff`` (None: any), in
    position order. Reads only the files whose statistics overlap ``[last.pos, cutoff]``, or none
    when :func:`prefetched` read every row after ``last`` already."""
    table = snap.table
    if table is None:
        return None
    _check_position_columns(snap)
    ahead = snap.after.get(last)
    if ahead is not None:
        return ahead if cutoff is None else ahead.filter(pc.less_equal(ahead["pos"], pa.scalar(cutoff, ahead["pos"].type)))
    # A row without an id has no position: it is quarantined, never part of a block.
    rows = _positions(snap, _Wanted(after=last, upto=cutoff), low=_minus(last.pos, STATS_SLACK), high=None if cutoff is None else _plus(cutoff, STATS_SLACK))
    return rows.sort_by([("pos", "ascending"), ("id", "ascending")])


@dataclass(frozen=True)
class BlockEnd:
    """Where the next block ends, how many base rows it holds, and the base table's Delta
    version the block was planned on (the block always reads that snapshot)."""

    end: Position | None
    rows: int
    version: int | None


def find_block_end(source: str | TableSnapshot, last: Position, cutoff: dt.datetime, maxstep: int) -> BlockEnd:
    """The end of the next block: the ``maxstep``-th row after ``last`` with ``pos <= cutoff``
    in ``(pos, id)`` order (or the last eligible row if fewer), and the number of rows in
    ``(last, end]``; ``end`` is None when no row is eligible.

    The cost follows the new data, not the table's history (see :func:`_rows_after`).
    """
    snap = _snapshot(source)
    rows, version = _rows_after(snap, last, cutoff), snap.version
    if rows is None:
        return BlockEnd(None, 0, None)
    if rows.num_rows == 0:
        return BlockEnd(None, 0, version)
    take = min(maxstep, rows.num_rows)
    end = Position(_ts(rows["pos"][take - 1].as_py()) or last.pos, int(rows["id"][take - 1].as_py()))
    if take < rows.num_rows:
        # Rows equal to the boundary position belong to the block too (ties are never split).
        tail = rows.slice(take)
        same = pc.and_(pc.equal(tail["pos"], rows["pos"][take - 1]), pc.equal(tail["id"], rows["id"][take - 1]))
        take += int(pc.sum(same).as_py() or 0)
    return BlockEnd(end, take, version)


def count_block(path: str, last: Position, next_: Position, version: int | None = None) -> int:
    """Rows of the base table at ``path`` (at ``version``) inside ``(last, next]``. When files of
    that version were compacted and deleted by VACUUM, the same rows are counted in a newer
    version where that is exact (see :func:`snapshot_read`), else :class:`RemovedDataError`."""
    try:
        rows = _rows_after(TableSnapshot.open(path, version), last, next_.pos)
    except OSError:  # a data file of that version is gone
        if version is None:
            raise
        route = snapshot_read(path, version, last, next_)
        rows = _rows_after(TableSnapshot.open(path, route.read_version), last, next_.pos)
        if rows is not None and route.max_id is not None:
            rows = rows.filter(pc.less_equal(rows["id"], pa.scalar(route.max_id, pa.int64())))
    if rows is None or rows.num_rows == 0:
        return 0
    at_end = pc.and_(pc.equal(rows["pos"], pa.scalar(next_.pos, rows.schema.field("pos").type)),
                     pc.greater(rows["id"], pa.scalar(next_.id, pa.int64())))
    return rows.num_rows - int(pc.sum(at_end).as_py() or 0)


def count_upto(snap: TableSnapshot, last: Position) -> int | None:
    """Rows of ``snap`` with a position at most ``last``: its rows by the files' statistics, less
    those after ``last`` (read from the files that may hold them) and those without a position (a
    null ``pos`` or ``id``). None when there is no table, a file's statistics do not count its
    rows, or the table may hold deletion vectors."""
    total = snap.row_count
    if total is None or snap.table is None or deletion_vectors(snap).feature or snap.files["num_records"].null_count:
        return None  # rows a vector deletes are still in the count; a file without statistics counts 0
    after = _rows_after(snap, last, None)
    return total - (0 if after is None else after.num_rows) - bad_position_rows(snap).num_rows


def bad_position_rows(source: str | TableSnapshot) -> pa.Table:
    """Rows whose ``pos`` or ``id`` is null. Reads only files whose statistics count nulls."""
    snap = _snapshot(source)
    table = snap.table
    if table is None:
        return pa.table({})
    files = snap.files
    if files.num_rows == 0 or "null_count.pos" not in files.column_names:
        return pa.table({})
    # A count the statistics do not give (a file written before the table had the column, or
    # without statistics for it) may be any: the file is read.
    counts = [files[c] if c in files.column_names else pa.nulls(files.num_rows, pa.int64()) for c in ("null_count.pos", "null_count.id")]
    if (pc.max(pc.add(pc.fill_null(counts[0], 1), pc.fill_null(counts[1], 1))).as_py() or 0) == 0:
        return pa.table({})
    # Filtered by kernels, not by an expression: deltalake's dataset gives a file without an ``id``
    # column the guarantee ``id >= null``, under which ``is_null(id)`` drops its rows.
    with delta_read.readable(snap.path):
        if snap.scanned:
            bad_rows = delta_read.scan(snap.table, predicate="pos IS NULL OR id IS NULL")
            return bad_rows if bad_rows.num_rows else pa.table({})
        bad = [b for b in (b.filter(pc.or_(pc.is_null(b["pos"]), pc.is_null(b["id"])))
                           for b in _dataset(snap, "pos IS NULL OR id IS NULL").to_batches()) if b.num_rows]
    return pa.Table.from_batches(bad) if bad else pa.table({})


@dataclass(frozen=True)
class LateRows:
    """Rows that arrived after their place was processed, and the commits that could not be
    read to look for them (removed by log retention): when ``unreadable`` is not empty the
    answer is incomplete, and callers must say so."""

    rows: pa.Table
    unreadable: tuple[int, ...] = ()


class RemovedDataError(ProcessingError):
    """Data files or commits Tidemark needs were removed (compacted by OPTIMIZE then deleted by
    VACUUM, or dropped by log retention) and no other route gives the same answer exactly. The
    message names the table, the version or file and the cause; callers add the topic and the
    command that lets it go on."""


def late_detection_warning(table: str, unreadable: tuple[int, ...]) -> str:
    """What to tell the user when late rows could not be looked for in ``unreadable`` commits of
    ``table`` ('' when there are none)."""
    if not unreadable:
        return ""
    first, last = unreadable[0], unreadable[-1]
    which = f"version {first}" if first == last else f"versions {first}..{last}"
    return (f"late-row detection incomplete: {table} {which} no longer in its Delta log (log retention); rows "
            f"added there at or before the topic's last position cannot be found (they are neither written nor quarantined)")


def missing_commits(path: str, after_version: int, upto: int) -> tuple[int, ...]:
    """Versions in ``(after_version, upto]`` whose commit file the table's log no longer holds."""
    if upto <= after_version:
        return ()
    fs, log = delta_log.log_fs(path)
    try:
        infos = fs.get_file_info(pafs.FileSelector(log))
    except (FileNotFoundError, OSError):
        return tuple(range(after_version + 1, upto + 1))
    present = {int(name[:-5]) for name in (i.base_name for i in infos) if name.endswith(".json") and name[:-5].isdigit()}
    return tuple(v for v in range(after_version + 1, upto + 1) if v not in present)


# -- what the log says happened since a version, and data files that are gone -------------------


@dataclass(frozen=True)
class _Added:
    """A data file a commit added with ``dataChange`` (new or changed rows; a compaction adds none)."""

    version: int
    path: str  # relative to the table root, unquoted
    stats: dict[str, Any]
    #: the files the same commit removed with ``dataChange`` (a DELETE, UPDATE or MERGE rewriting
    #: them): the rows it carried over from them are not new
    replaces: tuple[str, ...] = ()

    def low(self, column: str) -> Any:
        return (self.stats.get("minValues") or {}).get(column)


@dataclass
class _History:
    """The commits ``(after, upto]`` of a table, as far as its log still holds them."""

    after: int
    upto: int
    added: list[_Added] = field(default_factory=list)  # files added with dataChange, oldest first
    compacted: set[str] = field(default_factory=set)  # files added without dataChange (rewritten rows)
    removed_by: dict[str, tuple[int, str, bool]] = field(default_factory=dict)  # path -> (version, operation, dataChange)
    feed: dict[int, list[str]] = field(default_factory=dict)  # version -> the files its change data feed reads
    cdc_files: set[str] = field(default_factory=set)  # change data files (VACUUM deletes them by age alone)
    commits: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # version -> its actions
    data_changed: dict[int, bool] = field(default_factory=dict)  # version -> whether it changed any row
    #: version -> whether it only rewrote files (every add and remove with ``dataChange: false``, no
    #: metadata or protocol change): a compaction, or a purge of deletion vectors
    rewrite_only: dict[int, bool] = field(default_factory=dict)
    unreadable: list[int] = field(default_factory=list)  # versions gone from the log (log retention)

    @classmethod
    def read(cls, path: str, after: int, upto: int, names: Mapping[str, str] | None = None) -> _History:
        """``names``: ``{physical: column name}`` of a table with column mapping, for the statistics
        (:func:`delta_read.physical_names`)."""
        fs, log = delta_log.log_fs(path)
        out = cls(after, upto)
        for version in range(after + 1, upto + 1):
            try:
                actions = delta_log.read_commit(fs, log, version)
            except (FileNotFoundError, OSError):
                out.unreadable.append(version)
                continue
            out.commits[version] = actions
            op = next((str(a["commitInfo"].get("operation") or "") for a in actions if a.get("commitInfo")), "")
            cdc = [unquote(a["cdc"]["path"]) for a in actions if a.get("cdc")]
            out.cdc_files.update(cdc)
            data_files: list[str] = []
            # A file re-added with a deletion vector in the commit that removes it (DELETE, UPDATE,
            # MERGE with deletion vectors) holds no new row: only fewer of its old ones.
            removes = [a["remove"] for a in actions if a.get("remove")]
            removed = {unquote(r["path"]) for r in removes}
            rewritten = tuple(sorted(unquote(r["path"]) for r in removes if r.get("dataChange", True)))
            for a in actions:
                for kind in ("add", "remove"):
                    act = a.get(kind)
                    if not act:
                        continue
                    rel, data = unquote(act["path"]), bool(act.get("dataChange", True))
                    if data:
                        data_files.append(rel)
                    if kind == "remove":
                        out.removed_by[rel] = (version, op, data)
                    elif data:
                        if not (act.get("deletionVector") and rel in removed):
                            stats = delta_read.logical_stats(json.loads(act.get("stats") or "{}"), names or {})
                            out.added.append(_Added(version, rel, stats, tuple(r for r in rewritten if r != rel)))
                    else:
                        out.compacted.add(rel)
            # Without change data files the change feed reads the added and removed files themselves.
            out.feed[version] = cdc or data_files
            out.data_changed[version] = bool(cdc or data_files)
            out.rewrite_only[version] = not (cdc or data_files) and any(a.get("add") or a.get("remove") for a in actions) \
                and not any(a.get("metaData") or a.get("protocol") for a in actions)
        return out

    def why_gone(self, rel: str) -> str:
        """How a data file that no longer exists left the table."""
        by = self.removed_by.get(rel)
        if by is None:
            return "removed by VACUUM"
        version, op, data = by
        how = f"removed by {op or 'a commit'} at version {version}" if data else \
            f"compacted by {op or 'a commit'} at version {version}"
        return f"{how}, then deleted by VACUUM"


def missing_files(path: str, rels: list[str]) -> list[str]:
    """Those of the table's files ``rels`` (relative to its root) that no longer exist (deleted by
    VACUUM)."""
    if not rels:
        return []
    fs = arrow_filesystem(path)[0]
    infos = fs.get_file_info([delta_log.join_path(path, r) for r in rels])
    return [r for r, i in zip(rels, infos, strict=True) if i.type == pafs.FileType.NotFound]


def _ids_at(path: str, version: int) -> tuple[int | None, set[str]]:
    """The greatest ``id`` the table held at ``version`` (None: no row had one) and the paths of
    its data files, from the log alone (the files themselves may be gone). Raises
    :class:`RemovedDataError` when the log cannot say."""
    old = delta_log.open_table(path, version)
    if old is None:
        raise RemovedDataError(f"{path}: version {version} is no longer in its Delta log (removed by log retention)")
    files = delta_read.logical_files(old)
    paths = set(files["path"].to_pylist()) if files.num_rows else set()
    return _max_id(files, f"{path} (version {version})"), paths


def max_id(tables: Mapping[str, Collection[str]]) -> int | None:
    """The greatest ``id`` held now by the tables at the paths of ``tables`` that one of the
    writers named with each (their ``txnAppId``) has committed to (None: no row has one; a path without
    a table, or without a commit of those writers, holds none), from their Delta logs' statistics
    alone: no data file is read, and a table read before in this process is brought up to date
    incrementally. Raises :class:`RemovedDataError` when a file's statistics cannot say."""
    wanted = list(tables)
    best: int | None = None
    with prefetched(wanted):
        for path in wanted:
            snap = TableSnapshot.open(path)
            if snap.table is None or "id" not in snap.columns:
                continue
            if not any(snap.table.transaction_version(app) for app in tables[path]):
                continue  # another writer's table in the same schema: its ids are not ours to count
            high = _max_id(snap.files, f"{path} (version {snap.version})")
            best = high if best is None or (high is not None and high > best) else best
    return best


def _max_id(files: pa.Table, where: str) -> int | None:
    """The greatest ``id`` in the data files ``files`` (add actions with flattened statistics)."""
    if files.num_rows == 0:
        return None
    if "max.id" not in files.column_names or "num_records" not in files.column_names:
        raise RemovedDataError(f"{where}: the Delta log keeps no id statistics")
    nulls = files["null_count.id"].to_pylist() if "null_count.id" in files.column_names else [None] * files.num_rows
    best: int | None = None
    for high, rows, null in zip(files["max.id"].to_pylist(), files["num_records"].to_pylist(), nulls, strict=True):
        if high is None:
            if rows and null != rows:  # rows with an id, and no statistic saying how high
                raise RemovedDataError(f"{where}: the Delta log keeps no id statistics for one of its files")
            continue
        best = int(high) if best is None else max(best, int(high))
    return best


def _position_filter(schema: pa.Schema, last: Position | None = None, *, after: Position | None = None,
                     max_id: int | None = None, above_id: int | None = None) -> pc.Expression:
    """Rows with an id, at or before ``last``, after ``after``, ``id <= max_id``, ``id > above_id``."""
    pos_type = schema.field("pos").type
    cond = pc.field("id").is_valid()
    if last is not None:
        lp = pa.scalar(last.pos, pos_type)
        cond = cond & ((pc.field("pos") < lp) | ((pc.field("pos") == lp) & (pc.field("id") <= pa.scalar(last.id, pa.int64()))))
    if after is not None:
        ap = pa.scalar(after.pos, pos_type)
        cond = cond & ((pc.field("pos") > ap) | ((pc.field("pos") == ap) & (pc.field("id") > pa.scalar(after.id, pa.int64()))))
    if max_id is not None:
        cond = cond & (pc.field("id") <= pa.scalar(max_id, pa.int64()))
    if above_id is not None:
        cond = cond & (pc.field("id") > pa.scalar(above_id, pa.int64()))
    return cond


def _read_files(snap: TableSnapshot, rels: list[str], last: Position, *, above_id: int | None = None) -> pa.Table:
    """Rows of the table's data files ``rels`` at or before ``last`` (and with an id above
    ``above_id``), with every column each file has: read file by file, since one dataset over them
    would take the first file's columns and drop a column that a later file added (a late row
    quarantined without its values could not be replayed as it was). A file without ``pos`` or
    ``id`` holds no positioned row (its rows are bad rows, see :func:`bad_position_rows`)."""
    import pyarrow.dataset as pads

    path = snap.path
    fs = arrow_filesystem(path)[0]
    parts = []
    for rel in rels:
        file = delta_log.join_path(path, rel)
        if snap.scanned:  # physical column names: read whole, named, then filtered
            rows = snap.file_reader.read(file, fs if "://" in path else None)
            if "pos" in rows.column_names and "id" in rows.column_names:
                parts.append(rows.filter(_position_filter(rows.schema, last, above_id=above_id)))
            continue
        ds = pads.dataset(file, format="parquet", filesystem=fs if "://" in path else None)
        if "pos" in ds.schema.names and "id" in ds.schema.names:
            parts.append(ds.to_table(filter=_position_filter(ds.schema, last, above_id=above_id)))
    return _unified(parts)


def _unified(parts: list[pa.Table]) -> pa.Table:
    """``parts`` as one table with every column any of them has (an empty table without columns:
    none had rows to read)."""
    parts = [p for p in parts if p.num_columns]
    if not parts:
        return pa.table({})
    return pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]


_NS_PER = {"milliseconds": 1_000_000, "microseconds": 1_000, "nanoseconds": 1}


def _footer_type(column: Any) -> dict[str, Any]:
    return {"physical": column.physical_type, **json.loads(column.logical_type.to_json())}


def _may_hold_late(fs: Any, file: str, last: Position) -> bool:
    """False when the exact statistics in the Parquet footer of ``file`` show that none of its
    rows is at or before ``last`` (every row group starts after ``last.pos``, or at it with ids
    above ``last.id``); True when they do not tell (no statistics, INT96 or other types, mapped
    column names), and the file is read. The Delta log's statistics cannot say this: they are cut
    to milliseconds, and a row at ``last.pos`` with a higher id is the common case of a tie."""
    import pyarrow.parquet as pq

    meta = pq.read_metadata(file, filesystem=fs)
    names = {meta.schema.column(i).path: i for i in range(meta.num_columns)}
    if "pos" not in names or "id" not in names:
        return True
    pos_type, id_type = _footer_type(meta.schema.column(names["pos"])), _footer_type(meta.schema.column(names["id"]))
    if (pos_type["physical"] != "INT64" or pos_type["Type"] != "Timestamp" or pos_type.get("timeUnit") not in _NS_PER
            or id_type["physical"] not in ("INT32", "INT64") or id_type.get("isSigned") is False):
        return True
    per = _NS_PER[pos_type["timeUnit"]]
    limit = (last.pos - dt.datetime(1970, 1, 1)) // dt.timedelta(microseconds=1) * 1_000  # last.pos in ns
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        pos, ids = group.column(names["pos"]).statistics, group.column(names["id"]).statistics
        if pos is None or not pos.has_min_max:
            if group.num_rows and not (pos is not None and pos.null_count == group.num_rows):
                return True
            continue  # every position null: bad rows, never late ones
        low = int(pos.min_raw) * per
        if low > limit:
            continue
        if low < limit or ids is None or not ids.has_min_max or int(ids.min_raw) <= last.id:
            return True
    return False


def late_rows(source: str | TableSnapshot, after_version: int, last: Position) -> LateRows:
    """Rows added to the table after ``after_version`` (up to the snapshot's version) whose
    position is at or before ``last``: rows that arrived out of order, after their place was
    already processed.

    Reads only the commits after ``after_version`` and, of the files they added with
    ``dataChange`` (a compaction's files hold no new rows), only those whose statistics allow a
    position at or before ``last``. Commits the log no longer holds are listed in ``unreadable``.

    When some of those files are gone (compacted by OPTIMIZE, then deleted by VACUUM), their rows
    live on in the files that rewrote them, mixed with rows that were there before, and are told
    apart by ``id`` (see :func:`_late_rows_by_id`); where ids cannot tell,
    :class:`RemovedDataError` says which file and why."""
    snap = _snapshot(source)
    if snap.version is None or snap.version <= after_version:
        return LateRows(pa.table({}))
    path = snap.path
    history = _History.read(path, after_version, snap.version, snap.physical_names)
    limit = _plus(last.pos, STATS_SLACK)
    added = [a for a in history.added if (low := delta_log.parse_stat_ts(a.low("pos"))) is None or low <= limit]
    unreadable = tuple(history.unreadable)
    if not added:
        return LateRows(pa.table({}), unreadable)
    paths = [a.path for a in added]
    live = set(snap.files["path"].to_pylist()) if snap.files.num_rows else set()
    for _ in range(3):  # a VACUUM between looking and reading: look again
        gone = missing_files(path, [p for p in paths if p not in live])  # a file of the snapshot is there
        try:
            if not gone:
                fs = arrow_filesystem(path)[0]
                maybe = [p for p in paths if _may_hold_late(fs, delta_log.join_path(path, p), last)]
                return LateRows(_new_rows(snap, [a for a in added if a.path in maybe], last), unreadable)
            return LateRows(_late_rows_by_id(snap, history, added, gone, last), unreadable)
        except OSError:
            if missing_files(path, paths) == gone:
                raise  # not a file that went away meanwhile
    raise RemovedDataError(f"{path}: data files kept disappearing while late rows were looked for (a VACUUM running?)")


def _new_rows(snap: TableSnapshot, added: list[_Added], last: Position) -> pa.Table:
    """The rows at or before ``last`` that the files ``added`` brought: an appended file's rows, and
    of a file a DELETE, UPDATE or MERGE wrote (copy-on-write: the files it touched, rewritten;
    deletion vectors: the rows it updated, anew) only those at a ``(pos, id)`` the files that
    commit replaced did not hold. The others were there before (their block took them, or for a
    file added since, its own read finds them): a row updated or deleted in place is no late row.

    A row that arrived late stays found when a later commit deletes or rewrites it: its file is read
    whole (a deletion vector added since does not hide it; a file a rewrite removed is still there
    until VACUUM), as a copy-on-write writer's file is. The replaced files of a commit are read as
    they are on disk; one that is gone cannot tell, and the rows its rewrite carried count as late."""
    appended = [a.path for a in added if not a.replaces]
    parts = [_read_files(snap, appended, last)] if appended else []
    commits: dict[int, list[_Added]] = {}
    for a in added:
        if a.replaces:
            commits.setdefault(a.version, []).append(a)
    for version in sorted(commits):
        rows = _read_files(snap, [a.path for a in commits[version]], last)
        replaced = sorted({r for a in commits[version] for r in a.replaces})
        gone = set(missing_files(snap.path, replaced))
        parts.append(_not_carried_over(rows, _read_files(snap, [r for r in replaced if r not in gone], last)))
    return _unified(parts)


def _not_carried_over(rows: pa.Table, old: pa.Table) -> pa.Table:
    """``rows`` less those at a ``(pos, id)`` that ``old`` holds."""
    if rows.num_rows == 0 or old.num_rows == 0:
        return rows
    keys = rows.select(["pos", "id"])
    held = old.select(["pos", "id"]).cast(keys.schema).group_by(["pos", "id"]).aggregate([])
    # joined on the keys alone (a join carries no payload of nested types), then the rows picked by index
    index = pa.array(range(rows.num_rows), pa.int64())
    carried = keys.append_column("_i", index).join(held, ["pos", "id"], join_type="inner")
    keep = pc.invert(pc.is_in(index, value_set=carried["_i"].combine_chunks()))
    return rows.filter(keep)


def _late_rows_by_id(snap: TableSnapshot, history: _History, added: list[_Added], gone: list[str],
                     last: Position) -> pa.Table:
    """Late rows when files added since ``history.after`` are gone.

    A file added with ``dataChange`` that is still in the table is read as it is. The rows of one
    that left the table are, unless a data change removed them, in the files added since (a
    compaction keeps rows as they are), together with rows that were in the table at
    ``history.after``. Those had ids up to the greatest id of that version (the log's statistics
    say, without the files). If every such file's ids are above it (ids grow as rows arrive),
    the late rows among the rewritten ones are exactly the rows at or before ``last`` with a
    greater id in the files added since; otherwise :class:`RemovedDataError`."""
    path, after = snap.path, history.after
    live = set(snap.files["path"].to_pylist()) if snap.files.num_rows else set()
    kept = [a.path for a in added if a.path in live]
    rewritten = [a for a in added if a.path not in live]
    def cannot(a: _Added, why: str) -> RemovedDataError:
        state = (f"is gone ({history.why_gone(a.path)})" if a.path in gone else
                 f"was rewritten ({history.why_gone(a.path).split(', then')[0]}) and other files of that time are gone")
        return RemovedDataError(f"{path}: late rows added since version {after} cannot be found exactly: data file "
                                f"{a.path} (added by version {a.version}) {state}, and {why}")

    try:
        ceiling, before = _ids_at(path, after)
    except RemovedDataError as exc:
        raise cannot(next(a for a in added if a.path in gone),
                     f"the rows there before cannot be told apart from its rows: {exc}") from None
    for a in rewritten:
        low = a.low("id")
        if ceiling is not None and (not isinstance(low, int) or low <= ceiling):
            ids = "it has no id statistics" if not isinstance(low, int) else f"its ids (from {low})"
            raise cannot(a, f"{ids} are not above the greatest id at version {after} ({ceiling}), so they cannot tell "
                            f"its rows from the rows there before")
    files = snap.files
    limit = _plus(last.pos, STATS_SLACK)
    lows = files["min.pos"].to_pylist() if "min.pos" in files.column_names else [None] * files.num_rows
    highs = files["max.id"].to_pylist() if "max.id" in files.column_names else [None] * files.num_rows
    scan = []
    for rel, low, high in zip(files["path"].to_pylist() if files.num_rows else [], lows, highs, strict=True):
        if rel in before or rel in kept:  # there at ``after`` (no later id) / read whole below
            continue
        if (low is not None and (_ts(low) or limit) > limit) or (high is not None and ceiling is not None and high <= ceiling):
            continue
        scan.append(rel)
    parts = [_new_rows(snap, [a for a in added if a.path in live], last)] if kept else []
    if scan:
        parts.append(_read_files(snap, scan, last, above_id=ceiling))
    return _unified(parts)


@dataclass(frozen=True)
class SnapshotRead:
    """How to read the rows a table held at ``version``: at that version, or, when files of it
    were compacted and then deleted by VACUUM, at the newer ``read_version`` keeping only ids up
    to ``max_id`` (the same rows: see :func:`snapshot_read`)."""

    version: int
    read_version: int
    max_id: int | None = None

    @property
    def rerouted(self) -> bool:
        return self.read_version != self.version


def snapshot_read(path: str, version: int, after: Position | None = None, upto: Position | None = None) -> SnapshotRead:
    """How to read the rows of the table at ``path`` as of ``version`` in ``(after, upto]``
    (default: all), JVM-free.

    As they are when the files holding that range at ``version`` exist. When some are gone
    (OPTIMIZE, then VACUUM) the same rows are read from the newest version: exact when no commit
    since changed or deleted a row that was there (only compactions and appends) and every
    appended file's ids are above the greatest id at ``version``; then the rows of ``version``
    are those with an id up to it. Else :class:`RemovedDataError` names the file and why."""
    snap = TableSnapshot.open(path, version)
    if snap.version is None:
        raise RemovedDataError(f"{path}: version {version} is no longer in its Delta log (removed by log retention)")
    files = snap.files
    rels = files["path"].to_pylist() if files.num_rows else []
    if rels and "min.pos" in files.column_names and (after is not None or upto is not None):
        lo = _minus(after.pos, STATS_SLACK) if after is not None else dt.datetime.min
        hi = _plus(upto.pos, STATS_SLACK) if upto is not None else dt.datetime.max
        lows, highs = files["min.pos"].to_pylist(), files["max.pos"].to_pylist()
        rels = [r for r, a, b in zip(rels, lows, highs, strict=True)
                if (a is None or (_ts(a) or lo) <= hi) and (b is None or (_ts(b) or hi) >= lo)]
    gone = missing_files(path, rels)
    if not gone:
        return SnapshotRead(version, version)
    newest = delta_log.open_table(path)
    current = int(newest.version()) if newest is not None else version
    history = _History.read(path, version, current, snap.physical_names)
    cause = f"{path}: version {version} can no longer be read: its data file {gone[0]} is gone ({history.why_gone(gone[0])})"
    if history.unreadable:
        raise RemovedDataError(f"{cause}, and versions {history.unreadable[0]}..{history.unreadable[-1]} are no longer in "
                               f"its Delta log (log retention) to show what changed since")
    ceiling, before = _ids_at(path, version)
    for rel, (v, op, data) in history.removed_by.items():
        if data and (rel in before or rel in history.compacted):
            raise RemovedDataError(f"{cause}, and rows it held were changed or deleted since ({op or 'a commit'} at version "
                                   f"{v}), so the newest version does not hold the same rows")
    for a in history.added:
        low = a.low("id")
        if ceiling is not None and (not isinstance(low, int) or low <= ceiling):
            ids = "no id statistics" if not isinstance(low, int) else f"ids from {low}"
            raise RemovedDataError(f"{cause}, and rows added since (version {a.version}, {ids}) cannot be told apart from "
                                   f"its rows (ids up to {ceiling})")
    return SnapshotRead(version, current, ceiling if ceiling is not None else -(2**63))


def _property_on(snap: TableSnapshot, name: str) -> bool:
    """Whether the table's boolean property ``name`` is true (False without a table)."""
    conf = snap.table.metadata().configuration if snap.table is not None else {}
    return str(conf.get(name, "false")).lower() == "true"


def change_feed_enabled(snap: TableSnapshot) -> bool:
    return _property_on(snap, "delta.enableChangeDataFeed")


@dataclasses.dataclass(frozen=True)
class DeletionVectors:
    enabled: bool  # delta.enableDeletionVectors: writes may add deletion vectors
    feature: bool  # the table's protocol has the reader feature: the deltalake reader refuses its rows


def deletion_vectors(snap: TableSnapshot) -> DeletionVectors:
    """Whether the table (``snap``) writes deletion vectors and has their reader feature (JVM-free)."""
    features = (snap.table.protocol().reader_features or []) if snap.table is not None else []
    return DeletionVectors(_property_on(snap, "delta.enableDeletionVectors"), "deletionVectors" in features)


def input_change(table: str, path: str, old: int | None, upto: int | None = None) -> InputChange:
    """What changed in input ``table`` since version ``old`` up to version ``upto`` (default: now),
    JVM-free (the log's commit files, never the data): the version, the rows its commits changed,
    its row count, and why its change data feed cannot be read over ``(old, upto]`` ("" when it can):
    a commit removed from the log (log retention), or a file the feed reads (a change data file, or
    the file a commit added or removed) deleted by VACUUM. Compactions (``dataChange: false``) and
    other commits that change no row count as 0 changed rows: the change feed skips them; when every
    commit since ``old`` was such a rewrite, the change says so (``rewrites_only``: no unit is due
    for it)."""
    snap = TableSnapshot.open(path, upto)
    if snap.version is None:
        return InputChange(table, old, None, problem=f"no Delta table at {path}")
    change = InputChange(table, old, snap.version, table_rows=snap.row_count, table_bytes=snap.size_bytes)
    if not change.changed or old is None:
        return change
    if not change_feed_enabled(snap):
        return dataclasses.replace(change, problem="delta.enableChangeDataFeed is not set on the table "
                                                   f"(ALTER TABLE delta.`{path}` SET TBLPROPERTIES (delta.enableChangeDataFeed = true))")
    history = _History.read(path, old, snap.version, snap.physical_names)
    gone = history.unreadable
    if gone:
        return dataclasses.replace(change, problem=f"versions {gone[0]}..{gone[-1]} were removed from its Delta log (log retention)")
    if all(history.rewrite_only[v] for v in range(old + 1, snap.version + 1)):
        change = dataclasses.replace(change, rewrites_only=True)
    rows: int | None = 0
    for v in range(old + 1, snap.version + 1):
        n = delta_log.changed_rows(delta_log.commit_stats(v, history.commits[v])) if history.data_changed[v] else 0
        rows = None if n is None or rows is None else rows + n
    needed = [(v, rel) for v in range(old + 1, snap.version + 1) for rel in history.feed[v]]
    if upto is None:  # up to now, a file the feed reads can only be gone if it left the table meanwhile
        needed = [(v, rel) for v, rel in needed if rel in history.removed_by or rel in history.cdc_files]
    missing = set(missing_files(path, [rel for _, rel in needed]))
    if missing:
        v, rel = next((v, rel) for v, rel in needed if rel in missing)
        return dataclasses.replace(change, changed_rows=rows, problem=(
            f"the change data of version {v} is gone: {rel} ({history.why_gone(rel)})"))
    return dataclasses.replace(change, changed_rows=rows)


def unit_sizes(base: TableSnapshot, snap: TableSnapshot, changes: Sequence[InputChange], spec: TopicSpec) -> Sizes | None:
    """The sizes a merge unit's cost estimate needs (:func:`lineage.views.refresh.estimate`), from the
    Delta logs alone: ``base`` at the planned version, the view ``snap`` now, every other input as
    its change says (:func:`input_change`); ``spec``: the view's topic. None when the view is not
    there or a log lacks file sizes."""
    sizes = {c.table: c.table_bytes for c in changes}
    if (snap.size_bytes is None or snap.row_count is None or base.size_bytes is None or base.row_count is None
            or None in sizes.values()):
        return None
    return Sizes(base_bytes=base.size_bytes, base_rows=base.row_count, view_bytes=snap.size_bytes,
                 view_files=snap.files.num_rows, view_rows=snap.row_count,
                 inputs_bytes={t: int(n or 0) for t, n in sizes.items()}, view_columns=len(snap.columns),
                 clustered=_clustered_by(snap, cluster_column(spec, list(snap.columns))),
                 deletion_vectors=deletion_vectors(snap).enabled)


def _clustered_by(snap: TableSnapshot, column: str | None) -> bool:
    """Whether the files of ``snap`` hold narrow ranges of ``column`` (by their statistics): on
    average a file spans at most a quarter of the column's range, so a literal filter on it skips
    most files. A view recomputed in full is written unclustered; a single file never skips."""
    if column is None or snap.files.num_rows < 2:
        return False
    files = snap.files
    low, high = f"min.{column}", f"max.{column}"
    if low not in files.column_names or high not in files.column_names:
        return False
    lo, hi = files[low], files[high]
    if not (pa.types.is_integer(lo.type) or pa.types.is_floating(lo.type) or pa.types.is_decimal(lo.type)):
        return False
    ranges = [(float(a), float(b)) for a, b in zip(lo.to_pylist(), hi.to_pylist(), strict=True)
              if a is not None and b is not None]
    if not ranges:
        return False
    span = max(b for _, b in ranges) - min(a for a, _ in ranges)
    widths = [b - a for a, b in ranges]
    return span > 0 and sum(widths) / len(widths) <= span / 4


def _utc(ts: dt.datetime) -> dt.datetime:
    return ts.replace(tzinfo=dt.UTC)


def _minus(ts: dt.datetime, delta: dt.timedelta) -> dt.datetime:
    try:
        return ts - delta
    except OverflowError:
        return dt.datetime.min


def _plus(ts: dt.datetime, delta: dt.timedelta) -> dt.datetime:
    try:
        return ts + delta
    except OverflowError:
        return dt.datetime.max
