"""What a Delta table's log statistics say, without reading a data file: how far their timestamps
may be off (:data:`STATS_SLACK`: cut to milliseconds), the greatest ``id`` of a version, how many
rows may follow a position, whether a view's files are clustered, and the sizes a merge unit's cost
estimate needs (:func:`unit_sizes`). With the time helpers the readers of positions share.

May import: ``lineage``, ``delta_log``, ``delta_read``, ``snapshot``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lineage.core.positions import Position, to_naive_utc
from lineage.spec.model import TopicSpec
from lineage.views.refresh import InputChange, Sizes, cluster_column
from resources.storage import delta_log, delta_read
from resources.storage.snapshot import RemovedDataError, TableSnapshot

#: Delta truncates timestamp statistics to milliseconds; widen pruning ranges by this much.
STATS_SLACK = dt.timedelta(milliseconds=2)


def _ts(value: Any) -> dt.datetime | None:
    if value is None:
        return None
    if isinstance(value, dt.datetime):
        return to_naive_utc(value)
    return None


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


def widened(low: dt.datetime | None, high: dt.datetime | None) -> tuple[dt.datetime | None, dt.datetime | None]:
    """A ``pos`` range of rows widened by :data:`STATS_SLACK` each way: the range of statistics
    that may describe a file holding such a row (None: unbounded)."""
    return (None if low is None else _minus(low, STATS_SLACK)), (None if high is None else _plus(high, STATS_SLACK))


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


def unit_sizes(base: TableSnapshot, snap: TableSnapshot, changes: Sequence[InputChange], spec: TopicSpec) -> Sizes | None:
    """The sizes a merge unit's cost estimate needs (:func:`lineage.views.refresh.estimate`), from the
    Delta logs alone: ``base`` at the planned version, the view ``snap`` now, every other input as
    its change says (:func:`~resources.storage.history.input_change`); ``spec``: the view's topic.
    None when the view is not there or a log lacks file sizes."""
    sizes = {c.table: c.table_bytes for c in changes}
    if (snap.size_bytes is None or snap.row_count is None or base.size_bytes is None or base.row_count is None
            or None in sizes.values()):
        return None
    return Sizes(base_bytes=base.size_bytes, base_rows=base.row_count, view_bytes=snap.size_bytes,
                 view_files=snap.files.num_rows, view_rows=snap.row_count,
                 inputs_bytes={t: int(n or 0) for t, n in sizes.items()}, view_columns=len(snap.columns),
                 clustered=_clustered_by(snap, cluster_column(spec, list(snap.columns))))


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
