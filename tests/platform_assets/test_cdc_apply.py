"""A change batch applied to a Delta replica in one MERGE (real Spark + Delta): the seed's worked
examples, TOAST values carried from the replica, SCD2 history, soft deletes, truncate, replays."""

from __future__ import annotations

import datetime as dt
import json
import math
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lineage.cdc import columns as cdc_columns
from lineage.cdc.changes import (
    Column,
    Op,
    RowChange,
    TableSchema,
    Transaction,
    number,
    reduce_keyed,
    reduce_multiset,
)
from lineage.cdc.replicas import Deletes, Scd
from platform_assets.cdc import apply as cdc_apply
from platform_assets.cdc import scd1 as cdc_scd1
from platform_assets.cdc.apply import Commit, Layout

pytestmark = pytest.mark.spark
T0 = dt.datetime(2026, 1, 1)
CUSTOMERS = TableSchema("mydb.customers", (Column("id", "int"), Column("name", "string")), key=("id",))
NOKEY = TableSchema("mydb.names", (Column("name", "string"),))


@pytest.fixture(params=["driver", "spark"])
def merge_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """An SCD1 replica MERGEd (and appended) from the driver by ``deltalake``, as a small replica
    is, or by Spark, as a replica past ``SMALL_REPLICA_ROWS`` is: the same rows either way."""
    if request.param == "spark":
        monkeypatch.setattr(cdc_apply, "SMALL_REPLICA_ROWS", -1)
        monkeypatch.setenv("TIDEMARK_DIRECT_IO", "off")  # the append of new keys too
    return str(request.param)


def written_by(path: str) -> str:
    """Which engine wrote the replica's newest commit: ``driver`` (deltalake) or ``spark``."""
    from deltalake import DeltaTable

    return "driver" if "delta-rs" in DeltaTable(path).history(1)[0].get("clientVersion", "") else "spark"


def tx(xid: int, *changes: RowChange) -> Transaction:
    return Transaction(xid, 100 + xid, T0 + dt.timedelta(seconds=xid), tuple(changes))


def ch(op: Op, table: str = "mydb.customers", before: dict | None = None, unchanged: frozenset[str] = frozenset(),
       **after: object) -> RowChange:
    return RowChange(table, op, after=after or None, before=before, unchanged=unchanged)


def rows(spark, path: str, *cols: str) -> list[tuple]:  # type: ignore[no-untyped-def]
    return sorted(tuple(r) for r in spark.read.format("delta").load(path).select(*cols).collect())


def apply(spark, path: str, layout: Layout, batch: list[Transaction], first_seq: int, version: int) -> None:  # type: ignore[no-untyped-def]
    numbered = number(batch, first_seq)
    commit = Commit("tidemark:test", version, json.dumps({"unit": version}))
    if layout.multiset:
        cdc_apply.apply_multiset(spark, path, layout, reduce_multiset(numbered, layout.schema), commit)
    elif layout.scd is Scd.TYPE2:
        cdc_apply.apply_scd2(spark, path, layout, reduce_keyed(numbered, layout.schema, layout.key, history=True), commit)
    else:
        cdc_scd1.apply_scd1(spark, path, layout, reduce_keyed(numbered, layout.schema, layout.key), commit)


SEED_PK = [tx(1, ch(Op.INSERT, id=0, name="alice")), tx(2, ch(Op.UPDATE, before={"id": 0}, id=1, name="alice")),
           tx(3, ch(Op.UPDATE, before={"id": 1}, id=2, name="alice")), tx(4, ch(Op.DELETE, before={"id": 2})),
           tx(5, ch(Op.INSERT, id=0, name="Alice"), ch(Op.INSERT, id=1, name="blob")),
           tx(6, ch(Op.UPDATE, before={"id": 1}, id=1, name="Bob"))]


