"""The columnar SCD1 reduction gives what the Python one gives (lineage.cdc.changes.reduce_keyed), on the
seed's examples and on random batches; what it cannot do exactly it hands back (NotColumnar)."""

from __future__ import annotations

import datetime as dt
import math
import random
from decimal import Decimal

import pyarrow as pa
import pytest

from lineage.cdc.changes import (
    BatchError,
    Column,
    Numbered,
    Op,
    RowChange,
    TableSchema,
    Transaction,
    key_identity,
    number,
    reduce_keyed,
)
from lineage.cdc.columns import HAS_BEFORE, OP, SEQ, TIME, NotColumnar, before, column_array, reduce_scd1

T0 = dt.datetime(2026, 1, 1)
ONE = TableSchema("s.t", (Column("id", "bigint"), Column("name", "string"), Column("n", "double")), key=("id",))
TWO = TableSchema("s.t", (Column("a", "bigint"), Column("b", "string"), Column("v", "bigint")), key=("a", "b"))
FLOAT = TableSchema("s.t", (Column("x", "double"), Column("name", "string"), Column("n", "double")), key=("x",))
FLOAT_TWO = TableSchema("s.t", (Column("x", "double"), Column("b", "string"), Column("v", "bigint")), key=("x", "b"))
TYPES = {"bigint": pa.int64(), "string": pa.string(), "double": pa.float64()}


def comparable(v: object) -> object:
    """A value as the comparisons here see it: a NaN as 'NaN' (nan != nan), -0.0 as '-0.0' (a value
    written must stay -0.0, yet -0.0 == 0.0)."""
    if isinstance(v, float) and (math.isnan(v) or (v == 0.0 and math.copysign(1.0, v) < 0)):
        return "NaN" if math.isnan(v) else "-0.0"
    return v


def row_of(values: object) -> tuple:
    return tuple(comparable(v) for v in values)  # type: ignore[attr-defined]


def batch_of(numbered: list[Numbered], schema: TableSchema) -> pa.Table:
    """The columnar batch of numbered changes (as a source's columnar read builds it)."""
    cols: dict[str, list[object]] = {SEQ: [], TIME: [], OP: [], HAS_BEFORE: []}
    for c in schema.columns:
        cols[c.name] = []
    for k in schema.key:
        cols[before(k)] = []
    for n in numbered:
        ch = n.change
        cols[SEQ].append(n.seq)
        cols[TIME].append(n.commit_time)
        cols[OP].append(ch.op.value)
        cols[HAS_BEFORE].append(ch.before is not None)
        for c in schema.columns:
            cols[c.name].append((ch.after or {}).get(c.name))
        for k in schema.key:
            cols[before(k)].append((ch.before or {}).get(k))
    types = {c.name: TYPES[c.type] for c in schema.columns} | {before(k): TYPES[schema.column(k).type]  # type: ignore[union-attr]
                                                               for k in schema.key}
    types |= {SEQ: pa.int64(), TIME: pa.timestamp("us"), OP: pa.string(), HAS_BEFORE: pa.bool_()}
    return pa.table({name: pa.array(vals, type=types[name]) for name, vals in cols.items()})


def python_effect(numbered: list[Numbered], schema: TableSchema) -> dict[tuple, tuple]:
    eff = reduce_keyed(numbered, schema, schema.key)
    out = {}
    for k, e in eff.effects.items():
        values = e.values or dict(zip(schema.key, k, strict=True))
        out[row_of(k)] = (row_of(values.get(c) for c in schema.names), e.seq, e.commit_time, e.present)
    return out


def column_effect(numbered: list[Numbered], schema: TableSchema) -> tuple[dict[tuple, tuple], dict[str, int]]:
    eff = reduce_scd1(batch_of(numbered, schema), schema.key, schema.names, table=schema.table)
    out = {}
    for r in eff.rows.to_pylist():
        out[row_of(key_identity(r[k] for k in schema.key))] = (row_of(r[c] for c in schema.names), r[SEQ], r[TIME],
                                                               r["_tm_present"])
    assert len(out) == eff.rows.num_rows  # one row per key
    return out, eff.counts


