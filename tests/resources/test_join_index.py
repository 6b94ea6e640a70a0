"""A view's join index (:mod:`resources.storage.join_index`) on real tables written with ``deltalake``:
what it reads is exactly what a filtered scan of the base reads, or it is not used."""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from lineage.core.positions import Position
from platform_assets.core import table_reads
from resources.storage import join_index
from resources.storage.snapshot import TableSnapshot

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
CUSTOMERS = 300


def _orders(path: Path, first: int, n: int, *, at: int | None = None, seed: int = 0) -> None:
    """Orders ``first .. first + n - 1`` at second ``id`` (or all at second ``at``: late rows)."""
    rnd = random.Random(seed)
    ids = list(range(first, first + n))
    write_deltalake(str(path), pa.table({
        "pos": pa.array([T0 + dt.timedelta(seconds=at if at is not None else i) for i in ids], pa.timestamp("us", tz="UTC")),
        "id": pa.array(ids, pa.int64()),
        "customer_id": pa.array([rnd.randrange(CUSTOMERS) for _ in ids], pa.int64()),
        "amount": pa.array([rnd.randrange(1000) for _ in ids], pa.int64()),
        "note": pa.array(["x"] * n, pa.string()),
    }), mode="append")


def _end(seconds: int) -> Position:
    return Position(T0 + dt.timedelta(seconds=seconds), 2**62)


def _same(base: Path, index: str, values: list[Any], end: Position, column: str = "customer_id") -> int | None:
    """The index's read against the base's filtered scan (both sorted by id); None: index not used."""
    snap = TableSnapshot.open(str(base))
    got = table_reads.indexed_rows(snap, index, {column: values}, end, ["amount"])
    if got is None:
        return None
    want = table_reads.matching_rows(snap, {column: values}, end, columns=["amount"])
    assert want is not None
    cols = sorted(want.column_names)
    assert sorted(got.column_names) == cols
    assert got.select(cols).sort_by("id").to_pylist() == want.select(cols).sort_by("id").to_pylist()
    return got.num_rows


def test_the_index_reads_what_a_scan_of_the_base_reads_until_the_base_changes_under_it(tmp_path: Path) -> None:
    base, index = tmp_path / "orders", join_index.index_path(str(tmp_path / "wh"), "mart.v", "customer_id")
    for k in range(3):
        _orders(base, 1 + k * 20_000, 20_000, seed=k)
    assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith("written anew (none yet)")
    _, cov = join_index.covered(index) or (None, None)
    assert cov is not None and cov.rows == 60_000 and cov.upto == Position(T0 + dt.timedelta(seconds=60_000), 60_000)
    assert cov.columns == ("amount", "customer_id", "id", "pos")  # not `note`: the transform does not read it
    # small row groups, sorted by the join column: what lets the statistics prune
    [f] = DeltaTable(index).file_uris()
    meta = pq.ParquetFile(f).metadata
    assert meta.num_row_groups >= 3 and all(meta.row_group(i).num_rows <= join_index.ROW_GROUP for i in range(meta.num_row_groups))
    keys = pq.read_table(f, columns=["customer_id"]).column(0).to_pylist()
    assert keys == sorted(keys)

    assert _same(base, index, [3, 17, 299], _end(10**6)) > 0
    assert _same(base, index, [3, 17, 299], _end(30_000)) > 0  # a view behind the index: cut at its last
    assert _same(base, index, [CUSTOMERS + 5], _end(10**6)) == 0
    # the transform reads a column the index does not hold: not used
    assert table_reads.indexed_rows(TableSnapshot.open(str(base)), index, {"customer_id": [3]}, _end(10**6),
                                    ["amount", "note"]) is None

    _orders(base, 60_001, 5_000, seed=7)  # appended after upto: read from the base's tail
    n_before = _same(base, index, list(range(0, CUSTOMERS, 7)), _end(10**6))
    assert n_before is not None
    assert join_index.refresh(str(base), index, "customer_id", ["amount"]) == "appended 5,000 rows (base version 2 -> 3)"
    assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith("up to date (base version 3")
    assert _same(base, index, list(range(0, CUSTOMERS, 7)), _end(10**6)) == n_before

    _orders(base, 70_001, 10, at=100, seed=8)  # late rows (pos before upto): the index no longer covers them
    assert _same(base, index, [3], _end(10**6)) is None
    assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith(
        "written anew (no longer matches the base): 65,010 rows")
    assert _same(base, index, list(range(CUSTOMERS)), _end(10**6)) == 65_010

    DeltaTable(str(base)).delete("id % 1000 = 0")  # rewrites files among those the index covers
    assert _same(base, index, [3], _end(10**6)) is None
    assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith("written anew")
    assert _same(base, index, list(range(CUSTOMERS)), _end(10**6)) == 65_010 - 65

    DeltaTable(str(base)).optimize.compact()  # a compaction: other files, the same rows
    assert _same(base, index, [3], _end(10**6)) is None


