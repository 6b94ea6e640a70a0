"""The Delta log itself, read JVM-free: its commit files, the newest version, the commit that
holds a transaction (``txnAppId``/``txnVersion``), a commit's statistics and metrics, the newest
version that changed data, and a data file's path. Planning and recovery read these; the rows of
a table are read in the modules :mod:`resources.storage.delta_meta` re-exports and in
:mod:`resources.storage.delta_read`.

May import: pyarrow, deltalake, ``lineage.core``, ``resources.storage.warehouse`` and
``resources.storage.delta_read``.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import orjson
import pyarrow.fs as pafs

from lineage.core.errors import ProcessingError
from lineage.core.positions import to_naive_utc
from resources.storage.warehouse import arrow_filesystem, storage_options


def open_table(path: str, version: int | None = None) -> Any | None:
    """The ``deltalake.DeltaTable`` at ``path`` (at ``version``, else the newest), or None if
    there is no Delta table there."""
    from deltalake import DeltaTable

    try:
        return DeltaTable(path, version=version, storage_options=storage_options(path))
    except Exception:  # noqa: BLE001 - a missing or half-created table reads as "no table yet"
        return None


def commit_mark(path: str, version: int) -> tuple[str, int, int] | None:
    """What tells commit ``version`` of the table at ``path`` from another table's: its file's size
    and modification time (None: not there)."""
    fs, log = log_fs(path)
    info = fs.get_file_info(f"{log}/{version:020d}.json")
    if info.type == pafs.FileType.NotFound:
        return None
    return path, int(info.size or 0), int(info.mtime_ns or 0)


def join_path(path: str, name: str) -> str:
    if name.startswith("/") or "://" in name:
        return name
    root = arrow_filesystem(path)[1]
    return root.rstrip("/") + "/" + name


def parse_stat_ts(value: Any) -> dt.datetime | None:
    """A timestamp from Delta statistics (``2026-01-01T00:00:00.000Z``) as naive UTC; None if
    it is not one."""
    if not isinstance(value, str):
        return None
    try:
        return to_naive_utc(dt.datetime.fromisoformat(value.replace("Z", "+00:00")))
    except ValueError:
        return None


@dataclass(frozen=True)
class CommitStats:
    """What a Delta commit says about the rows it added (from per-file statistics)."""

    version: int
    rows: int
    min_values: dict[str, Any] = field(default_factory=dict)
    max_values: dict[str, Any] = field(default_factory=dict)
    null_counts: dict[str, int] = field(default_factory=dict)
    files: int = 0
    user_metadata: dict[str, Any] = field(default_factory=dict)
    paths: tuple[str, ...] = ()  # the data files the commit added, relative to the table root
    timestamp: dt.datetime | None = None  # when the commit was made (commitInfo, naive UTC)
    operation: str = ""  # commitInfo.operation: WRITE, MERGE, ...
    metrics: dict[str, int] = field(default_factory=dict)  # commitInfo.operationMetrics


def log_fs(path: str) -> tuple[pafs.FileSystem, str]:
    fs, root = arrow_filesystem(path)
    return fs, root.rstrip("/") + "/_delta_log"


def newest_version(path: str, known: int | None = None, *, recheck: bool = False) -> int | None:
    """The newest commit version of the Delta table at ``path`` (None: no table there), read
    JVM-free and cheaply: from ``known`` (a version seen before) it looks for the commit files
    after it, one file lookup per new commit and one when there is none, instead of reading the
    log. ``recheck`` also confirms that ``known`` itself is still there (a table dropped and
    written anew starts over at version 0); without ``known`` the log directory is listed once."""
    fs, log = log_fs(path)

    def exists(version: int) -> bool:
        return fs.get_file_info(f"{log}/{version:020d}.json").type != pafs.FileType.NotFound

    if known is not None and known >= 0 and (not recheck or exists(known)):
        version = known
        while exists(version + 1):
            version += 1
        return version
    try:
        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(log, allow_not_found=True))]
    except (FileNotFoundError, NotADirectoryError):
        return None
    versions = commit_versions(names)
    return max(versions) if versions else None


def commit_versions(names: Iterable[str]) -> list[int]:
    """The versions of the commit files (``<20 digits>.json``) among a log's file names."""
    return [int(n[:20]) for n in names if n.endswith(".json") and len(n) == 25 and n[:20].isdigit()]