@pytest.mark.parametrize("split", [None, 2, 3, 4])
def test_seed_example_with_primary_key_in_any_batching(merge_engine: str, spark, tmp_path: Path, split: int | None) -> None:
    path = str(tmp_path / "customers")
    layout = Layout(CUSTOMERS, ("id",))
    cdc_apply.ensure_replica(spark, path, layout)
    batches = [SEED_PK] if split is None else [SEED_PK[:split], SEED_PK[split:]]
    seq = 2
    for i, b in enumerate(batches, 1):
        apply(spark, path, layout, b, seq, i)
        assert written_by(path) == merge_engine
        seq += sum(t.rows for t in b)
    assert rows(spark, path, "id", "name", "_sequence_num") == [(0, "Alice", 6), (1, "Bob", 8)]


@pytest.mark.fast
def test_replay_of_a_unit_is_skipped_by_its_txn_version(merge_engine: str, spark, tmp_path: Path) -> None:
    path = str(tmp_path / "customers")
    layout = Layout(CUSTOMERS, ("id",))
    cdc_apply.ensure_replica(spark, path, layout)
    apply(spark, path, layout, SEED_PK[:1], 2, 1)
    apply(spark, path, layout, [tx(7, ch(Op.UPDATE, before={"id": 0}, id=0, name="x"))], 3, 2)
    apply(spark, path, layout, SEED_PK[:1], 2, 1)  # the same unit again: Delta skips it
    assert rows(spark, path, "id", "name") == [(0, "x")]


def test_seed_example_without_primary_key_keeps_exact_copies(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "names")
    layout = Layout(NOKEY, ())
    cdc_apply.ensure_replica(spark, path, layout)

    def u(old: str, new: str) -> RowChange:
        return ch(Op.UPDATE, "mydb.names", before={"name": old}, name=new)
    batch = [tx(0, ch(Op.INSERT, "mydb.names", name="alice"), ch(Op.INSERT, "mydb.names", name="alice"),
                ch(Op.INSERT, "mydb.names", name="Bob"))]
    apply(spark, path, layout, batch, 2, 1)
    assert Counter(r[0] for r in rows(spark, path, "name")) == {"alice": 2, "Bob": 1}
    apply(spark, path, layout, [tx(1, u("alice", "Alyce"), u("alice", "Alyce"))], 5, 2)
    assert Counter(r[0] for r in rows(spark, path, "name")) == {"Alyce": 2, "Bob": 1}
    apply(spark, path, layout, [tx(2, u("Alyce", "Alice"), u("Alyce", "Alice")),
                                tx(3, ch(Op.DELETE, "mydb.names", before={"name": "Alice"}))], 7, 3)
    assert rows(spark, path, "name", "_copy") == [("Alice", 1), ("Bob", 1)]
    apply(spark, path, layout, [tx(4, ch(Op.DELETE, "mydb.names", before={"name": "Alice"}))], 10, 4)
    assert rows(spark, path, "name") == [("Bob",)]


def test_unchanged_toast_value_is_kept_from_the_replica_also_across_a_key_change(spark, tmp_path: Path) -> None:
    schema = TableSchema("s.docs", (Column("id", "int"), Column("doc", "string"), Column("n", "int")), key=("id",))
    path = str(tmp_path / "docs")
    layout = Layout(schema, ("id",))
    cdc_apply.ensure_replica(spark, path, layout)
    big = "x" * 10_000
    apply(spark, path, layout, [tx(1, ch(Op.INSERT, "s.docs", id=1, doc=big, n=0), ch(Op.INSERT, "s.docs", id=2, doc="b", n=0))], 1, 1)
    toast = frozenset({"doc"})
    apply(spark, path, layout, [tx(2, ch(Op.UPDATE, "s.docs", unchanged=toast, id=1, n=1)),
                                tx(3, ch(Op.UPDATE, "s.docs", before={"id": 1}, unchanged=toast, id=5, n=2)),
                                tx(4, ch(Op.UPDATE, "s.docs", unchanged=toast, id=2, n=7))], 3, 2)
    got = {r[0]: (r[1], r[2]) for r in rows(spark, path, "id", "doc", "n")}
    assert got == {5: (big, 2), 2: ("b", 7)}


