"""Maintenance of one Delta table without a JVM (``deltalake``): its health, compaction of small
files, checkpoints, and cleanup (VACUUM, log retention) that never removes what a consumer needs.

A consumer's claim is a :class:`Need`: "I read this table at version V or later" (a topic's
per-input offset, the base version its late-row check starts from, the commit that records its
last block). The oldest need is the table's *horizon*: cleanup keeps every data file of every
version from the horizon on (``deltalake``'s ``vacuum(keep_versions=...)``) and every log entry
from the newest checkpoint at or below it on. What nobody needs is removed only when it is also
older than the retention (the table's ``delta.deletedFileRetentionDuration`` /
``delta.logRetentionDuration``, or ``retain_hours``).

The caller (``platform_assets/maintenance/tables.py``) knows the consumers; this module knows Delta.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import time
from collections.abc import Callable
from typing import Any

from lineage.core.errors import TidemarkError
from lineage.core.retry import retrying
from resources.storage import delta_log, delta_read, snapshot
from resources.storage.cleanup import (
    checkpoint_at_horizon,
    days,
    log_listing,
    remove_unneeded,
)
from resources.storage.health import (
    CHECKPOINT_AFTER_COMMITS,
    COMPACT_FROM_SMALL_FILES,
    OVERSIZED,
    TARGET_FILE_BYTES,
    Health,
    Need,
    Purge,
    Report,
)
from resources.storage.warehouse import storage_options

#: Rows per row group of the files compaction writes: a reader that wants a range of ``pos`` (the next
#: block's end, the newest position) reads only the groups whose statistics allow it. A table with
#: positions whose files under the target size hold most of it is rewritten in ``pos`` order (``Health.in_position_order``:
#: deltalake's Z-order by that one column), so each group holds a narrow range of it; else the files
#: under the target size are binned, which concatenates them in no particular order.
COMPACT_ROW_GROUP_ROWS = 8_192
#: The smallest target of a table kept in files of a given number of rows (``health``'s ``rows_per_file``).
MIN_TARGET_FILE_BYTES = 256 * 1024
#: Delta's defaults when the table sets no retention of its own.
DEFAULT_FILE_RETENTION = dt.timedelta(days=7)
DEFAULT_LOG_RETENTION = dt.timedelta(days=30)
#: Below this retention, files not yet in the log may belong to a commit in flight: only allowed when
#: the caller knows no writer of the table is running (``writers_idle``).
SAFE_RETAIN_HOURS = 1.0
#: A consumer's need is flagged when the table's own retention would remove it within this time.
RETENTION_WARNING = dt.timedelta(days=1)

#: ``deltalake``'s words for a commit that lost to a concurrent one.
_CONFLICT = re.compile(r"conflict|concurrent|already exists|version \d+ .*exists", re.IGNORECASE)


class MaintenanceError(TidemarkError):
    """A table could not be maintained (no table there, a commit conflict that kept recurring)."""


def _props(table: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in (table.metadata().configuration or {}).items()}


_INTERVAL = re.compile(r"^\s*(?:interval\s+)?(\d+)\s+(second|minute|hour|day|week)s?\s*$", re.IGNORECASE)


def parse_interval(text: str | None, default: dt.timedelta) -> dt.timedelta:
    """A Delta retention property (``interval 7 days``, ``168 hours``) as a timedelta."""
    if not text:
        return default
    m = _INTERVAL.match(text)
    if not m:
        return default
    n, unit = int(m.group(1)), m.group(2).lower()
    return dt.timedelta(**{f"{unit}s": n})


def retention(table: Any) -> tuple[dt.timedelta, dt.timedelta]:
    """The table's own file and log retention (Delta's defaults where it sets none)."""
    props = _props(table)
    return (parse_interval(props.get("delta.deletedFileRetentionDuration"), DEFAULT_FILE_RETENTION),
            parse_interval(props.get("delta.logRetentionDuration"), DEFAULT_LOG_RETENTION))


def health(table: str, path: str, needs: list[Need] | tuple[Need, ...] = (), *,
           now: dt.datetime | None = None, rows_per_file: int | None = None) -> Health:
    """Files, small files, bytes, checkpoint and what consumers need of the table at ``path``,
    read from the Delta log alone. ``rows_per_file``: the table is kept in files of about that
    many rows (a view clustered by its join column, whose reverse joins rewrite whole files), so
    its target file size is that many rows' bytes (at least :data:`MIN_TARGET_FILE_BYTES`) and a
    file is small below half of it; else files are small below :data:`SMALL_FILE_BYTES`."""
    snap = snapshot.TableSnapshot.open(path)
    if snap.table is None:
        if any(kind == "json" or kind.startswith("checkpoint") for _, kind, _, _ in log_listing(path)):
            raise MaintenanceError(f"{table}: {path} has a Delta log, but it cannot be read: {_open_error(path)}")
        return Health(table, path, None, needs=tuple(needs))
    files = snap.files
    sizes = files["size_bytes"].to_pylist() if "size_bytes" in files.column_names else []
    listing = log_listing(path)
    checkpoints = [v for v, kind, _, _ in listing if kind.startswith("checkpoint")]
    commits = [v for v, kind, _, _ in listing if kind == "json"]
    warnings = _retention_warnings(table, path, snap.table, needs, now or dt.datetime.now(dt.UTC).replace(tzinfo=None))
    rows = snap.row_count
    target = (max(MIN_TARGET_FILE_BYTES, min(TARGET_FILE_BYTES - 1, int(sum(sizes) / rows * rows_per_file)))
              if rows_per_file and rows and sizes else TARGET_FILE_BYTES)
    vector_files, deleted = delta_read.deleted_rows(snap.table)
    h = Health(table, path, snap.version, files=len(sizes), bytes=int(sum(sizes)), rows=rows or 0,
               vector_files=vector_files, deleted_rows=deleted,
               checkpoint=max(checkpoints) if checkpoints else None, oldest_log=min(commits) if commits else None,
               needs=tuple(needs), warnings=tuple(warnings), target_bytes=target)
    return dataclasses.replace(h, small_files=sum(1 for s in sizes if s < h.small_bytes),
                               binned_bytes=int(sum(s for s in sizes if s < target)),
                               positions="pos" in snap.columns,
                               oversized_files=sum(1 for s in sizes if s > OVERSIZED * target) if h.kept_small else 0)


def _open_error(path: str) -> str:
    from deltalake import DeltaTable

    try:
        DeltaTable(path, storage_options=storage_options(path))
    except Exception as exc:  # noqa: BLE001 - the reader's own words are the message
        return f"{type(exc).__name__}: {exc}"
    return "the deltalake reader refused it"


def _retention_warnings(table: str, path: str, delta_table: Any, needs: list[Need] | tuple[Need, ...],
                        now: dt.datetime) -> list[str]:
    """Where the table's own retention lets a VACUUM or log cleanup (by anyone) remove what a
    consumer still needs, within :data:`RETENTION_WARNING`."""
    if not needs:
        return []
    files_kept, log_kept = retention(delta_table)
    oldest = min(needs, key=lambda n: n.version)
    data = [n for n in needs if n.files]
    out = []
    if data:
        reader = min(data, key=lambda n: n.version)
        # The files of version V are removed by later commits; the first of them is V + 1.
        removed_at = delta_log.commit_time(path, reader.version + 1)
        if removed_at is not None and now - removed_at > files_kept - RETENTION_WARNING:
            out.append(f"{table}: {reader.describe()} — files removed after it were removed at "
                       f"{removed_at:%Y-%m-%d %H:%M} UTC, and the table's file retention ({days(files_kept)}) lets a "
                       f"VACUUM delete them from {removed_at + files_kept:%Y-%m-%d %H:%M} UTC; run `tidemark maintain` "
                       f"(it keeps them) instead of a plain VACUUM, or let {reader.who} catch up")
    committed = delta_log.commit_time(path, oldest.version)
    if committed is not None and now - committed > log_kept - RETENTION_WARNING:
        out.append(f"{table}: {oldest.describe()} was committed at {committed:%Y-%m-%d %H:%M} UTC, and the table's "
                   f"log retention ({days(log_kept)}) lets a checkpoint remove that commit from "
                   f"{committed + log_kept:%Y-%m-%d %H:%M} UTC; let {oldest.who} catch up before then")
    return out


def _retry(what: str, call: Any, attempts: int = 5) -> Any:
    """``call()``, again after a commit conflict with a concurrent writer (a MERGE that removed files
    the compaction read): the rewrite is planned again from the newer version."""
    from deltalake.exceptions import CommitFailedError

    def conflict(exc: BaseException) -> bool:
        return isinstance(exc, CommitFailedError) and bool(_CONFLICT.search(str(exc)))

    try:
        return retrying(call, attempts=attempts, retryable=conflict, backoff_s=0.2)
    except CommitFailedError as exc:
        if not conflict(exc):  # e.g. a table feature deltalake cannot write: no retry helps
            raise MaintenanceError(f"{what}: {exc}") from exc
        raise MaintenanceError(f"{what}: the commit conflicted with concurrent writers {attempts} times "
                               f"({exc}); run `tidemark maintain` again") from exc


def maintain(h: Health, *, retain_hours: float | None = None, writers_idle: bool = False, dry_run: bool = False,
             compact: bool = True, cleanup: bool = True, cluster_by: tuple[str, ...] = (),
             force_compact: bool = False, purge: Purge | None = None,
             point: Callable[[str], None] | None = None) -> Report:
    """Purge ``h``'s deletion vectors when they mark enough rows deleted (``purge``; skipped, and said,
    without one), compact ``h``'s table when it has small files (Z-order by ``cluster_by`` when given;
    the whole table in ``pos`` order when its small files are most of it, ``Health.in_position_order``),
    write a checkpoint after a compaction or a purge or when many commits follow the last one, then
    remove what is older than the retention and the consumers' horizon. ``retain_hours`` below
    :data:`SAFE_RETAIN_HOURS` skips the cleanup unless ``writers_idle`` (the files of a commit in
    flight are not in the log yet). ``point(name)`` is called between the steps (``maintain:purged``, ``maintain:compacted``,
    ``maintain:checkpointed``, ``maintain:vacuumed``, ``maintain:log-cleaning`` after the first log
    file is deleted): the crash tests kill the process there."""
    from deltalake import CommitProperties, DeltaTable, WriterProperties

    point = point or (lambda name: None)
    # marked, so that the first plan after it tells it a rewrite from its first line (delta_log.rewrites_only)
    marked = CommitProperties(custom_metadata=delta_log.REWRITE_METADATA)

    if retain_hours is not None and retain_hours < 0:
        raise MaintenanceError(f"{h.table}: retain_hours must be 0 or more, not {retain_hours}")
    started = time.monotonic()
    report = Report(h.table, dry_run=dry_run)
    if not h.exists:
        report.skipped.append("no table there")
        return report
    options = storage_options(h.path)

    def table() -> Any:
        return DeltaTable(h.path, storage_options=options)

    if compact and h.purge_due:
        if dry_run:
            report.purged = {"numFilesRemoved": h.vector_files, "numDeletedRowsRemoved": h.deleted_rows, "planned": True}
        elif purge is None:
            report.skipped.append(f"purge: {h.deleted_share:.0%} of the rows are marked deleted by deletion vectors, and "
                                  f"their purge needs Spark: REORG TABLE delta.`{h.path}` APPLY (PURGE)")
        else:
            report.purged = purge(h)
            point("maintain:purged")
    recluster = bool(h.kept_small and h.oversized_files and cluster_by)
    wanted = compact and (recluster or h.small_files >= COMPACT_FROM_SMALL_FILES or (force_compact and h.small_files > 1))
    mapping = delta_read.column_mapping(table()) if wanted else "none"
    if wanted and mapping != "none":
        report.skipped.append(f"compaction: deltalake cannot rewrite a table with column mapping (delta.columnMapping.mode "
                              f"= {mapping}); compact it with Spark: OPTIMIZE delta.`{h.path}`")
    elif wanted:
        ordered = not cluster_by and h.in_position_order
        if dry_run:
            report.compacted = {"numFilesRemoved": h.files if recluster or ordered else h.small_files, "planned": True}
            if recluster:
                report.clustered_by = cluster_by
            report.in_pos_order = ordered
        elif cluster_by and (recluster or not h.kept_small):  # a kept-small table's small files are binned
            report.compacted = _retry(f"{h.table}: Z-order", lambda: table().optimize.z_order(
                list(cluster_by), target_size=h.target_bytes, max_concurrent_tasks=2, commit_properties=marked))
            report.clustered_by = cluster_by
        elif ordered:  # Z-order by one column: the rows sorted by it
            report.compacted = _retry(f"{h.table}: compaction in pos order", lambda: table().optimize.z_order(
                ["pos"], target_size=h.target_bytes, max_concurrent_tasks=2, commit_properties=marked,
                writer_properties=WriterProperties(max_row_group_size=COMPACT_ROW_GROUP_ROWS)))
            report.in_pos_order = True
        else:
            # a table kept in small files: only the files under half its target are binned (into files
            # of up to that size), so the files a clustered build wrote stay as they are
            report.compacted = _retry(f"{h.table}: compaction", lambda: table().optimize.compact(
                target_size=h.small_bytes if h.kept_small else h.target_bytes, max_concurrent_tasks=2, commit_properties=marked,
                writer_properties=WriterProperties(max_row_group_size=COMPACT_ROW_GROUP_ROWS)))
    elif compact:
        report.skipped.append(f"compaction: not needed ({h.small_files} small files; compacts from {COMPACT_FROM_SMALL_FILES})")
    if report.compacted and not dry_run:
        point("maintain:compacted")
    current = table()
    version = int(current.version())
    files_kept, log_kept = retention(current)
    if retain_hours is not None:
        files_kept = log_kept = dt.timedelta(hours=retain_hours)
        if retain_hours < SAFE_RETAIN_HOURS and not writers_idle and cleanup:
            report.skipped.append(f"cleanup: a retention below {SAFE_RETAIN_HOURS:g} hour could delete the files of a "
                                  "commit in flight, and no writer of this table is known to be idle (a topic writing "
                                  "it holds its lock, or Tidemark's topics do not write it: say --writers-idle when "
                                  "nothing writes it now)")
            cleanup = False
    horizon = version if h.horizon is None else min(h.horizon.version, version)
    file_horizon = version if h.file_horizon is None else min(h.file_horizon.version, version)
    if cleanup:
        checkpoint_at_horizon(h, horizon, log_kept, report, dry_run=dry_run)
    since = version + 1 if h.checkpoint is None else version - h.checkpoint
    if since > 0 and (report.compacted or report.purged or since >= CHECKPOINT_AFTER_COMMITS):
        if not dry_run:
            current.create_checkpoint()
            point("maintain:checkpointed")
        report.checkpoint = version
    if cleanup:
        remove_unneeded(h, current, version, (file_horizon, horizon), files_kept, log_kept, report, dry_run=dry_run,
                 point=point)
    report.seconds = time.monotonic() - started
    return report
