"""A small unit's output committed from the driver by ``deltalake`` (:func:`commit_small`): Spark
computes the rows, they come to the driver as Arrow, and one ``deltalake`` commit lands them with
the unit's ``txn`` (``txnAppId``/``txnVersion``) and ``userMetadata``, exactly as the commit
protocol has a Spark write land them (DESIGN.md: Delta stores through ``delta-spark`` and
``deltalake``; Tidemark's intake and meta tables write through ``deltalake`` already).

Why: Spark's Delta writer rebuilds the destination's state at its newest version before each
commit, to look the transaction up (Delta 4.x does not take it from the checksum file), a Spark job
or two for every unit, whose output is often a few dozen rows. ``deltalake`` reads the
destination's log JVM-free, usually from the snapshot this process keeps
(:class:`~resources.storage.snapshot.TableSnapshot`), and commits in milliseconds.

Only where the commit is the one Spark would write (:func:`refusal` says why not): a table that
exists, whose protocol ``deltalake`` writes as Spark does (reader version 1; writer version up to
4, or 7 with only ``appendOnly``, ``invariants`` or ``changeDataFeed``), without partition columns,
CHECK constraints, invariants, generated, identity or default columns, and whose columns are the
output's, with the same types. Any other unit, and every unit with ``$TIDEMARK_DIRECT_IO=off``,
is written by Spark.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from lineage.core.errors import first_line
from platform_assets.core import spark_io, table_reads
from resources.storage import delta_log, delta_meta
from resources.storage.warehouse import storage_options

if TYPE_CHECKING:
    import pyarrow as pa
    from deltalake import CommitProperties
    from pyspark.sql import DataFrame

CHANGE_FEED = "delta.enableChangeDataFeed"
log = logging.getLogger(__name__)
_WRITER_FEATURES = frozenset({"appendOnly", "invariants", "changeDataFeed"})
_COLUMN_KEYS = ("delta.generationExpression", "delta.identity", "CURRENT_DEFAULT", "delta.invariants",
                "delta.columnMapping")


def refusal(snap: delta_meta.TableSnapshot, out_schema: Any) -> str | None:
    """None when ``deltalake`` may commit rows of ``out_schema`` (a Spark ``StructType``) to the
    table whose newest version is ``snap`` as Spark's writer would; else why not."""
    why = table_refusal(snap)
    if why is not None or snap.table is None:
        return why or "no table yet"
    have = {f["name"]: _type(f["type"]) for f in json.loads(snap.table.schema().to_json())["fields"]}
    want = {f["name"]: _type(f["type"]) for f in json.loads(out_schema.json())["fields"]}
    if have != want:
        return "the output's columns are not the table's"
    return None


def table_refusal(snap: delta_meta.TableSnapshot) -> str | None:
    """None when ``deltalake`` writes the table whose newest version is ``snap`` as Spark's writer
    would (its protocol, partitioning, constraints and columns); else why not."""
    table = snap.table
    if table is None:
        return "no table yet"
    proto = table.protocol()
    features = set(proto.writer_features or ())
    if proto.min_reader_version != 1 or not (proto.min_writer_version <= 4 or (proto.min_writer_version == 7
                                                                                and features <= _WRITER_FEATURES)):
        return f"protocol ({proto.min_reader_version}, {proto.min_writer_version}, {sorted(features)})"
    meta = table.metadata()
    if meta.partition_columns:
        return "partition columns"
    if any(k.startswith("delta.constraints.") for k in (meta.configuration or {})):
        return "CHECK constraints"
    fields = json.loads(table.schema().to_json())["fields"]
    if any(k.startswith(_COLUMN_KEYS) for f in fields for k in (f.get("metadata") or {})):
        return "generated, identity, default or constrained columns"
    return None


def _type(t: Any) -> Any:
    """A schema type (JSON) without nullability and metadata: what must match for a commit."""
    if isinstance(t, dict):
        return {k: _type(v) for k, v in t.items() if k not in ("nullable", "containsNull", "valueContainsNull", "metadata")}
    if isinstance(t, list):
        return [_type(v) for v in t]
    return t


