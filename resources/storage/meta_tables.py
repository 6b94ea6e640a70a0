"""Tidemark's own Delta tables, written with ``deltalake`` (no JVM):

* ``etl.log`` — per-block statistics (the seed's ``ETL.Log``), one row per block, written
  idempotently: a topic's rows carry the Delta transaction ``(tidemark-log:<topic>, seq)``;
* ``sch.lineage`` — the validated lineage, with who published it and when;
* ``etl.quarantine`` — base-table rows that cannot be placed (null ``pos``/``id``), as JSON;
* ``etl.offset_resets`` — every ``tidemark offsets reset``: the one move of an offset the Delta
  log of the destination cannot show, so a store lost before the topic's next unit gets it back.
"""

from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import json
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from lineage.core.durations import format_duration
from lineage.core.retry import retrying
from lineage.spec.model import Lineage
from resources.core.settings import Settings
from resources.storage.delta_log import open_table
from resources.storage.warehouse import storage_options

ETL_LOG = "etl.log"
LINEAGE = "sch.lineage"
QUARANTINE = "etl.quarantine"
OFFSET_RESETS = "etl.offset_resets"
META_TABLES = (ETL_LOG, LINEAGE, QUARANTINE, OFFSET_RESETS)

OFFSET_RESETS_SCHEMA = pa.schema([
    ("topic", pa.string()), ("last", pa.string()), ("seq", pa.int64()), ("late_from", pa.string()),
    ("who", pa.string()), ("reason", pa.string()), ("ts", pa.timestamp("us", tz="UTC")),
])

_TS = pa.timestamp("us", tz="UTC")

ETL_LOG_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("ts", _TS),
        ("rows", pa.int64()),
        ("max_id", pa.int64()),
        ("min_ts", _TS),
        ("max_ts", _TS),
        ("max_lag", pa.float64()),  # seconds from the block's oldest row to ts
        ("nulls", pa.map_(pa.string(), pa.int64())),
        ("run_id", pa.string()),
        ("processor", pa.string()),
        ("seq", pa.int64()),
        ("last", pa.string()),
        ("next", pa.string()),
        ("base_rows", pa.int64()),
        ("bad_rows", pa.int64()),
        ("delta_version", pa.int64()),
        ("duration_s", pa.float64()),
        ("strategy", pa.string()),  # merge: incremental | full
        ("detail", pa.string()),  # merge: why that strategy (reverse join of N keys, full recompute because ...)
        ("changes", pa.map_(pa.string(), pa.int64())),  # merge: rows_inserted, rows_updated, keys_rederived, ...
    ]
)


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    return None if value is None else value.replace(tzinfo=dt.UTC)


@dataclass(frozen=True)
class LogEntry:
    topic: str
    ts: dt.datetime
    rows: int
    max_id: int | None
    min_ts: dt.datetime | None
    max_ts: dt.datetime | None
    nulls: dict[str, int]
    run_id: str
    processor: str
    seq: int
    last: str
    next: str
    base_rows: int
    bad_rows: int
    delta_version: int | None
    duration_s: float
    max_lag: float | None = field(default=None)
    strategy: str | None = None
    detail: str | None = None
    changes: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.max_lag is None and self.min_ts is not None:
            object.__setattr__(self, "max_lag", max(0.0, (self.ts - self.min_ts).total_seconds()))


def log_app_id(topic: str) -> str:
    return f"tidemark-log:{topic}"


def write_etl_log(settings: Settings, entry: LogEntry) -> bool:
    """Append ``entry`` unless the log already holds this block (same topic and seq).
    Returns whether a row was written. Appends from threads of one process go one at a time, and an
    append that lost to another writer's commit (``etl.log`` created, or its schema merged, by two
    writers at once: ``deltalake`` refuses the loser's commit) is tried again: the row's txn makes
    a second try a no-op when the first landed."""
    with _ETL_LOG_LOCK:
        return retrying(lambda: _append_etl_log(settings, entry), attempts=ETL_LOG_ATTEMPTS, backoff_s=0.05,
                        retryable=lambda exc: type(exc).__name__ == "CommitFailedError")


#: Appends of one process to etl.log, one at a time (a unit's replicas log from threads).
_ETL_LOG_LOCK = threading.Lock()
#: How often an append that lost to a concurrent commit is tried.
ETL_LOG_ATTEMPTS = 5


