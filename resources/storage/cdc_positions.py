"""A replicator's positions in Delta (issue 57): ``etl.cdc_positions__<replicator>``, written with
``deltalake`` (no JVM).

A replica's own commits record the source position (LSN) each unit applied. A replica with nothing
in a span of the stream moves on without a commit, and the replication slot is then acknowledged
past its newest commit: only the offset store knew that the replica is complete up to there. Before
the slot moves past what the replicas' commits record, the replicator writes here, per replica, the
position up to which it is complete (and its state, the replicator's unit number and its change
counter), so a lost or restored offset store recovers every replica's exact position from Delta.

One small table per replicator (replicators never write each other's), overwritten whole each time
(one row per replica): its log is checkpointed by ``deltalake`` every 100 commits, expired log
files and removed data files are cleaned after an hour (:data:`RETENTION`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from lineage.core.retry import retrying
from resources.core.settings import Settings
from resources.storage.delta_log import open_table
from resources.storage.warehouse import storage_options

TABLE_PREFIX = "etl.cdc_positions__"
RETENTION = "interval 1 hours"
#: A commit of the table whose version is a multiple of this vacuums files removed over an hour ago.
VACUUM_EVERY = 100

SCHEMA = pa.schema([
    ("replica", pa.string()),
    ("lsn", pa.int64()),  # complete up to here: every change of its table at or before it is in its Delta table
    ("state", pa.string()),  # the replica's state word and reason (paused: ...)
    ("unit", pa.int64()),  # the replicator's newest unit number
    ("changes", pa.int64()),  # the replicator's change counter (``_sequence_num``)
    ("ts", pa.timestamp("us", tz="UTC")),
])


def table_name(replicator: str) -> str:
    return f"{TABLE_PREFIX}{replicator}"


@dataclass(frozen=True)
class Recorded:
    """What the table holds: per replica its position and state, the replicator's unit and change
    counter, when it was written and its Delta version (``version`` -1: no table yet)."""

    lsn: dict[str, int] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)
    unit: int = 0
    changes: int = 0
    ts: dt.datetime | None = None
    version: int = -1


def read(settings: Settings, replicator: str) -> Recorded:
    """The replicator's recorded positions (empty when never written)."""
    table = open_table(settings.table_path(table_name(replicator)))
    if table is None:
        return Recorded()
    rows = table.to_pyarrow_table().to_pylist()
    return Recorded(lsn={r["replica"]: int(r["lsn"]) for r in rows},
                    state={r["replica"]: r["state"] or "" for r in rows},
                    unit=max((int(r["unit"] or 0) for r in rows), default=0),
                    changes=max((int(r["changes"] or 0) for r in rows), default=0),
                    ts=max((r["ts"] for r in rows), default=None), version=int(table.version()))


def write(settings: Settings, replicator: str, positions: dict[str, tuple[int, str]], *, unit: int,
          changes: int, now: dt.datetime | None = None) -> Recorded:
    """Record ``positions`` (replica -> (lsn, state)) as the replicator's whole table; returns what it
    now holds."""
    from deltalake import write_deltalake

    path = settings.table_path(table_name(replicator))
    now = now or dt.datetime.now(dt.UTC)
    data = pa.Table.from_pylist([{"replica": r, "lsn": lsn, "state": state, "unit": unit, "changes": changes, "ts": now}
                                 for r, (lsn, state) in sorted(positions.items())], schema=SCHEMA)
    opts = storage_options(path)
    # (a user's pause or resume may write at the same moment: the loser of the two commits tries again)
    retrying(lambda: write_deltalake(path, data, mode="overwrite", storage_options=opts,
                                     configuration={"delta.logRetentionDuration": RETENTION,
                                                    "delta.deletedFileRetentionDuration": RETENTION}),
             attempts=5, backoff_s=0.05, retryable=lambda exc: type(exc).__name__ == "CommitFailedError")
    table: Any = open_table(path)
    version = int(table.version()) if table is not None else -1
    if table is not None and version and version % VACUUM_EVERY == 0:
        table.vacuum(retention_hours=1, enforce_retention_duration=False, dry_run=False)
    return Recorded(lsn={r: lsn for r, (lsn, _) in positions.items()}, state={r: s for r, (_, s) in positions.items()},
                    unit=unit, changes=changes, ts=now, version=version)


def set_state(settings: Settings, replicator: str, replica: str, state: str) -> None:
    """``replica``'s recorded state set to ``state`` (a pause or resume by the user), when it has a position."""
    rec = read(settings, replicator)
    if replica not in rec.lsn or rec.state.get(replica) == state:
        return
    write(settings, replicator, {r: (lsn, state if r == replica else rec.state.get(r, "")) for r, lsn in rec.lsn.items()},
          unit=rec.unit, changes=rec.changes)


def drop(settings: Settings, replicator: str, replicas: list[str] | None = None) -> None:
    """Forget the replicator's positions (``tidemark cdc delete``): every replica's, or those named."""
    from resources.storage.warehouse import remove_tree

    path = settings.table_path(table_name(replicator))
    if replicas is None:
        remove_tree(path)
        return
    table = open_table(path)
    if table is None:
        return
    rec = read(settings, replicator)
    keep = {r: (lsn, rec.state.get(r, "")) for r, lsn in rec.lsn.items() if replicas is not None and r not in replicas}
    write(settings, replicator, keep, unit=rec.unit, changes=rec.changes)
