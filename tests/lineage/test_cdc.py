"""The net effect of a change batch (pure): the seed's worked examples and the cases around them."""

from __future__ import annotations

import datetime as dt
import math

import pytest

from lineage.cdc.changes import (
    UNKNOWN,
    BatchError,
    Column,
    Op,
    RowChange,
    TableSchema,
    Transaction,
    format_lsn,
    number,
    parse_lsn,
    reduce_keyed,
    reduce_multiset,
)

T0 = dt.datetime(2026, 1, 1)
CUSTOMERS = TableSchema("mydb.customers", (Column("id", "int"), Column("name", "string")), key=("id",))
NOKEY = TableSchema("mydb.customers", (Column("name", "string"),))


def tx(xid: int, *changes: RowChange) -> Transaction:
    return Transaction(xid, 100 + xid, T0 + dt.timedelta(seconds=xid), tuple(changes))


def ins(**row: object) -> RowChange:
    return RowChange("mydb.customers", Op.INSERT, after=row)


def upd(before: dict[str, object], unchanged: frozenset[str] = frozenset(), **row: object) -> RowChange:
    return RowChange("mydb.customers", Op.UPDATE, after=row, before=before, unchanged=unchanged)


def dele(**before: object) -> RowChange:
    return RowChange("mydb.customers", Op.DELETE, before=before)


def present(effect) -> dict[tuple, dict]:  # type: ignore[no-untyped-def]
    return {k: e.values for k, e in effect.effects.items() if e.present}


def test_lsn_text_round_trip() -> None:
    assert format_lsn(parse_lsn("16/B374D848")) == "16/B374D848"
    assert parse_lsn("0/0") == 0
    with pytest.raises(ValueError, match="not an LSN"):
        parse_lsn("123")


def test_seed_with_primary_key_key_changes_followed_through_before_images() -> None:
    """0 -> 1 -> 2 -> deleted leaves nothing of 'alice'; 0 'Alice' and 1 'Bob' are inserted anew."""
    batch = [tx(1, ins(id=0, name="alice")), tx(2, upd({"id": 0}, id=1, name="alice")),
             tx(3, upd({"id": 1}, id=2, name="alice")), tx(4, dele(id=2)),
             tx(5, ins(id=0, name="Alice"), ins(id=1, name="blob")), tx(6, upd({"id": 1}, id=1, name="Bob"))]
    effect = reduce_keyed(number(batch, 2), CUSTOMERS, ["id"])
    assert present(effect) == {(0,): {"id": 0, "name": "Alice"}, (1,): {"id": 1, "name": "Bob"}}
    assert not effect.effects[(2,)].present  # deleted: a replica row 2 from before the batch goes too
    assert effect.effects[(1,)].seq == 8 and effect.effects[(0,)].seq == 6
    assert effect.counts == {"inserts": 3, "updates": 3, "deletes": 1, "truncates": 0}


def test_key_change_of_a_row_from_before_the_batch_removes_its_old_key() -> None:
    """The seed's diff query keeps the row at key 0 here; following the before-image deletes it."""
    effect = reduce_keyed(number([tx(1, upd({"id": 0}, id=1, name="x")), tx(2, upd({"id": 1}, id=2, name="y"))], 1),
                          CUSTOMERS, ["id"])
    assert {k: e.present for k, e in effect.effects.items()} == {(0,): False, (1,): False, (2,): True}
    assert effect.effects[(2,)].origin is None  # every value known from the batch


