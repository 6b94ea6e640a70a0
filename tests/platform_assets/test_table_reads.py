"""A table at a version as Spark reads it (``platform_assets.core.table_reads``): a plain version
straight from its files gives exactly the rows Delta's reader gives, any other through Delta (real
Spark + Delta, the session-scoped ``spark``)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from lineage.core.errors import ConfigError
from platform_assets.core import table_reads
from resources.storage import delta_meta

pytestmark = pytest.mark.spark

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _rows(first: int, n: int, **extra: list) -> pa.Table:
    return pa.table({"pos": pa.array([T0 + dt.timedelta(seconds=i) for i in range(first, first + n)], pa.timestamp("us", "UTC")),
                     "id": pa.array(range(first, first + n), pa.int64()), **extra})


def _sorted(df) -> list[tuple]:
    return sorted(tuple(r) for r in df.collect())


def _through_delta(df) -> bool:
    """Whether Spark reads ``df`` through Delta's file index (else from the files it was given)."""
    plan = df._jdf.queryExecution().executedPlan().toString()
    assert "FileScan" in plan, plan
    return "DeltaFileIndex" in plan or "TahoeLogFileIndex" in plan


def _delta(spark, path: str, version: int | None):
    reader = spark.read.format("delta")
    return (reader.option("versionAsOf", version) if version is not None else reader).load(path)


