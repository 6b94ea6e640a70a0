"""The columnar SCD1 reduction gives what the Python one gives (lineage.cdc.changes.reduce_keyed), on the
seed's examples and on random batches; what it cannot do exactly it hands back (NotColumnar)."""

from __future__ import annotations

import datetime as dt
import random

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
    number,
    reduce_keyed,
)
from lineage.cdc.columns import HAS_BEFORE, OP, SEQ, TIME, NotColumnar, before, reduce_scd1

T0 = dt.datetime(2026, 1, 1)
ONE = TableSchema("s.t", (Column("id", "bigint"), Column("name", "string"), Column("n", "double")), key=("id",))
TWO = TableSchema("s.t", (Column("a", "bigint"), Column("b", "string"), Column("v", "bigint")), key=("a", "b"))
TYPES = {"bigint": pa.int64(), "string": pa.string(), "double": pa.float64()}


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
        out[k] = (tuple(values.get(c) for c in schema.names), e.seq, e.commit_time, e.present)
    return out


def column_effect(numbered: list[Numbered], schema: TableSchema) -> tuple[dict[tuple, tuple], dict[str, int]]:
    eff = reduce_scd1(batch_of(numbered, schema), schema.key, schema.names, table=schema.table)
    out = {}
    for r in eff.rows.to_pylist():
        out[tuple(r[k] for k in schema.key)] = (tuple(r[c] for c in schema.names), r[SEQ], r[TIME], r["_tm_present"])
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
    live: set[tuple] = {tuple(rng.randrange(6) if schema.column(k).type == "bigint" else rng.choice("xyz")  # type: ignore[union-attr]
                              for k in keys) for _ in range(5)}

    def a_key() -> tuple:
        return tuple(rng.randrange(6) if schema.column(k).type == "bigint" else rng.choice("xyz")  # type: ignore[union-attr]
                     for k in keys)

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
            old = rng.choice(sorted(live))
            new = a_key() if rng.random() < 0.3 else old
            b = dict(zip(keys, old, strict=True)) if new != old or rng.random() < 0.5 else None
            changes.append(RowChange(schema.table, Op.UPDATE, after=row(new), before=b))
            live.discard(old)
            live.add(new)
        else:
            old = rng.choice(sorted(live))
            changes.append(RowChange(schema.table, Op.DELETE, before=dict(zip(keys, old, strict=True))))
            live.discard(old)
        if rng.random() < 0.4 or i == n - 1:
            txs.append(tx(len(txs) + 1, *changes))
            changes = []
    return number(txs, rng.randrange(1, 1000))


@pytest.mark.parametrize("schema", [ONE, TWO], ids=["one-column key", "two-column key"])
def test_random_batches_reduce_as_the_python_path_does(schema: TableSchema) -> None:
    rng = random.Random(19)
    for _ in range(150):
        batch = random_batch(rng, schema, rng.randrange(1, 40))
        got, counts = column_effect(batch, schema)
        assert got == python_effect(batch, schema)
        assert counts == reduce_keyed(batch, schema, schema.key).counts


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