def read_commit(fs: pafs.FileSystem, log: str, version: int) -> list[dict[str, Any]]:
    return parse_commit(read_commit_bytes(fs, log, version))


def read_commit_bytes(fs: pafs.FileSystem, log: str, version: int) -> bytes:
    """A commit file as it is written: one JSON action per line (not parsed)."""
    with fs.open_input_stream(f"{log}/{version:020d}.json") as f:
        return bytes(f.read())


def parse_commit(raw: bytes) -> list[dict[str, Any]]:
    # (orjson: a compaction's commit has a line per file it removed, and planning reads it)
    # (lines end at "\n" only, as rewrites_only counts them: a JSON string holds no raw "\r" or "\n")
    return [_action(line) for line in raw.split(b"\n") if line.strip()]


#: What ``tidemark maintain`` writes into the ``commitInfo`` of a compaction it commits through
#: ``deltalake`` (:data:`REWRITE_METADATA`), which rewrites files and changes no row.
REWRITE_METADATA = {"tidemark.maintain": "rewrite"}
REWRITE_MARK = json.dumps(REWRITE_METADATA, separators=(",", ":"))[1:-1].encode()  # as delta-rs writes it


def rewrites_only(raw: bytes) -> bool:
    """Whether a commit (:func:`read_commit_bytes`) is a rewrite that changes no row, told without
    parsing it: ``add`` and ``remove`` actions only (at least one), each with ``"dataChange":false``,
    after at most a ``commitInfo`` in the first line (where Spark and delta-rs write it) without
    that key. A compaction's commit has a line per file it removed; this spares the planner parsing
    them. Anything else, or the same written another way (spaces in the JSON, blank lines), answers
    False: the caller then parses the commit.

    A compaction ``tidemark maintain`` committed (an ``OPTIMIZE`` whose ``commitInfo``, the first
    line, carries :data:`REWRITE_MARK`) is told from that line alone: counting the lines of a
    2,000-file compaction costs the first plan after it 0.7 ms."""
    head = raw[:raw.find(b"\n")] if raw.startswith(b'{"commitInfo":') else b""
    if b'"dataChange"' in head:
        return False
    if REWRITE_MARK in head and b'"operation":"OPTIMIZE"' in head:
        return True  # Tidemark's own compaction (maintain marks it): its lines need no count
    files = raw.count(b'\n{"add":') + raw.count(b'\n{"remove":') + raw.startswith((b'{"add":', b'{"remove":'))
    lines = raw.count(b"\n") + (not raw.endswith(b"\n"))
    # One action per line, and a string value cannot hold the key unescaped: the counts are of the
    # actions' own fields, so every add and remove has one, and it is false.
    return (files > 0 and files + bool(head) == lines and raw.count(b'"dataChange"') == files
            and raw.count(b'"dataChange":false') == files)


def _action(line: bytes) -> dict[str, Any]:
    try:
        return orjson.loads(line)  # type: ignore[no-any-return]
    except orjson.JSONDecodeError:  # what only the standard parser reads (an integer beyond 64 bits)
        return json.loads(line)  # type: ignore[no-any-return]


class CommitUnavailableError(ProcessingError):
    """The Delta log records a transaction, but the commit that recorded it (and the
    ``userMetadata`` it carried) is no longer in the log: removed by log retention."""


#: How many of the newest commits are read directly before searching the log by snapshot.
RECENT_COMMITS = 20


def commit_has_txn(actions: list[dict[str, Any]], app_id: str, txn_version: int) -> bool:
    return any(a.get("txn", {}).get("appId") == app_id and a["txn"].get("version") == txn_version for a in actions)


def txn_at(path: str, version: int, app_id: str) -> int | None:
    """The txn version recorded for ``app_id`` as of table ``version`` (0 if none); None if the
    log can no longer reconstruct that version (cleaned up)."""
    from deltalake import DeltaTable

    try:
        table = DeltaTable(path, version=version, storage_options=storage_options(path))
    except Exception:  # noqa: BLE001 - the version's log files are gone
        return None
    return int(table.transaction_version(app_id) or 0)