def commit_small(out: DataFrame, dest: str, *, mode: str, input_rows: int, app_id: str, seq: int,
                 meta: str) -> spark_io.Counted | None:
    """Commit ``out`` to the table at ``dest`` (``mode``: ``append`` or ``overwrite``) from the
    driver as the unit ``(app_id, seq)`` with ``meta`` as its ``userMetadata``, and return its
    figures (counted on the driver); None, having written nothing, where Spark must write it:
    ``input_rows`` unknown or above :data:`~platform_assets.core.spark_io.SMALL_BLOCK_ROWS` (the
    output comes to the driver whole), :func:`refusal`, or ``$TIDEMARK_DIRECT_IO=off``. A unit whose
    transaction the table recorded already is not written again (as Spark's writer skips it)."""
    if not (0 <= input_rows <= spark_io.SMALL_BLOCK_ROWS) or not table_reads.direct_io_on():
        return None
    snap = delta_meta.TableSnapshot.open(dest)
    table = snap.table
    if table is None or refusal(snap, out.schema) is not None:
        return None
    arrow = out.toArrow()
    if mode == "overwrite":  # committed from the table as it is now (see _commit)
        now = _now(dest)
        if refusal(now, out.schema) is not None:
            return None
        table = now.table
    rows = _commit(arrow, table, dest, mode=mode, app_id=app_id, seq=seq, meta=meta)
    if rows is None:
        return None  # (e.g. a null in a NOT NULL column: Spark's writer says so)
    return spark_io.Counted(spark_io.BlockFigures(rows.num_rows, {c: rows.column(c).null_count for c in out.columns}))


def overwrite_small(out: DataFrame, dest: str, *, expected_rows: int | None, app_id: str, seq: int,
                    meta: str) -> bool:
    """A full recompute ``out`` committed from the driver as one overwrite of the table at ``dest``,
    as the unit ``(app_id, seq)`` with ``meta`` as its ``userMetadata``: True when it landed (or
    had landed before). Spark's Delta writer would first rebuild the table's state at its newest
    version to look the unit's txn up: a few Spark jobs, more after commits it did not write itself
    (``deltalake``'s, which leave no checksum file), a fixed cost that a small view's recompute pays
    beside the transform. False, having written nothing, where Spark must write it: ``expected_rows``
    (the rows the table holds now, the best guess of the output's) unknown or above
    :data:`~platform_assets.core.spark_io.SMALL_BLOCK_ROWS`, an output that turns out bigger than
    that or fails to come to the driver, the table's change data feed off (Spark's overwrite turns
    it on), :func:`refusal` (which also refuses a table with deletion vectors or column mapping),
    columns in another order (Spark's overwrite takes the output's), ``$TIDEMARK_DIRECT_IO=off``,
    or a commit ``deltalake`` refused (said in the log: e.g. a concurrent commit; Spark's write of
    the same unit is skipped by its ``txn`` if this one did land)."""
    if expected_rows is None or not 0 <= expected_rows <= spark_io.SMALL_BLOCK_ROWS or not table_reads.direct_io_on():
        return False
    snap = delta_meta.TableSnapshot.open(dest)
    if _overwrite_refusal(snap, out) is not None:
        return False
    if recorded(snap.table, app_id, seq):
        return True
    try:
        rows = small_arrow(out)
    except Exception as exc:  # noqa: BLE001 - e.g. over spark.driver.maxResultSize: Spark's writer computes it again
        log.warning("unit %s of %s: the recompute of %s did not come to the driver, so Spark writes it: %s", seq,
                    app_id, dest, first_line(exc)[:300])
        return False
    if rows is None:
        return False
    now = _now(dest)  # (the Spark job above took a while): the commit is made from this version
    if _overwrite_refusal(now, out) is not None:
        return False
    return _commit(rows, now.table, dest, mode="overwrite", app_id=app_id, seq=seq, meta=meta) is not None


def small_arrow(out: DataFrame) -> pa.Table | None:
    """``out``'s rows in the driver as Arrow, at most :data:`~platform_assets.core.spark_io.SMALL_BLOCK_ROWS`
    of them (None: more)."""
    got = out.limit(spark_io.SMALL_BLOCK_ROWS + 1).toArrow()
    return None if got.num_rows > spark_io.SMALL_BLOCK_ROWS else got


def _now(dest: str) -> delta_meta.TableSnapshot:
    """The table at ``dest`` as it is now: opened again, not the snapshot this process keeps."""
    return delta_meta.TableSnapshot(dest, delta_log.open_table(dest))


def _overwrite_refusal(snap: delta_meta.TableSnapshot, out: DataFrame) -> str | None:
    """:func:`refusal`, and why else Spark's overwrite of ``out`` would not be the one ``deltalake`` writes."""
    table = snap.table
    why = refusal(snap, out.schema)
    if why is not None or table is None:
        return why or "no table yet"
    if str((table.metadata().configuration or {}).get(CHANGE_FEED, "")).lower() != "true":
        return "its change data feed is off"
    if [f.name for f in table.schema().fields] != list(out.columns):
        return "the output's columns are in another order"
    return None