def test_soft_deletes_and_truncate(merge_engine: str, spark, tmp_path: Path) -> None:
    path = str(tmp_path / "soft")
    layout = Layout(CUSTOMERS, ("id",), deletes=Deletes.SOFT)
    cdc_apply.ensure_replica(spark, path, layout)
    apply(spark, path, layout, [tx(1, ch(Op.INSERT, id=1, name="a"), ch(Op.INSERT, id=2, name="b"))], 1, 1)
    apply(spark, path, layout, [tx(2, ch(Op.DELETE, before={"id": 1}))], 3, 2)
    assert written_by(path) == merge_engine
    assert rows(spark, path, "id", "name", "_deleted") == [(1, "a", True), (2, "b", False)]
    apply(spark, path, layout, [tx(3, ch(Op.INSERT, id=1, name="again"))], 4, 3)
    assert rows(spark, path, "id", "name", "_deleted") == [(1, "again", False), (2, "b", False)]
    hard = str(tmp_path / "hard")
    cdc_apply.ensure_replica(spark, hard, Layout(CUSTOMERS, ("id",)))
    apply(spark, hard, Layout(CUSTOMERS, ("id",)), [tx(1, ch(Op.INSERT, id=1, name="a"), ch(Op.INSERT, id=2, name="b"))], 1, 1)
    apply(spark, hard, Layout(CUSTOMERS, ("id",)), [tx(2, RowChange("mydb.customers", Op.TRUNCATE)), tx(3, ch(Op.INSERT, id=3, name="c"))], 3, 2)
    assert written_by(hard) == merge_engine  # (WHEN NOT MATCHED BY SOURCE ... DELETE)
    assert rows(spark, hard, "id", "name") == [(3, "c")]
    apply(spark, path, layout, [tx(4, RowChange("mydb.customers", Op.TRUNCATE)), tx(5, ch(Op.INSERT, id=5, name="e"))], 5, 4)
    assert written_by(path) == merge_engine  # (... UPDATE SET _deleted = true)
    assert rows(spark, path, "id", "name", "_deleted") == [(1, "again", True), (2, "b", True), (5, "e", False)]


def test_scd2_history_follows_every_transaction_and_closes_changed_keys(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "scd2")
    layout = Layout(CUSTOMERS, ("id",), scd=Scd.TYPE2)
    cdc_apply.ensure_replica(spark, path, layout)
    apply(spark, path, layout, [tx(1, ch(Op.INSERT, id=1, name="a"))], 1, 1)
    apply(spark, path, layout, [tx(2, ch(Op.UPDATE, before={"id": 1}, id=1, name="b")),
                                tx(3, ch(Op.UPDATE, before={"id": 1}, id=2, name="b")), tx(4, ch(Op.DELETE, before={"id": 2})),
                                tx(5, ch(Op.INSERT, id=2, name="z"))], 2, 2)
    got = rows(spark, path, "id", "name", "_valid_from", "_valid_to", "_is_current")
    t = [T0 + dt.timedelta(seconds=s) for s in range(6)]
    assert [(r[0], r[1], r[2].replace(tzinfo=None) if r[2] else None, r[3].replace(tzinfo=None) if r[3] else None, r[4])
            for r in got] == [(1, "a", t[1], t[2], False), (1, "b", t[2], t[3], False), (2, "b", t[3], t[4], False),
                              (2, "z", t[5], None, True)]


def test_an_empty_arrow_batch_becomes_an_empty_frame_of_its_schema(spark):
    """A snapshot of an empty table, or a flush with nothing left: over Spark Connect
    ``createDataFrame`` cannot infer a schema from no rows; ``local_frame`` passes the batch's."""
    import pyarrow as pa

    empty = cdc_apply.arrow_table([("id", "int"), ("name", "string"), ("at", "timestamp")], [])
    df = cdc_apply.local_frame(spark, empty)
    assert df.count() == 0
    assert [(f.name, f.dataType.simpleString()) for f in df.schema.fields] == [
        ("id", "int"), ("name", "string"), ("at", "timestamp")]
    one = cdc_apply.local_frame(spark, pa.table({"id": pa.array([7], pa.int32())}))
    assert one.collect()[0]["id"] == 7