def find_txn_commit(path: str, app_id: str, txn_version: int, *, hint: int | None = None) -> CommitStats | None:
    """The commit of ``path`` that recorded ``(app_id, txn_version)``, with its statistics; None if
    the table never recorded that transaction.

    No lookup window: the newest few commits are read first (a block that just landed), then the
    table version where the transaction first appears is found by binary search over snapshots
    (Delta keeps ``txn`` in checkpoints, so this works after log cleanup too) and that one commit
    is read. ``hint``: a version where the commit probably is (e.g. recorded in the offset store).

    Raises :class:`CommitUnavailableError` when the transaction is recorded but its commit was
    removed by log retention."""
    table = open_table(path)
    if table is None:
        return None
    recorded = table.transaction_version(app_id)
    if recorded is None or recorded < txn_version:
        return None
    newest = int(table.version())
    fs, log = log_fs(path)

    def read(version: int) -> list[dict[str, Any]] | None:
        try:
            return read_commit(fs, log, version)
        except (FileNotFoundError, OSError):
            return None

    if hint is not None and 0 <= hint <= newest:
        actions = read(hint)
        if actions is not None and commit_has_txn(actions, app_id, txn_version):
            return commit_stats(hint, actions)
    for version in range(newest, max(-1, newest - RECENT_COMMITS), -1):
        actions = read(version)
        if actions is None:
            break
        if commit_has_txn(actions, app_id, txn_version):
            return commit_stats(version, actions)
    # Binary search for the first version whose snapshot records txn >= txn_version. Versions the
    # log cannot rebuild any more count as "before": the search then ends at the oldest version
    # it can rebuild.
    lo, hi = 0, newest
    while lo < hi:
        mid = (lo + hi) // 2
        at = txn_at(path, mid, app_id)
        if at is not None and at >= txn_version:
            hi = mid
        else:
            lo = mid + 1
    actions = read(lo)
    if actions is not None and commit_has_txn(actions, app_id, txn_version):
        return commit_stats(lo, actions)
    if actions is None or (lo > 0 and txn_at(path, lo - 1, app_id) is None):
        raise CommitUnavailableError(
            f"{path}: the Delta log records transaction {app_id!r} version {txn_version} (or later), but the commit "
            f"that wrote it is no longer in the log (removed by log retention)"
        )
    return None  # the table went from below txn_version to above it: that transaction never landed


def last_commit_stats(path: str) -> CommitStats:
    """Statistics of the newest commit of ``path``."""
    table = open_table(path)
    if table is None:
        raise ProcessingError(f"{path}: no Delta table")
    fs, log = log_fs(path)
    return commit_stats(table.version(), read_commit(fs, log, table.version()))


def commit_stats(version: int, actions: list[dict[str, Any]]) -> CommitStats:
    rows, nfiles = 0, 0
    user: dict[str, Any] = {}
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    paths: list[str] = []
    at: dt.datetime | None = None
    operation = ""
    metrics: dict[str, int] = {}
    for a in actions:
        info = a.get("commitInfo")
        if info:
            operation = str(info.get("operation") or "")
            metrics = _int_metrics(info.get("operationMetrics"))
        if info and isinstance(info.get("timestamp"), int):
            at = dt.datetime.fromtimestamp(info["timestamp"] / 1000, dt.UTC).replace(tzinfo=None)
        if info and info.get("userMetadata"):
            try:
                user = json.loads(info["userMetadata"])
            except (TypeError, ValueError):
                user = {"text": info["userMetadata"]}
        add = a.get("add")
        if not add:
            continue
        nfiles += 1
        paths.append(unquote(add["path"]))
        stats = json.loads(add.get("stats") or "{}")
        rows += int(stats.get("numRecords", 0))
        for k, v in (stats.get("minValues") or {}).items():
            if not isinstance(v, dict) and v is not None:
                mins[k] = v if k not in mins else min(mins[k], v)
        for k, v in (stats.get("maxValues") or {}).items():
            if not isinstance(v, dict) and v is not None:
                maxs[k] = v if k not in maxs else max(maxs[k], v)
        for k, v in (stats.get("nullCount") or {}).items():
            if isinstance(v, int):
                nulls[k] = nulls.get(k, 0) + v
    return CommitStats(version=version, rows=rows, min_values=mins, max_values=maxs, null_counts=nulls, files=nfiles,
                       user_metadata=user if isinstance(user, dict) else {}, paths=tuple(paths), timestamp=at,
                       operation=operation, metrics=metrics)