def commit_arrow(rows: pa.Table, dest: str, *, mode: str, app_id: str, seq: int, meta: str) -> bool:
    """:func:`commit_small` of rows in the driver already (the table's columns, in any order, of
    types that cast to its own): False, having written nothing, where Spark must write them."""
    if not table_reads.direct_io_on():
        return False
    snap = delta_meta.TableSnapshot.open(dest)
    if snap.table is None or table_refusal(snap) is not None:
        return False
    return _commit(rows, snap.table, dest, mode=mode, app_id=app_id, seq=seq, meta=meta) is not None


def _commit(rows: pa.Table, table: Any, dest: str, *, mode: str, app_id: str, seq: int, meta: str) -> pa.Table | None:
    """``rows`` cast to the table's columns and committed as the unit (unless it landed already);
    None, having written nothing, when they do not cast, or when an overwrite lost to a commit made
    after ``table``'s version (then Spark's writer runs)."""
    from deltalake import write_deltalake

    cast = cast_to(rows, table, only=True)
    if cast is None or recorded(table, app_id, seq):
        return cast
    if mode != "overwrite":
        write_deltalake(dest, cast, mode=mode, storage_options=storage_options(dest),  # type: ignore[call-overload]
                        commit_properties=unit_commit(app_id, seq, meta))
        return cast
    # An overwrite is committed from ``table``'s version and fails on any commit after it:
    # deltalake's conflict check does not take a concurrent compaction (its removes change no
    # data) as a conflict, and the compacted files, old rows all, would stay beside the new ones.
    try:
        write_deltalake(table, cast, mode=mode,  # type: ignore[call-overload]
                        commit_properties=unit_commit(app_id, seq, meta, retries=0))
    except Exception as exc:  # noqa: BLE001 - Spark's write of the same unit follows (skipped if this one landed)
        if (landed := _now(dest).table) is not None and recorded(landed, app_id, seq):
            return cast  # (e.g. a post-commit checkpoint failed)
        log.warning("unit %s of %s: deltalake's overwrite of %s failed, so Spark writes it instead: %s", seq, app_id,
                    dest, first_line(exc)[:300])
        return None
    return cast


def cast_to(rows: pa.Table, table: Any, *, only: bool) -> pa.Table | None:
    """``rows`` with the table's columns cast to its types (``only``: those columns alone, in its
    order; else other columns kept as they are); None when a column is missing or cannot be cast."""
    import pyarrow as pa

    target = pa.schema(table.schema().to_arrow())
    if only:
        try:
            return rows.select(target.names).cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, KeyError):
            return None
    if not set(target.names) <= set(rows.column_names):
        return None
    try:
        columns = [rows.column(f.name).cast(target.field(f.name).type) if f.name in target.names else rows.column(f.name)
                   for f in rows.schema]
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return None
    return pa.table(columns, names=rows.column_names)


def recorded(table: Any, app_id: str, seq: int) -> bool:
    """Whether the table (a ``DeltaTable``) recorded the transaction ``(app_id, seq)`` already."""
    recorded = table.transaction_version(app_id)
    return recorded is not None and recorded >= seq


def unit_commit(app_id: str, seq: int, meta: str, *, retries: int | None = None) -> CommitProperties:
    """A commit's ``txn`` and ``userMetadata``, as Spark's writer records them for a unit
    (``retries``: how often ``deltalake`` may commit it again after a concurrent commit; None: its default)."""
    from deltalake import CommitProperties, Transaction

    return CommitProperties(app_transactions=[Transaction(app_id=app_id, version=seq)], custom_metadata={"userMetadata": meta},
                            **({} if retries is None else {"max_commit_retries": retries}))


def write_unit(out: DataFrame, dest: str, *, mode: str, options: dict[str, str], input_rows: int, app_id: str,
               seq: int, meta: str, one_file: bool = False) -> spark_io.Counted | spark_io.BlockObservation:
    """Land ``out`` in the table at ``dest`` as the unit ``(app_id, seq)``: committed from the driver
    (:func:`commit_small`) where it may be, else by Spark's Delta writer in ``mode`` with
    ``options`` (``one_file``: a small block's output in one file, :func:`spark_io.one_file_if_small`).
    Returns what gives the unit's figures (:func:`protocol.block_figures`)."""
    counted = commit_small(out, dest, mode=mode, input_rows=input_rows, app_id=app_id, seq=seq, meta=meta)
    if counted is not None:
        return counted
    spark_out, observed = spark_io.observe_output(spark_io.one_file_if_small(out, input_rows) if one_file else out)
    spark_io.save_unit(spark_out.write.format("delta").mode(mode).options(**options), dest, app_id=app_id, seq=seq, meta=meta)
    return observed
