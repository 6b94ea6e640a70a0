"""A view's keyed MERGE (``platform_assets.core.keyed_merge``) run from the driver by ``deltalake``
gives what Spark's Delta MERGE gives: the same rows, change data feed, txn, userMetadata and row
counts, for re-derived rows and for an additive view's contributions; Spark runs it where the
driver may not (real Spark + Delta, the session-scoped ``spark``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from platform_assets.core import keyed_merge, table_reads
from resources.storage import delta_log

pytestmark = pytest.mark.spark

PRESENT = "_tm_present"
VIEW_DDL = "`k` BIGINT, `Country` STRING, `n` BIGINT, `amount` DECIMAL(18,2), `tags` ARRAY<STRING>"


@pytest.mark.fast
def test_clauses_read_the_same_in_sparks_merge() -> None:
    clauses = keyed_merge.rows_clauses(["k", "Country"], ["k", "Country", "n"], PRESENT, delete_missing=True)
    assert clauses.on() == "(t.`k` IS NOT DISTINCT FROM s.`k`) AND (t.`Country` IS NOT DISTINCT FROM s.`Country`)"
    sql = clauses.spark_sql("/w/v", "t.`n` IN (1)")
    assert sql == ("MERGE INTO delta.`/w/v` t USING {source} s ON (t.`k` IS NOT DISTINCT FROM s.`k`) AND "
                   "(t.`Country` IS NOT DISTINCT FROM s.`Country`) AND (t.`n` IN (1))\n"
                   "WHEN MATCHED AND (s.`_tm_present` IS NULL) THEN DELETE\n"
                   "WHEN MATCHED AND (s.`_tm_present` AND ((t.`n` IS DISTINCT FROM s.`n`))) THEN UPDATE SET t.`n` = s.`n`\n"
                   "WHEN NOT MATCHED AND (s.`_tm_present`) THEN INSERT (`k`, `Country`, `n`) "
                   "VALUES (s.`k`, s.`Country`, s.`n`)")
    keep = keyed_merge.rows_clauses(["k"], ["k"], PRESENT, delete_missing=False)
    assert keep.matched == ()  # nothing but the key: insert only
    add = keyed_merge.add_clauses(["k"], "n", ["amount"], {"n": "bigint", "amount": "decimal(18,2)"}, delete_missing=True)
    assert [action is None for _, action in add.matched] == [True, False]  # the delete first
    assert add.matched[1][1] == {"n": "CAST((coalesce(t.`n`, 0) + s.`n`) AS bigint)",
                                 "amount": "CAST((coalesce(t.`amount`, 0) + s.`amount`) AS decimal(18,2))"}
    soft = keyed_merge.Clauses(("id",), (("NOT s.p", {"gone": "true"}), ("s.p", {"v": "s.v"})), None,
                               by_source=(("t.seq < 5", None),), null_safe=False)
    assert soft.spark_sql("/w/r") == ("MERGE INTO delta.`/w/r` t USING {source} s ON (t.`id` = s.`id`)\n"
                                      "WHEN MATCHED AND (NOT s.p) THEN UPDATE SET t.`gone` = true\n"
                                      "WHEN MATCHED AND (s.p) THEN UPDATE SET t.`v` = s.v\n"
                                      "WHEN NOT MATCHED BY SOURCE AND (t.seq < 5) THEN DELETE")


def _view(spark: Any, path: str, rows: list[tuple[Any, ...]], **options: str) -> None:
    spark.createDataFrame(rows, VIEW_DDL).coalesce(1).write.format("delta") \
        .option("delta.enableChangeDataFeed", "true").options(**options).save(path)


def _rows(spark: Any, path: str) -> list[tuple[Any, ...]]:
    return sorted((tuple(r) for r in spark.read.format("delta").load(path).collect()), key=repr)


def _changes(spark: Any, path: str, version: int) -> list[tuple[Any, ...]]:
    feed = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", version).load(path)
    return sorted((tuple(r) for r in feed.drop("_commit_version", "_commit_timestamp").collect()), key=repr)


def _commit(path: str, version: int) -> dict[str, Any]:
    fs, log = delta_log.log_fs(path)
    return next(a["commitInfo"] for a in delta_log.read_commit(fs, log, version) if "commitInfo" in a)


def _both(spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: list[tuple[Any, ...]],
          clauses: keyed_merge.Clauses, source: Any, **options: str) -> tuple[str, str]:
    """The same view MERGEd by each engine (driver: ``deltalake``; spark: Spark's MERGE)."""
    paths = {}
    for name, small in (("driver", keyed_merge.SMALL_VIEW_ROWS), ("spark", -1)):
        path = str(tmp_path / name)
        shutil.rmtree(path, ignore_errors=True)
        _view(spark, path, rows, **options)
        monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", small)
        keyed_merge.merge(spark, clauses, source, path, app_id="tidemark:mart.v", seq=7, meta=json.dumps({"seq": 7}))
        paths[name] = path
    return paths["driver"], paths["spark"]


def test_rederived_rows_merged_from_the_driver_equal_sparks_merge(spark, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    view = [(1, "DE", 2, "1.50", ["a"]), (2, "FR", 1, "2.00", None), (3, None, 4, None, []), (None, "NL", 5, "5.00", ["b"]),
            (5, "IT", 1, "1.00", ["c"])]
    view = [(k, c, n, _dec(a) if a else None, t) for k, c, n, a, t in view]
    source = spark.createDataFrame([
        (1, "DE", 3, _dec("1.50"), ["a"], True),      # changed count: updated
        (2, "FR", 1, _dec("2.00"), None, True),       # unchanged: not rewritten
        (3, None, 4, _dec("0.10"), [], True),         # null key column matched null-safely, amount changed
        (None, "NL", None, None, None, None),         # no longer produced: deleted
        (6, "ES", 1, _dec("9.99"), ["x", None], True),  # new: inserted
        (7, "PT", 1, None, None, None),               # no longer produced and not in the view: nothing
    ], f"{VIEW_DDL}, `{PRESENT}` BOOLEAN")
    clauses = keyed_merge.rows_clauses(["k", "Country"], ["k", "Country", "n", "amount", "tags"], PRESENT,
                                       delete_missing=True)
    driver, by_spark = _both(spark, tmp_path, monkeypatch, view, clauses, source)
    assert "delta-rs" in str(_commit(driver, 1).get("engineInfo")), _commit(driver, 1)
    assert "delta-rs" not in str(_commit(by_spark, 1).get("engineInfo"))
    assert _rows(spark, driver) == _rows(spark, by_spark)
    assert (6, "ES", 1, _dec("9.99"), ["x", None]) in _rows(spark, driver)
    # the change feed says the same: two updates, one delete, one insert, the unchanged row absent
    assert _changes(spark, driver, 1) == _changes(spark, by_spark, 1)
    assert len(_changes(spark, driver, 1)) == 2 * 2 + 1 + 1
    for path in (driver, by_spark):  # the unit's txn, userMetadata and counts, by Spark's metric names
        landed = delta_log.find_txn_commit(path, "tidemark:mart.v", 7)
        assert landed is not None and landed.version == 1 and landed.user_metadata == {"seq": 7}
        m = landed.metrics
        assert (m["numTargetRowsInserted"], m["numTargetRowsUpdated"], m["numTargetRowsDeleted"]) == (1, 2, 1), m
        assert delta_log.changed_rows(landed) == 4
    # the same unit again (a retry after a crash) writes nothing
    assert keyed_merge.merge_small(clauses, source, driver, app_id="tidemark:mart.v", seq=7, meta="{}", max_rows=100)
    assert DeltaTable(driver).version() == 1
    # a unit that changes nothing still commits its txn, as Spark's MERGE does (deltalake's commits nothing)
    for path in (driver, by_spark):
        monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", 100 if path == driver else -1)
        keyed_merge.merge(spark, clauses, source, path, app_id="tidemark:mart.v", seq=8, meta=json.dumps({"seq": 8}))
        landed = delta_log.find_txn_commit(path, "tidemark:mart.v", 8)
        assert landed is not None and landed.version == 2 and landed.user_metadata == {"seq": 8}, path
        assert not landed.metrics.get("numTargetRowsInserted") and not landed.metrics.get("numTargetRowsUpdated")
    # deltalake's commit holds no file (Spark's rewrote the file holding the matched keys)
    assert delta_log.find_txn_commit(driver, "tidemark:mart.v", 8).rows == 0  # type: ignore[union-attr]
    assert delta_log.data_version(driver, 2, 0) == 1
    assert _rows(spark, driver) == _rows(spark, by_spark)


def test_an_additive_views_contributions_merged_from_the_driver_equal_sparks_merge(
        spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    view = [(1, "DE", 2, _dec("1.50"), None), (2, "FR", 1, _dec("2.00"), None), (3, "IT", 4, None, None)]
    source = spark.createDataFrame([
        (1, "DE", 1, _dec("0.25")),    # grows
        (2, "FR", -1, _dec("-2.00")),  # count reaches 0: deleted
        (3, "IT", 0, _dec("0")),       # no change: not rewritten
        (4, "ES", 2, _dec("3.10")),    # new group
        (5, "PT", -1, _dec("-1")),     # leaves a group the view does not hold: nothing
    ], "`k` BIGINT, `Country` STRING, `n` BIGINT, `amount` DECIMAL(28,2)")
    clauses = keyed_merge.add_clauses(["k", "Country"], "n", ["amount"], {"n": "bigint", "amount": "decimal(18,2)"},
                                      delete_missing=True)
    # an additive view holds only its key and sums: the tags column is left out of the view here
    view_ddl = VIEW_DDL.replace(", `tags` ARRAY<STRING>", "")
    paths = []
    for name, small in (("driver", keyed_merge.SMALL_VIEW_ROWS), ("spark", -1)):
        path = str(tmp_path / name)
        spark.createDataFrame([r[:4] for r in view], view_ddl).write.format("delta") \
            .option("delta.enableChangeDataFeed", "true").save(path)
        monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", small)
        keyed_merge.merge(spark, clauses, source, path, app_id="tidemark:mart.v", seq=1, meta="{}")
        paths.append(path)
    driver, by_spark = paths
    assert "delta-rs" in str(_commit(driver, 1).get("engineInfo"))
    assert _rows(spark, driver) == _rows(spark, by_spark) == [(1, "DE", 3, _dec("1.75")), (3, "IT", 4, None),
                                                              (4, "ES", 2, _dec("3.10"))]
    assert DeltaTable(driver).schema().to_json() == DeltaTable(by_spark).schema().to_json()
    assert _changes(spark, driver, 1) == _changes(spark, by_spark, 1)


def test_spark_merges_where_the_driver_may_not(spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    view = [(1, "DE", 2, _dec("1.50"), ["a"])]
    source = spark.createDataFrame([(1, "DE", 3, _dec("1.50"), ["a"], True)], f"{VIEW_DDL}, `{PRESENT}` BOOLEAN")
    clauses = keyed_merge.rows_clauses(["k", "Country"], ["k", "Country", "n", "amount", "tags"], PRESENT, True)
    cases = {
        "deletion vectors (a reader feature)": {"delta.enableDeletionVectors": "true"},
        "a view above SMALL_VIEW_ROWS": {},
        "TIDEMARK_DIRECT_IO=off": {},
    }
    for i, (why, options) in enumerate(cases.items()):
        path = str(tmp_path / f"v{i}")
        _view(spark, path, view, **options)
        if "SMALL_VIEW_ROWS" in why:
            monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", 0)
        if "DIRECT_IO" in why:
            monkeypatch.setenv(table_reads.ENV, "off")
        assert not keyed_merge.merge_small(clauses, source, path, app_id="a", seq=1, meta="{}",
                                             max_rows=keyed_merge.SMALL_VIEW_ROWS), why
        assert DeltaTable(path).version() == 0, why  # nothing written
        keyed_merge.merge(spark, clauses, source, path, app_id="a", seq=1, meta="{}")
        assert "delta-rs" not in str(_commit(path, 1).get("engineInfo")), why
        assert _rows(spark, path) == [(1, "DE", 3, _dec("1.50"), ["a"])], why
        monkeypatch.undo()
    # a source without the view's columns is Spark's to refuse
    path = str(tmp_path / "v9")
    _view(spark, path, view)
    narrow = source.drop("tags")
    assert not keyed_merge.merge_small(clauses, narrow, path, app_id="a", seq=1, meta="{}", max_rows=10)
    with pytest.raises(Exception):  # noqa: B017, PT011 - Delta 4's message for it is an internal error
        keyed_merge.merge(spark, clauses, narrow, path, app_id="a", seq=1, meta="{}")


def _dec(text: str) -> Any:
    import decimal

    return decimal.Decimal(text)


@pytest.mark.fast
def test_a_target_filter_keeps_the_columns_with_exact_literals_and_says_whether_datafusion_reads_them() -> None:
    import datetime as dt
    import decimal

    f = keyed_merge.TargetFilter.of({"c": [3, None, 1], "d": [dt.date(2026, 1, 2)], "t": [dt.datetime(2026, 1, 1)]})
    assert f.columns() == {"c": (3, None, 1), "d": (dt.date(2026, 1, 2),)}  # a timestamp has no exact literal
    assert f.sql() == "(t.`c` IN (3, 1) OR t.`c` IS NULL) AND (t.`d` IN (DATE'2026-01-02'))"
    assert f.portable
    assert keyed_merge.TargetFilter.of({"c": []}).sql() == "(FALSE)"  # the view holds none of the keys
    assert keyed_merge.TargetFilter().sql() == ""
    assert not keyed_merge.TargetFilter.of({"a": [decimal.Decimal("1.5")]}).portable  # Spark's 1.5BD
    assert not keyed_merge.TargetFilter.of({"s": ["it's"]}).portable  # Spark's \' escape
    assert keyed_merge.TargetFilter.of({"s": ["plain text"]}).portable


def test_a_large_view_is_merged_from_the_driver_when_its_filter_leaves_few_rows(
        spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A view above SMALL_VIEW_ROWS: deltalake MERGEs it when the filter's files hold at most
    FILTERED_VIEW_ROWS rows (pruning its scan by the same filter), with what Spark's MERGE gives; else
    Spark does."""
    from resources.storage.delta_meta import TableSnapshot

    # four files, each of one Country: the filter on Country leaves one of 3 rows
    groups = [[(k, c, 1, _dec("1.00"), None) for k in range(i * 3, i * 3 + 3)] for i, c in enumerate(["DE", "FR", "IT", "NL"])]
    source = spark.createDataFrame([(3, "FR", 9, _dec("2.00"), None, True), (4, "FR", None, None, None, None),
                                    (40, "FR", 1, None, None, True)], f"{VIEW_DDL}, `{PRESENT}` BOOLEAN")
    clauses = keyed_merge.rows_clauses(["k"], ["k", "Country", "n", "amount", "tags"], PRESENT, delete_missing=True)
    fr = keyed_merge.TargetFilter.of({"Country": ["FR"]})
    paths = {}
    for name, small, within in (("driver", 3, fr), ("spark", -1, fr), ("wide", 3, keyed_merge.TargetFilter.of({"Country": ["FR", "IT"]}))):
        path = str(tmp_path / name)
        for rows in groups:
            spark.createDataFrame(rows, VIEW_DDL).coalesce(1).write.format("delta").mode("append") \
                .option("delta.enableChangeDataFeed", "true").save(path)
        assert TableSnapshot.open(path).rows_holding(within.columns()) == 3 * len(within.columns()["Country"])
        monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", small)
        monkeypatch.setattr(keyed_merge, "FILTERED_VIEW_ROWS", small)
        keyed_merge.merge(spark, clauses, source, path, app_id="tidemark:mart.v", seq=1, meta="{}", target_filter=within)
        paths[name] = path
    driver = _commit(paths["driver"], 4)
    assert "delta-rs" in str(driver.get("engineInfo")), driver
    assert "FR" in driver["operationParameters"]["predicate"]
    assert driver["operationMetrics"]["num_target_files_removed"] == 1  # only the FR file rewritten
    for other in ("spark", "wide"):  # Spark's MERGE, by choice and because the filter leaves 6 rows > 3
        assert "delta-rs" not in str(_commit(paths[other], 4).get("engineInfo")), other
    assert _rows(spark, paths["driver"]) == _rows(spark, paths["spark"]) == _rows(spark, paths["wide"])
    assert (3, "FR", 9, _dec("2.00"), None) in _rows(spark, paths["driver"])
    assert len(_rows(spark, paths["driver"])) == 12  # one deleted, one inserted
    assert _changes(spark, paths["driver"], 4) == _changes(spark, paths["spark"], 4)


@pytest.mark.fast
def test_a_large_view_merges_from_the_driver_where_its_filter_leaves_files_of_at_most_filtered_view_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A view over ``SMALL_VIEW_ROWS`` rows: its MERGE runs from the driver where the unit's filter
    leaves files of at most ``FILTERED_VIEW_ROWS`` rows and ``FILTERED_VIEW_BYTES`` bytes by their
    statistics (a view whose MERGEs packed rows into files spanning many ranges: stop 83), else
    Spark's; no filter, Spark's."""
    import pyarrow as pa
    from deltalake import write_deltalake

    clauses = keyed_merge.rows_clauses(["k"], ["k", "n"], PRESENT, delete_missing=True)
    rows = pa.table({"k": pa.array([7, 9], pa.int64()), "n": pa.array([70, 90], pa.int64()), PRESENT: [True, True]})
    within = keyed_merge.TargetFilter.of({"k": [7, 9]})
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", 10)
    sparks: list[str] = []
    monkeypatch.setattr(keyed_merge.spark_io, "run_merge", lambda *a, **k: sparks.append(str(a[1])))
    for filtered, size, target_filter, driver in ((50, 1 << 30, within, True), (49, 1 << 30, within, False),
                                                  (50, 1, within, False), (10**9, 1 << 30, keyed_merge.NO_FILTER, False)):
        path = str(tmp_path / f"v{filtered}-{size}-{driver}")
        for lo in range(0, 300, 50):  # 300 rows in six files of 50, each a narrow range of k
            write_deltalake(path, pa.table({"k": pa.array(range(lo, lo + 50), pa.int64()),
                                            "n": pa.array([0] * 50, pa.int64())}), mode="append")
        monkeypatch.setattr(keyed_merge, "FILTERED_VIEW_ROWS", filtered)
        monkeypatch.setattr(keyed_merge, "FILTERED_VIEW_BYTES", size)
        before = len(sparks)
        keyed_merge.merge(None, clauses, lambda: None, path, app_id="a", seq=1, meta="{}",  # type: ignore[arg-type]
                          target_filter=target_filter, rows=rows)
        assert (len(sparks) == before) is driver, (filtered, sparks)
        got = DeltaTable(path)
        assert got.version() == (6 if driver else 5), filtered
        if driver:  # one file of 50 rewritten, the unit's txn on the commit
            assert got.history(1)[0]["operationMetrics"]["num_target_files_removed"] == 1
            assert delta_log.find_txn_commit(path, "a", 1) is not None
            n = dict(zip(*[got.to_pyarrow_table(columns=["k", "n"]).column(c).to_pylist() for c in ("k", "n")],
                         strict=True))
            assert (n[7], n[9], n[8], n[60]) == (70, 90, 0, 0)
