"""Small units committed from the driver by ``deltalake`` (``platform_assets.core.driver_writes``):
the same rows, txn, userMetadata and figures as Spark's writer lands, and Spark's writer wherever
the commit would not be the one Spark writes (real Spark + Delta, the session-scoped ``spark``)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from lineage.spec.loader import load_lineage
from platform_assets.core import driver_writes, spark_io, table_reads
from platform_assets.engine.runner import Engine
from resources.core.settings import Settings
from resources.storage import delta_log, delta_meta
from resources.storage.meta_tables import read_etl_log
from tests.platform_assets.shop import full_recompute, seeded, table_rows

pytestmark = pytest.mark.spark


def _engines(path: str) -> list[str]:
    """Each commit's writer (``engineInfo``/``clientVersion``), oldest first."""
    fs, log = delta_log.log_fs(path)
    out = []
    for version in range(DeltaTable(path).version() + 1):
        info = next(a["commitInfo"] for a in delta_log.read_commit(fs, log, version) if "commitInfo" in a)
        out.append(str(info.get("clientVersion") or info.get("engineInfo")))
    return out


def test_a_step_topics_small_blocks_are_committed_by_deltalake_exactly_as_spark_lands_them(
        spark, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = seeded(settings, tmp_path, maxstep=60, events=300, distinct_pos=50, seed=3)
    eng = Engine(settings, load_lineage(settings.lineage), spark=spark)
    eng.run_until_caught_up()
    dest = eng.path("fact.events")
    engines = _engines(dest)
    assert len(engines) >= 4
    # the first block creates the table (Spark); every later one is a deltalake commit
    assert "delta-rs" not in engines[0] and all("delta-rs" in e for e in engines[1:]), engines
    assert table_rows(spark, dest) == full_recompute(spark, settings)
    table = DeltaTable(dest)
    rec = eng.store.get("fact.events")
    assert rec is not None and table.transaction_version("tidemark:fact.events") == rec.seq
    for seq in range(1, rec.seq + 1):  # each block's commit is self-describing: its txn and userMetadata
        landed = delta_log.find_txn_commit(dest, "tidemark:fact.events", seq)
        assert landed is not None and landed.user_metadata["seq"] == seq
    # etl.log's figures are the rows each commit added, and the null counts of every column
    log = read_etl_log(settings, "fact.events", limit=1000)
    assert len(log) == rec.seq and sum(e["rows"] for e in log) == len(table_rows(spark, dest))
    countries = spark.read.format("delta").load(dest).where("country IS NULL").count()
    assert sum(dict(e["nulls"])["country"] for e in log) == countries > 0

    # with TIDEMARK_DIRECT_IO=off, Spark writes every block
    monkeypatch.setenv(table_reads.ENV, "off")
    off = seeded(settings.with_(home=tmp_path / "off" / "home", warehouse=str(tmp_path / "off" / "wh"),
                                offsets_url=f"sqlite:///{tmp_path / 'off-offsets.db'}"),
                 tmp_path / "off", maxstep=60, events=300, distinct_pos=50, seed=3)
    eng_off = Engine(off, load_lineage(off.lineage), spark=spark)
    eng_off.run_until_caught_up()
    assert not any("delta-rs" in e for e in _engines(eng_off.path("fact.events")))
    assert table_rows(spark, eng_off.path("fact.events")) == table_rows(spark, dest)


def _out(spark, rows: int = 3):
    return spark.createDataFrame([(i, f"v{i}") for i in range(rows)], "id long, name string")


@pytest.mark.fast
def test_a_transaction_the_table_recorded_is_not_written_again(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    _out(spark).write.format("delta").save(path)
    meta = json.dumps({"seq": 7})
    first = driver_writes.commit_small(_out(spark), path, mode="append", input_rows=3, app_id="app", seq=7, meta=meta)
    assert first is not None and first.figures() == spark_io.BlockFigures(3, {"id": 0, "name": 0})
    version = DeltaTable(path).version()
    again = driver_writes.commit_small(_out(spark), path, mode="append", input_rows=3, app_id="app", seq=7, meta=meta)
    assert again is not None and DeltaTable(path).version() == version
    assert spark.read.format("delta").load(path).count() == 6
    landed = delta_log.find_txn_commit(path, "app", 7)
    assert landed is not None and landed.rows == 3 and landed.user_metadata == {"seq": 7}


@pytest.mark.parametrize("case", ["no table", "partitioned", "constraint", "generated", "new column", "other type",
                                  "too many rows"])
def test_spark_writes_what_deltalake_would_not_write_as_spark_does(spark, tmp_path: Path, case: str) -> None:
    path = str(tmp_path / "t")
    out, rows = _out(spark), 3
    if case == "partitioned":
        _out(spark).write.format("delta").partitionBy("name").save(path)
    elif case == "constraint":
        _out(spark).write.format("delta").save(path)
        spark.sql(f"ALTER TABLE delta.`{path}` ADD CONSTRAINT positive CHECK (id >= 0)")
    elif case == "generated":
        from delta.tables import DeltaTable as SparkDeltaTable

        (SparkDeltaTable.create(spark).location(path).addColumn("id", "BIGINT").addColumn("name", "STRING")
         .addColumn("twice", "BIGINT", generatedAlwaysAs="id * 2").execute())
        out = _out(spark).selectExpr("id", "name", "id * 2 AS twice")
    elif case == "new column":
        _out(spark).write.format("delta").save(path)
        out = _out(spark).selectExpr("*", "1 AS extra")
    elif case == "other type":
        _out(spark).write.format("delta").save(path)
        out = _out(spark).selectExpr("CAST(id AS INT) AS id", "name")
    elif case == "too many rows":
        _out(spark).write.format("delta").save(path)
        rows = spark_io.SMALL_BLOCK_ROWS + 1
    before = DeltaTable(path).version() if case != "no table" else None
    assert driver_writes.commit_small(out, path, mode="append", input_rows=rows, app_id="app", seq=1, meta="{}") is None
    if before is not None:
        assert DeltaTable(path).version() == before  # nothing written
        snap = delta_meta.TableSnapshot.open(path)
        assert (driver_writes.refusal(snap, out.schema) is None) == (case == "too many rows")


def test_a_table_deltalake_wrote_reads_the_same_through_spark_and_deltalake(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    out = spark.sql("SELECT CAST('2026-01-01 00:00:01' AS TIMESTAMP) AS pos, 1L AS id, CAST(2.5 AS DECIMAL(18, 2)) AS amount, "
                    "array(1, 2) AS xs, named_struct('a', 'x') AS s, CAST(NULL AS STRING) AS note")
    out.write.format("delta").save(path)
    schema = spark.read.format("delta").load(path).schema  # as Spark wrote the table
    assert driver_writes.commit_small(out, path, mode="append", input_rows=1, app_id="app", seq=1, meta="{}") is not None
    assert driver_writes.commit_small(out, path, mode="overwrite", input_rows=1, app_id="app", seq=2, meta="{}") is not None
    got = spark.read.format("delta").load(path)
    assert got.schema == schema
    assert [tuple(r) for r in got.collect()] == [tuple(r) for r in out.collect()]
    assert DeltaTable(path).to_pyarrow_table().num_rows == 1
    assert pa.schema(DeltaTable(path).schema().to_arrow()).names == out.columns


def _changes(spark, path: str, version: int) -> list[tuple]:
    feed = (spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", version)
            .option("endingVersion", version).load(path))
    return sorted((r["id"], r["name"], r["_change_type"]) for r in feed.collect())


@pytest.mark.fast
def test_a_small_recompute_is_one_overwrite_from_the_driver_with_the_table_settings_and_change_feed_spark_gives(
        spark, tmp_path: Path) -> None:
    path = str(tmp_path / "view")
    (_out(spark).write.format("delta").option("delta.enableChangeDataFeed", "true")
     .option("delta.checkpointInterval", "10").save(path))
    new = spark.createDataFrame([(1, "v1"), (2, "changed"), (5, "v5")], "id long, name string")
    meta = json.dumps({"seq": 4})
    assert driver_writes.overwrite_small(new, path, expected_rows=3, app_id="app", seq=4, meta=meta)
    table = DeltaTable(path)
    assert table.version() == 1 and "delta-rs" in _engines(path)[1]
    assert table.metadata().configuration == {"delta.enableChangeDataFeed": "true", "delta.checkpointInterval": "10"}
    got = spark.read.format("delta").load(path)
    assert sorted(tuple(r) for r in got.collect()) == [(1, "v1"), (2, "changed"), (5, "v5")]
    landed = delta_log.find_txn_commit(path, "app", 4)
    assert landed is not None and landed.rows == 3 and landed.user_metadata == {"seq": 4}
    # the change feed of the overwrite: every old row deleted, every new one inserted (as after Spark's overwrite)
    assert _changes(spark, path, 1) == sorted([(i, f"v{i}", "delete") for i in range(3)]
                                              + [(1, "v1", "insert"), (2, "changed", "insert"), (5, "v5", "insert")])
    # a unit the table recorded is not written again
    assert driver_writes.overwrite_small(_out(spark), path, expected_rows=3, app_id="app", seq=4, meta=meta)
    assert DeltaTable(path).version() == 1


@pytest.mark.parametrize("case", ["unknown size", "big table", "big output", "no change feed", "deletion vectors",
                                  "new column"])
def test_spark_overwrites_a_recompute_the_driver_should_not_write(spark, tmp_path: Path, case: str) -> None:
    path = str(tmp_path / "view")
    writer = _out(spark).write.format("delta")
    if case != "no change feed":
        writer = writer.option("delta.enableChangeDataFeed", "true")
    if case == "deletion vectors":
        writer = writer.option("delta.enableDeletionVectors", "true")
    writer.save(path)
    out, expected = _out(spark, 2), 3
    if case == "unknown size":
        expected = None
    elif case == "big table":
        expected = spark_io.SMALL_BLOCK_ROWS + 1
    elif case == "big output":  # the table held few rows, the recompute makes more than the driver takes
        out = spark.range(spark_io.SMALL_BLOCK_ROWS + 1).selectExpr("id", "CAST(id AS STRING) AS name")
    elif case == "new column":
        out = _out(spark).selectExpr("*", "1 AS extra")
    assert not driver_writes.overwrite_small(out, path, expected_rows=expected, app_id="app", seq=1, meta="{}")
    assert DeltaTable(path).version() == 0  # nothing written


def _ids(path: str) -> list[int]:
    from deltalake import QueryBuilder

    got = QueryBuilder().register("t", DeltaTable(path)).execute("SELECT id FROM t").read_all()
    return sorted(got.column("id").to_pylist())


@pytest.mark.fast
@pytest.mark.parametrize("when", ["before the commit", "while it writes"])
def test_an_overwrite_from_the_driver_loses_to_a_compaction_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """deltalake's own conflict check lets an overwrite commit over a concurrent compaction, which
    would keep the compacted file (every old row) beside the new rows; the unit's overwrite fails
    instead, writes nothing, and Spark's writer (the caller's fallback) does it."""
    import subprocess
    import sys

    from deltalake import write_deltalake

    path = str(tmp_path / "t")
    for i in range(3):
        write_deltalake(path, pa.table({"id": pa.array([3 * i, 3 * i + 1, 3 * i + 2], pa.int64())}), mode="append")
    new = pa.table({"id": pa.array([1, 2, 50], pa.int64())})
    opened = DeltaTable(path)  # the version the unit's commit is made from
    compact = [sys.executable, "-c", f"from deltalake import DeltaTable; DeltaTable({path!r}).optimize.compact()"]
    if when == "before the commit":
        subprocess.run(compact, check=True)
    else:
        def racing(rows: pa.Table, table: object, only: bool) -> object:
            def batches():
                yield from rows.to_batches()
                subprocess.run(compact, check=True)  # (tidemark maintain, as deltalake writes the new file)
            return pa.RecordBatchReader.from_batches(rows.schema, batches())
        monkeypatch.setattr(driver_writes, "cast_to", racing)
    assert driver_writes._commit(new, opened, path, mode="overwrite", app_id="app", seq=4, meta="{}") is None
    table = DeltaTable(path)
    assert table.version() == 3 and table.transaction_version("app") is None  # the compaction alone landed
    assert _ids(path) == list(range(9))
    monkeypatch.undo()
    assert driver_writes._commit(new, table, path, mode="overwrite", app_id="app", seq=4, meta="{}") is not None
    assert _ids(path) == [1, 2, 50] and DeltaTable(path).transaction_version("app") == 4
