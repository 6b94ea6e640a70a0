"""The net effect of a batch on a keyed SCD1 replica, computed on columns (issue 19, part 1).

:func:`lineage.cdc.changes.reduce_keyed` walks a batch change by change in Python (about 13 µs a change);
this does the same reduction with Arrow compute, for the batches it can do exactly: every change
carries whole rows (no TOAST value left unsent), no TRUNCATE, and every key known. Then the net
effect of a batch is plain: each change *touches* keys — an INSERT or UPDATE sets its after-row's
key to the after-row, an UPDATE that changed the key and a DELETE clear the before-image's key —
and the effect at a key is its last touch. (With an unsent column the row would depend on the
key's earlier state, which is why those batches stay on the Python path.)

A batch is an Arrow table, one row per change in source order (the columnar read of a source:
``resources.cdc.debezium.DebeziumFileSource.read_columns``):

* ``_tm_seq`` int64 — the change's sequence number (:func:`lineage.cdc.changes.number`'s);
* ``_tm_time`` timestamp — its transaction's commit time;
* ``_tm_op`` string — ``insert``, ``update`` or ``delete`` (:class:`lineage.cdc.changes.Op` values);
* the source's columns, the after-row's values (null without an after-row);
* ``_tm_before_<k>`` per key column ``k``, and ``_tm_has_before`` — the before-image's key.

:func:`reduce_scd1` returns one row per touched key: the source's columns (key columns set; the
others null where the key ends absent), ``_tm_seq``, ``_tm_time`` and ``_tm_present``.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from lineage.cdc.changes import BatchError, Op

SEQ, TIME, OP, HAS_BEFORE, PRESENT = "_tm_seq", "_tm_time", "_tm_op", "_tm_has_before", "_tm_present"
#: more columns of a source's columnar read: position, its transaction's position and number, table
POS, LSN, TX, TABLE = "_tm_pos", "_tm_lsn", "_tm_tx", "_tm_table"
ROW = "_tm_row"  # a change's index in its read


def arrow_type(spark_type: str, *, timestamp_tz: str | None = "UTC") -> pa.DataType:
    """The Arrow type of a replica column of Spark SQL type ``spark_type`` (a primitive type).
    ``timestamp_tz``: the zone of a ``timestamp`` column's Arrow type (None: naive, as a PostgreSQL
    snapshot's values are read)."""
    t = spark_type.strip().lower()
    if m := re.fullmatch(r"decimal\((\d+),\s*(\d+)\)", t):
        return pa.decimal128(int(m[1]), int(m[2]))
    simple = {"tinyint": pa.int8(), "smallint": pa.int16(), "int": pa.int32(), "integer": pa.int32(), "bigint": pa.int64(),
              "float": pa.float32(), "double": pa.float64(), "boolean": pa.bool_(), "string": pa.string(),
              "date": pa.date32(), "timestamp": pa.timestamp("us", tz=timestamp_tz), "timestamp_ntz": pa.timestamp("us"),
              "binary": pa.binary()}
    if t not in simple:
        raise ValueError(f"replica column type {spark_type!r} is not supported (use a Spark SQL primitive type)")
    return simple[t]


#: What Arrow raises for a value a column's type cannot hold.
REFUSED = (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError)


def column_array(values: Sequence[object], typ: pa.DataType, column: str) -> pa.Array:
    """``values`` as an Arrow array of ``typ``, the type of replica column ``column`` (its name and
    Spark type, as the message shows it). A value the type cannot hold (a PostgreSQL ``numeric`` NaN
    or Infinity: a decimal has neither) is a :class:`BatchError` naming the column and the value."""
    try:
        return pa.array(values, type=typ)
    except REFUSED as exc:
        bad = next((v for v in values if _refused(v, typ)), None)
        raise BatchError(f"{column} cannot hold the source's value {bad!r} ({exc}); change the column's type at "
                         f"the source, or its value") from None


def _refused(value: object, typ: pa.DataType) -> bool:
    try:
        pa.array([value], type=typ)
    except REFUSED:
        return True
    return False


