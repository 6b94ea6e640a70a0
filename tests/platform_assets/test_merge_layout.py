"""A clustered view keeps its layout through the MERGEs ``deltalake`` runs from the driver
(``platform_assets.core.merge_layout``): the files a MERGE packed from several are written again,
sorted by the view's cluster column, in a commit that changes no row; the next unit's filter then
rewrites only the files of its own keys. Read back by ``deltalake``'s DataFusion reader, by Spark
(its data skipping on the new statistics) and by the change data feed."""

from __future__ import annotations

import datetime as dt
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, QueryBuilder, write_deltalake

from platform_assets.core import keyed_merge, merge_layout
from resources.storage import delta_log

PRESENT = "_tm_present"
COLUMNS = ["cid", "k", "name", "day", "amount", "at", "ok"]
SCHEMA = pa.schema([("cid", pa.int64()), ("k", pa.int64()), ("name", pa.string()), ("day", pa.date32()),
                    ("amount", pa.float64()), ("at", pa.timestamp("us", tz="UTC")), ("ok", pa.bool_())])
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
FILES, PER_FILE = 8, 100


@pytest.fixture(autouse=True)
def _small_packs(monkeypatch: pytest.MonkeyPatch) -> None:
    """These views are tiny: every packed file is re-sorted, whatever its rows (but see
    test_a_pack_under_min_rows_stays_as_the_merge_wrote_it)."""
    monkeypatch.setattr(merge_layout, "MIN_ROWS", 0)


def _view(path: str, seed: int) -> dict[int, tuple[Any, ...]]:
    """A view of FILES files of PER_FILE rows, each file a narrow range of ``cid`` (two rows a
    customer), its rows shuffled; returns the rows by key ``k``."""
    rnd = random.Random(seed)
    rows: dict[int, tuple[Any, ...]] = {}
    for f in range(FILES):
        part = []
        for i in range(PER_FILE):
            k = f * PER_FILE + i
            part.append((k // 2, k, f"n{k:04d}", dt.date(2026, 1, 1) + dt.timedelta(days=k % 50),
                         None if k % 7 == 0 else k * 1.5, T0 + dt.timedelta(microseconds=k * 1_234_567), k % 3 == 0))
        rnd.shuffle(part)
        write_deltalake(path, pa.table({c: [r[i] for r in part] for i, c in enumerate(COLUMNS)}, schema=SCHEMA),
                        mode="append", configuration={"delta.enableChangeDataFeed": "true"} if f == 0 else None)
        rows.update((r[1], r) for r in part)
    return rows


def _unit(path: str, rows: dict[int, tuple[Any, ...]], cids: list[int], seq: int, cluster_by: str | None,
          spark: Any = None) -> None:
    """A unit re-deriving the rows of customers ``cids`` (their names changed), MERGEd from the
    driver where it may (``spark``: the session for Spark's MERGE)."""
    changed = [(*r[:2], f"{r[2]}-{seq}", *r[3:]) for r in rows.values() if r[0] in cids]
    rows.update((r[1], r) for r in changed)
    source = pa.table({**{c: [r[i] for r in changed] for i, c in enumerate(COLUMNS)}, PRESENT: [True] * len(changed)})
    clauses = keyed_merge.rows_clauses(["k"], COLUMNS, PRESENT, delete_missing=True)
    ddl = "cid BIGINT, k BIGINT, name STRING, day DATE, amount DOUBLE, at TIMESTAMP, ok BOOLEAN, `_tm_present` BOOLEAN"
    keyed_merge.merge(spark, clauses, lambda: spark.createDataFrame([(*r, True) for r in changed], ddl), path,
                      app_id="tidemark:mart.v", seq=seq,
                      meta=json.dumps({"seq": seq}), target_filter=keyed_merge.TargetFilter.of({"cid": cids}),
                      rows=source, cluster_by=cluster_by)


def _files(path: str) -> list[dict[str, Any]]:
    adds = pa.table(DeltaTable(path).get_add_actions(flatten=True)).to_pylist()
    return sorted(adds, key=lambda a: a["min.cid"])


def _read(path: str) -> dict[int, tuple[Any, ...]]:
    got = pa.table(QueryBuilder().register("v", DeltaTable(path)).execute(
        f"SELECT {', '.join(COLUMNS)} FROM v").read_all()).to_pylist()
    return {r["k"]: tuple(r[c] for c in COLUMNS) for r in got}


def _commit(path: str, version: int) -> tuple[bytes, list[dict[str, Any]]]:
    fs, log = delta_log.log_fs(path)
    raw = delta_log.read_commit_bytes(fs, log, version)
    return raw, delta_log.parse_commit(raw)


