"""What a Delta table's log says happened since a version, and its data files that are gone: the
commits ``(after, upto]`` (:class:`_History`: files added and removed with or without
``dataChange``, what the change data feed reads), commits and files no longer there, how to read a
version whose files were vacuumed (:func:`snapshot_read`) and what changed in a view's input
(:func:`input_change`). The log's commit files only, never the data.

May import: ``lineage``, ``delta_log``, ``delta_read``, ``warehouse``, ``snapshot``, ``statistics``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import pyarrow.fs as pafs

from lineage.core.positions import Position
from lineage.views.refresh import InputChange
from resources.storage import delta_log, delta_read
from resources.storage.snapshot import RemovedDataError, TableSnapshot, change_feed_enabled
from resources.storage.statistics import STATS_SLACK, _ids_at, _minus, _plus, _ts
from resources.storage.warehouse import arrow_filesystem


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
    """The commits ``(after, upto]`` of a table, as far as its log still holds them.

    A commit that only rewrites files (:func:`delta_log.rewrites_only`: a compaction, one line per
    file it removed) is parsed only when :attr:`commits`, :attr:`removed_by` or :attr:`compacted` is
    asked for: it adds no row, so the late-row check and most input changes never need its files."""

    after: int
    upto: int
    added: list[_Added] = field(default_factory=list)  # files added with dataChange, oldest first
    feed: dict[int, list[str]] = field(default_factory=dict)  # version -> the files its change data feed reads
    cdc_files: set[str] = field(default_factory=set)  # change data files (VACUUM deletes them by age alone)
    data_changed: dict[int, bool] = field(default_factory=dict)  # version -> whether it changed any row
    #: version -> whether it only rewrote files (every add and remove with ``dataChange: false``, no
    #: metadata or protocol change): a compaction, or a purge of deletion vectors
    rewrite_only: dict[int, bool] = field(default_factory=dict)
    unreadable: list[int] = field(default_factory=list)  # versions gone from the log (log retention)
    _commits: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    _unparsed: dict[int, bytes] = field(default_factory=dict)  # rewrite-only commits, as written
    _files: tuple[dict[str, tuple[int, str, bool]], set[str]] | None = None

    @property
    def commits(self) -> dict[int, list[dict[str, Any]]]:
        """version -> its actions."""
        if self._unparsed:
            self._commits.update((v, delta_log.parse_commit(raw)) for v, raw in self._unparsed.items())
            self._unparsed.clear()
            self._commits = dict(sorted(self._commits.items()))
        return self._commits

    @property
    def removed_by(self) -> dict[str, tuple[int, str, bool]]:
        """path -> (version, operation, dataChange) of the newest commit that removed it."""
        return self._file_changes()[0]

    @property
    def compacted(self) -> set[str]:
        """Files added without dataChange (rewritten rows)."""
        return self._file_changes()[1]

    def _file_changes(self) -> tuple[dict[str, tuple[int, str, bool]], set[str]]:
        if self._files is None:
            removed_by: dict[str, tuple[int, str, bool]] = {}
            compacted: set[str] = set()
            for version, actions in self.commits.items():
                op = _operation(actions)
                for a in actions:
                    if act := a.get("remove"):
                        removed_by[unquote(act["path"])] = (version, op, bool(act.get("dataChange", True)))
                    elif (act := a.get("add")) and not act.get("dataChange", True):
                        compacted.add(unquote(act["path"]))
            self._files = removed_by, compacted
        return self._files

    @classmethod
    def read(cls, path: str, after: int, upto: int, names: Mapping[str, str] | None = None) -> _History:
        """``names``: ``{physical: column name}`` of a table with column mapping, for the statistics
        (:func:`delta_read.physical_names`)."""
        fs, log = delta_log.log_fs(path)
        out = cls(after, upto)
        for version in range(after + 1, upto + 1):
            try:
                raw = delta_log.read_commit_bytes(fs, log, version)
            except (FileNotFoundError, OSError):
                out.unreadable.append(version)
                continue
            if delta_log.rewrites_only(raw):
                out._unparsed[version] = raw
                out.feed[version], out.data_changed[version], out.rewrite_only[version] = [], False, True
                continue
            actions = out._commits[version] = delta_log.parse_commit(raw)
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
                    if not act or not act.get("dataChange", True):
                        continue
                    rel = unquote(act["path"])
                    data_files.append(rel)
                    if kind == "add" and not (act.get("deletionVector") and rel in removed):
                        stats = delta_read.logical_stats(json.loads(act.get("stats") or "{}"), names or {})
                        out.added.append(_Added(version, rel, stats, tuple(r for r in rewritten if r != rel)))
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


def _operation(actions: list[dict[str, Any]]) -> str:
    return next((str(a["commitInfo"].get("operation") or "") for a in actions if a.get("commitInfo")), "")


def missing_files(path: str, rels: list[str]) -> list[str]:
    """Those of the table's files ``rels`` (relative to its root) that no longer exist (deleted by
    VACUUM)."""
    if not rels:
        return []
    fs = arrow_filesystem(path)[0]
    infos = fs.get_file_info([delta_log.join_path(path, r) for r in rels])
    return [r for r, i in zip(rels, infos, strict=True) if i.type == pafs.FileType.NotFound]


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