def before(key_column: str) -> str:
    """The batch column holding the before-image's value of a key column."""
    return f"_tm_before_{key_column}"


@dataclass(frozen=True)
class Spilled:
    """A table's changes of a read too big to hold, written as they streamed to a Parquet file that
    Spark reads (the columns of a ``parts`` table, without ``_tm_pos`` and ``_tm_table``; ``_tm_time``
    a UTC instant there), and its figures. Only rows with ``_tm_row`` below ``rows_below`` belong to
    the read."""

    path: str
    rows_below: int
    count: int
    first_row: int
    last_row: int
    oldest: dt.datetime | None
    lsn: int  # the commit LSN of its last change
    inserts: int
    updates: int
    deletes: int

    @property
    def counts(self) -> dict[str, int]:
        return {"inserts": self.inserts, "updates": self.updates, "deletes": self.deletes, "truncates": 0}


@dataclass(frozen=True)
class ColumnRead:
    """What a source's ``read_columns`` returns: its ``read()``'s answer as Arrow tables — one
    ``frame`` of every table's changes (columns shared by name), or, with ``parts``, one table per
    source table whose ``_tm_row`` is the change's index in read()'s order (``frame`` then empty)."""

    frame: pa.Table  # the wanted row changes, in source order (the columns of :func:`empty_frame`, then the tables')
    transactions: int  # how many Transaction objects read() would have returned for the same call
    lsn: int  # where the read ended: the position a unit plans up to (as the caller takes it from read())
    parts: dict[str, pa.Table] | None = None
    spilled: dict[str, Spilled] | None = None  # tables whose changes went to Parquet files (not in parts)

    @property
    def rows(self) -> int:
        return (self.frame.num_rows + sum(p.num_rows for p in (self.parts or {}).values())
                + sum(s.count for s in (self.spilled or {}).values()))

    @property
    def nbytes(self) -> int:
        """The Arrow bytes held in memory (``frame`` and ``parts``; spilled changes are on disk)."""
        return self.frame.nbytes + sum(p.nbytes for p in (self.parts or {}).values())

    def by_table(self) -> dict[str, pa.Table]:
        """Per source table its changes in source order, each with ``_tm_row``."""
        if self.parts is not None:
            return self.parts
        frame = self.frame.append_column(ROW, pa.array(range(self.frame.num_rows), pa.int64()))
        return {name: frame.filter(pc.equal(frame[TABLE], name)) for name in pc.unique(frame[TABLE]).to_pylist()}


def empty_frame() -> pa.Table:
    """A read's frame without changes: its own columns, no source columns."""
    return pa.table({POS: pa.array([], pa.int64()), LSN: pa.array([], pa.int64()), TIME: pa.array([], pa.timestamp("us")),
                     TX: pa.array([], pa.int64()), TABLE: pa.array([], pa.string()), OP: pa.array([], pa.string()),
                     HAS_BEFORE: pa.array([], pa.bool_())})


class NotColumnar(Exception):
    """The batch holds something only the Python path reduces exactly (the caller reduces it there)."""


@dataclass(frozen=True)
class ColumnEffect:
    """The net effect of a batch on a keyed SCD1 replica: one row per touched key."""

    rows: pa.Table
    counts: dict[str, int]


def same(a: pa.ChunkedArray | pa.Array, b: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """Whether key values are one key: null-safe equality (``<=>``) where any NaN equals any NaN, as
    :func:`lineage.cdc.changes.key_value` has it (Arrow's ``equal`` says NaN != NaN; ``-0.0`` equals
    ``0.0`` already)."""
    both_null = pc.and_(pc.is_null(a), pc.is_null(b))
    out = pc.or_(pc.fill_null(pc.equal(a, b), False), both_null)
    if pa.types.is_floating(a.type) and pa.types.is_floating(b.type):
        out = pc.or_(out, pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False))
    return out


def identity_column(values: pa.ChunkedArray | pa.Array) -> pa.ChunkedArray | pa.Array:
    """A key column as key identity where a value is only the key (a cleared key): ``-0.0`` as ``0.0``
    (:func:`lineage.cdc.changes.key_value`; NaN is NaN, and :func:`same` makes all NaNs one)."""
    if not pa.types.is_floating(values.type):
        return values
    return pc.if_else(pc.equal(values, 0), pa.scalar(0.0, values.type), values)


