"""Schema changes captured in a replicator's stream, applied to the replicas in order (issue 10).

* CREATE of a selected table: a new, empty replica; every row of the table arrives in the stream.
* ALTER: added columns are added to the replica (Delta schema evolution); a column type widened
  the way Delta's type widening allows (``int``→``bigint``, ``float``→``double``, a larger decimal)
  is widened (the replica takes on the type widening table feature then, not before: the
  ``deltalake`` reader cannot read a table that has it); a dropped column stays in the replica (null in rows written later). Any other type
  change cannot be applied: the table is **paused** with the reason and the fix, nothing after it
  is applied or acknowledged, and ``tidemark cdc resume`` continues from there.
* DROP: the replica is kept (``on_drop: keep``, the default) or removed; no more changes.
* RENAME: the replica follows (copied to the new name's replica, the old one removed). Renamed
  between two units, the new name is copied from a snapshot and the old replica is removed.
  A table that left the source's catalog between units (renamed or dropped) is found by its
  replica's record, and the stream is read from that replica's position for its rename or drop.
"""

from __future__ import annotations

import re
from dataclasses import replace

from lineage.cdc.changes import DdlChange, DdlKind, TableSchema, format_lsn, lsn_position
from platform_assets.cdc import apply as cdc_apply
from platform_assets.cdc.units import CdcResult, ReplicaHost, Table, state_word
from platform_assets.core import spark_io
from platform_assets.core.spark_io import quote
from resources.storage import warehouse as storage

_INTS = ["tinyint", "smallint", "int", "bigint"]


def widens(old: str, new: str) -> bool:
    """Whether Delta's type widening turns column type ``old`` into ``new`` in place."""
    old, new = old.lower().replace("integer", "int"), new.lower().replace("integer", "int")
    if old == new:
        return True
    if old in _INTS and new in _INTS:
        return _INTS.index(new) > _INTS.index(old)
    if (old, new) in {("float", "double"), ("date", "timestamp_ntz")}:
        return True
    if old in _INTS and new.startswith("decimal") or old == "float" and new == "double":
        return True
    m_old, m_new = re.fullmatch(r"decimal\((\d+),\s*(\d+)\)", old), re.fullmatch(r"decimal\((\d+),\s*(\d+)\)", new)
    if m_old and m_new:
        p1, s1, p2, s2 = int(m_old[1]), int(m_old[2]), int(m_new[1]), int(m_new[2])
        return s2 >= s1 and p2 - s2 >= p1 - s1
    return False


def remove_table(path: str) -> None:
    """Delete a replica's files (``on_drop: drop``, the old name of a renamed table); already gone
    (a unit redone after a crash): nothing to do."""
    fs, where = storage.arrow_filesystem(path)
    try:
        fs.delete_dir(where)
    except FileNotFoundError:
        pass


