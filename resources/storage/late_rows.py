"""Late rows: rows added to a Delta table after their place was processed (:func:`late_rows`). Read
from the files the commits since a version added, told apart from rows carried over by ``(pos, id)``
and, where files were compacted and then deleted by VACUUM, by ``id``; a Parquet footer's exact
statistics rule a file out without reading it.

May import: ``lineage``, ``delta_log``, ``delta_read``, ``warehouse``, ``snapshot``, ``statistics``,
``history``, ``positions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lineage.core.positions import Position
from resources.storage import delta_log, delta_read
from resources.storage.history import _Added, _History, missing_files
from resources.storage.positions import position_filter
from resources.storage.snapshot import RemovedDataError, TableSnapshot, _snapshot
from resources.storage.statistics import STATS_SLACK, _ids_at, _plus, _ts
from resources.storage.warehouse import arrow_filesystem


@dataclass(frozen=True)
class LateRows:
    """Rows that arrived after their place was processed, and the commits that could not be
    read to look for them (removed by log retention): when ``unreadable`` is not empty the
    answer is incomplete, and callers must say so."""

    rows: pa.Table
    unreadable: tuple[int, ...] = ()


def late_detection_warning(table: str, unreadable: tuple[int, ...]) -> str:
    """What to tell the user when late rows could not be looked for in ``unreadable`` commits of
    ``table`` ('' when there are none)."""
    if not unreadable:
        return ""
    first, last = unreadable[0], unreadable[-1]
    which = f"version {first}" if first == last else f"versions {first}..{last}"
    return (f"late-row detection incomplete: {table} {which} no longer in its Delta log (log retention); rows "
            f"added there at or before the topic's last position cannot be found (they are neither written nor quarantined)")


def _read_files(snap: TableSnapshot, rels: list[str], last: Position, *, above_id: int | None = None) -> pa.Table:
    """Rows of the table's data files ``rels`` at or before ``last`` (and with an id above
    ``above_id``), with every column each file has: read file by file, since one dataset over them
    would take the first file's columns and drop a column that a later file added (a late row
    quarantined without its values could not be replayed as it was). A file without ``pos`` or
    ``id`` holds no positioned row (its rows are bad rows, see
    :func:`~resources.storage.positions.bad_position_rows`)."""
    import pyarrow.dataset as pads

    path = snap.path
    fs = arrow_filesystem(path)[0]
    parts = []
    for rel in rels:
        file = delta_log.join_path(path, rel)
        if snap.scanned:  # physical column names: read whole, named, then filtered
            rows = snap.file_reader.read(file, fs if "://" in path else None)
            if "pos" in rows.column_names and "id" in rows.column_names:
                parts.append(rows.filter(position_filter(rows.schema, last, above_id=above_id)))
            continue
        ds = pads.dataset(file, format="parquet", filesystem=fs if "://" in path else None)
        if "pos" in ds.schema.names and "id" in ds.schema.names:
            parts.append(ds.to_table(filter=position_filter(ds.schema, last, above_id=above_id)))
    return _unified(parts)


def _unified(parts: list[pa.Table]) -> pa.Table:
    """``parts`` as one table with every column any of them has (an empty table without columns:
    none had rows to read)."""
    parts = [p for p in parts if p.num_columns]
    if not parts:
        return pa.table({})
    return pa.concat_tables(parts, promote_options="permissive") if len(parts) > 1 else parts[0]


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
    per = delta_read.timestamp_ns_per(meta.schema.column(names["pos"]))
    id_type = delta_read.footer_type(meta.schema.column(names["id"]))
    if per is None or id_type["physical"] not in ("INT32", "INT64") or id_type.get("isSigned") is False:
        return True
    limit = delta_read.epoch_ns(last.pos)
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