def _int_metrics(raw: Any) -> dict[str, int]:
    """A commit's integer ``operationMetrics``, by Spark's names (``deltalake`` writes
    ``num_target_rows_inserted`` where Spark writes ``numTargetRowsInserted``)."""
    out: dict[str, int] = {}
    for k, v in (raw or {}).items() if isinstance(raw, dict) else ():
        try:
            out[_camel(str(k))] = int(v)
        except (TypeError, ValueError):
            continue
    return out


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


#: operationMetrics that count rows a commit inserted, updated or deleted (Spark's names: :func:`_int_metrics`).
CHANGE_METRICS = ("numTargetRowsInserted", "numTargetRowsUpdated", "numTargetRowsDeleted", "numUpdatedRows",
                  "numDeletedRows", "numAddedRows")


def changed_rows(commit: CommitStats) -> int | None:
    """Rows ``commit`` inserted, updated or deleted, from its operation metrics (None: they do not say)."""
    m = commit.metrics
    if commit.operation in ("WRITE", "CREATE TABLE AS SELECT", "REPLACE TABLE AS SELECT", "CREATE OR REPLACE TABLE AS SELECT"):
        if "numOutputRows" in m:  # an overwrite rewrites every row: count as many as it wrote
            return m["numOutputRows"]
    known = [m[k] for k in CHANGE_METRICS if k in m]
    if known:
        return sum(known)
    if "numOutputRows" in m:
        return m["numOutputRows"]
    return None


#: How many commits :func:`data_version` reads back at most.
DATA_VERSION_LOOKBACK = 50


def data_version(path: str, version: int, floor: int) -> int:
    """The newest version of the table at ``path`` (at most ``version``, at least ``floor``) that
    changed data: commits whose adds and removes all say ``dataChange: false`` (OPTIMIZE,
    ``tidemark maintain``) or that hold none (VACUUM START/END) change no row. Reads back at most
    :data:`DATA_VERSION_LOOKBACK` commits; where it cannot tell, ``version``."""
    fs, log = log_fs(path)
    v = version
    while v > floor and version - v < DATA_VERSION_LOOKBACK:
        try:
            actions = read_commit(fs, log, v)
        except (FileNotFoundError, OSError):
            return version
        if any(a[k].get("dataChange", True) for a in actions for k in ("add", "remove", "cdc") if k in a) or any(
                k in a for a in actions for k in ("metaData", "protocol")):
            return v
        v -= 1
    return v if v == floor else version


def commit_null_counts(path: str, commit: CommitStats) -> tuple[int, dict[str, int]]:
    """Rows and the null count of every top-level column of the files ``commit`` added to the
    table at ``path``: exact for all columns, unlike the commit's statistics (Delta collects those
    for the first 32 columns only). From the Parquet footers; a column whose footers lack a null
    count is read."""
    import pyarrow.parquet as pq

    fs = arrow_filesystem(path)[0]
    rows, nulls = 0, dict[str, int]()
    for rel in commit.paths:
        with fs.open_input_file(join_path(path, rel)) as f:
            pf = pq.ParquetFile(f)
            md = pf.metadata
            rows += md.num_rows
            leaves = {md.schema.column(j).path: j for j in range(md.num_columns)}
            for name in pf.schema_arrow.names:
                j = leaves.get(name)  # None: a nested column (its footers count leaves, not the column)
                stats = [md.row_group(g).column(j).statistics for g in range(md.num_row_groups)] if j is not None else None
                if stats is not None and all(s is not None and s.has_null_count for s in stats):
                    n = sum(s.null_count for s in stats)  # type: ignore[union-attr]
                else:
                    n = pf.read(columns=[name]).column(0).null_count
                nulls[name] = nulls.get(name, 0) + int(n)
    return rows, nulls


