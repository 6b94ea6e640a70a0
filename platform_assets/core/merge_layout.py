"""A clustered view's layout kept through the MERGEs ``deltalake`` runs from the driver
(:func:`resort_merged`).

A view is built clustered by its join column (each file holds a narrow range of it), so that a
unit's MERGE of a few keys rewrites only the files of those keys. ``deltalake``'s MERGE writes the
rows of every file it rewrote into one or two files, in no order: their statistics span the ranges
of all the files they came from, so every later unit's filter leaves them too and rewrites them
again, with more rows each unit (``bench/view_wear.py``, stop 83: ~0.2M rows a unit on a 10M-row
view). After such a MERGE, :func:`resort_merged` writes each file it packed again, sorted by the
column and cut into as many files as the MERGE removed, each of a narrow range, in a second commit
that changes no row: its adds and removes say ``dataChange: false``, as ``OPTIMIZE`` does, so the
change data feed, the units of views on this view and the planner take it for a compaction
(:func:`resources.storage.delta_log.rewrites_only`).

The new files' statistics are exact: the row count, the null counts, and the column's bounds;
no other column's bounds (:func:`_stats`). Only a table read as plain Parquet
(:attr:`~resources.storage.snapshot.TableSnapshot.plain`: no deletion vectors, column mapping or
partitions) by a column of integers, strings or dates, and only files of at most
:data:`MAX_ROWS` rows. Anything else, or any failure, leaves the MERGE's files as they are (the
unit has landed; this is its layout only).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from lineage.core.errors import first_line
from resources.storage import delta_log
from resources.storage.snapshot import TableSnapshot
from resources.storage.warehouse import arrow_filesystem

log = logging.getLogger(__name__)

#: A MERGE's output file is written again sorted when it holds more than this many times the
#: average rows of the files the MERGE removed (it packed the rows of several).
PACKED = 1.5
#: ... and at most this many rows (the driver holds them: a unit's MERGE from the driver rewrote
#: at most :data:`platform_assets.core.keyed_merge.FILTERED_VIEW_ROWS`). Read at call time.
MAX_ROWS = 5_000_000
#: What the commit of a re-sort carries in its ``commitInfo``.
RESORT_METADATA = {"tidemark.layout": "resort"}


def is_resort(commit_info: dict[str, Any]) -> bool:
    """Whether a commit (its ``commitInfo``, as ``DeltaTable.history`` gives it) is a re-sort."""
    return all(commit_info.get(k) == v for k, v in RESORT_METADATA.items())


def newest_unit_commit(table: Any) -> dict[str, Any]:
    """The ``commitInfo`` of the newest commit of ``table`` (a ``DeltaTable``) that is not a
    re-sort: a unit's MERGE, which a re-sort may follow ({} for a table without history)."""
    return next((c for c in table.history(2) if not is_resort(c)), {})


@dataclass(frozen=True)
class Resorted:
    """A re-sort's commit: its version, the files it replaced and wrote, the rows it moved."""

    version: int
    removed: int
    added: int
    rows: int


def resort_merged(dest: str, table: Any, column: str, *, app_id: str, seq: int) -> Resorted | None:
    """Write again, sorted by ``column``, each file that the MERGE of unit ``(app_id, seq)`` just
    committed to the table at ``dest`` (``table``: that version, a ``DeltaTable``) packed from
    several; None where nothing was packed, where that version is not the unit's commit, or where
    it may not (module docstring)."""
    started = time.monotonic()
    try:
        done = _resort(dest, table, column, app_id, seq)
        if done is not None:
            log.info("%s: the %s file(s) of %s rows deltalake's MERGE packed were sorted again by %s into %s files "
                     "(version %s, %.2f s)", dest, done.removed, f"{done.rows:,}", column, done.added, done.version,
                     time.monotonic() - started)
        return done
    except Exception as exc:  # noqa: BLE001 - the unit has landed; its files stay as the MERGE wrote them
        log.warning("%s: the MERGE's files were not sorted again by %s: %s", dest, column, first_line(exc)[:300])
        return None


