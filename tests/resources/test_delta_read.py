"""JVM-free reads of tables as Spark and Databricks write them: deletion vectors and column mapping
(``name`` and ``id``), through deltalake's own readers; and late rows after in-place DELETE,
UPDATE and MERGE of a base, whether the writer rewrites files (copy-on-write, ``deltalake``) or
marks rows with deletion vectors (Spark)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from lineage.core.positions import Position
from resources.storage import delta_meta, delta_read, statistics
from resources.storage.delta_meta import TableSnapshot

T0 = dt.datetime(2026, 1, 1)
FAR = dt.datetime(2030, 1, 1)
UTC_TS = pa.timestamp("us", tz="UTC")


def _at(seconds: int, id_: int) -> Position:
    return Position(T0 + dt.timedelta(seconds=seconds), id_)


def _rows(ids: range | list[int], v: int = 1) -> pa.Table:
    ids = list(ids)
    return pa.table({"pos": pa.array([(T0 + dt.timedelta(seconds=i)).replace(tzinfo=dt.UTC) for i in ids], UTC_TS),
                     "id": pa.array(ids, pa.int64()), "v": pa.array([v] * len(ids), pa.int64())})


@pytest.mark.fast
def test_copy_on_write_delete_update_and_merge_of_a_base_are_not_late_rows(tmp_path: Path) -> None:
    """deltalake rewrites the file a DELETE or UPDATE touches: its other rows, and the updated
    ones, are carried over at the positions they had, and are no late rows. A MERGE that also
    inserts a row at an old position adds exactly that one late row."""
    path = str(tmp_path / "base")
    write_deltalake(path, _rows(range(100)))
    last = _at(60, 60)
    DeltaTable(path).delete("id = 5")
    DeltaTable(path).update(updates={"v": "2"}, predicate="id = 7 OR id = 80")
    assert delta_meta.late_rows(path, 0, last).rows.num_rows == 0
    new = _rows([8, 30]).set_column(1, "id", pa.array([8, 1000], pa.int64())).set_column(2, "v", pa.array([3, 3]))
    (DeltaTable(path).merge(new, "s.id = t.id", source_alias="s", target_alias="t")
     .when_matched_update_all().when_not_matched_insert_all().execute())
    late = delta_meta.late_rows(path, 0, last).rows
    assert late.select(["id", "v"]).to_pylist() == [{"id": 1000, "v": 3}]  # (id 8 was updated at its place: not late)
    # the late row updated in its turn (its file rewritten again) is still found, once
    DeltaTable(path).update(updates={"v": "9"}, predicate="id = 1000")
    assert delta_meta.late_rows(path, 0, last).rows.select(["id", "v"]).to_pylist() == [{"id": 1000, "v": 3}]
    # plain appends are found as before
    write_deltalake(path, _rows([10_000], v=4).set_column(0, "pos", pa.array([(T0 + dt.timedelta(seconds=1)).replace(
        tzinfo=dt.UTC)], UTC_TS)), mode="append")
    assert sorted(delta_meta.late_rows(path, 0, last).rows["id"].to_pylist()) == [1000, 10_000]


@pytest.mark.fast
def test_plain_tables_are_read_as_before(tmp_path: Path) -> None:
    path = str(tmp_path / "plain")
    write_deltalake(path, _rows(range(10)))
    table = DeltaTable(path)
    assert not delta_read.needs_scan(table) and delta_read.physical_names(table) == {}
    assert delta_read.count_rows(table) == 10 and delta_read.read_rows(table, ["id"])["id"].to_pylist() == list(range(10))
    assert not TableSnapshot.open(path).scanned


def _spark_table(spark, path: Path, mode: str) -> str:  # noqa: ANN001 - a SparkSession
    """A table as Databricks writes one: deletion vectors and column mapping ``mode`` on, 2,000
    rows in 8 files, then every tenth deleted (deletion vectors), ``note`` renamed to ``label``
    and ``gone`` dropped."""
    p = str(path)
    spark.sql(f"""CREATE TABLE delta.`{p}` (pos TIMESTAMP, id BIGINT, amount DOUBLE, note STRING, gone STRING) USING delta
                 TBLPROPERTIES ('delta.enableDeletionVectors' = 'true', 'delta.columnMapping.mode' = '{mode}',
                                'delta.minReaderVersion' = '3', 'delta.minWriterVersion' = '7')""")
    for lo in (0, 1000):  # versions 1 and 2
        (spark.range(lo, lo + 1000).repartition(4)
         .selectExpr("timestamp_seconds(unix_seconds(timestamp'2026-01-01 00:00:00') + id) AS pos", "id",
                     "CAST(id * 1.5 AS DOUBLE) AS amount", "concat('n', id) AS note", "'g' AS gone")
         .write.format("delta").mode("append").save(p))
    spark.sql(f"DELETE FROM delta.`{p}` WHERE id % 10 = 0")  # version 3: a deletion vector on every file
    spark.sql(f"ALTER TABLE delta.`{p}` RENAME COLUMN note TO label")
    spark.sql(f"ALTER TABLE delta.`{p}` DROP COLUMN gone")
    return p


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["name", "id"])
def test_every_jvm_free_read_of_a_table_with_deletion_vectors_and_column_mapping(spark, tmp_path, mode):
    p = _spark_table(spark, tmp_path / "t", mode)
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    snap = TableSnapshot.open(p)
    assert snap.scanned and delta_read.physical_names(snap.table)  # physical names differ from the columns
    assert {"min.pos", "max.pos", "max.id", "null_count.id"} <= set(snap.files.column_names)
    # every read applies the deletions: ids 0..1999 less the multiples of 10
    kept = [i for i in range(2000) if i % 10]
    rows = delta_read.read_rows(snap.table)
    assert rows.column_names == ["pos", "id", "amount", "label"] and sorted(rows["id"].to_pylist()) == kept
    assert rows.schema.field("label").type == pa.string() and not rows.schema.metadata
    assert delta_read.count_rows(snap.table) == len(kept) == spark.read.format("delta").load(p).count()
    # planning: the newest position, a block's end and its rows, the null and late rows
    assert delta_meta.table_mark(snap).max_position == _at(1999, 1999)
    assert delta_meta.find_block_end(snap, _at(10, 10), FAR, 100) == delta_meta.BlockEnd(_at(121, 121), 100, snap.version)
    assert delta_meta.count_block(p, _at(10, 10), _at(110, 110)) == 90
    assert delta_meta.bad_position_rows(snap).num_rows == 0
    assert statistics._max_id(snap.files, p) == 1999
    # late rows after version 1 at or before id 1800: version 2's rows there, those the DELETE marked
    # deleted since too (they arrived late: a later delete does not undo that, as with a writer that
    # rewrites files); the DELETE's files (the same files with a vector) add none
    late = delta_meta.late_rows(p, 1, _at(1800, 1800)).rows
    assert sorted(late["id"].to_pylist()) == list(range(1000, 1801))
    assert "label" in late.column_names and "gone" not in late.column_names
    # an UPDATE in place writes the updated rows anew and a vector on their old files: not late
    spark.sql(f"UPDATE delta.`{p}` SET amount = -1 WHERE id < 50")
    after_update = TableSnapshot.open(p)
    assert delta_meta.late_rows(after_update, snap.version, _at(1800, 1800)).rows.num_rows == 0
    # a row inserted at an old position is late, with its values under the table's column names
    spark.sql(f"INSERT INTO delta.`{p}` VALUES (timestamp'2026-01-01 00:00:05', 5000, 2.0, 'late')")
    late = delta_meta.late_rows(p, after_update.version, _at(1800, 1800)).rows
    assert late.select(["id", "label"]).to_pylist() == [{"id": 5000, "label": "late"}]
    # OPTIMIZE (a compaction: no data change) purges the vectors; nothing is new, nothing is late
    before = TableSnapshot.open(p).version
    spark.sql(f"OPTIMIZE delta.`{p}`")
    assert delta_meta.late_rows(p, before, _at(1800, 1800)).rows.num_rows == 0
    assert delta_read.count_rows(DeltaTable(p)) == len(kept) + 1


@pytest.mark.spark
def test_maintenance_of_a_table_with_column_mapping_skips_only_the_compaction(spark, tmp_path):
    """deltalake cannot rewrite a column-mapped table (``OPTIMIZE``): maintenance says so and how to
    compact it, and goes on with the rest; a table with deletion vectors alone is compacted, its deleted
    rows purged."""
    from resources.storage import maintenance

    mapped = _spark_table(spark, tmp_path / "mapped", "name")
    report = maintenance.maintain(maintenance.health("t.mapped", mapped), force_compact=True, retain_hours=0,
                                  writers_idle=True)
    assert not report.compacted and any("cannot rewrite a table with column mapping" in s and "OPTIMIZE delta.`" in s
                                        for s in report.skipped), report.skipped
    assert delta_read.count_rows(DeltaTable(mapped)) == 1800
    vectors = str(tmp_path / "vectors")
    spark.sql(f"CREATE TABLE delta.`{vectors}` (pos TIMESTAMP, id BIGINT) USING delta "
              "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
    for lo in (0, 100, 200):
        spark.sql(f"INSERT INTO delta.`{vectors}` SELECT timestamp_seconds(1767225600 + id), id FROM range({lo}, {lo + 100})")
    spark.sql(f"DELETE FROM delta.`{vectors}` WHERE id % 3 = 0")
    report = maintenance.maintain(maintenance.health("t.vectors", vectors), force_compact=True)
    assert report.compacted and delta_read.count_rows(DeltaTable(vectors)) == 200
    assert not DeltaTable(vectors).deletion_vectors().read_all().num_rows  # purged by the rewrite


@pytest.mark.fast
def test_a_late_row_rewritten_by_a_later_delete_is_found_once(tmp_path: Path) -> None:
    """A late row lands, then a DELETE of another row of its file rewrites that file: the late row
    is in both files (the appended one, still there until VACUUM, and the rewrite), and is found
    once; the rows the rewrite carried over from before are not late."""
    path = str(tmp_path / "base")
    write_deltalake(path, _rows(range(100)))
    last = _at(60, 60)
    late = _rows([5, 6]).set_column(1, "id", pa.array([500, 501], pa.int64()))
    write_deltalake(path, late, mode="append")  # two late rows in one new file
    DeltaTable(path).delete("id = 501")  # rewrites the new file without it
    DeltaTable(path).delete("id = 3")  # and an old one
    found = delta_meta.late_rows(path, 0, last).rows
    assert sorted(found["id"].to_pylist()) == [500, 501]  # (501 arrived late; its deletion since does not undo that)


@pytest.mark.fast
@pytest.mark.parametrize("error", [
    "The table has set these reader features: {'typeWidening'} but these are not yet supported by the deltalake reader.",
    "External error: Transaction failed: Unsupported table features required: [TypeWidening]",
])
def test_a_reader_feature_neither_reader_has_is_a_clear_error(error: str) -> None:
    from lineage.core.errors import ProcessingError

    with pytest.raises(ProcessingError, match=r"^/w/stage/x: deltalake cannot read this table's rows \(reader features: "
                                              r"[tT]ypeWidening\).*DROP FEATURE typeWidening\) or read it as a later input"):
        with delta_read.readable("/w/stage/x"):
            raise RuntimeError(error)
    with pytest.raises(KeyError), delta_read.readable("/w/stage/x"):  # anything else is raised as it is
        raise KeyError("x")


@pytest.mark.fast
def test_the_unresolved_column_hint_names_where_the_column_went(tmp_path: Path) -> None:
    """The hint a failing transform gets: the input that renamed or dropped the column Spark could
    not resolve, and the version, for a qualified name and another case too (no Spark: the error
    text as Spark 4 words it, and a log written by deltalake with Spark's commitInfo)."""
    from lineage.spec.model import Topic, TopicSpec
    from platform_assets.core import spark_io

    path = tmp_path / "orders"
    write_deltalake(str(path), _rows(range(3)))
    log = path / "_delta_log"
    for version, op, params in [(1, "RENAME COLUMN", {"oldColumnPath": "note", "newColumnPath": "memo"}),
                                (2, "DROP COLUMNS", {"columns": '["extra"]'})]:
        commit = {"commitInfo": {"timestamp": 1, "operation": op, "operationParameters": params}}
        (log / f"{version:020d}.json").write_text(json.dumps(commit) + "\n")
    topic = Topic(TopicSpec(table="fact.x", depends_on=["stage.orders"], transforms=["x.sql"]), tmp_path / "l.yaml", 1, ())
    paths = {"stage.orders": str(path)}
    error = ("[UNRESOLVED_COLUMN.WITH_SUGGESTION] A column, variable, or function parameter with name `b`.`NOTE` cannot "
             "be resolved. Did you mean one of the following? [`b`.`memo`]. SQLSTATE: 42703")
    assert spark_io._gone_column(error, topic, paths) == (
        " (stage.orders renamed note to memo at version 1: change the transform to read the column by its new name, "
        "or not at all)")
    assert "dropped extra at version 2" in spark_io._gone_column(error.replace("`NOTE`", "`extra`"), topic, paths)
    assert spark_io._gone_column(error.replace("`NOTE`", "`other`"), topic, paths) == ""
    assert spark_io._gone_column("[TABLE_OR_VIEW_NOT_FOUND] x", topic, paths) == ""


@pytest.mark.parametrize(("tz", "unit", "int96"), [(None, "us", False), ("UTC", "us", False), ("UTC", "ms", False),
                                                  (None, "ns", False), ("UTC", "ns", True)])
def test_a_file_in_pos_order_is_read_in_the_row_groups_that_can_hold_the_range(
        tmp_path: Path, tz: str | None, unit: str, int96: bool) -> None:
    """By the footer's statistics: raw for an INT64 timestamp of any unit, with or without time
    zone. INT96 (no statistics a reader may use): read whole."""
    import pyarrow.parquet as pq

    t0 = dt.datetime(2026, 1, 1)
    pos = [t0 + dt.timedelta(seconds=i) for i in range(1000)]
    table = pa.table({"pos": pa.array(pos, pa.timestamp(unit, tz=tz)), "id": pa.array(range(1000), pa.int64())})
    file = str(tmp_path / "f.parquet")
    pq.write_table(table, file, row_group_size=100, use_deprecated_int96_timestamps=int96)
    assert (delta_read.timestamp_ns_per(pq.read_metadata(file).schema.column(0)) is None) == int96

    def read(low: dt.datetime | None, high: dt.datetime | None) -> list[int]:
        return delta_read.read_parquet_range(file, None, ["pos", "id"], "pos", low, high)["id"].to_pylist()

    def groups(ids: range) -> list[int]:
        return list(range(1000)) if int96 else list(ids)

    # rows 250..349 lie in groups 2 and 3: 200 rows read, every wanted one among them
    got = read(t0 + dt.timedelta(seconds=250), t0 + dt.timedelta(seconds=349))
    assert got == groups(range(200, 400))
    assert read(t0 + dt.timedelta(seconds=950), None) == groups(range(900, 1000))  # the newest group alone
    assert read(None, t0 + dt.timedelta(seconds=5)) == groups(range(100))
    assert read(t0 + dt.timedelta(seconds=2000), None) == groups(range(0))  # after every row: no group
    assert read(None, None) == list(range(1000))
    assert read(t0 + dt.timedelta(seconds=199), t0 + dt.timedelta(seconds=200)) == groups(range(100, 300))  # bounds kept
    # a file without statistics is read whole
    pq.write_table(table, file, row_group_size=100, write_statistics=False, use_deprecated_int96_timestamps=int96)
    assert read(t0 + dt.timedelta(seconds=950), None) == list(range(1000))


def test_a_footer_read_before_is_reused_only_for_the_same_file(tmp_path: Path) -> None:
    """Planning reads the newest file of a base on every tick: its footer is read once. The file
    written anew at the same path (not what Delta does, but a footer must never outlive its file)
    is read again."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, file = pafs.LocalFileSystem(), str(tmp_path / "f.parquet")
    t0 = dt.datetime(2026, 1, 1)

    def write(n: int) -> None:
        pq.write_table(pa.table({"pos": pa.array([t0 + dt.timedelta(seconds=i) for i in range(n)], pa.timestamp("us")),
                                 "id": pa.array(range(n), pa.int64())}), file, row_group_size=100)

    def read() -> list[int]:
        return delta_read.read_parquet_range(file, fs, ["id"], "pos", t0 + dt.timedelta(seconds=450), None)["id"].to_pylist()

    write(500)
    assert read() == list(range(400, 500)) and delta_read._FOOTERS.get(delta_read._FOOTERS.key(file, fs)) is not None
    assert read() == list(range(400, 500))  # (the footer kept)
    write(1000)
    assert delta_read._FOOTERS.get(delta_read._FOOTERS.key(file, fs)) is None and read() == list(range(400, 1000))
