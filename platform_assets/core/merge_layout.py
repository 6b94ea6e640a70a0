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

The new files' statistics are Tidemark's, exact: the row count, and each column's bounds and null
count where it can write them (:func:`_stats`; Spark answers ``MIN``/``MAX`` from bounds, so none
are wider than the values). Only a table read as plain Parquet
(:attr:`~resources.storage.snapshot.TableSnapshot.plain`: no deletion vectors, column mapping or
partitions) by a column of integers, strings or dates, and only files of :data:`MIN_ROWS` to
:data:`MAX_ROWS` rows. Anything else, or any failure, leaves the MERGE's files as they are (the
unit has landed; this is its layout only).
"""

from __future__ import annotations

import datetime as dt
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
#: ... and the packed files hold at least this many rows together. Below it a later MERGE rewrites
#: a packed file for less than the re-sort costs (a second commit, and small files for every scan
#: after it: a view's test of 212 s took 240 s with every unit re-sorted); it grows to this size,
#: and is then cut up. Read at call time.
MIN_ROWS = 100_000
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
    if not packed or not MIN_ROWS <= sum(n for _, n in packed) <= MAX_ROWS:
        return None
    snap = TableSnapshot(dest, table)
    kind = pa.schema(table.schema().to_arrow()).field(column).type if column in snap.columns else None
    if not snap.plain or kind is None or not (pa.types.is_integer(kind) or _is_text(kind) or pa.types.is_date32(kind)):
        return None
    data_fs, root = arrow_filesystem(dest)
    written: list[str] = []
    try:
        removes, new = _write_sorted(packed, per_file, column, data_fs, root.rstrip("/"), written)
        _commit(table, removes, new)
    except BaseException as exc:
        # A commit may land and then fail (deltalake's post-commit checkpoint, a lost reply from
        # object storage): its files are the table's then, and stay.
        if written and _landed(fs, logdir, version + 1, written[0].rsplit("/", 1)[-1]):
            log.warning("%s: the re-sort landed as version %s, then failed: %s", dest, version + 1,
                        first_line(exc)[:300])
            return Resorted(version + 1, len(packed), len(written), sum(n for _, n in packed))
        for path in written:  # (not committed: nothing reads them; a failed delete leaves them to VACUUM)
            try:
                data_fs.delete_file(path)
            except OSError:
                pass
        raise
    return Resorted(version + 1, len(removes), len(new), sum(n for _, n in packed))


def _landed(fs: Any, logdir: str, version: int, name: str) -> bool:
    """Whether commit ``version`` is there and adds the file ``name`` (the re-sort's)."""
    try:
        actions = delta_log.read_commit(fs, logdir, version)
    except (FileNotFoundError, OSError):
        return False
    return any(a.get("add", {}).get("path") == name for a in actions)


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
        for start in range(0, rows, size):
            piece = part.slice(start, size)
            name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
            path = f"{root}/{name}"
            written.append(path)
            pq.write_table(piece, path, filesystem=fs, compression="snappy", coerce_timestamps="us",
                           allow_truncated_timestamps=False)  # (Spark reads no nanoseconds)
            info = fs.get_file_info(path)
            adds.append(AddAction(path=name, size=int(info.size or 0), partition_values={}, modification_time=now,
                                  data_change=False, stats=json.dumps(_stats(piece))))
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


def _stats(piece: Any) -> dict[str, Any]:
    """Delta statistics of ``piece``, exact: its row count, and for each top-level column whose
    bounds it can write (:func:`_bounds`) those bounds and its null count. A column without is left
    out whole (no bounds and no null count: a reader takes a null count without bounds for a
    column of nulls only), so a reader reads the file for it."""
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for name, values in zip(piece.column_names, piece.columns, strict=True):
        bounds = _bounds(values)
        if bounds is None:
            continue
        nulls[name] = values.null_count
        if bounds != ():
            mins[name], maxs[name] = bounds
    return {"numRecords": piece.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}


def _bounds(values: Any) -> tuple[Any, ...] | None:
    """A column's bounds as Delta statistics write them: integers and finite floats as JSON
    numbers, strings as they are, dates as ``YYYY-MM-DD``, timestamps with a time zone in UTC to
    the millisecond (the minimum down, the maximum up); ``()`` for a column of nulls only; None
    for any other type (decimals, booleans, binaries, nested types, timestamps without a time
    zone) or floats with a NaN or an infinity."""
    import math

    import pyarrow as pa
    import pyarrow.compute as pc

    kind = values.type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_date32(kind) or _is_text(kind)
            or (pa.types.is_timestamp(kind) and kind.tz is not None)):
        return None
    if values.null_count == len(values):
        return ()
    low, high = (v.as_py() for v in pc.min_max(values).values())
    if isinstance(low, float) and not (math.isfinite(low) and math.isfinite(high) and not pc.any(pc.is_nan(values)).as_py()):
        return None
    if pa.types.is_timestamp(kind):
        return _utc_ms(low, up=False), _utc_ms(high, up=True)
    if pa.types.is_date32(kind):
        return low.isoformat(), high.isoformat()
    return low, high


def _is_text(kind: Any) -> bool:
    """Whether an Arrow type is a string, in any of Arrow's three layouts."""
    import pyarrow as pa

    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind))


def _utc_ms(value: dt.datetime, *, up: bool) -> str:
    """``value`` in UTC to the millisecond, rounded down or ``up``, as Delta statistics write it."""
    value = value.astimezone(dt.UTC)
    if up and value.microsecond % 1000:
        value += dt.timedelta(microseconds=1000 - value.microsecond % 1000)
    return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"


def _commit(table: Any, removes: list[Any], adds: list[Any]) -> None:
    """One commit of the re-sort, from ``table``'s version: a commit made since conflicts with it
    (deltalake's check), and then nothing is committed."""
    from deltalake import CommitProperties

    table.create_write_transaction([*removes, *adds], mode="append", schema=table.schema(),
                                   commit_properties=CommitProperties(custom_metadata=RESORT_METADATA,
                                                                      max_commit_retries=0))