def test_an_index_of_another_table_or_column_is_not_read(tmp_path: Path) -> None:
    base, index = tmp_path / "orders", str(tmp_path / "index")
    _orders(base, 1, 1_000)
    assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith("written anew")
    snap = TableSnapshot.open(str(base))
    assert table_reads.indexed_rows(snap, index, {"amount": [5]}, _end(10**6), ["customer_id"]) is None
    other = tmp_path / "other"
    _orders(other, 1, 1_000)  # the same files' names could not match, but the table's id is checked first
    assert table_reads.indexed_rows(TableSnapshot.open(str(other)), index, {"customer_id": [5]}, _end(10**6),
                                    ["amount"]) is None
    assert table_reads.indexed_rows(snap, str(tmp_path / "none"), {"customer_id": [5]}, _end(10**6), ["amount"]) is None


def test_parts_past_the_limit_are_written_anew_as_one(tmp_path: Path) -> None:
    base, index = tmp_path / "orders", str(tmp_path / "index")
    _orders(base, 1, 100)
    join_index.refresh(str(base), index, "customer_id", ["amount"])
    for k in range(join_index.MAX_PARTS):
        _orders(base, 101 + k * 10, 10, seed=k)
        assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith("appended 10 rows")
    _orders(base, 10_000, 10)
    assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith("written anew (too many parts)")
    assert len(DeltaTable(index).file_uris()) == 1
    assert _same(base, index, list(range(CUSTOMERS)), _end(10**6)) == 100 + 10 * join_index.MAX_PARTS + 10


def test_two_refreshes_at_once_leave_an_index_no_unit_reads(tmp_path: Path, monkeypatch) -> None:
    base, index = tmp_path / "orders", str(tmp_path / "index")
    _orders(base, 1, 1_000)
    join_index.refresh(str(base), index, "customer_id", ["amount"])
    stale = join_index.usable(TableSnapshot.open(str(base)), index, "customer_id", ["amount"])
    assert stale is not None
    _orders(base, 1_001, 100, seed=1)
    assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith("appended 100 rows")  # index v1
    assert _same(base, index, [3], _end(10**6)) is not None
    _orders(base, 1_101, 20, seed=2)
    # a second refresh that had read the index before the first appended appends its rows again, and more
    with monkeypatch.context() as m:
        m.setattr(join_index, "usable", lambda *_: stale)
        assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith("appended 120 rows")  # v2
    assert join_index.covered(index) is None and _same(base, index, [3], _end(10**6)) is None
    # a reader that opened the index at v1 (before v2 landed) reads v1's record, not v2's: exact
    opened = join_index.delta_log.open_table
    with monkeypatch.context() as m:
        m.setattr(join_index.delta_log, "open_table", lambda p, version=None: opened(p, 1 if p == index else version))
        _, cov = join_index.covered(index) or (None, None)
        assert cov is not None and cov.rows == 1_100
        assert _same(base, index, list(range(CUSTOMERS)), _end(10**6)) == 1_120
    assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith(
        "written anew (none yet): 1,120 rows")  # (what it covered cannot be told: written anew)
    assert _same(base, index, list(range(CUSTOMERS)), _end(10**6)) == 1_120
    assert join_index.refresh(str(base), index, "customer_id", ["amount"]).startswith("up to date")


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["name", "id"])
def test_an_index_of_a_base_with_deletion_vectors_and_column_mapping(spark, tmp_path, mode):
    from tests.resources.test_delta_read import _spark_table

    p = _spark_table(spark, tmp_path / "t", mode)  # ids 0..1999 less multiples of 10; note renamed to label
    index = str(tmp_path / "index")
    assert join_index.refresh(p, index, "label", ["amount"]).startswith("written anew (none yet): 1,800 rows")
    labels = ["n1", "n15", "n1999", "n20"]  # (n20: deleted)
    assert _same(Path(p), index, labels, _end(10**6), column="label") == 3
    spark.sql(f"INSERT INTO delta.`{p}` VALUES (timestamp'2026-01-02 00:00:00', 5000, 1.0, 'n1')")  # after upto
    assert _same(Path(p), index, labels, _end(10**6), column="label") == 4
    spark.sql(f"DELETE FROM delta.`{p}` WHERE id = 15")  # a deletion vector on a file the index covers
    assert _same(Path(p), index, labels, _end(10**6), column="label") is None
    assert join_index.refresh(p, index, "label", ["amount"]).startswith("written anew (no longer matches the base)")
    assert _same(Path(p), index, labels, _end(10**6), column="label") == 3
    # a rename and a new column of the old name change no file: the index still holds the old column
    spark.sql(f"ALTER TABLE delta.`{p}` RENAME COLUMN amount TO amount_before")
    spark.sql(f"ALTER TABLE delta.`{p}` ADD COLUMNS (amount DOUBLE)")
    assert _same(Path(p), index, labels, _end(10**6), column="label") is None
    assert join_index.refresh(p, index, "label", ["amount"]).startswith("written anew (no longer matches the base)")
    assert _same(Path(p), index, labels, _end(10**6), column="label") == 3