def test_unchanged_toast_value_comes_from_the_batch_or_the_replica_row_of_the_origin_key() -> None:
    schema = TableSchema("s.t", (Column("id", "int"), Column("doc", "string"), Column("n", "int")), key=("id",))
    toast = frozenset({"doc"})
    # inserted in the batch, then updated without the TOAST value: carried from the insert
    eff = reduce_keyed(number([tx(1, RowChange("s.t", Op.INSERT, after={"id": 1, "doc": "big", "n": 0})),
                               tx(2, RowChange("s.t", Op.UPDATE, after={"id": 1, "n": 1}, unchanged=toast))], 1),
                       schema, ["id"])
    assert eff.effects[(1,)].values == {"id": 1, "doc": "big", "n": 1} and eff.effects[(1,)].origin is None
    # a replica row updated twice and its key changed: the value is the replica's row 5's
    eff = reduce_keyed(number([tx(1, RowChange("s.t", Op.UPDATE, after={"id": 5, "n": 1}, unchanged=toast)),
                               tx(2, RowChange("s.t", Op.UPDATE, after={"id": 6, "n": 2}, before={"id": 5}, unchanged=toast))], 1),
                       schema, ["id"])
    six = eff.effects[(6,)]
    assert six.values is not None and six.values["doc"] is UNKNOWN and six.origin == (5,) and six.unknown == ["doc"]
    assert not eff.effects[(5,)].present


def test_truncate_clears_what_came_before_it() -> None:
    batch = [tx(1, ins(id=1, name="a")), tx(2, RowChange("mydb.customers", Op.TRUNCATE)), tx(3, ins(id=2, name="b"))]
    effect = reduce_keyed(number(batch, 1), CUSTOMERS, ["id"])
    assert effect.truncated_at == 2 and present(effect) == {(2,): {"id": 2, "name": "b"}}


def test_delete_without_before_image_is_refused() -> None:
    with pytest.raises(BatchError, match="without a before-image"):
        reduce_keyed(number([tx(1, RowChange("mydb.customers", Op.DELETE))], 1), CUSTOMERS, ["id"])


def test_scd2_history_keeps_one_state_per_key_and_transaction() -> None:
    batch = [tx(1, ins(id=0, name="a"), upd({"id": 0}, id=0, name="b")), tx(2, upd({"id": 0}, id=1, name="b")),
             tx(3, dele(id=1))]
    effect = reduce_keyed(number(batch, 1), CUSTOMERS, ["id"], history=True)
    assert [v[0] for v in effect.effects[(0,)].versions] == [{"id": 0, "name": "b"}, None]
    assert [v[0] for v in effect.effects[(1,)].versions] == [{"id": 1, "name": "b"}, None]


def test_seed_without_primary_key_counts_copies() -> None:
    """'alice', 'alice', 'Bob'; both alices renamed twice; both deleted: exactly one 'Bob' remains."""
    def u(old: str, new: str) -> RowChange:
        return upd({"name": old}, name=new)
    batch = [tx(0, ins(name="alice"), ins(name="alice"), ins(name="Bob")), tx(1, u("alice", "Alyce"), u("alice", "Alyce")),
             tx(2, u("Alyce", "Alice"), u("Alyce", "Alice")), tx(3, dele(name="Alice"), dele(name="Alice"))]
    effect = reduce_multiset(number(batch, 2), NOKEY)
    assert {k: d for k, d in effect.deltas.items() if d} == {("Bob",): 1}
    # split inside transaction 2 (what the seed warns about): the counts still follow each change
    first = reduce_multiset(number(batch[:2], 2), NOKEY)
    assert {k: d for k, d in first.deltas.items() if d} == {("Bob",): 1, ("Alyce",): 2}


def test_multiset_update_needs_the_whole_old_row() -> None:
    schema = TableSchema("s.t", (Column("a", "int"), Column("b", "int")))
    with pytest.raises(BatchError, match="REPLICA IDENTITY FULL"):
        reduce_multiset(number([tx(1, RowChange("s.t", Op.UPDATE, after={"a": 1, "b": 2}, before={"a": 1}))], 1), schema)


# ---------------------------------------------------------------- float keys: NaN and -0.0 (PostgreSQL float8, Spark)

FLOATS = TableSchema("s.f", (Column("k", "double"), Column("v", "string")), key=("k",))


