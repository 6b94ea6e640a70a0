"""Maintenance of one Delta table without a JVM: health, compaction, checkpoints, and a cleanup that
keeps every version a consumer needs (real ``deltalake`` tables)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import random

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from resources.storage import delta_log, health
from resources.storage import maintenance as m


def blocks(path: str, n: int, *, cdf: bool = True, start: int = 0) -> None:
    for i in range(start, start + n):
        conf = {"delta.enableChangeDataFeed": "true"} if cdf and i == 0 else None
        write_deltalake(path, pa.table({"id": pa.array([2 * i, 2 * i + 1], pa.int64()), "v": [float(i), float(i)]}),
                        mode="append", configuration=conf)


def rows(path: str, version: int | None = None) -> list[tuple[int, float]]:
    t = DeltaTable(path, version=version).to_pyarrow_table()
    return sorted(zip(t["id"].to_pylist(), t["v"].to_pylist(), strict=True))


def test_health_counts_files_small_files_bytes_and_commits_since_the_checkpoint(tmp_path):
    path = str(tmp_path / "t")
    blocks(path, 20)
    h = m.health("s.t", path, [m.Need(5, "mart.v", "input offset"), m.Need(12, "fact.f", "base")])
    assert (h.version, h.files, h.small_files, h.checkpoint, h.since_checkpoint) == (19, 20, 20, None, 20)
    assert h.bytes == sum(os.path.getsize(f.removeprefix("file://")) for f in DeltaTable(path).file_uris())
    assert h.horizon == m.Need(5, "mart.v", "input offset")
    assert h.reasons() == ["20 small files (compaction from 16)", "20 commits since the last checkpoint (one from 20)"]
    assert not m.health("s.none", str(tmp_path / "none")).exists


def test_maintain_compacts_checkpoints_and_keeps_every_version_a_consumer_needs(tmp_path):
    path = str(tmp_path / "t")
    blocks(path, 30)
    DeltaTable(path).delete("id < 10")  # v30 removes the files of blocks 0-4
    before = {v: rows(path, v) for v in (10, 20, 30)}
    h = m.health("s.t", path, [m.Need(20, "mart.v", "input offset")])

    dry = m.maintain(h, retain_hours=0, writers_idle=True, dry_run=True)
    assert dry.compacted["numFilesRemoved"] == 25 and DeltaTable(path).version() == 30  # nothing changed
    assert dry.horizon_checkpoint == 20 and dry.checkpoint == 30 and len(dry.logs_removed) == 20

    r = m.maintain(h, retain_hours=0, writers_idle=True)
    assert r.compacted["numFilesRemoved"] == 25 and r.compacted["numFilesAdded"] == 1
    assert r.vacuumed == []  # every file removed so far is in a version from v20 on
    assert len(r.logs_removed) == 20 and r.kept == ["versions from v20 on: v20 for mart.v: input offset"]
    after = m.health("s.t", path, h.needs)
    assert (after.files, after.oldest_log, after.checkpoint) == (1, 20, 31) and after.reasons() == []
    # What the consumer reads is intact: the version it needs, the change feed after it, the newest version.
    assert rows(path, 20) == before[20] and rows(path, 30) == before[30] == rows(path)
    cdf = pa.table(DeltaTable(path).load_cdf(starting_version=21).read_all())
    assert sorted(i for i, c in zip(cdf["id"].to_pylist(), cdf["_change_type"].to_pylist(), strict=True)
                  if c == "delete") == list(range(10))
    with pytest.raises(Exception):  # noqa: B017 - below the horizon nobody needs the log any more
        DeltaTable(path, version=10).to_pyarrow_table()

    # Once the consumer has moved on, what it read is removed.
    moved = m.health("s.t", path, [m.Need(31, "mart.v", "input offset")])
    r2 = m.maintain(moved, retain_hours=0, writers_idle=True)
    assert len(r2.vacuumed) == 31 and rows(path) == before[30]  # 25 compacted, 5 deleted, the delete's change data
    assert sum(f.startswith("_change_data/") for f in r2.vacuumed) == 1
    assert not any(os.path.exists(tmp_path / "t" / f) for f in r2.vacuumed)


def test_cleanup_keeps_what_is_younger_than_the_retention(tmp_path):
    path = str(tmp_path / "t")
    blocks(path, 25)
    DeltaTable(path).delete("id < 10")
    r = m.maintain(m.health("s.t", path), retain_hours=24, writers_idle=True)
    assert r.compacted and r.vacuumed == [] and r.logs_removed == []
    assert r.skipped == ["log cleanup: nothing below checkpoint v26 is older than 1 day"]
    assert rows(path, 5) == sorted((i, float(i // 2)) for i in range(12))  # old versions still readable


def test_a_retention_below_an_hour_is_refused_while_a_writer_runs(tmp_path):
    path = str(tmp_path / "t")
    blocks(path, 3)
    DeltaTable(path).delete("id < 2")
    r = m.maintain(m.health("s.t", path), retain_hours=0)
    assert r.vacuumed == [] and r.skipped[-1].startswith("cleanup: a retention below 1 hour could delete the files")
    assert len(DeltaTable(path).file_uris()) == 2 and rows(path, 0) == [(0, 0.0), (1, 0.0)]
    with pytest.raises(m.MaintenanceError, match="retain_hours must be 0 or more"):
        m.maintain(m.health("s.t", path), retain_hours=-1, writers_idle=True)


def test_retention_warning_when_the_tables_own_retention_would_remove_a_needed_version(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": pa.array([1], pa.int64())}),
                    configuration={"delta.deletedFileRetentionDuration": "interval 2 days"})
    write_deltalake(path, pa.table({"id": pa.array([2], pa.int64())}), mode="overwrite")
    need = [m.Need(0, "mart.v", "input offset")]
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    assert m.health("s.t", path, need, now=now).warnings == ()
    later = m.health("s.t", path, need, now=now + dt.timedelta(days=1, hours=1))
    assert len(later.warnings) == 1
    assert later.warnings[0].startswith("s.t: v0 for mart.v: input offset — files removed after it were removed at ")
    assert "file retention (2 days) lets a VACUUM delete them from" in later.warnings[0]
    log = m.health("s.t", path, need, now=now + dt.timedelta(days=29, hours=1))
    assert any("log retention (30 days) lets a checkpoint remove that commit" in w for w in log.warnings)


@pytest.mark.parametrize(("text", "expected"), [
    ("interval 7 days", dt.timedelta(days=7)), ("168 hours", dt.timedelta(hours=168)),
    ("interval 1 week", dt.timedelta(weeks=1)), ("30 minutes", dt.timedelta(minutes=30)),
    (None, dt.timedelta(days=3)), ("soon", dt.timedelta(days=3)),
])
def test_parse_interval(text, expected):
    assert m.parse_interval(text, dt.timedelta(days=3)) == expected


def test_change_data_files_go_once_no_consumer_reads_the_change_feed_of_their_commit(tmp_path):
    path = str(tmp_path / "t")
    blocks(path, 3)
    DeltaTable(path).update(predicate="id < 2", updates={"v": "v + 10"})  # v3 writes _change_data
    cdc = tmp_path / "t" / "_change_data"
    [written] = list(cdc.iterdir())
    r = m.maintain(m.health("s.t", path, [m.Need(2, "mart.v", "input offset")]), retain_hours=0, writers_idle=True)
    assert list(cdc.iterdir()) == [written] and r.vacuumed == []  # mart.v reads the change feed of v3
    feed = pa.table(DeltaTable(path).load_cdf(starting_version=3).read_all())
    assert sorted(feed["_change_type"].to_pylist()) == ["update_postimage"] * 2 + ["update_preimage"] * 2
    r = m.maintain(m.health("s.t", path, [m.Need(3, "mart.v", "input offset")]), retain_hours=0, writers_idle=True)
    assert list(cdc.iterdir()) == [] and f"_change_data/{written.name}" in r.vacuumed
    assert rows(path) == [(0, 10.0), (1, 10.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0)]


def test_cleanup_adds_no_table_version_and_a_second_one_finds_nothing(tmp_path):
    path = str(tmp_path / "t")
    blocks(path, 20)
    r = m.maintain(m.health("s.t", path), retain_hours=0, writers_idle=True)
    assert r.compacted and len([f for f in r.vacuumed if not f.startswith("_change_data/")]) == 20
    assert DeltaTable(path).version() == 20  # the compaction's commit only: no VACUUM START/END commits
    again = m.maintain(m.health("s.t", path), retain_hours=0, writers_idle=True)
    assert again.vacuumed == [] and again.logs_removed == [] and DeltaTable(path).version() == 20


def test_a_need_of_the_commit_alone_keeps_the_log_entry_not_the_files(tmp_path):
    path = str(tmp_path / "t")
    blocks(path, 20)
    h = m.health("s.t", path, [m.Need(3, "fact.f", "the commit of its last unit", files=False)])
    r = m.maintain(h, retain_hours=0, writers_idle=True)
    assert len([f for f in r.vacuumed if not f.startswith("_change_data/")]) == 20  # no version's files are needed
    assert r.logs_removed == [] and m.health("s.t", path).oldest_log == 0  # commit 3 stays readable (no checkpoint <= 3)
    far = m.health("s.t", path, [m.Need(3, "fact.f", "the commit", files=False)],
                   now=dt.datetime.now(dt.UTC).replace(tzinfo=None) + dt.timedelta(days=10))
    assert not any("file retention" in w for w in far.warnings)  # no file warning for a log-only need


def test_an_unreadable_table_is_named_never_taken_for_no_table(tmp_path):
    path = tmp_path / "t"
    blocks(str(path), 2)
    (path / "_delta_log" / "00000000000000000002.json").write_text("{not json\n")
    with pytest.raises(m.MaintenanceError, match=r"s\.t: .* has a Delta log, but it cannot be read: "):
        m.health("s.t", str(path))


def test_data_version_looks_past_compactions_and_cleanups(tmp_path):
    from resources.storage.delta_log import data_version

    path = str(tmp_path / "t")
    blocks(path, 20)  # v0-v19
    m.maintain(m.health("s.t", path), retain_hours=0, writers_idle=True)  # v20: the compaction
    assert DeltaTable(path).version() == 20
    assert data_version(path, 20, 19) == 19  # v20 changed no row
    assert data_version(path, 20, 20) == 20
    blocks(path, 1, start=50)  # v21 appends
    assert data_version(path, 21, 19) == 21


def test_a_table_kept_in_small_files_is_compacted_only_in_its_small_files(tmp_path):
    """A view clustered by its join column (files of ~``rows_per_file`` rows, written small on purpose:
    its reverse joins rewrite whole files) keeps those files; only the files under half that size
    (units' appends) are binned, and ``--cluster``'s Z-order writes files of that size again."""
    path = str(tmp_path / "v")
    # 24 "clustered" files of 20,000 rows, each a narrow range of ``c``, then 20 appended files of 50 rows
    rng = random.Random(7)  # values that do not compress away: files of realistic size

    def part(ids: range, c: int) -> pa.Table:
        return pa.table({"id": pa.array(ids, pa.int64()), "c": pa.array([c] * len(ids), pa.int64()),
                         "x": pa.array([rng.random() for _ in ids], pa.float64())})

    for f in range(24):
        write_deltalake(path, part(range(f * 20_000, (f + 1) * 20_000), f), mode="append")
    clustered = set(DeltaTable(path).file_uris())
    for i in range(20):
        write_deltalake(path, part(range(10**6 + 50 * i, 10**6 + 50 * (i + 1)), i % 24), mode="append")
    plain = m.health("mart.v", path)
    assert (plain.small_files, plain.target_bytes, plain.kept_small) == (44, m.TARGET_FILE_BYTES, False)
    h = m.health("mart.v", path, rows_per_file=20_000)
    assert h.kept_small and m.MIN_TARGET_FILE_BYTES <= h.target_bytes < m.TARGET_FILE_BYTES
    assert h.small_files == 20, "only the appended files are small"
    before = rows_of(path)
    report = m.maintain(h)
    assert report.compacted and report.compacted["numFilesRemoved"] == 20
    after = set(DeltaTable(path).file_uris())
    assert clustered <= after, "the clustered files were rewritten"
    assert rows_of(path) == before
    again = m.health("mart.v", path, rows_per_file=20_000)
    assert again.small_files < 16 and not again.oversized_files
    assert not m.maintain(again, cluster_by=("c",)).compacted, "a healthy clustered view is left alone"
    # a full recompute wrote the view in one big file: clustered again by the join column, into files
    # of about 20,000 rows
    write_deltalake(path, pa.concat_tables([part(range(f * 20_000, (f + 1) * 20_000), f) for f in range(24)]),
                    mode="overwrite")
    before = rows_of(path)
    big = m.health("mart.v", path, rows_per_file=20_000)
    assert big.oversized_files == 1 and any("clustered again by its join column" in r for r in big.reasons())
    assert not m.maintain(big).compacted, "nothing says what to cluster by"
    report = m.maintain(big, cluster_by=("c",))
    assert report.compacted and report.clustered_by == ("c",)
    after = m.health("mart.v", path, rows_per_file=20_000)
    assert after.files >= 12 and not after.oversized_files and after.small_files < 16
    assert rows_of(path) == before


def test_the_rewrite_in_pos_order_is_for_tables_with_positions_mostly_in_files_under_the_target():
    """deltalake's compaction rewrites every file under the target size; the rewrite in pos order
    rewrites every file, so it is chosen where that costs at most twice as much, and only for a
    table with positions that is not kept in small files on purpose."""
    target = health.TARGET_FILE_BYTES
    h = m.Health("fact.f", "/x", 3, files=20, small_files=19, bytes=10 * target, binned_bytes=5 * target, positions=True)
    assert h.in_position_order
    assert not dataclasses.replace(h, binned_bytes=5 * target - 1).in_position_order, "mostly in large files"
    assert not dataclasses.replace(h, positions=False).in_position_order, "no pos column (a view, a replica)"
    assert not dataclasses.replace(h, target_bytes=target // 4).in_position_order, "kept in small files"


def rows_of(path: str) -> list[tuple[int, int]]:
    t = DeltaTable(path).to_pyarrow_table()
    return sorted(zip(t["id"].to_pylist(), t["c"].to_pylist(), strict=True))


def test_compaction_writes_small_row_groups_and_planning_reads_the_compacted_file_exactly(tmp_path):
    import pyarrow.parquet as pq

    from lineage.core.positions import Position
    from resources.storage import delta_meta

    path = str(tmp_path / "fact")
    t0 = dt.datetime(2026, 1, 1)
    per, n = 1_000, 20  # 20 blocks of 1,000 rows in (pos, id) order, as step units append them
    for b in range(n):
        ids = range(b * per, (b + 1) * per)
        write_deltalake(path, pa.table({"pos": pa.array([t0 + dt.timedelta(seconds=i) for i in ids], pa.timestamp("us")),
                                        "id": pa.array(ids, pa.int64())}), mode="append")
    h = m.health("fact.f", path)
    assert h.positions and h.binned_bytes == h.bytes and h.in_position_order
    assert m.maintain(h, dry_run=True).in_pos_order
    r = m.maintain(h, cleanup=False)
    assert r.compacted["numFilesRemoved"] == n and r.compacted["numFilesAdded"] == 1 and r.in_pos_order
    (file,) = DeltaTable(path).file_uris()
    meta = pq.ParquetFile(file.removeprefix("file://")).metadata
    assert meta.num_row_groups == -(-n * per // m.COMPACT_ROW_GROUP_ROWS) > 1
    pos = pq.read_table(file.removeprefix("file://"), columns=["pos"])["pos"].to_pylist()
    assert pos == sorted(pos) and len(pos) == n * per, "the small files are rewritten in pos order"
    spans = [(meta.row_group(g).column(0).statistics.min, meta.row_group(g).column(0).statistics.max)
             for g in range(meta.num_row_groups)]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), "row groups hold disjoint pos ranges"
    log = DeltaTable(path).history(1)[0]
    assert log["operation"] == "OPTIMIZE", "a compaction, not a change of data (readers run no unit for it)"
    # marked as maintain's own rewrite: told from its first line, and what counting its lines says too
    fs, log_dir = delta_log.log_fs(path)
    raw = delta_log.read_commit_bytes(fs, log_dir, n)
    assert log["tidemark.maintain"] == "rewrite" and delta_log.REWRITE_MARK in raw[:raw.index(b"\n")]
    unmarked = raw.replace(delta_log.REWRITE_MARK, b'"other":"x"', 1)
    assert delta_log.rewrites_only(raw) and delta_log.rewrites_only(unmarked)
    # the next block's end and the newest position, read through the row groups' statistics
    last = Position(t0 + dt.timedelta(seconds=n * per - 500), n * per - 500)
    end = delta_meta.find_block_end(path, last, t0 + dt.timedelta(days=1), 100)
    assert (end.end, end.rows) == (Position(t0 + dt.timedelta(seconds=n * per - 400), n * per - 400), 100)
    assert delta_meta.table_mark(path).max_position == Position(t0 + dt.timedelta(seconds=n * per - 1), n * per - 1)