@pytest.mark.fast
def test_a_view_clustered_by_a_string_column_is_sorted_by_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", 10)
    path = str(tmp_path / "v")
    rows = _view(path, 4)  # (names n0000..n0799: each file a narrow range of them too)
    _unit(path, rows, [10, 110, 210], 1, "name")
    raw, _ = _commit(path, FILES + 1)
    assert delta_log.rewrites_only(raw)
    adds = pa.table(DeltaTable(path).get_add_actions(flatten=True)).to_pylist()
    files = sorted(adds, key=lambda a: a["min.name"])
    assert len(files) == FILES and all(a["max.name"] < b["min.name"] for a, b in zip(files, files[1:], strict=False))
    assert _read(path) == rows


def _scanned(actions: list[dict[str, Any]]) -> int:
    """How many files deltalake's MERGE read (its filter left them)."""
    return int(next(a["commitInfo"] for a in actions if "commitInfo" in a)["operationMetrics"]["num_target_files_scanned"])


@pytest.mark.fast
def test_the_files_a_driver_merge_packed_are_written_again_sorted_in_a_commit_that_changes_no_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", 10)  # a "large" view, MERGEd by its filter
    path = str(tmp_path / "v")
    rows = _view(path, 1)
    _unit(path, rows, [10, 110, 210, 310], 1, "cid")  # one customer in each of four files
    raw, merged = _commit(path, FILES)
    assert delta_log.commit_has_txn(merged, "tidemark:mart.v", 1)
    assert sum("remove" in a for a in merged) == 4 and sum("add" in a for a in merged) == 1  # deltalake packed four files
    raw, resorted = _commit(path, FILES + 1)
    assert delta_log.rewrites_only(raw), raw[:500]
    info = next(a["commitInfo"] for a in resorted if "commitInfo" in a)
    assert info["tidemark.layout"] == "resort"
    assert sum("add" in a for a in resorted) == 4 and sum("remove" in a for a in resorted) == 1
    assert _read(path) == rows
    # the files' cid ranges are disjoint again, each of about PER_FILE rows, and their statistics true
    files = _files(path)
    assert len(files) == FILES and sum(f["num_records"] for f in files) == FILES * PER_FILE
    assert all(a["max.cid"] < b["min.cid"] for a, b in zip(files, files[1:], strict=False)), files
    root = Path(path)
    new = {a["add"]["path"] for a in resorted if "add" in a}
    for f in files:
        part = pq.read_table(root / f["path"])
        assert f["num_records"] == part.num_rows
        assert (f["min.cid"], f["max.cid"]) == (min(part["cid"].to_pylist()), max(part["cid"].to_pylist()))
        if f["path"] not in new:
            continue
        for c in ("k", "name", "day", "amount"):  # a new file's bounds are its values'
            values = [v for v in part[c].to_pylist() if v is not None]
            assert (f[f"min.{c}"], f[f"max.{c}"], f[f"null_count.{c}"]) == (min(values), max(values), part[c].null_count)
        at = part["at"].to_pylist()  # to the millisecond, the minimum down and the maximum up
        assert dt.timedelta(0) <= min(at) - f["min.at"] < dt.timedelta(milliseconds=1), (min(at), f["min.at"])
        assert dt.timedelta(0) <= f["max.at"] - max(at) < dt.timedelta(milliseconds=1), (max(at), f["max.at"])
        assert f.get("min.ok") is None and f.get("null_count.ok") is None  # booleans: no statistics
    # the change feed holds the unit's changes only (pre- and post-images of its 8 rows)
    feed = pa.table(DeltaTable(path).load_cdf(starting_version=FILES).read_all())
    assert feed.num_rows == 16 and set(feed["_commit_version"].to_pylist()) == {FILES}
    # the next unit's filter leaves the files of its keys only: one customer, one file read and rewritten
    _unit(path, rows, [150], 2, "cid")
    _, second = _commit(path, FILES + 2)
    assert delta_log.commit_has_txn(second, "tidemark:mart.v", 2)
    assert _scanned(second) == 1 and sum("remove" in a for a in second) == 1
    assert DeltaTable(path).version() == FILES + 2  # one file rewritten: nothing packed, nothing sorted again
    assert _read(path) == rows