def test_nan_float_keys_are_one_key_in_the_merge_the_spilled_reduction_and_multiset_counts(merge_engine: str, spark, tmp_path: Path) -> None:
    """PostgreSQL float8 and Spark: NaN = NaN. A NaN key inserted, then updated in later units (the MERGE's
    ``ON`` matches it; the spilled reduction in Spark keeps one row), stays one row; a multiset's NaN row
    deleted in a later unit loses a copy (its current count found for a NaN collected from Spark)."""
    nan = lambda: float("nan")  # noqa: E731  (a new object each time, as decoded)
    schema = TableSchema("s.f", (Column("k", "double"), Column("v", "string")), key=("k",))
    path, layout = str(tmp_path / "f"), Layout(schema, ("k",))
    cdc_apply.ensure_replica(spark, path, layout)
    apply(spark, path, layout, [tx(1, ch(Op.INSERT, "s.f", k=nan(), v="a"))], 1, 1)
    apply(spark, path, layout, [tx(2, ch(Op.UPDATE, "s.f", before={"k": nan()}, k=nan(), v="b"))], 2, 2)
    got = rows(spark, path, "k", "v", "_sequence_num")
    assert len(got) == 1 and math.isnan(got[0][0]) and got[0][1:] == ("b", 2)
    c = cdc_columns
    spill = str(tmp_path / "spill.parquet")
    pq.write_table(pa.table({"k": [nan(), nan(), nan()], "v": ["c", "d", "e"], c.before("k"): [None, nan(), nan()],
                             c.ROW: [0, 1, 2], c.OP: ["update", "update", "update"], c.HAS_BEFORE: [False, True, True],
                             c.TIME: pa.array([dt.datetime(2026, 1, 1, tzinfo=dt.UTC)] * 3, pa.timestamp("us", tz="UTC"))}),
                   spill)
    spilled = c.Spilled(spill, 3, 3, 0, 2, None, 10, 0, 3, 0)
    effect = cdc_scd1.spilled_effect(spark, spilled, layout, 10, table="s.f")
    assert [(r["v"], r[c.SEQ], r[c.PRESENT]) for r in effect.collect()] == [("e", 12, True)]
    cdc_scd1.apply_scd1_spilled(spark, path, layout, effect, Commit("tidemark:test", 3, "{}"))
    got = rows(spark, path, "k", "v", "_sequence_num")
    assert len(got) == 1 and math.isnan(got[0][0]) and got[0][1:] == ("e", 12)
    nokey = TableSchema("s.g", (Column("x", "double"), Column("v", "string")))
    path, layout = str(tmp_path / "g"), Layout(nokey, ())
    cdc_apply.ensure_replica(spark, path, layout)
    apply(spark, path, layout, [tx(1, ch(Op.INSERT, "s.g", x=nan(), v="a"), ch(Op.INSERT, "s.g", x=nan(), v="a"))], 1, 1)
    apply(spark, path, layout, [tx(2, ch(Op.DELETE, "s.g", before={"x": nan(), "v": "a"}))], 3, 2)
    got = rows(spark, path, "x", "v", "_copy")
    assert len(got) == 1 and math.isnan(got[0][0]) and got[0][1:] == ("a", 1)


@pytest.mark.fast
def test_key_ranges_are_exact_literals_of_the_sources_lowest_and_highest_keys() -> None:
    def ranges(key: tuple[str, ...], **cols: pa.Array) -> list[tuple[str, str, str]]:
        schema = TableSchema("s.t", tuple(Column(n, "string") for n in cols), key=key)
        return cdc_scd1.key_ranges(Layout(schema, key), pa.table(cols))

    assert ranges(("id",), id=pa.array([7, 3, None, 12])) == [("id", "3", "12")]
    assert ranges(("a", "b"), a=pa.array(["m", "b'x", "z"]), b=pa.array([dt.date(2026, 1, 2), dt.date(2025, 5, 1), None])) == [
        ("a", "'b\\'x'", "'z'"), ("b", "DATE'2025-05-01'", "DATE'2026-01-02'")]
    # no exact literal text (floats, timestamps, non-printable strings): the column is left out
    assert ranges(("f", "t", "s"), f=pa.array([1.5, 2.5]), t=pa.array([T0, T0]), s=pa.array(["a\n", "b"])) == []
    assert ranges(("id",), id=pa.array([], pa.int64())) == []


