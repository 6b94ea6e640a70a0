"""The event processor's files and Delta tables (seed 002, "Directory structure"):

| path under ``$TIDEMARK_HOME/events/`` | what |
|---|---|
| ``incoming/ready/<file>.log.status`` | DestinationStatus of a file being processed (JSON, written atomically) |
| ``archive/yyyy-mm-dd/<file>.log.gz`` | processed files (the day of the file's first event) |
| ``failed/failed.dst=<id>.log`` | EventError JSON lines: ``{event, error, destination, table, file, line, failed_at}`` |
| ``failed/replay.dst=<id>.json`` | the plan of a replay under way |
| ``processor.json`` | the last file ordinal given out (row ids) |

Delta: stage tables (appended with ``deltalake``, schema merged, a Delta transaction per unit)
and ``etl.failed_events``. One batch processor at a time holds the intake's lock, a record of the
offset store (:mod:`platform_assets.core.locks`), on whatever host it runs.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import gzip
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from lineage.core.errors import ProcessingError, TidemarkError
from lineage.intake.columns import SqlType
from lineage.intake.pipeline import ColumnType
from resources.storage.delta_log import open_table
from resources.storage.warehouse import storage_options

FAILED_EVENTS = "etl.failed_events"
_TS = pa.timestamp("us", tz="UTC")
FAILED_SCHEMA = pa.schema([
    ("failure_id", pa.string()),  # <file>:<line>:<destination>, or the replayed failure's id
    ("destination", pa.string()), ("table", pa.string()), ("error", pa.string()),
    ("event", pa.string()),  # the original event (after ContextEnrichment), JSON
    ("file", pa.string()), ("line", pa.int64()), ("failed_at", _TS), ("received_at", _TS),
])
_DELTA_TYPES: dict[str, ColumnType] = {
    "long": ColumnType(SqlType.BIGINT), "integer": ColumnType(SqlType.BIGINT, 32),
    "short": ColumnType(SqlType.BIGINT, 16), "byte": ColumnType(SqlType.BIGINT, 8),
    "double": ColumnType(SqlType.DOUBLE), "float": ColumnType(SqlType.DOUBLE, 32),
    "boolean": ColumnType(SqlType.BOOLEAN), "string": ColumnType(SqlType.STRING),
    "timestamp": ColumnType(SqlType.TIMESTAMP),
}


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` so that a crash leaves the old or the new content, whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_json(path: Path) -> Any | None:
    try:
        return orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None


def next_ordinal(events_dir: Path, at_least: int = 0, take: Callable[[int], int] | None = None) -> int:
    """Give out the next unit ordinal (the high 32 bits of row ids), durably, before it is used.
    ``take``: draws it from a counter every host shares (the offset store's), given the floor
    this folder knows (``processor.json``, kept as that floor: a store restored from a backup does
    not give a number this folder used again); without it, from the folder's counter alone."""
    path = events_dir / "processor.json"
    events_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(events_dir / ".ordinal.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the batch processor and stream loops share the counter
        state = read_json(path) or {}
        floor = max(int(state.get("last_ordinal", 0)), at_least)
        n = take(floor) if take is not None else floor + 1
        write_json_atomic(path, {**state, "last_ordinal": n})
    finally:
        os.close(fd)
    return n


def status_path(file: Path) -> Path:
    return file.with_name(file.name + ".status")


def failed_dir(events_dir: Path) -> Path:
    return events_dir / "failed"


def failed_log(events_dir: Path, dest: str) -> Path:
    return failed_dir(events_dir) / f"failed.dst={dest}.log"


def append_failed(path: Path, offset: int, lines: list[bytes]) -> int:
    """Make ``path`` hold exactly its first ``offset`` bytes plus ``lines``, durably (a retry after
    a crash mid-append truncates what the crashed attempt wrote); returns the new size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as f:
        f.truncate(offset)
        f.seek(offset)
        for line in lines:
            f.write(line)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def archive_file(events_dir: Path, file: Path, day: dt.date) -> Path:
    """Gzip ``file`` into ``archive/<day>/`` (durably), then remove it and its status file."""
    folder = events_dir / "archive" / day.isoformat()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / (file.name + ".gz")
    if file.exists():
        tmp = target.with_name(target.name + ".tmp")
        with open(file, "rb") as src, gzip.open(tmp, "wb", compresslevel=1) as dst:
            shutil.copyfileobj(src, dst, 1024 * 1024)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_dir(folder)
        file.unlink()
    status_path(file).unlink(missing_ok=True)
    fsync_dir(file.parent)
    return target


@dataclass(frozen=True)
class TableState:
    """What the processor needs from a stage table before writing to it."""

    columns: dict[str, ColumnType]
    txn_version: int  # of this writer's app id; 0 if none
    max_pos: dt.datetime | None
    version: int = -1  # the table's Delta version (-1: no table yet)


def _columns(table: Any) -> dict[str, ColumnType]:
    cols = {}
    for f in table.schema().fields:
        name = getattr(f.type, "type", None)
        cols[f.name] = _DELTA_TYPES.get(str(name), ColumnType(None))
    return cols


def table_columns(path: str) -> dict[str, ColumnType]:
    """The columns of a stage table as the intake sees them (none if it does not exist yet)."""
    table = open_table(path)
    return {} if table is None else _columns(table)


def table_state(path: str, app_id: str) -> TableState:
    table = open_table(path)
    if table is None:
        return TableState({}, 0, None)
    cols = _columns(table)
    max_pos = None
    if "pos" in cols:
        actions = pa.table(table.get_add_actions(flatten=True))
        if "max.pos" in actions.column_names and actions.num_rows:
            values = [v for v in actions.column("max.pos").to_pylist() if v is not None]
            max_pos = max(values) if values else None
            if max_pos is not None and max_pos.tzinfo is None:
                max_pos = max_pos.replace(tzinfo=dt.UTC)
    return TableState(cols, table.transaction_version(app_id) or 0, max_pos, table.version())


def committed_files(path: str, app_id: str, names: list[str], depth: int = 200, *, version: int | None = None,
                    since: int | None = None) -> set[str]:
    """Which of the incoming files (or units) ``names`` a commit of ``app_id`` carries (by its
    userMetadata: ``unit``, and ``files`` of a unit of several): the Delta log's word when a
    status file was lost, or when a planned transaction version was found taken. ``version``:
    only the commit of that transaction version; ``since``: only commits after that Delta version
    of the table (all of them, however many: where the plan was made), else the newest ``depth``."""
    table = open_table(path)
    if table is None:
        return set()
    limit = max(table.version() - since, 1) if since is not None else depth
    commits = table.history(limit)
    if since is not None and version is not None and len(commits) < limit:
        raise ProcessingError(
            f"{path}: the unit {names[0]} planned transaction {app_id} version {version} when the table was at "
            f"version {since}; that version has been taken since, but the commits after version {since} are no longer all "
            f"in its Delta log (removed by log retention or a log cleanup), so the log cannot tell whether they hold "
            f"this unit. Nothing was written. Look for the rows of {', '.join(names[:3])}"
            f"{' ...' if len(names) > 3 else ''} in the table: if they are there, move those incoming files to the "
            "archive by hand; if not, remove the unit's status file (`.status` beside its first file, or the stream "
            "destination's pending.status) and run again, which plans them anew")
    wanted, found = set(names), set()
    for commit in commits:
        m = _app_meta(commit, app_id)
        if m is None:
            continue
        if version is not None and m.get("version", version) != version:  # (older failed-events commits name none)
            continue
        found |= wanted & {m.get("unit"), *(m.get("files") or [])}
    return found


def _app_meta(commit: dict[str, Any], app_id: str) -> dict[str, Any] | None:
    """A commit's userMetadata when a unit of ``app_id`` wrote it (else None)."""
    meta = commit.get("userMetadata")
    if not meta:
        return None
    try:
        m = orjson.loads(meta)
    except orjson.JSONDecodeError:
        return None
    return m if isinstance(m, dict) and m.get("app_id") == app_id else None


def newest_unit_meta(path: str, app_id: str, match: Callable[[dict[str, Any]], bool]) -> tuple[dict[str, Any], int] | None:
    """The userMetadata of the newest commit of ``app_id`` in the table at ``path`` that ``match``
    accepts, with its Delta version; None when no commit of the log does. Reads the log newest
    first, in growing pages, so it costs what lies above that commit, however deep it is. A table
    that ``app_id`` never wrote (no transaction of it) is not read."""
    table = open_table(path)
    if table is None or not table.transaction_version(app_id):
        return None
    total, limit, seen = table.version() + 1, 32, 0
    while seen < total:
        commits = table.history(limit)
        for commit in commits[seen:]:
            m = _app_meta(commit, app_id)
            if m is not None and match(m):
                return m, int(commit.get("version", -1))
        seen, limit = len(commits), limit * 4
        if len(commits) < limit // 4:
            break  # the log holds no older commits (a checkpoint replaced them)
    return None


def arrow_type(ct: ColumnType) -> pa.DataType:
    t = ct.type
    if t is SqlType.BIGINT:
        return {8: pa.int8(), 16: pa.int16(), 32: pa.int32()}.get(ct.int_bits, pa.int64())
    if t is SqlType.DOUBLE:
        return pa.float32() if ct.int_bits == 32 else pa.float64()
    if t is SqlType.BOOLEAN:
        return pa.bool_()
    if t is SqlType.TIMESTAMP:
        return _TS
    return pa.string()


def write_stage(path: str, columns: pa.Table, pos: pa.Array, ids: pa.Array, app_id: str, version: int,
                metadata: dict[str, Any]) -> None:
    """Append one unit's rows (``pos``, ``id`` first, then ``columns``) in one Delta commit that
    carries the transaction ``(app_id, version)`` and ``metadata`` (with ``app_id``) as
    userMetadata; new columns are added (schema merge)."""
    from deltalake import CommitProperties, Transaction, write_deltalake

    data = columns.add_column(0, pa.field("id", pa.int64()), ids).add_column(0, pa.field("pos", _TS), pos)
    meta = orjson.dumps({**metadata, "app_id": app_id, "version": version}, option=orjson.OPT_SORT_KEYS).decode()
    write_deltalake(path, data, mode="append", schema_mode="merge", storage_options=storage_options(path),
                    commit_properties=CommitProperties(app_transactions=[Transaction(app_id=app_id, version=version)],
                                                       custom_metadata={"userMetadata": meta}))


def stage_app_id(dest: str, table: str) -> str:
    """The Delta ``txnAppId`` of destination ``dest``'s commits to stage table ``table``."""
    return f"tidemark-intake:{dest}:{table}"


def failed_app_id(dest: str) -> str:
    return f"tidemark-intake-failed:{dest}"


def failed_state(path: str, dest: str) -> tuple[int, int]:
    """``dest``'s transaction version in the failed-events table at ``path`` (0 if none) and the
    table's Delta version (-1: no table yet), from one read of its log."""
    table = open_table(path)
    if table is None:
        return 0, -1
    return table.transaction_version(failed_app_id(dest)) or 0, table.version()


def failed_version(path: str, dest: str) -> int:
    return failed_state(path, dest)[0]


def write_failed_events(path: str, rows: list[dict[str, Any]], dest: str, version: int, unit: str,
                        replace_ids: list[str] | None = None, files: list[str] | None = None,
                        extra: dict[str, Any] | None = None) -> None:
    """Append failed events (``replace_ids``: replace those rows in the same commit, for a
    replay) in one commit carrying the transaction ``(tidemark-intake-failed:<dest>, version)``;
    ``extra``: more userMetadata (a stream micro-batch's queue plan)."""
    from deltalake import CommitProperties, Transaction, write_deltalake

    data = pa.Table.from_pylist(rows, schema=FAILED_SCHEMA)
    app_id = failed_app_id(dest)
    props = CommitProperties(app_transactions=[Transaction(app_id=app_id, version=version)],
                             custom_metadata={"userMetadata": orjson.dumps(
                                 {**(extra or {}), "app_id": app_id, "version": version, "unit": unit,
                                  **({"files": files} if files and len(files) > 1 else {})}).decode()})
    opts = storage_options(path)
    if replace_ids is not None and open_table(path) is not None:
        ids = ", ".join("'" + i.replace("'", "''") + "'" for i in replace_ids) or "''"
        write_deltalake(path, data, mode="overwrite", predicate=f"failure_id IN ({ids})", storage_options=opts,
                        commit_properties=props)
    else:
        write_deltalake(path, data, mode="append", storage_options=opts, commit_properties=props)


def read_failed_events(path: str, dest: str | None = None) -> list[dict[str, Any]]:
    table = open_table(path)
    if table is None:
        return []
    rows = table.to_pyarrow_table().to_pylist()
    return [r for r in rows if dest is None or r["destination"] == dest]


def open_geo(path: str) -> Any:
    """``ip -> record`` of a MaxMind-format database (GeoLite2/GeoIP2 City or Country, or any .mmdb)."""
    import maxminddb

    try:
        reader = maxminddb.open_database(path)
    except (OSError, ValueError) as exc:
        raise TidemarkError(f"lookups.geo_db {path!r}: cannot open the MaxMind database ({exc}); "
                            "give the path of a .mmdb file or remove geo_db") from exc
    return reader.get
