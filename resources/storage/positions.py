"""``pos`` and ``id`` of a Delta table's rows, JVM-free: a table's mark (version and newest position),
the end of the next block and the rows in one, rows without a position (bad rows), a dependency's
freshness. Only the files whose statistics allow the wanted positions are read: a plain table's
files one by one as Parquet, any other table through deltalake's dataset or its DataFusion reader.

May import: ``lineage``, ``delta_log``, ``delta_read``, ``warehouse``, ``snapshot``, ``statistics``,
``history`` (a block of a version whose files were vacuumed is counted where
:func:`~resources.storage.history.snapshot_read` says).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from lineage.core.errors import ProcessingError
from lineage.core.positions import Position
from lineage.planning.planner import TableMark
from resources.storage import delta_log, delta_read
from resources.storage.history import snapshot_read
from resources.storage.snapshot import TableSnapshot, _snapshot
from resources.storage.statistics import STATS_SLACK, _ids_known_from, _minus, _plus, _ts, _utc
from resources.storage.warehouse import arrow_filesystem


def _check_position_columns(snap: TableSnapshot) -> None:
    missing = [c for c in ("pos", "id") if c not in snap.columns]
    if missing:
        raise ProcessingError(
            f"{snap.path}: base table has no {' and no '.join(missing)} column; a step topic's base table needs "
            "'pos TIMESTAMP' and 'id BIGINT' (the row's position)"
        )
    types = snap.position_schema
    if not pa.types.is_timestamp(types.field("pos").type) or not pa.types.is_integer(types.field("id").type):
        raise ProcessingError(
            f"{snap.path}: base table has 'pos' of type {types.field('pos').type} and 'id' of type "
            f"{types.field('id').type}; a step topic's base table needs 'pos TIMESTAMP' and 'id BIGINT' (the row's "
            "position); cast them in the table that feeds it"
        )


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
        cond = pos.is_valid() & position_filter(schema, after=self.after)
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


def position_filter(schema: pa.Schema, last: Position | None = None, *, after: Position | None = None,
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


def files_in_range(snap: TableSnapshot, low: dt.datetime | None, high: dt.datetime | None) -> list[str]:
    """The data files of ``snap`` (their paths as its log names them) whose statistics allow a
    ``pos`` in ``[low, high]`` (None: unbounded; callers widen bounds that come from rows by
    :data:`STATS_SLACK`). A file without statistics is always one of them."""
    files = snap.files
    if files.num_rows == 0:
        return []
    keep = pa.array([True] * files.num_rows)
    if low is not None and "max.pos" in files.column_names:
        keep = pc.and_(keep, pc.invert(pc.fill_null(pc.less(files["max.pos"], pa.scalar(low, files["max.pos"].type)), False)))
    if high is not None and "min.pos" in files.column_names:
        keep = pc.and_(keep, pc.invert(pc.fill_null(pc.greater(files["min.pos"], pa.scalar(high, files["min.pos"].type)), False)))
    return pc.filter(files["path"], keep).to_pylist()


def _plain_positions(snap: TableSnapshot, wanted: _Wanted, low: dt.datetime | None, high: dt.datetime | None) -> pa.Table:

    target = snap.position_schema
    fs = arrow_filesystem(snap.path)[0]
    parts = []
    for rel in files_in_range(snap, low, high):
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
    if snap.newest is None:
        snap.newest = (_newest(snap, floor),)
    return TableMark(snap.newest[0], version)


def _newest(snap: TableSnapshot, floor: dt.datetime) -> Position | None:
    """The exact newest valid ``(pos, id)`` of ``snap``, read from the few rows at or after ``floor``
    (the statistics' newest ``pos`` less the slack). None: no valid row."""
    rows = _positions(snap, _Wanted(since=floor), low=floor)
    if rows.num_rows == 0:  # the newest rows have no id (bad rows): the newest valid row is older
        rows = _positions(snap, _Wanted())
    if rows.num_rows == 0:
        return None
    rows = rows.sort_by([("pos", "descending"), ("id", "descending")])
    return Position(_ts(rows["pos"][0].as_py()) or floor, int(rows["id"][0].as_py()))


def every_row_upto(source: str | TableSnapshot, end: Position) -> bool:
    """Whether every row of the version has a ``(pos, id)`` at most ``end``, and none a null one, as
    the files' statistics and the newest rows (:func:`table_mark`) tell; False where they cannot
    tell. A read of the rows up to ``end`` then needs no filter, nor the ``pos`` and ``id`` columns
    that the filter alone would read (a view's full recompute whose query reads neither)."""
    snap = _snapshot(source)
    files = snap.files
    if snap.table is None or files.num_rows == 0 or not {"pos", "id"} <= snap.columns:
        return False
    if not pa.types.is_timestamp(snap.position_schema.field("pos").type):
        return False  # (a position of another type is not compared here: the filter decides)
    if not _no_null_positions(files):
        return False
    newest = table_mark(snap, newer_than=end).max_position
    return newest is not None and newest <= end


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


def _rows_after(snap: TableSnapshot, last: Position, cutoff: dt.datetime | None) -> pa.Table | None:
    """``pos``/``id`` of the rows of ``snap`` after ``last`` with ``pos <= cutoff`` (None: any), in
    position order. Reads only the files whose statistics overlap ``[last.pos, cutoff]``, or none
    when :func:`~resources.storage.prefetch.prefetched` read every row after ``last`` already."""
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
    null ``pos`` or ``id``). At or after the newest row (:func:`every_row_upto`) that is the
    statistics' count alone, and no file is read. None when there is no table, a file's statistics
    do not count its rows, or the table may hold deletion vectors."""
    total = snap.exact_rows
    if total is None:
        return None
    if every_row_upto(snap, last):  # (its newest rows read once per snapshot, none of the files after them)
        return total
    after = _rows_after(snap, last, None)
    return total - (0 if after is None else after.num_rows) - bad_position_rows(snap).num_rows


def _no_null_positions(files: pa.Table) -> bool:
    """Whether the files' statistics (:attr:`TableSnapshot.files`) count no null ``pos`` and no null
    ``id`` in any file. A count the statistics do not give (a file written before the table had the
    column, or without statistics for it) may be any: then False."""
    counts = [files[c] if c in files.column_names else pa.nulls(files.num_rows, pa.int64()) for c in ("null_count.pos", "null_count.id")]
    return (pc.max(pc.add(pc.fill_null(counts[0], 1), pc.fill_null(counts[1], 1))).as_py() or 0) == 0


def bad_position_rows(source: str | TableSnapshot) -> pa.Table:
    """Rows whose ``pos`` or ``id`` is null. Reads only files whose statistics count nulls."""
    snap = _snapshot(source)
    table = snap.table
    if table is None:
        return pa.table({})
    files = snap.files
    if files.num_rows == 0 or "null_count.pos" not in files.column_names:
        return pa.table({})
    if _no_null_positions(files):
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