def test_a_merge_reads_only_the_replica_files_of_its_key_range(spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recent keys changed: the replica's files of older keys are not even opened by Spark's MERGE
    (they are moved away while the MERGE runs: a read of one would fail it), and no match is missed."""
    import shutil
    from urllib.parse import unquote, urlparse

    from pyspark.sql import functions as F  # noqa: N812

    monkeypatch.setattr(cdc_apply, "SMALL_REPLICA_ROWS", -1)
    path = str(tmp_path / "customers")
    layout = Layout(CUSTOMERS, ("id",))
    cdc_apply.ensure_replica(spark, path, layout)
    for unit in range(4):  # four units of 25 new keys each: files of consecutive keys
        apply(spark, path, layout, [tx(unit, *[ch(Op.INSERT, id=i, name=f"n{i}") for i in range(unit * 25 + 1, unit * 25 + 26)])],
              unit * 25 + 1, unit + 1)
    old = spark.read.format("delta").load(path).where("id <= 75").select(F.input_file_name()).distinct().collect()
    files = [Path(unquote(urlparse(r[0]).path)) for r in old]
    assert files and all(f.is_file() for f in files)
    aside = tmp_path / "aside"
    aside.mkdir()
    for f in files:
        shutil.move(f, aside / f.name)
    try:
        apply(spark, path, layout, [tx(9, ch(Op.UPDATE, id=90, name="changed"), ch(Op.DELETE, before={"id": 95}),
                                       ch(Op.UPDATE, before={"id": 80}, id=101, name="moved"))], 200, 5)
    finally:
        for f in files:
            shutil.move(aside / f.name, f)
    expected = {i: f"n{i}" for i in range(1, 101) if i not in (80, 95)} | {90: "changed", 101: "moved"}
    assert dict(rows(spark, path, "id", "name")) == expected
    predicate = spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").first()["operationParameters"]["predicate"]
    assert ">= 80) AND" in predicate and "<= 101)" in predicate, predicate


@pytest.mark.parametrize("soft", [False, True])
def test_a_unit_of_new_keys_only_is_appended_not_merged(merge_engine: str, spark, tmp_path: Path, soft: bool) -> None:
    path = str(tmp_path / "customers")
    layout = Layout(CUSTOMERS, ("id",), deletes=Deletes.SOFT if soft else Deletes.HARD)
    cdc_apply.ensure_replica(spark, path, layout)
    apply(spark, path, layout, [tx(1, ch(Op.INSERT, id=1, name="a"), ch(Op.INSERT, id=2, name="b"))], 1, 1)
    unit2 = [tx(2, ch(Op.INSERT, id=3, name="c"), ch(Op.INSERT, id=4, name="d")), tx(3, ch(Op.DELETE, before={"id": 4}))]
    apply(spark, path, layout, unit2, 3, 2)
    apply(spark, path, layout, unit2, 3, 2)  # replayed: Delta skips it by its txn version
    apply(spark, path, layout, [tx(4, ch(Op.UPDATE, id=2, name="B"), ch(Op.INSERT, id=5, name="e"))], 6, 3)
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").orderBy("version").collect()
    assert [h["operation"] for h in history][1:] == ["WRITE", "WRITE", "MERGE"]
    assert [h["userMetadata"] for h in history][1:] == ['{"unit": 1}', '{"unit": 2}', '{"unit": 3}']
    cols = ("id", "name", "_sequence_num", "_deleted") if soft else ("id", "name", "_sequence_num")
    got = rows(spark, path, *cols)
    expected = [(1, "a", 1), (2, "B", 6), (3, "c", 3), (5, "e", 7)]
    assert got == ([(*r, False) for r in expected] if soft else expected)