def recorded_txn(path: str, app_id: str) -> int:
    """The highest ``txnVersion`` the table at ``path`` recorded for ``app_id`` (0 if none). The
    newest ``txn`` action of an app is its version, so the newest commits after the last
    checkpoint are read first, JVM-free, a file each (a topic's own commit is usually the newest):
    only when none of them names ``app_id`` is the table's whole snapshot opened. Raises when the
    log shows commits but cannot be read.

    The answer is kept with the newest commit it was read at; asked again while that commit is
    still the newest and the same file (a look for the next one and at its size and time), it is
    given without reading the log: a unit reads it under its lock and once more just before it
    plans or writes."""
    fs, log = log_fs(path)
    key = (path, app_id)
    with _TXN_READ_LOCK:
        seen = _TXN_READ.get(key)
    if seen is not None:
        newest, mark, txn_version = seen
        if (fs.get_file_info(f"{log}/{newest + 1:020d}.json").type == pafs.FileType.NotFound
                and commit_mark(path, newest) == mark):
            return txn_version
    commits, checkpoint = _commits_since_checkpoint(fs, log)
    txn_version = _read_txn(path, app_id, fs, log, commits, checkpoint)
    newest_mark = commit_mark(path, commits[0]) if commits else None
    with _TXN_READ_LOCK:
        if len(_TXN_READ) >= TXN_READ_ENTRIES:
            _TXN_READ.clear()
        if newest_mark is not None:
            _TXN_READ[key] = (commits[0], newest_mark, txn_version)
        else:
            _TXN_READ.pop(key, None)
    return txn_version


#: What :func:`recorded_txn` read last, per (table, app): the newest commit then, its mark
#: (:func:`commit_mark`) and the version found; at most this many.
TXN_READ_ENTRIES = 4096
_TXN_READ: dict[tuple[str, str], tuple[int, tuple[str, int, int], int]] = {}
_TXN_READ_LOCK = threading.Lock()


def _read_txn(path: str, app_id: str, fs: pafs.FileSystem, log: str, commits: list[int], checkpoint: int | None) -> int:
    for version in commits[:RECENT_COMMITS]:
        try:
            actions = read_commit(fs, log, version)
        except (FileNotFoundError, OSError, ValueError):
            break  # removed meanwhile (log cleanup), or not readable: the snapshot decides
        for a in actions:
            txn = a.get("txn")
            if isinstance(txn, dict) and txn.get("appId") == app_id:
                return int(txn.get("version") or 0)
    if not commits and checkpoint is None:
        return 0  # no Delta table there
    table = open_table(path)
    if table is None:  # a transient read error must not pass for "no block recorded"
        raise ProcessingError(f"{path}: its Delta log has commits but cannot be read now (the transactions it "
                              f"recorded for {app_id} are unknown); try again")
    return int(table.transaction_version(app_id) or 0)


#: At most this many commit files after the last checkpoint are looked up one by one; a longer
#: tail (or none named by ``_last_checkpoint``) is found by listing the log.
PROBED_COMMITS = 64


def last_checkpoint_hint(fs: pafs.FileSystem, log: str) -> int | None:
    """The version ``_last_checkpoint`` names (None: no such file, or not readable). A hint: a
    checkpoint written since may not be named yet."""
    try:
        with fs.open_input_stream(f"{log}/_last_checkpoint") as f:
            return int(json.loads(f.read().decode("utf-8"))["version"])
    except (FileNotFoundError, OSError, ValueError, KeyError, TypeError):
        return None


def _commits_since_checkpoint(fs: pafs.FileSystem, log: str) -> tuple[list[int], int | None]:
    """The versions of the commit files after the last checkpoint, newest first, and that
    checkpoint's version (None: none). From ``_last_checkpoint`` and a lookup per commit after it
    (not a listing of a log that log retention may keep long); by listing the log without it."""
    checkpoint = last_checkpoint_hint(fs, log)
    if checkpoint is not None:
        found: list[int] = []
        for version in range(checkpoint + 1, checkpoint + 1 + PROBED_COMMITS):
            if fs.get_file_info(f"{log}/{version:020d}.json").type == pafs.FileType.NotFound:
                return found[::-1], checkpoint
            found.append(version)
    try:
        names = [i.base_name for i in fs.get_file_info(pafs.FileSelector(log, allow_not_found=True))]
    except (FileNotFoundError, NotADirectoryError):
        return [], None
    newest_checkpoint = max((int(n[:20]) for n in names if ".checkpoint" in n and n[:20].isdigit()), default=None)
    commits = sorted((v for v in commit_versions(names) if newest_checkpoint is None or v > newest_checkpoint),
                     reverse=True)
    return commits, newest_checkpoint


def commit_time(path: str, version: int) -> dt.datetime | None:
    """When version ``version`` of the table at ``path`` was committed (naive UTC; None when the log
    no longer holds that commit)."""
    fs, log = log_fs(path)
    try:
        return commit_stats(version, read_commit(fs, log, version)).timestamp
    except (FileNotFoundError, OSError):
        return None