def test_a_plain_version_reads_from_its_files_with_the_rows_delta_reads(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    write_deltalake(path, _rows(0, 5))
    write_deltalake(path, _rows(5, 5, note=pa.array(list("abcde"))), mode="append", schema_mode="merge")  # a column added
    write_deltalake(path, _rows(10, 5, note=pa.array(list("fghij"))), mode="append")
    for version in (0, 1, 2, None):
        direct = table_reads._direct(spark, path, version, None, None)
        assert direct is not None, f"version {version} of a plain table should be read from its files"
        assert not _through_delta(direct) and _through_delta(_delta(spark, path, version))
        assert direct.schema.names == _delta(spark, path, version).schema.names
        assert _sorted(direct) == _sorted(_delta(spark, path, version)), f"version {version}"
    # the rows of the first file read the added column as null, as Delta reads them
    assert [r.note for r in table_reads.read_version(spark, path, 1).collect() if r.id < 5] == [None] * 5


def test_a_pos_range_reads_only_the_files_that_may_hold_it(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    for first in (0, 10, 20):
        write_deltalake(path, _rows(first, 10), mode="append")
    low, high = (T0 + dt.timedelta(seconds=12)).replace(tzinfo=None), (T0 + dt.timedelta(seconds=14)).replace(tzinfo=None)
    df = table_reads.read_version(spark, path, 2, low=low, high=high)
    assert len(df.inputFiles()) == 1
    assert sorted(r.id for r in df.collect()) == list(range(10, 20))
    # a range at a file's edge keeps the neighbour whose statistics (cut to milliseconds) may hold it
    edge = (T0 + dt.timedelta(seconds=9)).replace(tzinfo=None)
    assert len(table_reads.read_version(spark, path, 2, low=edge, high=edge).inputFiles()) >= 1
    assert table_reads.read_version(spark, path, 2, low=T0.replace(tzinfo=None) - dt.timedelta(days=1),
                                    high=T0.replace(tzinfo=None) - dt.timedelta(hours=1)).count() == 0


def test_values_read_only_the_files_whose_statistics_may_hold_them(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    for first in (0, 10, 20):
        write_deltalake(path, _rows(first, 10), mode="append")
    df = table_reads.read_version(spark, path, 2, holding={"id": [12, 25]})
    assert len(df.inputFiles()) == 2
    assert sorted(r.id for r in df.where("id IN (12, 25)").collect()) == [12, 25]
    assert table_reads.read_version(spark, path, 2, holding={"id": [100]}).count() == 0
    # values that do not compare with the statistics: every file
    assert len(table_reads.read_version(spark, path, 2, holding={"id": ["x"]}).inputFiles()) == 3


def test_other_tables_and_the_off_switch_read_through_delta(spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parted = str(tmp_path / "parted")
    write_deltalake(parted, _rows(0, 6, part=pa.array(["a", "b"] * 3)), partition_by=["part"])
    assert table_reads._direct(spark, parted, 0, None, None) is None  # partition values live in the log
    assert _through_delta(table_reads.read_version(spark, parted, 0))
    assert _sorted(table_reads.read_version(spark, parted, 0)) == _sorted(_delta(spark, parted, 0))

    plain = str(tmp_path / "plain")
    write_deltalake(plain, _rows(0, 3))
    assert not _through_delta(table_reads.read_version(spark, plain, 0))
    monkeypatch.setenv(table_reads.ENV, "off")
    assert _through_delta(table_reads.read_version(spark, plain, 0))
    assert table_reads.read_version(spark, plain, 0).count() == 3
    monkeypatch.setenv(table_reads.ENV, "sometimes")
    with pytest.raises(ConfigError, match="TIDEMARK_DIRECT_IO"):
        table_reads.direct_io_on()


def test_too_many_files_read_through_delta(spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "t")
    for first in range(0, 4):
        write_deltalake(path, _rows(first, 1), mode="append")
    monkeypatch.setattr(table_reads, "DIRECT_MAX_FILES", 3)
    assert table_reads._direct(spark, path, 3, None, None) is None
    assert table_reads.read_version(spark, path, 3).count() == 4


def test_a_version_kept_in_the_process_is_opened_once(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    write_deltalake(path, _rows(0, 2))
    newest = delta_meta.TableSnapshot.open(path)
    assert delta_meta.TableSnapshot.open(path, 0) is newest  # the same version: the snapshot kept
    write_deltalake(path, _rows(2, 2), mode="append")
    assert delta_meta.TableSnapshot.open(path, 0) is newest  # still that version, though no longer the newest
    assert delta_meta.TableSnapshot.open(path).version == 1


def test_a_bad_direct_io_setting_is_refused_before_an_engine_runs(settings, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from lineage.spec.loader import load_lineage
    from platform_assets.engine.runner import Engine
    from tests.platform_assets.shop import write_lineage

    lineage = load_lineage(write_lineage(tmp_path))
    monkeypatch.setenv(table_reads.ENV, "yes")
    with pytest.raises(ConfigError, match="TIDEMARK_DIRECT_IO='yes': expected on or off"):
        Engine(settings, lineage)


def _spark_feed(spark, path: str, start: int, end: int, column: str) -> set:
    feed = (spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", start)
            .option("endingVersion", end).load(path))
    return {r[0] for r in feed.select(column).distinct().collect()}


def test_changed_values_read_by_deltalake_are_those_of_spark_change_feed(spark, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The join values of a change feed Spark wrote (an UPDATE, a DELETE of some rows, a DELETE of a
    whole file, an INSERT, an OPTIMIZE), read JVM-free, are the values Spark's own change feed reader
    gives; where deltalake would read the files as they are (deletion vectors), Spark reads them."""
    path = str(tmp_path / "dim")
    spark.createDataFrame([(i, f"C{i % 3}") for i in range(20)], "id long, country string").repartition(2).write \
        .format("delta").option("delta.enableChangeDataFeed", "true").save(path)
    spark.sql(f"UPDATE delta.`{path}` SET country = 'XX' WHERE id IN (3, 4)")
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id = 7")
    spark.createDataFrame([(100, "N")], "id long, country string").write.format("delta").mode("append").save(path)
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id >= 100")  # the whole appended file
    spark.sql(f"OPTIMIZE delta.`{path}`")
    for start, end in ((1, 1), (1, 4), (2, 5), (4, 5), (5, 5)):  # version 5: the OPTIMIZE
        got = table_reads.changed_values(spark, path, start, end, {"id": "customer_id"}, 100)
        assert got is not None, (start, end)
        df, rows = got
        want = _spark_feed(spark, path, start, end, "id")
        assert {r[0] for r in rows} == want == {r["customer_id"] for r in df.collect()}, (start, end)
        assert len(rows) == len(want)
    assert table_reads.changed_values(spark, path, 1, 4, {"id": "customer_id"}, 2) is None  # more than the limit
    every = len(_spark_feed(spark, path, 1, 4, "id"))  # (distinct values: an update's two images count once)
    assert table_reads.changed_value_rows(path, 1, 4, {"id": "customer_id"}, every) is not None
    assert table_reads.changed_value_rows(path, 1, 4, {"id": "customer_id"}, every - 1) is None
    assert table_reads.changed_values(spark, path, 1, 9, {"id": "customer_id"}, 100) is None  # past the newest version
    monkeypatch.setenv("TIDEMARK_DIRECT_IO", "off")
    assert table_reads.changed_values(spark, path, 1, 4, {"id": "customer_id"}, 100) is None
    monkeypatch.delenv("TIDEMARK_DIRECT_IO")
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    assert table_reads.changed_values(spark, path, 1, 4, {"id": "customer_id"}, 100) is None


def test_rows_up_to_the_newest_row_are_read_without_the_position_filter(spark, tmp_path: Path) -> None:
    """Where every row of the version is at most the end (statistics and newest rows), the rows up to
    it are the version's rows unfiltered, and a query of other columns reads no ``pos``/``id``; an end
    before the newest row, or a row with a null ``id``, keeps the filter and its answer."""
    from lineage.core.positions import Position
    from platform_assets.core import blocks

    path = str(tmp_path / "orders")
    n = 20
    t = pa.table({"pos": pa.array([T0 + dt.timedelta(seconds=i // 2) for i in range(n)], pa.timestamp("us", "UTC")),
                  "id": pa.array(range(n), pa.int64()), "amount": pa.array([float(i) for i in range(n)])})
    write_deltalake(path, t)

    def read(end: Position, version: int | None) -> tuple[list[int], str]:
        rows = blocks.rows_upto(spark, path, end, version)
        plan = rows.select("amount")._jdf.queryExecution().executedPlan().toString()
        return sorted(r["id"] for r in rows.collect()), plan

    newest = Position(T0 + dt.timedelta(seconds=9), 19)
    ids, plan = read(newest, 0)
    assert ids == list(range(n)) and "ReadSchema: struct<amount:double>" in plan, plan
    assert read(Position(T0 + dt.timedelta(seconds=10), 0), 0)[0] == list(range(n))
    ids, plan = read(Position(T0 + dt.timedelta(seconds=9), 18), 0)  # a tie on pos: id 19 is after the end
    assert ids == list(range(n - 1)) and "ReadSchema: struct<amount:double>" not in plan
    assert "ReadSchema: struct<amount:double>" not in read(newest, None)[1]  # the newest, which may move: filtered
    write_deltalake(path, pa.table({"pos": pa.array([T0], pa.timestamp("us", "UTC")), "id": pa.array([None], pa.int64()),
                                    "amount": pa.array([99.0])}), mode="append")
    ids, plan = read(newest, 1)  # a null id is never up to an end
    assert ids == list(range(n)) and "ReadSchema: struct<amount:double>" not in plan
    # statistics keep milliseconds: a newest row 700 µs into a second is after an end at 500 µs
    path = str(tmp_path / "fine")
    write_deltalake(path, pa.table({"pos": pa.array([T0, T0 + dt.timedelta(microseconds=700)], pa.timestamp("us", "UTC")),
                                    "id": pa.array([1, 2], pa.int64()), "amount": pa.array([1.0, 2.0])}))
    assert not delta_meta.every_row_upto(delta_meta.TableSnapshot.open(path, 0),
                                         Position(T0 + dt.timedelta(microseconds=500), 10**9))
    assert sorted(r["id"] for r in blocks.rows_upto(spark, path, Position(T0 + dt.timedelta(microseconds=500), 10**9), 0)
                  .collect()) == [1]
    assert delta_meta.every_row_upto(delta_meta.TableSnapshot.open(path, 0), Position(T0 + dt.timedelta(microseconds=700), 2))
    # a pos that is no timestamp is not compared: the filter decides
    path = str(tmp_path / "dates")
    write_deltalake(path, pa.table({"pos": pa.array([dt.date(2026, 1, 1)], pa.date32()), "id": pa.array([1], pa.int64())}))
    assert not delta_meta.every_row_upto(delta_meta.TableSnapshot.open(path, 0), Position(dt.datetime(2025, 1, 1), 0))


def test_rows_matching_read_by_deltalake_are_the_rows_spark_filters(spark, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The base rows of chosen join values up to a position, read JVM-free by a filtered scan, are
    the rows Spark's filter gives, ties on ``pos`` decided by ``id``, nulls matched by a None, late
    rows left out; deletion vectors applied; other values and the off switch go to Spark (None)."""
    from lineage.core.positions import Position
    from platform_assets.core import blocks

    path = str(tmp_path / "orders")
    n = 40
    t = pa.table({"pos": pa.array([T0 + dt.timedelta(seconds=i // 2) for i in range(n)], pa.timestamp("us", "UTC")),
                  "id": pa.array(range(n), pa.int64()),
                  "customer_id": pa.array([None if i % 7 == 0 else i % 5 for i in range(n)], pa.int64()),
                  "amount": pa.array([float(i) for i in range(n)])})
    write_deltalake(path, t.slice(0, 20))
    write_deltalake(path, t.slice(20), mode="append")
    end = Position(T0 + dt.timedelta(seconds=15), 30)  # pos 15 holds ids 30 and 31: 30 is in, 31 is not
    snap = delta_meta.TableSnapshot.open(path, 1)
    spark_rows = blocks.rows_upto(spark, path, end, 1)

    def want(values: list, late: set) -> list[tuple]:
        return sorted(tuple(r) for r in spark_rows.collect()
                      if (r["customer_id"] in values) and r["id"] not in late)

    for values, late in (([1, 3], set()), ([2, None], {2, 12}), ([None], set()), ([], set())):
        got = table_reads.rows_matching(spark, snap, {"customer_id": values}, end, spark_rows.schema, exclude_ids=late)
        assert got is not None, values
        assert got.schema == spark_rows.schema
        assert _sorted(got) == want(values, late), (values, late)
    assert table_reads.rows_matching(spark, snap, {"customer_id": [1.5]}, end, spark_rows.schema) is None
    assert table_reads.rows_matching(spark, snap, {"customer_id": [1], "id": [2]}, end, spark_rows.schema) is None
    monkeypatch.setenv("TIDEMARK_DIRECT_IO", "off")
    assert table_reads.rows_matching(spark, snap, {"customer_id": [1]}, end, spark_rows.schema) is None
    monkeypatch.delenv("TIDEMARK_DIRECT_IO")
    # deletion vectors (Spark deletes rows of a file without rewriting it): the deleted rows are not read
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id IN (1, 6)")
    snap = delta_meta.TableSnapshot.open(path)
    assert delta_meta.deletion_vectors(snap).feature
    got = table_reads.rows_matching(spark, snap, {"customer_id": [1]}, end, spark_rows.schema)
    assert got is not None
    assert [r["id"] for r in sorted(got.collect(), key=lambda r: r["id"])] == [11, 16, 26]
