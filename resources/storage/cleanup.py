"""Cleanup of one Delta table (``maintenance.maintain``'s last step), without a JVM: the data files
and change-feed files no version from the consumers' horizon on references, and the log entries
below the newest checkpoint at or below the horizon, each only once older than the table's
retention; a checkpoint at the horizon when many old commits lie below it. May import the
``resources.storage`` modules below it (``delta_log``, ``warehouse``, ``health``: a table's state and
a maintenance's report); ``maintenance`` imports it.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import pyarrow.fs as pafs

from resources.storage import delta_log
from resources.storage.health import CHECKPOINT_AFTER_COMMITS, Health, Report
from resources.storage.warehouse import arrow_filesystem, storage_options

_LOG_FILE = re.compile(r"^(\d{20})\.(json|crc|checkpoint\.parquet|checkpoint\.\d+\.\d+\.parquet)$")


def log_listing(path: str) -> list[tuple[int, str, str, float]]:
    """``(version, kind, full path, modified epoch seconds)`` of every versioned file in the log."""
    fs, log = delta_log.log_fs(path)
    out = []
    for info in fs.get_file_info(pafs.FileSelector(log, allow_not_found=True)):
        m = _LOG_FILE.match(info.base_name)
        if m and info.type == pafs.FileType.File:
            mtime = info.mtime.timestamp() if info.mtime is not None else time.time()
            out.append((int(m.group(1)), m.group(2), info.path, mtime))
    return sorted(out)


def days(span: dt.timedelta) -> str:
    hours = span.total_seconds() / 3600
    n, unit = (hours / 24, "day") if hours >= 24 else (hours, "hour")
    return f"{n:g} {unit}{'' if n == 1 else 's'}"


def checkpoint_at_horizon(h: Health, horizon: int, log_kept: dt.timedelta, report: Report, *, dry_run: bool) -> None:
    """A checkpoint at the consumers' horizon when many old commits lie below it and no checkpoint is
    near: a reader of the horizon then starts there, and the log entries before it can go (the
    newest checkpoint is written after, so ``_last_checkpoint`` names that one)."""
    from deltalake import DeltaTable

    listing = log_listing(h.path)
    if any(kind.startswith("checkpoint") and horizon - CHECKPOINT_AFTER_COMMITS < v <= horizon for v, kind, _, _ in listing):
        return
    cutoff = time.time() - log_kept.total_seconds()
    old = sum(1 for v, kind, _, mtime in listing if kind == "json" and v < horizon and mtime <= cutoff)
    if old < CHECKPOINT_AFTER_COMMITS or not any(v == horizon and kind == "json" for v, kind, _, _ in listing):
        return
    if not dry_run:
        DeltaTable(h.path, version=horizon, storage_options=storage_options(h.path)).create_checkpoint()
    report.horizon_checkpoint = horizon


def _relative(listed: str, path: str, root: str) -> str:
    """A path ``vacuum`` listed (relative to the table, or a URI / absolute path) relative to the table."""
    for prefix in (path.rstrip("/") + "/", root + "/", "file://" + root + "/"):
        if listed.startswith(prefix):
            return unquote(listed[len(prefix):])
    return unquote(listed)


def _change_data_cleanup(h: Health, keep_from: int, version: int, cutoff: float, *, dry_run: bool) -> list[str]:
    """Change-feed files (``_change_data/``, which ``deltalake``'s VACUUM leaves) that no commit after
    the horizon references and that are older than ``cutoff`` (epoch seconds): a consumer reads the
    change feed of the commits after the version it applied, never before."""
    fs, root = arrow_filesystem(h.path)
    folder = f"{root.rstrip('/')}/_change_data"
    infos = [i for i in fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True, recursive=True))
             if i.type == pafs.FileType.File]
    if not infos:
        return []
    fs_log, log = delta_log.log_fs(h.path)
    needed: set[str] = set()
    for v in range(keep_from + 1, version + 1):
        try:
            actions = delta_log.read_commit(fs_log, log, v)
        except (FileNotFoundError, OSError):
            return []  # a commit the horizon needs is not readable: remove nothing
        needed |= {unquote(a["cdc"]["path"]) for a in actions if "cdc" in a}
    doomed = []
    for info in infos:
        rel = info.path[len(root.rstrip("/")) + 1:]
        mtime = info.mtime.timestamp() if info.mtime is not None else time.time()
        if rel not in needed and mtime <= cutoff:
            doomed.append(rel)
            if not dry_run:
                fs.delete_file(info.path)
    return doomed


def remove_unneeded(h: Health, current: Any, version: int, horizons: tuple[int, int], files_kept: dt.timedelta,
                    log_kept: dt.timedelta, report: Report, *, dry_run: bool, point: Callable[[str], None]) -> None:
    file_from, keep_from = horizons
    if h.horizon is not None:
        report.kept.append(f"versions from v{keep_from} on: " + "; ".join(n.describe() for n in h.needs))
    # deltalake's VACUUM lists what no version from ``file_from`` on references and is older than the
    # retention; the files are deleted here, without its VACUUM START/END commits: a cleanup then adds no
    # table version (no view runs an empty unit, no reload rebuilds because of it), and files already
    # gone are not listed again.
    listed = current.vacuum(retention_hours=math.ceil(files_kept.total_seconds() / 3600), dry_run=True,
                            enforce_retention_duration=False, keep_versions=list(range(file_from, version + 1)))
    fs, root = arrow_filesystem(h.path)
    root = root.rstrip("/")
    rels = [_relative(f, h.path, root) for f in listed]
    infos = fs.get_file_info([f"{root}/{rel}" for rel in rels]) if rels else []
    doomed = [rel for rel, info in zip(rels, infos, strict=True) if info.type == pafs.FileType.File]
    if not dry_run:
        for rel in doomed:
            fs.delete_file(f"{root}/{rel}")
    report.vacuumed = doomed
    report.vacuumed += _change_data_cleanup(h, file_from, version, time.time() - files_kept.total_seconds(),
                                            dry_run=dry_run)
    if not dry_run:
        point("maintain:vacuumed")
    # Log entries: a reader of version V replays the newest checkpoint at or below V and the commits
    # after it, so everything below that checkpoint can go once it is older than the log retention.
    listing = log_listing(h.path)
    floor_cp = [v for v, kind, _, _ in listing if kind.startswith("checkpoint") and v <= keep_from]
    if dry_run:
        floor_cp += [v for v in (report.checkpoint, report.horizon_checkpoint) if v is not None and v <= keep_from]
    cutoff = time.time() - log_kept.total_seconds()
    if not floor_cp:
        if any(v < keep_from and mtime <= cutoff for v, _, _, mtime in listing):
            report.skipped.append(f"log cleanup: no checkpoint at or below v{keep_from} yet")
        return
    floor = max(floor_cp)
    doomed = [p for v, _, p, mtime in listing if v < floor and mtime <= cutoff]
    if not dry_run and doomed:
        fs, _ = delta_log.log_fs(h.path)
        for i, p in enumerate(doomed):  # oldest first: a reader from the checkpoint on never needs them
            fs.delete_file(p)
            if i == 0:
                point("maintain:log-cleaning")
    report.logs_removed = doomed
    if not doomed and any(v < floor for v, _, _, _ in listing):
        report.skipped.append(f"log cleanup: nothing below checkpoint v{floor} is older than {days(log_kept)}")
