"""One version of a Delta table, opened once (:class:`TableSnapshot`: its log, its file list with
flattened statistics, how its rows are read), and what its metadata says: table properties such as
the change data feed, and deletion vectors (:func:`deletion_vectors`). JVM-free, through the
``deltalake`` package. :class:`RemovedDataError` lives here, the one error every reader of a
snapshot raises when files or commits it needs were removed.

The modules that read a snapshot build on this one: :mod:`resources.storage.statistics`,
:mod:`resources.storage.history`, :mod:`resources.storage.positions`,
:mod:`resources.storage.prefetch` (which opens many snapshots ahead of their use and hands them to
:meth:`TableSnapshot.open`) and :mod:`resources.storage.late_rows`.

May import: ``lineage``, ``resources.core``, ``delta_log``, ``delta_read``, ``warehouse``; none of the modules above.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextvars
import dataclasses
import datetime as dt
import functools
import re
import sys
import threading
from collections.abc import Collection, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lineage.core.errors import ProcessingError
from lineage.core.positions import Position
from resources.core.lru import Bounded
from resources.storage import delta_log, delta_read
from resources.storage.warehouse import is_object_store


class TableSnapshot:
    """One version of a Delta table, opened once. Planning a block asks the base table for its
    mark, its null and late rows and the block's end: one snapshot answers all of them, so the
    table and its file list are read once and every answer describes the same version."""

    def __init__(self, path: str, table: Any | None) -> None:
        self.path = path
        self.table = table  # deltalake.DeltaTable; None when there is no table at ``path``
        self.after: dict[Position, pa.Table] = {}  # every row after a position, read ahead (see prefetch)
        # the exact newest (pos, id), once positions.table_mark has read it: a version never changes,
        # and a process that keeps its snapshots (the follower; run_until_caught_up's look for more
        # work after a unit) plans a base that did not change again on the same snapshot
        self.newest: tuple[Position | None] | None = None

    @classmethod
    def open(cls, path: str, version: int | None = None, *, at_least: int | None = None) -> TableSnapshot:
        """``path`` at ``version`` (default the newest: inside
        :func:`~resources.storage.prefetch.prefetched`, the one it opened, unless it is older than
        version ``at_least``)."""
        if version is None and (ready := _PREFETCHED.get()) is not None and path in ready:
            snap = ready[path].result()  # (None: reading it failed; read again here, which says why)
            if snap is not None and (at_least is None or snap.version is None or snap.version >= at_least):
                return snap
        if (snap := _NEWEST.get(path, at_least, version)) is not None:
            return snap
        snap = cls(path, delta_log.open_table(path, version))
        if version is None:
            _NEWEST.put(snap)
        return snap

    @functools.cached_property
    def version(self) -> int | None:
        return None if self.table is None else int(self.table.version())

    @functools.cached_property
    def columns(self) -> frozenset[str]:
        return frozenset() if self.table is None else frozenset(f.name for f in self.table.schema().fields)

    @functools.cached_property
    def row_count(self) -> int | None:
        """Rows in this version, from the files' statistics (None: no table, or no file has a row
        count column). A file without ``numRecords`` counts 0. With deletion vectors, the rows
        before the deletions they mark (the add actions as ``deltalake`` lists them do not carry
        the vectors' cardinality): an upper bound. :attr:`exact_rows` is None in both cases."""
        return self._total("num_records")

    @functools.cached_property
    def exact_rows(self) -> int | None:
        """:attr:`row_count` where it is exact: None also when a file's statistics do not count its
        rows (it would count 0) or the table may hold deletion vectors (their rows still count)."""
        total = self.row_count
        if total is None or self.files["num_records"].null_count or deletion_vectors(self).feature:
            return None
        return total

    @functools.cached_property
    def size_bytes(self) -> int | None:
        """Bytes of this version's data files (None: no table, or the log does not say)."""
        return self._total("size_bytes")

    def rows_holding(self, values: Mapping[str, Collection[Any]]) -> int | None:
        """Rows in the files :meth:`files_holding` keeps (an upper bound of the rows whose columns
        take those values). None: no table, no row counts, or values that do not compare with the
        statistics."""
        return self._held_total(values, "num_records")

    def bytes_holding(self, values: Mapping[str, Collection[Any]]) -> int | None:
        """Bytes of the files :meth:`files_holding` keeps (what a scan filtered by those values
        reads at most). None as for :meth:`rows_holding`."""
        return self._held_total(values, "size_bytes")

    def _held_total(self, values: Mapping[str, Collection[Any]], column: str) -> int | None:
        files = self.files
        keep = self._holding(values)
        if keep is None or column not in files.column_names:
            return None
        return sum(n or 0 for n, k in zip(files[column].to_pylist(), keep, strict=True) if k)

    def files_holding(self, values: Mapping[str, Collection[Any]]) -> list[str] | None:
        """The data files (paths as the log names them) whose statistics allow a row whose every
        column of ``values`` takes one of its values there (a None among them: a null), as a scan
        filtered by them reads them; a file without statistics for a column is kept. None: no
        table, or values that do not compare with the statistics."""
        keep = self._holding(values)
        return None if keep is None else [p for p, k in zip(self.files["path"].to_pylist(), keep, strict=True) if k]

    def _holding(self, values: Mapping[str, Collection[Any]]) -> list[bool] | None:
        """Per data file, whether its statistics allow the rows :meth:`files_holding` describes."""
        files = self.files
        if self.table is None:
            return None
        keep = [True] * files.num_rows
        try:
            for col, given in values.items():
                present = sorted(v for v in given if v is not None)
                if any(isinstance(v, float) for v in present):  # NaN has no place in the statistics
                    continue
                stat = {k: files[f"{k}.{col}"].to_pylist() if f"{k}.{col}" in files.column_names else None
                        for k in ("min", "max", "null_count")}
                stat["rows"] = files["num_records"].to_pylist() if "num_records" in files.column_names else None
                for i in range(files.num_rows):
                    if keep[i]:
                        keep[i] = _may_hold(present, None in given, *(None if s is None else s[i] for s in stat.values()))
        except TypeError:  # (values of another type than the column's statistics)
            return None
        return keep

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


#: Spark's Delta writer keeps a string's statistics to this many characters (a longer maximum is a
#: prefix with a character after it); shorter ones are the values themselves.
_STRING_STATS = 32


def _may_hold(present: list[Any], null: bool, low: Any, high: Any, nulls: Any, rows: Any = None) -> bool:
    """Whether a file of ``rows`` rows whose column has the statistics ``low``, ``high``, ``nulls``
    (None: not recorded) may hold one of the sorted values ``present``, or a null (``null``). Without
    bounds only a column of nulls (``nulls`` equal to ``rows``) is ruled out: Spark records a null
    count without bounds for a boolean or binary column. Where writers
    truncate a maximum (a timestamp to milliseconds, a long string to a prefix), it is widened: a
    timestamp's by a millisecond; a string's is not used from :data:`_STRING_STATS` characters."""
    if null and (nulls is None or nulls > 0):
        return True
    if not present:
        return False
    if low is None or high is None:  # no bounds: unknown, unless the column is nulls only
        return not (low is None and high is None and nulls is not None and rows is not None and nulls >= rows > 0)
    at = bisect.bisect_left(present, low)
    if at == len(present):
        return False
    if isinstance(high, str) and len(high) >= _STRING_STATS:
        return True
    if isinstance(high, dt.datetime):
        high = high + dt.timedelta(milliseconds=1)
    return bool(present[at] <= high)


#: Reader features that leave a table's data files readable as plain Parquet.
_PLAIN_READER_FEATURES = frozenset({"timestampNtz"})


_PREFETCHED: contextvars.ContextVar[dict[str, concurrent.futures.Future[TableSnapshot | None]] | None] = \
    contextvars.ContextVar("tidemark_prefetched", default=None)


class _NewestSnapshots:
    """The newest snapshot opened of each table, kept while it is still the newest version: a
    resident process (the follower, the planner sensor's code server) plans every topic on every
    tick, and a table that did not change is then not read again. Whether it changed costs two file
    lookups: the snapshot's own commit file, unchanged (a table dropped and written anew starts over
    at version 0), and no commit file after it.

    When the table has newer commits, the kept table is moved forward by them alone
    (``DeltaTable.update_incremental``: the new commits read, not the checkpoint and the log up to
    them again), and a new snapshot wraps it, provided nothing else holds the old snapshot or its
    ``deltalake`` table (their reference counts; else the table is opened anew). So a snapshot
    once handed out never changes, threads may share it, and what a resident process pays for a
    new block follows the commits since its last look, not the table's history (a checkpoint that
    carries a compaction's removed files until they expire, say). Bounded: the tables used least
    recently are forgotten."""

    def __init__(self, size: int = 256) -> None:
        self._snaps: Bounded[str, tuple[TableSnapshot, tuple[str, int, int]]] = Bounded(size)
        self._lock = threading.Lock()  # (a snapshot is checked and moved forward by one thread at a time)

    def get(self, path: str, at_least: int | None, version: int | None = None) -> TableSnapshot | None:
        """The kept snapshot of ``path`` if it is still the newest (at least version ``at_least``),
        or with ``version``, if it is that version (newest or not: a version never changes).
        Without ``version``, a kept snapshot with newer commits after it is moved forward to the
        newest (see the class); None: open the table anew."""
        with self._lock:
            entry = self._snaps.get(path)
            if entry is None:
                return None
            snap, mark = entry
            del entry  # (the references to ``snap`` are counted below)
            have = snap.version
            if have is None or (version is not None and have != version):
                return None
            try:
                if delta_log.commit_mark(path, have) != mark:
                    return None
                newest = have if version is not None else delta_log.newest_version(path, have)
            except (OSError, ValueError):  # (the lookups failed: open the table, which says why)
                return None
            if newest == have:
                return None if at_least is not None and have < at_least else snap
            self._snaps.pop(path)
            # Held elsewhere: the local name and getrefcount's argument are the only references
            # expected to the snapshot, and the snapshot's own to its table.
            if (snap.table is None or sys.getrefcount(snap) > 2 or sys.getrefcount(snap.table) > 2
                    or sys.getrefcount(snap.table._table) > 2):
                return None
            table = snap.table
            del snap  # (the old snapshot is gone: nothing sees its table change)
            try:
                table.update_incremental()
            except Exception:  # noqa: BLE001 - e.g. the commits it needs were cleaned up: open the table anew
                return None
            moved = TableSnapshot(path, table)
            if moved.version is None or (at_least is not None and moved.version < at_least):
                return None
            self._put(moved)
            return moved

    def put(self, snap: TableSnapshot) -> None:
        with self._lock:
            self._put(snap)

    def _put(self, snap: TableSnapshot) -> None:
        if snap.version is None or not _native_path(snap.path):  # (file:/x: pyarrow cannot look its files up)
            return
        try:
            mark = delta_log.commit_mark(snap.path, snap.version)
        except (OSError, ValueError):
            return
        if mark is not None:
            self._snaps.put(snap.path, (snap, mark))

    def clear(self) -> None:
        self._snaps.clear()


_NEWEST = _NewestSnapshots()


def _snapshot(source: str | TableSnapshot) -> TableSnapshot:
    """``source`` if it is a snapshot already, else the newest version of the table at that path."""
    return source if isinstance(source, TableSnapshot) else TableSnapshot.open(source)


def _native_path(path: str) -> bool:
    """Whether ``pyarrow``'s own file systems take the table location ``path`` as
    :func:`~resources.storage.warehouse.arrow_filesystem` gives it: a local path without a scheme,
    or object storage (not e.g. ``file:/x`` or ``file://localhost/x``, on which
    ``SubTreeFileSystem`` aborts the process)."""
    return is_object_store(path) or re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", path) is None


class RemovedDataError(ProcessingError):
    """Data files or commits Tidemark needs were removed (compacted by OPTIMIZE then deleted by
    VACUUM, or dropped by log retention) and no other route gives the same answer exactly. The
    message names the table, the version or file and the cause; callers add the topic and the
    command that lets it go on."""


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