def nan() -> float:
    """A NaN as a source decodes it: a new object each time (two of them are neither == nor one dict key)."""
    return float("nan")


def f_ins(k: float, v: str) -> RowChange:
    return RowChange("s.f", Op.INSERT, after={"k": k, "v": v})


def f_upd(old: float, k: float, v: str, unchanged: frozenset[str] = frozenset()) -> RowChange:
    return RowChange("s.f", Op.UPDATE, after={"k": k, "v": v} if not unchanged else {"k": k}, before={"k": old},
                     unchanged=unchanged)


def f_del(k: float) -> RowChange:
    return RowChange("s.f", Op.DELETE, before={"k": k})


def test_a_nan_key_is_one_key_as_postgresql_and_spark_have_it() -> None:
    """INSERT NaN, UPDATE NaN (same key, its before-image NaN) [, DELETE NaN]: one key's net effect."""
    batch = [tx(1, f_ins(nan(), "a")), tx(2, f_upd(nan(), nan(), "b"))]
    effect = reduce_keyed(number(batch, 1), FLOATS, ["k"])
    assert len(effect.effects) == 1
    (eff,) = effect.effects.values()
    assert eff.present and eff.seq == 2 and eff.op is Op.UPDATE and eff.values is not None
    assert math.isnan(eff.values["k"]) and eff.values["v"] == "b"  # the value written stays NaN
    effect = reduce_keyed(number([*batch, tx(3, f_del(nan()))], 1), FLOATS, ["k"])
    assert [(e.present, e.seq) for e in effect.effects.values()] == [(False, 3)]
    # an UPDATE of a NaN key is no key change: an unsent (TOAST) value comes from the batch's row
    toast = reduce_keyed(number([tx(1, f_ins(nan(), "a")), tx(2, f_upd(nan(), nan(), "", unchanged=frozenset({"v"})))], 1),
                         FLOATS, ["k"])
    assert [(e.values or {}).get("v") for e in toast.effects.values()] == ["a"]
    # SCD2: one key's states, not a NaN key closed and another opened
    history = reduce_keyed(number([*batch, tx(3, f_del(nan()))], 1), FLOATS, ["k"], history=True)
    assert [[(v[0] or {}).get("v") for v in e.versions] for e in history.effects.values()] == [["a", "b", None]]


def test_minus_zero_is_the_key_zero_and_stays_minus_zero_as_a_value() -> None:
    effect = reduce_keyed(number([tx(1, f_ins(-0.0, "a")), tx(2, f_upd(0.0, -0.0, "b"))], 1), FLOATS, ["k"])
    assert list(effect.effects) == [(0.0,)]
    values = effect.effects[(0.0,)].values
    assert values is not None and values["v"] == "b" and math.copysign(1.0, values["k"]) == -1.0  # as decoded
    effect = reduce_keyed(number([tx(1, f_ins(-0.0, "a")), tx(2, f_del(0.0))], 1), FLOATS, ["k"])
    assert [(k, e.present) for k, e in effect.effects.items()] == [((0.0,), False)]


def test_multiset_rows_holding_nan_are_one_row() -> None:
    schema = TableSchema("s.f", (Column("x", "double"), Column("v", "string")))
    row = lambda: {"x": nan(), "v": "a"}  # noqa: E731
    batch = [tx(1, RowChange("s.f", Op.INSERT, after=row()), RowChange("s.f", Op.INSERT, after=row())),
             tx(2, RowChange("s.f", Op.UPDATE, before=row(), after={"x": 1.0, "v": "a"})),
             tx(3, RowChange("s.f", Op.DELETE, before=row()))]
    effect = reduce_multiset(number(batch, 1), schema)
    assert {k: d for k, d in effect.deltas.items() if d} == {(1.0, "a"): 1}
    assert len(effect.deltas) == 2  # the NaN row, with delta 0, and (1.0, 'a')