def _append_etl_log(settings: Settings, entry: LogEntry) -> bool:
    from deltalake import CommitProperties, Transaction, write_deltalake

    path = settings.table_path(ETL_LOG)
    app_id = log_app_id(entry.topic)
    table = open_table(path)
    if table is not None and (table.transaction_version(app_id) or 0) >= entry.seq:
        return False
    row = asdict(entry)
    for k in ("ts", "min_ts", "max_ts"):
        row[k] = _utc(row[k])
    row["nulls"] = list(row["nulls"].items())
    row["changes"] = None if row["changes"] is None else list(row["changes"].items())
    data = pa.Table.from_pylist([row], schema=ETL_LOG_SCHEMA)
    write_deltalake(
        path,
        data,
        mode="append",
        schema_mode="merge",
        commit_properties=CommitProperties(app_transactions=[Transaction(app_id=app_id, version=entry.seq)]),
        storage_options=storage_options(path),
    )
    return True


def logged_seq(settings: Settings, topic: str) -> int:
    """The newest unit of ``topic`` that ``etl.log`` records (0: none)."""
    table = open_table(settings.table_path(ETL_LOG))
    return int((table.transaction_version(log_app_id(topic)) or 0) if table is not None else 0)


def read_etl_log(settings: Settings, topic: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
    """The newest ``limit`` rows of etl.log (all topics, or one), newest first."""
    table = open_table(settings.table_path(ETL_LOG))
    if table is None:
        return []
    rows = table.to_pyarrow_table().to_pylist()
    if topic:
        rows = [r for r in rows if r["topic"] == topic]
    rows.sort(key=lambda r: (r["ts"], r["seq"]), reverse=True)
    return rows[:limit]


def lineage_rows(lineage: Lineage) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for s in lineage.sources.values():
        rows.append({"kind": "source", "topic": None, "table": s.name, "tag": None, "shard": None, "depends_on": [],
                     "processor": None, "transforms": [], "delay": None, "repeat": None, "maxstep": None,
                     "before": [], "after": [], "comment": s.spec.comment, "owner": s.spec.owner,
                     "source_file": f"{s.file}:{s.line}"})
    for t in lineage.topics.values():
        sp = t.spec
        rows.append({"kind": "topic", "topic": sp.name, "table": sp.destination, "tag": sp.topic.tag,
                     "shard": sp.topic.shard, "depends_on": list(sp.depends_on), "processor": sp.processor.value,
                     "transforms": list(sp.transforms), "delay": format_duration(sp.delay),
                     "repeat": format_duration(sp.repeat), "maxstep": sp.maxstep, "before": list(sp.before),
                     "after": list(sp.after), "comment": sp.comment, "owner": sp.owner, "source_file": t.where})
    return rows


def lineage_hash(lineage: Lineage) -> str:
    rows = lineage_rows(lineage)
    sql = {t.name: [tr.sql for tr in t.transforms] for t in lineage.topics.values()}
    return hashlib.sha256(json.dumps([rows, sql], sort_keys=True, default=str).encode()).hexdigest()[:16]


def publish_lineage(settings: Settings, lineage: Lineage, *, now: dt.datetime | None = None) -> bool:
    """Overwrite ``sch.lineage`` with ``lineage`` unless it already holds this exact lineage.
    Returns whether it wrote."""
    from deltalake import write_deltalake

    path = settings.table_path(LINEAGE)
    digest = lineage_hash(lineage)
    table = open_table(path)
    if table is not None:
        current = table.to_pyarrow_table(columns=["spec_hash"]).column("spec_hash").to_pylist()
        if current and current[0] == digest:
            return False
    now = now or dt.datetime.now(dt.UTC)
    user = _user()
    rows = [{**r, "spec_hash": digest, "user": user, "updated_at": now} for r in lineage_rows(lineage)]
    schema = pa.schema([
        ("kind", pa.string()), ("topic", pa.string()), ("table", pa.string()), ("tag", pa.string()),
        ("shard", pa.string()), ("depends_on", pa.list_(pa.string())), ("processor", pa.string()),
        ("transforms", pa.list_(pa.string())), ("delay", pa.string()), ("repeat", pa.string()),
        ("maxstep", pa.int64()), ("before", pa.list_(pa.string())), ("after", pa.list_(pa.string())),
        ("comment", pa.string()), ("owner", pa.string()), ("source_file", pa.string()),
        ("spec_hash", pa.string()), ("user", pa.string()), ("updated_at", _TS),
    ])
    write_deltalake(path, pa.Table.from_pylist(rows, schema=schema), mode="overwrite", schema_mode="overwrite",
                    storage_options=storage_options(path))
    return True


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name in some containers
        return "unknown"


QUARANTINE_SCHEMA = pa.schema([
    ("topic", pa.string()), ("source", pa.string()), ("reason", pa.string()),
    ("detected_at", _TS), ("row", pa.string()),
    # Late rows: the base version after which they were added (their batch's key); null for
    # rows with a null pos/id, which are kept as one current set per topic.
    ("after_version", pa.int64()),
])

NULL_POSITION = "null position"
LATE = "late"


def _quarantine_key(topic: str, after_version: int | None) -> str:
    safe = topic.replace("'", "''")
    return f"topic = '{safe}' AND " + ("after_version IS NULL" if after_version is None else f"after_version = {int(after_version)}")


def quarantined_count(settings: Settings, topic: str, after_version: int | None = None) -> int:
    table = open_table(settings.table_path(QUARANTINE))
    if table is None:
        return 0
    cols = table.to_pyarrow_table(columns=["topic", "after_version"]).to_pylist()
    return sum(1 for r in cols if r["topic"] == topic and r["after_version"] == after_version)


def quarantine_rows(settings: Settings, topic: str, source: str, bad: pa.Table, now: dt.datetime,
                    *, after_version: int | None = None) -> int:
    """Make ``etl.quarantine`` hold exactly ``bad`` for ``(topic, after_version)``, replacing what
    it held under that key, so that detecting the same rows twice stores them once. Rows with a
    null ``pos``/``id`` use ``after_version=None``; late rows the base version they came after.
    Returns how many rows were added compared with before."""
    from deltalake import write_deltalake

    before = quarantined_count(settings, topic, after_version)
    if bad.num_rows == before:
        return 0
    rows = []
    for r in bad.to_pylist():
        if after_version is not None:
            reason = f"{LATE}: position at or before the topic's last (added after base version {after_version})"
        else:
            missing = [c for c in ("pos", "id") if r.get(c) is None]
            reason = f"{NULL_POSITION}: null {' and '.join(missing)}"
        rows.append({"topic": topic, "source": source, "reason": reason, "detected_at": _utc(now),
                     "row": json.dumps(r, default=str, sort_keys=True), "after_version": after_version})
    data = pa.Table.from_pylist(rows, schema=QUARANTINE_SCHEMA)
    path = settings.table_path(QUARANTINE)
    if open_table(path) is None:
        write_deltalake(path, data, mode="append", storage_options=storage_options(path))
    else:
        write_deltalake(path, data, mode="overwrite", predicate=_quarantine_key(topic, after_version), schema_mode="merge",
                        storage_options=storage_options(path))
    return bad.num_rows - before


def record_reset(settings: Settings, topic: str, last: str, seq: int, late_from: dict[str, int] | None, who: str,
                 reason: str, now: dt.datetime) -> None:
    """Append a reset of ``topic`` to ``last`` (``seq``: the newest unit the destination's log
    recorded then) to ``etl.offset_resets``."""
    from deltalake import write_deltalake

    path = settings.table_path(OFFSET_RESETS)
    row = {"topic": topic, "last": last, "seq": seq, "late_from": json.dumps(late_from) if late_from else None,
           "who": who, "reason": reason, "ts": now.replace(tzinfo=dt.UTC)}
    write_deltalake(path, pa.Table.from_pylist([row], schema=OFFSET_RESETS_SCHEMA), mode="append",
                    storage_options=storage_options(path))


def last_reset(settings: Settings, topic: str) -> dict[str, Any] | None:
    """The newest row of ``etl.offset_resets`` for ``topic`` (None: never reset)."""
    table = open_table(settings.table_path(OFFSET_RESETS))
    if table is None:
        return None
    rows = [r for r in table.to_pyarrow_table().to_pylist() if r["topic"] == topic]
    return max(rows, key=lambda r: r["ts"]) if rows else None