@pytest.mark.fast
def test_a_pack_under_min_rows_stays_as_the_merge_wrote_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A MERGE that packed fewer rows than MIN_ROWS is left as written: rewriting that file in a
    later unit costs less than a second commit and small files would."""
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", 10)
    monkeypatch.setattr(merge_layout, "MIN_ROWS", 4 * PER_FILE + 1)
    path = str(tmp_path / "v")
    rows = _view(path, 3)
    _unit(path, rows, [10, 110, 210, 310], 1, "cid")  # four files of PER_FILE rows packed into one
    assert DeltaTable(path).version() == FILES  # no second commit
    assert len(_files(path)) == FILES - 3 and _read(path) == rows
    monkeypatch.setattr(merge_layout, "MIN_ROWS", 4 * PER_FILE)  # the bound itself is re-sorted
    done = merge_layout.resort_merged(path, DeltaTable(path), "cid", app_id="tidemark:mart.v", seq=1)
    assert done is not None and (done.removed, done.added, done.rows) == (1, 4, 4 * PER_FILE)
    assert len(_files(path)) == FILES and _read(path) == rows


@pytest.mark.fast
def test_without_a_cluster_column_the_packed_file_stays_and_wears_the_next_unit(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What the re-sort prevents (stop 83): the packed file's statistics span four ranges, so the
    next unit's filter leaves it with its own file, and its MERGE reads both. No re-sort by a
    float column, nor of a commit that is not the unit's."""
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", 10)
    path = str(tmp_path / "v")
    rows = _view(path, 2)
    _unit(path, rows, [10, 110, 210, 310], 1, None)
    assert DeltaTable(path).version() == FILES  # no second commit
    table = DeltaTable(path)
    assert merge_layout.resort_merged(path, table, "amount", app_id="tidemark:mart.v", seq=1) is None  # a float column
    assert merge_layout.resort_merged(path, table, "cid", app_id="tidemark:mart.v", seq=2) is None  # not that unit's
    assert DeltaTable(path).version() == FILES
    _unit(path, rows, [150], 2, None)
    _, second = _commit(path, FILES + 1)
    assert _scanned(second) == 2  # its own file and the packed one, whose bounds hold cid 150
    assert _read(path) == rows


@pytest.mark.fast
def test_a_resort_that_lands_and_then_fails_keeps_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """deltalake may raise after the commit landed (its post-commit checkpoint): the files stay;
    one that did not land leaves no file behind."""
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", 10)
    commit = merge_layout._commit

    def lands_then_fails(*a: Any) -> None:
        commit(*a)
        raise OSError("checkpoint failed")

    path = str(tmp_path / "v")
    rows = _view(path, 5)
    _unit(path, rows, [10, 110, 210, 310], 1, None)
    monkeypatch.setattr(merge_layout, "_commit", lands_then_fails)
    done = merge_layout.resort_merged(path, DeltaTable(path), "cid", app_id="tidemark:mart.v", seq=1)
    assert done is not None and done.version == FILES + 1 and DeltaTable(path).version() == FILES + 1
    assert _read(path) == rows  # every file it added is there
    parquet = {p.name for p in Path(path).glob("*.parquet")}
    _unit(path, rows, [20, 120], 2, None)  # another packed file, whose re-sort fails before it lands
    refused: list[int] = []

    def refuse(*a: Any) -> None:
        refused.append(len(a[2]))  # (the files it would add)
        raise OSError("refused")

    monkeypatch.setattr(merge_layout, "_commit", refuse)
    before = {p.name for p in Path(path).glob("*.parquet")}
    assert merge_layout.resort_merged(path, DeltaTable(path), "cid", app_id="tidemark:mart.v", seq=2) is None
    assert refused and refused[0] >= 2  # it wrote its files and tried to commit them
    assert {p.name for p in Path(path).glob("*.parquet")} == before != parquet  # its files deleted again
    assert _read(path) == rows


@pytest.mark.spark
def test_spark_reads_skips_and_merges_a_resorted_view(spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark reads the re-sorted files (their Parquet and statistics) as deltalake does: the whole
    view, a filter its data skipping prunes by the new bounds, the change feed; and its own MERGE
    into the view afterwards."""
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", 10)
    path = str(tmp_path / "v")
    rows = _view(path, 3)
    _unit(path, rows, [10, 110, 210, 310], 1, "cid")
    assert DeltaTable(path).version() == FILES + 1
    view = spark.read.format("delta").load(path).select(*COLUMNS[:5])
    assert sorted(tuple(r) for r in view.collect()) == sorted(r[:5] for r in rows.values())
    for cid in (10, 49, 110, 111, 399):
        assert sorted(tuple(r) for r in view.where(f"cid = {cid}").collect()) == sorted(
            r[:5] for r in rows.values() if r[0] == cid), cid
    # what Spark may answer from the statistics alone (count, MIN, MAX) is the rows'
    got = spark.sql(f"SELECT count(*), min(cid), max(cid), min(amount), max(amount), min(name) FROM delta.`{path}`").first()
    amounts = [r[4] for r in rows.values() if r[4] is not None]
    assert tuple(got) == (len(rows), min(r[0] for r in rows.values()), max(r[0] for r in rows.values()), min(amounts),
                          max(amounts), min(r[2] for r in rows.values()))
    feed = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", FILES).load(path)
    assert feed.count() == 16 and {r[0] for r in feed.select("_commit_version").distinct().collect()} == {FILES}
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", -1)
    monkeypatch.setattr(keyed_merge, "FILTERED_VIEW_ROWS", -1)
    _unit(path, rows, [110, 250], 2, "cid", spark)  # Spark's MERGE: its files are not sorted again here
    assert "delta-rs" not in json.dumps(_commit(path, FILES + 2)[1][0])
    assert DeltaTable(path).version() == FILES + 2
    assert sorted(tuple(r) for r in spark.read.format("delta").load(path).select(*COLUMNS[:5]).collect()) == sorted(
        r[:5] for r in rows.values())