def apply(unit: ReplicaHost, t: Table | None, ddl: DdlChange, tx_lsn: int, result: CdcResult) -> Table | None:
    """Apply one schema change; returns the table the following changes go to (None: none)."""
    store, owner, spark = unit.engine.store, unit.owner, unit.engine.spark
    if ddl.kind is DdlKind.CREATE and ddl.schema is not None and (t is None or t.applied is None):
        t = unit.table(ddl.schema)
        counts = result.tables.setdefault(t.replica, {})
        counts["ddl"] = counts.get("ddl", 0) + 1
        if unit.source.snapshots:  # rows of a CREATE TABLE AS or a rename into the selection were never streamed:
            return t  # the next unit copies the table from a snapshot (stream changes up to it are skipped)
        cdc_apply.ensure_replica(spark, t.path, t.layout)
        start = lsn_position(tx_lsn - 1)
        if t.rec.last < start:
            t.rec = store.plan(t.replica, owner, last=t.rec.last, next=start, seq=t.rec.seq + 1, source_version=None)
            t.rec = store.commit(t.replica, owner, seq=t.rec.seq, last=t.rec.last, next=start, rows=0, state="replicating",
                                 note=f"created in the source at {format_lsn(tx_lsn)}: {ddl.statement[:200]}")
        return t
    if t is None:
        return None
    counts = result.tables.setdefault(t.replica, {})
    if ddl.kind in (DdlKind.ALTER, DdlKind.CREATE) and ddl.schema is not None:
        problem = alter(unit, t, ddl.schema)
        if problem:
            why = (f"paused: {problem} at {format_lsn(tx_lsn)} ({ddl.statement[:200]}); nothing after it is applied. Fix the "
                   f"replica's column type (or re-copy the table: tidemark cdc resume {t.replica} --resync), then: "
                   f"tidemark cdc resume {t.replica}")
            store.set_state(t.replica, owner, why)
            t.rec = store.get(t.replica) or t.rec
            result.paused[t.replica] = why
            counts["failed"] = counts.get("failed", 0) + 1
            return t
        counts["ddl"] = counts.get("ddl", 0) + 1
        return t
    if ddl.kind is DdlKind.DROP:
        if unit.spec.on_drop == "drop":
            remove_table(t.path)
        store.set_state(t.replica, owner, f"dropped: {ddl.table} was dropped in the source at {format_lsn(tx_lsn)}"
                                          + ("; replica removed" if unit.spec.on_drop == "drop" else "; replica kept"))
        t.rec = store.get(t.replica) or t.rec
        counts["ddl"] = counts.get("ddl", 0) + 1
        return None
    if ddl.kind is DdlKind.RENAME and ddl.new_table:
        if not unit.spec.selects(ddl.new_table):
            return apply(unit, t, DdlChange(ddl.table, DdlKind.DROP, statement=ddl.statement), tx_lsn, result)
        new = unit.tables.get(ddl.new_table) or unit.table(TableSchema(ddl.new_table, t.layout.schema.columns,
                                                                      t.layout.schema.key))
        if new.replica == t.replica:  # a new name of the same replica ("Foo" -> foo): nothing moves
            counts["ddl"] = counts.get("ddl", 0) + 1
            return new
        how = ""
        if new.applied is not None and new.applied >= tx_lsn:
            # renamed between units: the new name's replica was copied from a snapshot taken after the
            # rename and holds every row; a copy of the old one would take back what it has
            how = f"; {new.replica} was copied from a snapshot at {format_lsn(new.applied)}"
        elif not new.active:  # paused (its snapshot failed): it says why; a copy would hide that
            how = f"; {new.replica} is {state_word(new.rec)}, not copied from the old replica"
        else:
            seq = new.rec.seq + 1
            pos = lsn_position(tx_lsn)
            new.rec = store.plan(new.replica, owner, last=new.rec.last, next=pos, seq=seq, source_version=None)
            df = spark.read.format("delta").load(t.path)
            spark_io.save_unit(df.write.format("delta").mode("overwrite").option("overwriteSchema", "true"), new.path,
                               app_id=f"tidemark:{new.replica}", seq=seq,
                               meta=unit.commit_meta(result.unit, tx_lsn, kind="rename", renamed_from=t.replica,
                                                     key=list(new.layout.key)))
            new.rec = store.commit(new.replica, owner, seq=seq, last=new.rec.last, next=pos, rows=0, state="replicating",
                                   note=f"renamed from {t.source} at {format_lsn(tx_lsn)}")
        remove_table(t.path)
        store.set_state(t.replica, owner, f"dropped: renamed to {ddl.new_table} ({new.replica}) at {format_lsn(tx_lsn)}"
                                          + how)
        t.rec = store.get(t.replica) or t.rec
        counts["ddl"] = counts.get("ddl", 0) + 1
        return new
    return t


def alter(unit: ReplicaHost, t: Table, schema: TableSchema, have: dict[str, str] | None = None) -> str | None:
    """Bring the replica's columns to ``schema`` (``have``: its columns now, if already read); the
    reason when a change cannot be applied."""
    have = cdc_apply.replica_columns(t.path) if have is None else have
    for col in schema.columns:
        old = have.get(col.name)
        if old is not None and not widens(old, col.type):
            return (f"column {t.source}.{col.name} changed type from {old} to {col.type} ({col.source_type or col.type}), "
                    f"which the replica's Delta table cannot take in place")
    added = [c for c in schema.columns if c.name not in have]
    spark = unit.engine.spark if added or any(c.name in have and have[c.name].lower() != c.type.lower()
                                              for c in schema.columns) else None
    if added and spark is not None:
        spark.sql(f"ALTER TABLE delta.`{t.path}` ADD COLUMNS ("
                  + ", ".join(f"{quote(c.name)} {c.type}" for c in added) + ")")
    widened = [c for c in schema.columns if (old := have.get(c.name)) is not None and old.lower() != c.type.lower()]
    if widened and spark is not None:
        # type widening is a reader feature the deltalake reader lacks: a replica takes it on only
        # when a column of its source actually widens
        spark.sql(f"ALTER TABLE delta.`{t.path}` SET TBLPROPERTIES ('{cdc_apply.TYPE_WIDENING}' = 'true')")
        for col in widened:
            spark.sql(f"ALTER TABLE delta.`{t.path}` ALTER COLUMN {quote(col.name)} TYPE {col.type}")
    kept = [c for c in t.layout.schema.columns if schema.column(c.name) is None]  # dropped in the source: kept, null
    t.layout = replace(t.layout, schema=TableSchema(schema.table, schema.columns + tuple(kept), t.layout.key))
    return None