def tx(xid: int, *changes: RowChange) -> Transaction:
    return Transaction(xid, 100 + xid, T0 + dt.timedelta(seconds=xid), tuple(changes))


def test_the_seeds_key_changes_followed_through_before_images() -> None:
    ins = lambda **r: RowChange("s.t", Op.INSERT, after=r)  # noqa: E731
    upd = lambda b, **r: RowChange("s.t", Op.UPDATE, after=r, before=b)  # noqa: E731
    batch = number([tx(1, ins(id=0, name="alice", n=1.0)), tx(2, upd({"id": 0}, id=1, name="alice", n=1.0)),
                    tx(3, upd({"id": 1}, id=2, name="alice", n=1.0)), tx(4, RowChange("s.t", Op.DELETE, before={"id": 2})),
                    tx(5, ins(id=0, name="Alice", n=2.0), ins(id=1, name="blob", n=None)),
                    tx(6, upd({"id": 1}, id=1, name="Bob", n=3.0))], 1)
    got, counts = column_effect(batch, ONE)
    assert got == python_effect(batch, ONE)
    assert {k: v[0] for k, v in got.items() if v[3]} == {(0,): (0, "Alice", 2.0), (1,): (1, "Bob", 3.0)}
    assert got[(2,)][3] is False
    assert counts == {"inserts": 3, "updates": 3, "deletes": 1, "truncates": 0}


def random_batch(rng: random.Random, schema: TableSchema, n: int) -> list[Numbered]:
    """Inserts, updates (same key with and without a before-image, key changes) and deletes over a
    small key space, so keys are touched many times; values include nulls."""
    keys = [c for c in schema.key]

    def a_value(k: str) -> object:
        typ = schema.column(k).type  # type: ignore[union-attr]
        if typ == "double":  # NaN and -0.0 among them: NaN = NaN and -0.0 = 0.0 in PostgreSQL and Spark
            return rng.choice([float("nan"), -0.0, 0.0, 1.5, 2.5])
        return rng.randrange(6) if typ == "bigint" else rng.choice("xyz")

    def a_key() -> tuple:
        return tuple(a_value(k) for k in keys)

    def decoded(k: tuple) -> tuple:
        """A key as a source decodes it again (a NaN a new object, -0.0 and 0.0 as sent)."""
        return tuple(float(repr(v)) if isinstance(v, float) else v for v in k)

    live: set[tuple] = {a_key() for _ in range(5)}

    def row(k: tuple) -> dict[str, object]:
        r: dict[str, object] = dict(zip(keys, k, strict=True))
        for c in schema.columns:
            if c.name not in keys:
                r[c.name] = None if rng.random() < 0.2 else (rng.choice(["p", "q", "r"]) if c.type == "string"
                                                             else rng.randrange(100) * (1.5 if c.type == "double" else 1))
        return r

    txs, changes = [], []
    for i in range(n):
        op = rng.random()
        if op < 0.3 or not live:
            k = a_key()
            changes.append(RowChange(schema.table, Op.INSERT, after=row(k)))
            live.add(k)
        elif op < 0.75:
            old = rng.choice(sorted(live, key=repr))
            new = a_key() if rng.random() < 0.3 else old
            b = dict(zip(keys, decoded(old), strict=True)) if new != old or rng.random() < 0.5 else None
            changes.append(RowChange(schema.table, Op.UPDATE, after=row(decoded(new)), before=b))
            live.discard(old)
            live.add(new)
        else:
            old = rng.choice(sorted(live, key=repr))
            changes.append(RowChange(schema.table, Op.DELETE, before=dict(zip(keys, decoded(old), strict=True))))
            live.discard(old)
        if rng.random() < 0.4 or i == n - 1:
            txs.append(tx(len(txs) + 1, *changes))
            changes = []
    return number(txs, rng.randrange(1, 1000))


@pytest.mark.parametrize("schema", [ONE, TWO, FLOAT, FLOAT_TWO],
                         ids=["one-column key", "two-column key", "float key", "float and string key"])