def reduce_scd1(batch: pa.Table, key: Sequence[str], names: Sequence[str], *, table: str) -> ColumnEffect:
    """The last touch of every key the batch touches (see the module docstring); raises
    :class:`NotColumnar` for what :func:`lineage.cdc.changes.reduce_keyed` must do, and the same
    :class:`~lineage.cdc.changes.BatchError` it raises for a DELETE without a before-image."""
    ops = batch[OP]
    is_ins, is_upd, is_del = (pc.equal(ops, op.value) for op in (Op.INSERT, Op.UPDATE, Op.DELETE))
    counts = {"inserts": pc.sum(is_ins).as_py() or 0, "updates": pc.sum(is_upd).as_py() or 0,
              "deletes": pc.sum(is_del).as_py() or 0, "truncates": 0}
    if counts["inserts"] + counts["updates"] + counts["deletes"] != batch.num_rows:
        raise NotColumnar("a change that is not an insert, update or delete")
    has_before = pc.fill_null(batch[HAS_BEFORE], False)
    if pc.any(pc.and_(is_del, pc.invert(has_before))).as_py():
        raise BatchError(f"{table}: a DELETE without a before-image (the source sent no old key)")
    sets = pc.or_(is_ins, is_upd)
    for k in key:
        # a null key in an after-row: the Python path tells a missing key column (an error) from a null value
        if pc.any(pc.and_(sets, pc.is_null(batch[k]))).as_py():
            raise NotColumnar(f"a null value of key column {k!r}")
    # an UPDATE that changed the key, or a DELETE: clears the before-image's key
    key_changed = pc.and_(is_upd, has_before)
    if key:
        same_key = same(batch[key[0]], batch[before(key[0])])
        for k in key[1:]:
            same_key = pc.and_(same_key, same(batch[k], batch[before(k)]))
        key_changed = pc.and_(key_changed, pc.invert(same_key))
    clears = pc.or_(is_del, key_changed)
    for k in key:
        if pc.any(pc.and_(clears, pc.is_null(batch[before(k)]))).as_py():
            raise NotColumnar(f"a before-image without key column {k!r}")
    set_rows = batch if pc.all(sets).as_py() else batch.filter(sets)  # (a filter copies every column)
    set_rows = set_rows.select([*names, SEQ, TIME]).append_column(PRESENT, _fill(True, set_rows.num_rows))
    gone = batch.filter(clears)
    cleared = pa.table({c: (identity_column(gone[before(c)]) if c in key else pa.nulls(gone.num_rows, batch.schema.field(c).type))
                        for c in names} | {SEQ: gone[SEQ], TIME: gone[TIME], PRESENT: _fill(False, gone.num_rows)})
    touches = pa.concat_tables([set_rows, cleared.cast(set_rows.schema)])
    return ColumnEffect(last_per_key(touches, key), counts)


def last_per_key(touches: pa.Table, key: Sequence[str]) -> pa.Table:
    """The row with the greatest ``_tm_seq`` of each key (a key's touches have distinct numbers:
    an UPDATE's cleared and set keys differ), in key order. Sorted by key and number, a key's last
    row is the one where the next row's key differs; only the key columns are sorted, the rows are
    taken once (a batch of millions of changes is copied once, not three times)."""
    n = touches.num_rows
    if n <= 1:
        return touches
    order = pc.sort_indices(touches.select([*key, SEQ]), sort_keys=[(c, "ascending", "at_end") for c in (*key, SEQ)])
    differs = None
    for k in key:
        col = touches[k].take(order).combine_chunks()
        d = pc.invert(same(col.slice(0, n - 1), col.slice(1)))
        differs = d if differs is None else pc.or_(differs, d)
    return touches.take(order.filter(pa.concat_arrays([differs, pa.array([True])])))


def _fill(value: bool, n: int) -> pa.Array:
    return pa.repeat(pa.scalar(value, pa.bool_()), n)