def _resort(dest: str, table: Any, column: str, app_id: str, seq: int) -> Resorted | None:
    import pyarrow as pa

    version = table.version()
    fs, logdir = delta_log.log_fs(dest)
    actions = delta_log.read_commit(fs, logdir, version)
    if not delta_log.commit_has_txn(actions, app_id, seq):
        return None
    adds = [a["add"] for a in actions if "add" in a and a["add"].get("dataChange", True) and a["add"].get("stats")]
    removed = [a["remove"] for a in actions if "remove" in a and a["remove"].get("dataChange", True)]
    if len(removed) < 2 or not adds:
        return None
    counts = [json.loads(a["stats"]).get("numRecords") for a in adds]
    if any(not isinstance(n, int) for n in counts):
        return None
    per_file = max(1, sum(counts) // len(removed))  # (the files removed held about the rows added)
    packed = [(a, n) for a, n in zip(adds, counts, strict=True) if n > PACKED * per_file]
    if not packed or sum(n for _, n in packed) > MAX_ROWS:
        return None
    snap = TableSnapshot(dest, table)
    kind = pa.schema(table.schema().to_arrow()).field(column).type if column in snap.columns else None
    if not snap.plain or kind is None or not (pa.types.is_integer(kind) or pa.types.is_string(kind)
                                              or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
                                              or pa.types.is_date32(kind)):
        return None
    data_fs, root = arrow_filesystem(dest)
    written: list[str] = []
    try:
        removes, new = _write_sorted(packed, per_file, column, data_fs, root.rstrip("/"), written)
        _commit(table, removes, new)
    except BaseException:
        for path in written:  # (not committed: nothing reads them; a failed delete leaves them to VACUUM)
            try:
                data_fs.delete_file(path)
            except OSError:
                pass
        raise
    return Resorted(version + 1, len(removes), len(new), sum(n for _, n in packed))


def _write_sorted(packed: list[tuple[dict[str, Any], int]], per_file: int, column: str, fs: Any, root: str,
                  written: list[str]) -> tuple[list[Any], list[Any]]:
    """Each packed file's rows sorted by ``column`` and cut into files of about ``per_file`` rows,
    written under ``root`` (their paths appended to ``written`` as they are); the remove and add
    actions of the commit."""
    import pyarrow.parquet as pq
    from deltalake.transaction import AddAction, RemoveAction

    now = int(time.time() * 1000)
    removes: list[Any] = []
    adds: list[Any] = []
    for add, rows in packed:
        part = pq.read_table(f"{root}/{add['path']}", filesystem=fs, coerce_int96_timestamp_unit="us")
        if part.num_rows != rows:
            raise ValueError(f"{add['path']} holds {part.num_rows} rows, its statistics say {rows}")
        part = _plain_types(part).sort_by([(column, "ascending")])
        pieces = max(1, round(rows / per_file))
        size = -(-rows // pieces)
        stats = json.loads(add["stats"])
        for start in range(0, rows, size):
            piece = part.slice(start, size)
            name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
            path = f"{root}/{name}"
            written.append(path)
            pq.write_table(piece, path, filesystem=fs, compression="snappy", coerce_timestamps="us",
                           allow_truncated_timestamps=False)  # (Spark reads no nanoseconds)
            info = fs.get_file_info(path)
            adds.append(AddAction(path=name, size=int(info.size or 0), partition_values={}, modification_time=now,
                                  data_change=False, stats=json.dumps(_stats(piece, stats, column))))
        removes.append(RemoveAction(path=add["path"], data_change=False, deletion_timestamp=now,
                                    size=int(add.get("size") or 0), partition_values={}))
    return removes, adds


def _plain_types(part: Any) -> Any:
    """``part`` with its string and binary views as plain strings and binaries (the Parquet
    written is the same; pyarrow's sort takes no views)."""
    import pyarrow as pa

    plain = {pa.string_view(): pa.string(), pa.binary_view(): pa.binary()}
    if not any(f.type in plain for f in part.schema):
        return part
    return part.cast(pa.schema([f.with_type(plain.get(f.type, f.type)) for f in part.schema], metadata=part.schema.metadata))


def _stats(piece: Any, source: dict[str, Any], column: str) -> dict[str, Any]:
    """Delta statistics of ``piece``, part of the file whose statistics are ``source``: its row
    count, the null counts of the columns ``source`` counts (top-level ones), and ``column``'s
    bounds, all exact. No other column's bounds: the source file's would hold for the piece, but
    a reader may take bounds for the values themselves (Spark answers ``MIN``/``MAX`` from them),
    and a bound left out only means the file is read."""
    import pyarrow.compute as pc

    low, high = pc.min_max(piece.column(column)).values()
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    for bounds, value in ((mins, low.as_py()), (maxs, high.as_py())):
        if value is not None:
            bounds[column] = value.isoformat() if hasattr(value, "isoformat") else value
    nulls = {c: piece.column(c).null_count for c, n in (source.get("nullCount") or {}).items()
             if isinstance(n, int) and c in piece.column_names}
    return {"numRecords": piece.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}


def _commit(table: Any, removes: list[Any], adds: list[Any]) -> None:
    """One commit of the re-sort, from ``table``'s version: a commit made since conflicts with it
    (deltalake's check), and then nothing is committed."""
    from deltalake import CommitProperties

    table.create_write_transaction([*removes, *adds], mode="append", schema=table.schema(),
                                   commit_properties=CommitProperties(custom_metadata=RESORT_METADATA,
                                                                      max_commit_retries=0))