def test_random_batches_reduce_as_the_python_path_does(schema: TableSchema) -> None:
    rng = random.Random(19)
    for _ in range(150):
        batch = random_batch(rng, schema, rng.randrange(1, 40))
        got, counts = column_effect(batch, schema)
        assert got == python_effect(batch, schema)
        assert counts == reduce_keyed(batch, schema, schema.key).counts


def test_a_nan_key_is_one_key_on_columns_as_in_python() -> None:
    """INSERT NaN, UPDATE NaN (its before-image NaN: no key change) [, DELETE NaN]: one key's net effect,
    the Python path's; -0.0 and 0.0 are one key too, and a value stays as decoded."""
    ins = lambda k, v: RowChange("s.t", Op.INSERT, after={"x": k, "name": v, "n": k})  # noqa: E731
    upd = lambda old, k, v: RowChange("s.t", Op.UPDATE, after={"x": k, "name": v, "n": k}, before={"x": old})  # noqa: E731
    nan = lambda: float("nan")  # noqa: E731  (a new object each time, as decoded)
    batch = [tx(1, ins(nan(), "a")), tx(2, upd(nan(), nan(), "b"))]
    for changes in (batch, [*batch, tx(3, RowChange("s.t", Op.DELETE, before={"x": nan()}))]):
        numbered = number(changes, 1)
        got, counts = column_effect(numbered, FLOAT)
        assert got == python_effect(numbered, FLOAT)
        assert list(got) == [("NaN",)] and got[("NaN",)][1:] == (len(changes), T0 + dt.timedelta(seconds=len(changes)),
                                                                  len(changes) == 2)
    assert got[("NaN",)][0] == ("NaN", None, None)  # deleted
    numbered = number(batch, 1)
    assert column_effect(numbered, FLOAT)[0][("NaN",)][0] == ("NaN", "b", "NaN")  # NaN values stay NaN
    numbered = number([tx(1, ins(-0.0, "a")), tx(2, upd(0.0, -0.0, "b")), tx(3, ins(1.5, "c")),
                       tx(4, upd(1.5, 0.0, "d")), tx(5, upd(0.0, -0.0, "e"))], 1)  # 1.5 -> 0.0: a key change
    got, _ = column_effect(numbered, FLOAT)
    assert got == python_effect(numbered, FLOAT)
    assert got == {(0.0,): (("-0.0", "e", "-0.0"), 5, T0 + dt.timedelta(seconds=5), True),
                   (1.5,): ((1.5, None, None), 4, T0 + dt.timedelta(seconds=4), False)}


def test_an_empty_batch_touches_nothing() -> None:
    got, counts = column_effect([], ONE)
    assert got == {} and counts["inserts"] == 0


def test_a_delete_without_a_before_image_is_the_python_paths_error() -> None:
    batch = number([tx(1, RowChange("s.t", Op.DELETE, before=None))], 1)
    with pytest.raises(BatchError, match="a DELETE without a before-image"):
        column_effect(batch, ONE)
    with pytest.raises(BatchError, match="a DELETE without a before-image"):
        reduce_keyed(batch, ONE, ONE.key)


@pytest.mark.parametrize("change", [
    RowChange("s.t", Op.INSERT, after={"name": "x"}),  # no key value: missing (an error) or null? only Python tells
    RowChange("s.t", Op.TRUNCATE),
    RowChange("s.t", Op.UPDATE, after={"id": 1, "name": "x"}, before={"name": "y"}),  # a before-image without the key
], ids=["null key", "truncate", "before without key"])
def test_what_only_the_python_path_does_exactly_is_handed_back(change: RowChange) -> None:
    with pytest.raises(NotColumnar):
        column_effect(number([tx(1, change)], 1), ONE)


def test_a_value_its_column_cannot_hold_is_refused_naming_the_column_and_the_value():
    ok = column_array([Decimal("1.50"), None], pa.decimal128(10, 2), "column v (decimal(10,2))")
    assert ok.to_pylist() == [Decimal("1.50"), None]
    with pytest.raises(BatchError, match=r"column v \(decimal\(10,2\)\) cannot hold the source's value Decimal\('NaN'\)"):
        column_array([Decimal("1.50"), Decimal("NaN")], pa.decimal128(10, 2), "column v (decimal(10,2))")
