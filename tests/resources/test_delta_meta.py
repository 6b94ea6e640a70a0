"""JVM-free facts about Delta tables, on real tables written with ``deltalake``."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from lineage.core.errors import ProcessingError
from lineage.core.positions import Position
from resources.storage import delta_log, delta_meta, history, positions
from resources.storage import late_rows as late_rows_module
from resources.storage.delta_log import RECENT_COMMITS, CommitUnavailableError
from resources.storage.delta_meta import (
    BlockEnd,
    TableSnapshot,
    bad_position_rows,
    find_block_end,
    late_detection_warning,
    late_rows,
    missing_commits,
    table_mark,
)

T0 = dt.datetime(2026, 1, 1)
FAR = dt.datetime(2030, 1, 1)


def _append(path: Path, rows: list[tuple[int | None, int | None]]) -> None:
    """Rows ``(seconds after T0, id)``; None stays null."""
    pos = [None if s is None else (T0 + dt.timedelta(seconds=s)).replace(tzinfo=dt.UTC) for s, _ in rows]
    write_deltalake(str(path), pa.table({"pos": pa.array(pos, pa.timestamp("us", tz="UTC")),
                                         "id": pa.array([i for _, i in rows], pa.int64())}), mode="append")


def _at(seconds: int, id_: int) -> Position:
    return Position(T0 + dt.timedelta(seconds=seconds), id_)


def test_a_snapshot_answers_every_question_for_its_own_version(tmp_path: Path) -> None:
    path = tmp_path / "base"
    _append(path, [(i, i) for i in range(1, 11)])
    old = TableSnapshot.open(str(path))
    last = _at(5, 5)
    _append(path, [(2, 100), (None, 101), (20, 102)])  # a late row, a null position, a new row

    assert old.version == 0 and table_mark(old).max_position == _at(10, 10)
    assert find_block_end(old, last, FAR, 100) == BlockEnd(_at(10, 10), 5, 0)
    assert bad_position_rows(old).num_rows == 0 and late_rows(old, 0, last).rows.num_rows == 0

    new = TableSnapshot.open(str(path))
    assert new.version == 1 and table_mark(new).max_position == _at(20, 102)
    assert find_block_end(new, last, FAR, 100) == BlockEnd(_at(20, 102), 6, 1)
    assert bad_position_rows(new)["id"].to_pylist() == [101]
    assert late_rows(new, 0, last).rows["id"].to_pylist() == [100]
    # A path reads the newest version, as a snapshot opened now does.
    assert table_mark(str(path)) == table_mark(new)
    assert find_block_end(str(path), last, FAR, 100) == find_block_end(new, last, FAR, 100)


def test_a_mark_newer_than_a_position_reads_rows_only_when_the_statistics_cannot_tell(tmp_path: Path) -> None:
    path = tmp_path / "base"
    _append(path, [(i, i) for i in range(1, 11)])
    exact = _at(10, 10)
    assert table_mark(str(path)).max_position == exact
    # Well before the newest statistic: enough to know a newer row exists, no rows read.
    assert table_mark(str(path), newer_than=_at(5, 5)).max_position == _at(10, 0)
    # Within the statistics' precision of the newest row: the exact position decides.
    assert table_mark(str(path), newer_than=exact).max_position == exact
    assert table_mark(str(path), newer_than=_at(10, 9)).max_position == exact
    # A null id among the newest rows: the statistics cannot tell, the rows are read.
    _append(path, [(30, None)])
    assert table_mark(str(path), newer_than=_at(5, 5)) == table_mark(str(path))


def test_a_kept_snapshot_reads_its_newest_rows_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resident process plans an unchanged base again on the snapshot it keeps: the exact newest
    position is read from the files once per snapshot, and a new commit is read anew."""
    path = tmp_path / "base"
    _append(path, [(i, i) for i in range(1, 11)])
    reads: list[int | None] = []
    real = positions._positions

    def counted(snap: TableSnapshot, *args: object, **kwargs: object) -> pa.Table:
        reads.append(snap.version)
        return real(snap, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(positions, "_positions", counted)
    assert table_mark(str(path)).max_position == _at(10, 10)
    assert table_mark(str(path)).max_position == _at(10, 10)
    assert TableSnapshot.open(str(path)) is TableSnapshot.open(str(path)) and reads == [0]
    _append(path, [(20, 5), (20, 3)])
    assert table_mark(str(path)).max_position == _at(20, 5) and reads == [0, 1]
    assert table_mark(str(path)).max_position == _at(20, 5) and reads == [0, 1]
    # A snapshot opened anew of the same version reads them itself, and finds the same.
    assert table_mark(TableSnapshot(str(path), delta_log.open_table(str(path)))).max_position == _at(20, 5)
    assert reads == [0, 1, 1]


def test_rows_up_to_the_newest_row_are_counted_by_the_statistics_alone(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``count_upto`` (a row-wise view checks that it holds every base row up to its unit's end):
    the rows after the position are read from the files only where the position is before the
    newest row or a null position may exist; at or after the newest row the statistics' count is the
    answer, and no file is read for it."""
    path = tmp_path / "base"
    _append(path, [(i, i) for i in range(1, 11)])
    _append(path, [(10, 11), (12, 12)])  # a tie on pos with the first commit's newest row
    reads: list[Position] = []
    real = positions._rows_after

    def counted(snap: TableSnapshot, last: Position, cutoff: dt.datetime | None) -> pa.Table | None:
        reads.append(last)
        return real(snap, last, cutoff)

    monkeypatch.setattr(positions, "_rows_after", counted)
    snap = TableSnapshot.open(str(path))
    assert delta_meta.count_upto(snap, _at(5, 5)) == 5
    assert delta_meta.count_upto(snap, _at(10, 10)) == 10 and reads == [_at(5, 5), _at(10, 10)]
    assert delta_meta.count_upto(snap, _at(12, 12)) == 12
    assert delta_meta.count_upto(snap, _at(20, 0)) == 12 and reads == [_at(5, 5), _at(10, 10)]
    _append(path, [(15, None)])  # a null id: the statistics cannot rule it out, so the rows are read
    assert delta_meta.count_upto(TableSnapshot.open(str(path)), _at(20, 0)) == 12 and reads[-1] == _at(20, 0)


def test_a_base_whose_position_is_not_a_timestamp_is_refused_by_name(tmp_path: Path) -> None:
    """A ``pos`` of type DATE (or an ``id`` that is no integer) is not a position: planning says
    which table and which types, instead of ending blocks at year 1."""
    path = tmp_path / "dates"
    write_deltalake(str(path), pa.table({"pos": pa.array([dt.date(2026, 1, 1)], pa.date32()),
                                         "id": pa.array([1], pa.int64())}))
    with pytest.raises(ProcessingError, match=r"dates: base table has 'pos' of type date32\[day\] and 'id' of type int64"):
        find_block_end(str(path), Position.zero(), FAR, 10)
    path = tmp_path / "text_ids"
    write_deltalake(str(path), pa.table({"pos": pa.array([T0], pa.timestamp("us")), "id": pa.array(["a"], pa.string())}))
    with pytest.raises(ProcessingError, match="'id' of type string"):
        find_block_end(str(path), Position.zero(), FAR, 10)


def test_a_snapshot_of_a_missing_table_has_no_facts(tmp_path: Path) -> None:
    snap = TableSnapshot.open(str(tmp_path / "nothing"))
    assert snap.version is None and snap.files.num_rows == 0
    assert table_mark(snap).max_position is None and table_mark(snap).version is None
    assert find_block_end(snap, Position.zero(), FAR, 10) == BlockEnd(None, 0, None)
    assert bad_position_rows(snap).num_rows == 0 and late_rows(snap, 0, Position.zero()).rows.num_rows == 0


def _txn_append(path: Path, app_id: str, version: int, n: int = 1) -> None:
    data = pa.table({"pos": pa.array([T0.replace(tzinfo=dt.UTC)] * n, pa.timestamp("us", tz="UTC")),
                     "id": pa.array(range(n), pa.int64())})
    write_deltalake(str(path), data, mode="append",
                    commit_properties=CommitProperties(app_transactions=[Transaction(app_id=app_id, version=version)],
                                                       custom_metadata={"userMetadata": f"block {version}"}))


def test_a_block_commit_is_found_however_far_back_without_reading_every_commit(tmp_path: Path) -> None:
    from resources.storage.delta_log import find_txn_commit

    path = tmp_path / "dest"
    _txn_append(path, "tidemark:t", 1, n=3)
    _txn_append(path, "tidemark:t", 2, n=2)
    for _ in range(RECENT_COMMITS * 3):  # far more unrelated commits than the recent window
        _append(path, [(1, 1)])
    _txn_append(path, "tidemark:t", 4, n=5)  # block 3 never landed (planned, then reset)
    found = find_txn_commit(str(path), "tidemark:t", 2)
    assert found is not None and found.version == 1 and found.rows == 2
    assert find_txn_commit(str(path), "tidemark:t", 1).version == 0
    assert find_txn_commit(str(path), "tidemark:t", 3) is None
    assert find_txn_commit(str(path), "tidemark:t", 4).rows == 5
    assert find_txn_commit(str(path), "tidemark:t", 5) is None
    assert find_txn_commit(str(path), "tidemark:other", 1) is None
    # The hint is taken when right, and ignored when wrong.
    assert find_txn_commit(str(path), "tidemark:t", 2, hint=1).version == 1
    assert find_txn_commit(str(path), "tidemark:t", 2, hint=7).version == 1


def test_a_commit_removed_by_log_retention_is_reported_not_guessed(tmp_path: Path) -> None:
    from resources.storage.delta_log import find_txn_commit

    path = tmp_path / "dest"
    _txn_append(path, "tidemark:t", 1)
    for _ in range(RECENT_COMMITS + 5):
        _append(path, [(1, 1)])
    table = DeltaTable(str(path))
    table.create_checkpoint()
    for f in (path / "_delta_log").glob("*.json"):
        if int(f.stem) < table.version():
            f.unlink()
    assert DeltaTable(str(path)).transaction_version("tidemark:t") == 1  # the checkpoint keeps txn
    with pytest.raises(CommitUnavailableError, match="removed by log retention"):
        find_txn_commit(str(path), "tidemark:t", 1)
    assert missing_commits(str(path), 0, table.version()) == tuple(range(1, table.version()))
    gaps = late_rows(TableSnapshot.open(str(path)), 0, _at(1, 1))
    assert gaps.unreadable == tuple(range(1, table.version()))
    assert f"versions 1..{table.version() - 1} no longer in its Delta log" in late_detection_warning("stage.x", gaps.unreadable)
    assert late_detection_warning("stage.x", ()) == ""


def test_late_rows_read_only_the_files_whose_parquet_statistics_allow_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "base"
    _append(path, [(i, i) for i in range(1, 11)])
    last = _at(10, 10)
    tie = (T0 + dt.timedelta(seconds=10, microseconds=500)).replace(tzinfo=dt.UTC)  # same millisecond as last
    write_deltalake(str(path), pa.table({"pos": pa.array([tie], pa.timestamp("us", tz="UTC")), "id": pa.array([5], pa.int64())}),
                    mode="append")  # after last by 500 us, though its id is lower: not late
    _append(path, [(10, 11), (12, 12)])  # at last's position with a higher id, and after: not late
    _append(path, [(10, 10), (30, 14)])  # last's own position and id: late
    _append(path, [(9, 15)])  # before: late
    read: list[str] = []
    real = late_rows_module._read_files
    monkeypatch.setattr(late_rows_module, "_read_files", lambda p, rels, *a, **k: read.extend(rels) or real(p, rels, *a, **k))
    found = late_rows(TableSnapshot.open(str(path)), 0, last)
    assert sorted(found.rows["id"].to_pylist()) == [10, 15]
    added = [a.path for a in history._History.read(str(path), 0, 4).added]
    assert sorted(read) == sorted(added[2:])  # the two files without a late row were never read


@pytest.mark.parametrize(("unit", "int96"), [("ms", False), ("us", False), ("ns", False), ("us", True)])
def test_a_parquet_footer_rules_a_file_out_only_when_its_exact_statistics_do(tmp_path: Path, unit: str, int96: bool) -> None:
    import pyarrow.parquet as pq

    fs = pa.fs.LocalFileSystem()
    last = Position(T0 + dt.timedelta(seconds=10, milliseconds=7), 10)

    def may_hold(rows: list[tuple[dt.timedelta | None, int | None]], group: int = 10) -> bool:
        f = str(tmp_path / f"f{len(list(tmp_path.iterdir()))}.parquet")
        pos = pa.array([None if d is None else T0 + dt.timedelta(seconds=10, milliseconds=7) + d for d, _ in rows], pa.timestamp(unit))
        pq.write_table(pa.table({"pos": pos, "id": pa.array([i for _, i in rows], pa.int64())}), f, row_group_size=group,
                       use_deprecated_int96_timestamps=int96)
        return late_rows_module._may_hold_late(fs, f, last)

    step = dt.timedelta(milliseconds=1)
    if int96:  # Spark's legacy timestamps: no ordered statistics, the file is read
        assert may_hold([(step, 1)])
        return
    assert not may_hold([(step, 1), (2 * step, 2)])  # after last, whatever the ids
    assert not may_hold([(dt.timedelta(0), 11), (step, 12)])  # at last's position with a higher id
    assert may_hold([(dt.timedelta(0), 11), (step, 3)])  # not late, but a group's minima cannot tell
    assert may_hold([(dt.timedelta(0), 10)])  # last itself
    assert may_hold([(-step, 30)])  # before
    assert may_hold([(step, 1), (step, 2), (-step, 3)], group=2)  # the second row group holds a late row
    assert not may_hold([(None, 1), (step, 2)], group=1)  # a row group of null positions: bad rows, not late ones
    assert may_hold([(dt.timedelta(0), None), (dt.timedelta(0), None)])  # ids that cannot tell
    if unit == "ns":
        assert not may_hold([(dt.timedelta(microseconds=1), 1)])


def test_wanted_rows_by_kernels_equal_those_by_expression() -> None:
    """The plain read filters with compute kernels, the dataset with an expression: same rows,
    with ties at the bound, null positions and null ids, and bounds of every kind."""
    import random

    rng = random.Random(7)
    pos = [None if rng.random() < 0.1 else T0 + dt.timedelta(seconds=rng.randrange(6)) for _ in range(400)]
    ids = [None if rng.random() < 0.1 else rng.randrange(8) for _ in range(400)]
    for unit, tz in (("us", "UTC"), ("ns", None), ("ms", None)):
        pos_type = pa.timestamp(unit, tz=tz)
        table = pa.table({"pos": pa.array([p and (p.replace(tzinfo=dt.UTC) if tz else p) for p in pos], pos_type),
                          "id": pa.array(ids, pa.int64())})
        for since in (None, T0 + dt.timedelta(seconds=2)):
            for after in (None, _at(3, 4), _at(-1, 0)):
                for upto in (None, T0 + dt.timedelta(seconds=4), T0):
                    wanted = positions._Wanted(since=since, after=after, upto=upto)
                    by_kernels = wanted.rows(table)
                    assert by_kernels == table.filter(wanted.expression(table.schema)), (unit, since, after, upto)
                    assert by_kernels["pos"].null_count == by_kernels["id"].null_count == 0


def test_positions_read_as_plain_parquet_equal_those_read_through_deltalake(tmp_path: Path) -> None:
    path = tmp_path / "base"
    write_deltalake(str(path), pa.table({"pos": pa.array([(T0 + dt.timedelta(seconds=s)).replace(tzinfo=dt.UTC) for s in (1, 2)],
                                                         pa.timestamp("us", tz="UTC"))}), mode="append")  # no id column yet
    write_deltalake(str(path), pa.table({"pos": pa.array([(T0 + dt.timedelta(seconds=3)).replace(tzinfo=dt.UTC)], pa.timestamp("us", tz="UTC")),
                                         "id": pa.array([7], pa.int64())}), mode="append", schema_mode="merge")
    _append(path, [(4, 8), (5, 9), (None, 10)])
    snap = TableSnapshot.open(str(path))
    assert snap.plain
    wanted = positions._Wanted(since=T0 + dt.timedelta(seconds=2))
    plain = positions._positions(snap, wanted)  # the file without an id does not read as the schema says: the dataset reads
    through_deltalake = TableSnapshot(str(path), snap.table)
    through_deltalake.__dict__["plain"] = False
    assert plain.sort_by("id") == positions._positions(through_deltalake, wanted).sort_by("id")
    assert sorted(plain["id"].to_pylist()) == [7, 8, 9]  # (the rows without an id have no position)
    # ... they are bad rows, to be quarantined (the log has no null count for a column a file lacks)
    assert sorted(bad_position_rows(str(path))["id"].to_pylist(), key=str) == [10, None, None]
    only_old = tmp_path / "only_old"  # every null in the file written before the id column
    write_deltalake(str(only_old), pa.table({"pos": pa.array([T0.replace(tzinfo=dt.UTC)], pa.timestamp("us", tz="UTC"))}))
    write_deltalake(str(only_old), pa.table({"pos": pa.array([T0.replace(tzinfo=dt.UTC)], pa.timestamp("us", tz="UTC")),
                                             "id": pa.array([1], pa.int64())}), mode="append", schema_mode="merge")
    assert bad_position_rows(str(only_old))["id"].to_pylist() == [None]
    # A table whose files each read as its schema says: read file by file, pruned by statistics.
    new = tmp_path / "new"
    _append(new, [(1, 1), (2, 2)])
    _append(new, [(3, 3), (4, 4)])
    snap = TableSnapshot.open(str(new))
    assert snap.plain and table_mark(snap).max_position == _at(4, 4)
    assert find_block_end(snap, _at(2, 2), FAR, 1) == BlockEnd(_at(3, 3), 1, 1)
    # A location pyarrow's own file systems do not take as it is (file:/x) reads through deltalake.
    uri = TableSnapshot.open(f"file:{new}")
    assert not uri.plain and table_mark(uri) == table_mark(snap)
    assert find_block_end(uri, _at(2, 2), FAR, 1) == find_block_end(snap, _at(2, 2), FAR, 1)
    # Deletion vectors are not plain: their rows are read through deltalake (which refuses them).
    dv = tmp_path / "dv"
    write_deltalake(str(dv), pa.table({"pos": pa.array([T0.replace(tzinfo=dt.UTC)], pa.timestamp("us", tz="UTC")),
                                       "id": pa.array([1], pa.int64())}),
                    configuration={"delta.enableDeletionVectors": "true"})
    assert not TableSnapshot.open(str(dv)).plain


# -- someone else cleans up: OPTIMIZE (compaction), VACUUM, log retention -----------------------


def _compact_and_vacuum(path: Path) -> None:
    """What a user's ``OPTIMIZE`` then ``VACUUM ... RETAIN 0 HOURS`` does (here with delta-rs)."""
    DeltaTable(str(path)).optimize.compact()
    DeltaTable(str(path)).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)


def _drop_log_below_checkpoint(path: Path) -> int:
    """Log cleanup: a checkpoint at the newest version, and every older commit file removed."""
    table = DeltaTable(str(path))
    table.create_checkpoint()
    for f in (path / "_delta_log").glob("*.json"):
        if int(f.stem) < table.version():
            f.unlink()
    return table.version()


def test_late_rows_are_found_exactly_after_optimize_and_vacuum(tmp_path: Path) -> None:
    from resources.storage.delta_meta import missing_files

    path = tmp_path / "base"
    for first in (1, 6):
        _append(path, [(i, i) for i in range(first, first + 5)])
    topic_read = DeltaTable(str(path)).version()  # the topic processed up to (10, 10) at this version
    last = _at(10, 10)
    _append(path, [(3, 11), (20, 12)])  # one late row (position 3), one new
    _append(path, [(10, 13), (21, 14), (2, 15)])  # at last's pos but a higher id (after last: not late), new, late
    want = late_rows(TableSnapshot.open(str(path)), topic_read, last).rows
    assert sorted(want["id"].to_pylist()) == [11, 15]
    # Compaction alone: the files are still there and read as before.
    DeltaTable(str(path)).optimize.compact()
    assert late_rows(TableSnapshot.open(str(path)), topic_read, last).rows.sort_by("id") == want.sort_by("id")
    DeltaTable(str(path)).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    snap = TableSnapshot.open(str(path))
    assert len(snap.files["path"]) == 1  # every row in one compacted file
    found = late_rows(snap, topic_read, last)
    assert found.rows.sort_by("id") == want.sort_by("id") and found.unreadable == ()
    # Rows that arrive after the compaction: in a file of their own, read as it is.
    _append(path, [(4, 16)])
    assert sorted(late_rows(TableSnapshot.open(str(path)), topic_read, last).rows["id"].to_pylist()) == [11, 15, 16]
    assert missing_files(str(path), ["nothing.parquet", snap.files["path"][0].as_py()]) == ["nothing.parquet"]


def test_a_compaction_commit_is_known_as_a_rewrite_without_parsing_it_and_answers_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction's commit (a line per file it removed) is told a rewrite from its bytes; its
    files are parsed only when asked for, and then say what a commit parsed at once says."""
    path = tmp_path / "base"
    for first in range(1, 30, 5):
        _append(path, [(i, i) for i in range(first, first + 5)])
    DeltaTable(str(path)).optimize.compact()
    _append(path, [(3, 31)])  # a late row after it
    fs, log = delta_log.log_fs(str(path))
    rewrite = DeltaTable(str(path)).version() - 1
    raw = delta_log.read_commit_bytes(fs, log, rewrite)
    assert delta_log.rewrites_only(raw)
    assert not delta_log.rewrites_only(delta_log.read_commit_bytes(fs, log, rewrite + 1))  # an append
    assert not delta_log.rewrites_only(delta_log.read_commit_bytes(fs, log, 0))  # metaData, protocol
    assert not delta_log.rewrites_only(raw.replace(b'"dataChange":false', b'"dataChange": false', 1))  # parsed, not guessed
    assert not delta_log.rewrites_only(raw.replace(b'"dataChange":false', b'"dataChange":true', 1))
    line_end = raw.index(b"\n")
    assert not delta_log.rewrites_only(raw[:line_end] + b'\n{"txn":{"appId":"a","version":1}}' + raw[line_end:])
    no_flag = raw.replace(b',"dataChange":false', b"", 1).replace(b'"dataChange":false,', b"", 1)
    assert not delta_log.rewrites_only(no_flag)  # a file without the flag (read as a data change)
    assert not delta_log.rewrites_only(b'{"commitInfo":{"operation":"OPTIMIZE"}}\n')  # no file rewritten
    assert not delta_log.rewrites_only(raw.replace(b"\n", b"\n\n", 1))  # a blank line: parsed
    body = raw[line_end + 1:]
    assert delta_log.rewrites_only(body) and delta_log.rewrites_only(body.rstrip(b"\n"))  # no commitInfo; no last "\n"
    assert not delta_log.rewrites_only(raw + b'{"cdc":{"path":"c.parquet","dataChange":false}}\n')  # another action
    assert not delta_log.rewrites_only(raw + b' {"add":{"path":"a.parquet","dataChange":false}}\n')  # a line opened otherwise
    assert not delta_log.rewrites_only(raw[:line_end])  # a commitInfo alone
    assert not delta_log.rewrites_only(b"")
    # the mark tidemark maintain writes tells a compaction from its first line; elsewhere it is counted
    marked = raw.replace(b'{"commitInfo":{', b'{"commitInfo":{' + delta_log.REWRITE_MARK + b",", 1)
    assert delta_log.rewrites_only(marked)
    append = delta_log.read_commit_bytes(fs, log, rewrite + 1)
    assert not delta_log.rewrites_only(append.replace(b'{"commitInfo":{', b'{"commitInfo":{' + delta_log.REWRITE_MARK + b",", 1))
    assert not delta_log.rewrites_only(delta_log.REWRITE_MARK + b"\n" + body)  # not in a commitInfo line

    parsed: list[int] = []
    real_parse = delta_log.parse_commit
    monkeypatch.setattr(delta_log, "parse_commit", lambda r: parsed.append(len(real_parse(r))) or real_parse(r))
    found = late_rows(TableSnapshot.open(str(path)), rewrite - 1, _at(15, 15))
    assert found.rows["id"].to_pylist() == [31] and parsed == [2]  # the append's commitInfo and add only
    lazy = history._History.read(str(path), 2, rewrite + 1)
    assert lazy.rewrite_only[rewrite] and not lazy.data_changed[rewrite] and lazy.feed[rewrite] == []
    monkeypatch.setattr(delta_log, "rewrites_only", lambda r: False)
    eager = history._History.read(str(path), 2, rewrite + 1)
    assert (lazy.removed_by, lazy.compacted) == (eager.removed_by, eager.compacted)
    assert lazy.commits == eager.commits and list(lazy.commits) == list(range(3, rewrite + 2))
    def files(version: int) -> set[str]:
        return set(DeltaTable(str(path), version=version).get_add_actions(flatten=True)["path"].to_pylist())

    assert lazy.removed_by == {rel: (rewrite, "OPTIMIZE", False) for rel in files(rewrite - 1)} and len(files(rewrite - 1)) == 6
    assert lazy.compacted == files(rewrite) and len(lazy.compacted) == 1
    assert (lazy.added, lazy.feed, lazy.rewrite_only) == (eager.added, eager.feed, eager.rewrite_only)


def test_late_rows_keep_every_column_their_files_have(tmp_path: Path) -> None:
    """A late row in a file that added a column keeps its value (it is quarantined to be replayed
    as it was), though an earlier late file lacks the column."""
    path = tmp_path / "base"
    _append(path, [(10, 1), (20, 2)])
    _append(path, [(5, 3)])  # late, without v

    def late_file(table: pa.Table) -> None:
        write_deltalake(str(path), table, mode="append", schema_mode="merge")

    stamp = pa.array([(T0 + dt.timedelta(seconds=6)).replace(tzinfo=dt.UTC)], pa.timestamp("us", tz="UTC"))
    late_file(pa.table({"pos": stamp, "id": pa.array([4], pa.int64()), "v": pa.array(["x"])}))
    got = late_rows(TableSnapshot.open(str(path)), 0, _at(20, 2)).rows.sort_by("id").to_pylist()
    assert [(r["id"], r.get("v")) for r in got] == [(3, None), (4, "x")]


def test_late_rows_whose_ids_do_not_tell_stop_with_the_file_and_the_cause(tmp_path: Path) -> None:
    from resources.storage.delta_meta import RemovedDataError

    path = tmp_path / "base"
    _append(path, [(i, i) for i in range(1, 11)])
    _append(path, [(2, 5)])  # a late row re-using an old id: ids cannot show it arrived later
    before = late_rows(TableSnapshot.open(str(path)), 0, _at(10, 10)).rows
    assert before["id"].to_pylist() == [5]
    _compact_and_vacuum(path)
    with pytest.raises(RemovedDataError) as err:
        late_rows(TableSnapshot.open(str(path)), 0, _at(10, 10))
    msg = str(err.value)
    assert "late rows added since version 0 cannot be found exactly" in msg
    assert "(added by version 1) is gone (compacted by OPTIMIZE at version 2, then deleted by VACUUM)" in msg
    assert "and its ids (from 5) are not above the greatest id at version 0 (10), so they cannot tell its rows" in msg
    # Nothing late since a newer version: nothing to look for, no error.
    assert late_rows(TableSnapshot.open(str(path)), 1, _at(10, 10)).rows.num_rows == 0


def test_late_rows_after_vacuum_and_log_cleanup_say_what_is_gone(tmp_path: Path) -> None:
    from resources.storage.delta_meta import RemovedDataError

    path = tmp_path / "base"
    _append(path, [(i, i) for i in range(1, 11)])
    _append(path, [(2, 20)])
    _compact_and_vacuum(path)
    _drop_log_below_checkpoint(path)  # version 0, where the topic read, is gone from the log
    # The commit that added the late row is gone too: the answer is incomplete, and says so.
    gaps = late_rows(TableSnapshot.open(str(path)), 0, _at(10, 10))
    assert gaps.rows.num_rows == 0 and gaps.unreadable
    # A late row after the log cleanup, compacted and vacuumed: the version the topic read is gone.
    _append(path, [(3, 21)])
    after = DeltaTable(str(path)).version() - 1
    _compact_and_vacuum(path)
    with pytest.raises(RemovedDataError, match=r"version 0 is no longer in its Delta log \(removed by log retention\)"):
        late_rows(TableSnapshot.open(str(path)), 0, _at(10, 10))
    # From a version the log still rebuilds, the ids tell.
    assert late_rows(TableSnapshot.open(str(path)), after, _at(10, 10)).rows["id"].to_pylist() == [21]


def test_a_vacuumed_snapshot_is_read_from_a_newer_version_only_where_that_is_exact(tmp_path: Path) -> None:
    from resources.storage.delta_meta import RemovedDataError, count_block, snapshot_read

    path = tmp_path / "base"
    _append(path, [(i, i) for i in range(1, 11)])
    _append(path, [(i, i) for i in range(11, 21)])
    planned = DeltaTable(str(path)).version()  # a block (5, 15] planned on this version, not run yet
    assert snapshot_read(str(path), planned, _at(5, 5), _at(15, 15)).rerouted is False
    _append(path, [(7, 30)])  # lands inside the planned range later: not part of the block
    _compact_and_vacuum(path)
    route = snapshot_read(str(path), planned, _at(5, 5), _at(15, 15))
    assert route.rerouted and route.read_version == DeltaTable(str(path)).version() and route.max_id == 20
    assert count_block(str(path), _at(5, 5), _at(15, 15), planned) == 10
    # A row that was there is deleted since: the newest version no longer holds the same rows.
    DeltaTable(str(path)).delete("id = 6")
    with pytest.raises(RemovedDataError, match=r"rows it held were changed or deleted since \(DELETE at version"):
        snapshot_read(str(path), planned, _at(5, 5), _at(15, 15))


def test_an_input_change_whose_change_data_was_vacuumed_is_a_visible_problem(tmp_path: Path) -> None:
    from resources.storage.delta_meta import input_change

    path = tmp_path / "dim"
    data = pa.table({"id": pa.array([1, 2], pa.int64()), "country": ["A", "B"]})
    write_deltalake(str(path), data, configuration={"delta.enableChangeDataFeed": "true"})
    write_deltalake(str(path), pa.table({"id": pa.array([3], pa.int64()), "country": ["C"]}), mode="append")
    change = input_change("dim.x", str(path), 0)
    assert change.problem == "" and change.changed_rows == 1
    DeltaTable(str(path)).optimize.compact()  # a compaction changes no row
    compacted = input_change("dim.x", str(path), 1)
    assert compacted.changed and compacted.changed_rows == 0 and compacted.problem == ""
    assert compacted.rewrites_only and not compacted.due  # the same rows: no unit is due for it
    assert change.due and not input_change("dim.x", str(path), 0).rewrites_only  # an append among them: due
    DeltaTable(str(path)).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    gone = input_change("dim.x", str(path), 0)
    assert gone.problem.startswith("the change data of version 1 is gone: part-")
    assert gone.problem.endswith("(compacted by OPTIMIZE at version 2, then deleted by VACUUM)")
    assert input_change("dim.x", str(path), 1).problem == ""  # from the compaction on, the feed reads nothing gone
    _drop_log_below_checkpoint(path)
    assert "were removed from its Delta log (log retention)" in input_change("dim.x", str(path), 0).problem


def test_a_destination_compacted_and_vacuumed_still_answers_recovery(tmp_path: Path) -> None:
    from platform_assets.core.protocol import block_figures
    from resources.storage.delta_log import find_txn_commit
    from resources.storage.delta_meta import missing_files

    path = tmp_path / "dest"
    _txn_append(path, "tidemark:t", 1, n=3)
    _txn_append(path, "tidemark:t", 2, n=2)
    _compact_and_vacuum(path)
    found = find_txn_commit(str(path), "tidemark:t", 2)  # the log, not the files, says where block 2 ended
    assert found is not None and (found.version, found.rows, found.user_metadata) == (1, 2, {"text": "block 2"})
    assert missing_files(str(path), list(found.paths)) == list(found.paths)
    # A block that landed before a crash, its files vacuumed before the retry: its figures from the statistics.
    figures = block_figures(str(path), found, None, run_id="retry")
    assert (figures.rows, figures.nulls) == (2, {"pos": 0, "id": 0})


def test_the_newest_version_is_found_by_looking_for_the_next_commit_files(tmp_path: Path) -> None:
    from resources.storage.delta_log import newest_version

    path = tmp_path / "t"
    assert newest_version(str(path)) is None  # no table
    # A known version is trusted unless rechecked: only the commits after it are looked for.
    assert newest_version(str(path), 3) == 3
    assert newest_version(str(path), 3, recheck=True) is None
    _append(path, [(1, 1)])
    assert newest_version(str(path)) == 0
    _append(path, [(2, 2)])
    _append(path, [(3, 3)])
    assert newest_version(str(path)) == 2
    assert newest_version(str(path), 0) == 2  # two commits after the one known
    assert newest_version(str(path), 2) == 2
    # Dropped and written anew: version 0 again. Only a recheck of the known version sees it.
    import shutil
    shutil.rmtree(path)
    _append(path, [(4, 4)])
    assert newest_version(str(path), 2) == 2
    assert newest_version(str(path), 2, recheck=True) == 0


def test_unit_sizes_reads_bytes_rows_and_whether_the_view_is_clustered_from_the_logs(tmp_path):
    from lineage.spec.model import TopicSpec

    spec = TopicSpec.model_validate({"table": "mart.v", "depends_on": ["stage.o", "dim.c"], "processor": "merge",
                                     "transforms": ["v.sql"], "key": ["id"], "join_keys": {"dim.c": {"customer_id": "id"}}})
    base, dim = tmp_path / "base", tmp_path / "dim"
    write_deltalake(str(base), pa.table({"id": list(range(100)), "customer_id": [i % 10 for i in range(100)]}))
    write_deltalake(str(dim), pa.table({"id": list(range(10))}))
    clustered, mixed = tmp_path / "clustered", tmp_path / "mixed"
    for first in range(0, 100, 25):  # four files, each a quarter of the customers; and four of all of them
        ids = list(range(first, first + 25))
        write_deltalake(str(clustered), pa.table({"id": ids, "customer_id": [i // 10 for i in ids]}), mode="append")
        write_deltalake(str(mixed), pa.table({"id": ids, "customer_id": [i % 10 for i in ids]}), mode="append")
    changes = [delta_meta.input_change("dim.c", str(dim), None)]
    snap = delta_meta.TableSnapshot.open

    got = delta_meta.unit_sizes(snap(str(base)), snap(str(clustered)), changes, spec)
    assert got is not None and got.clustered
    assert (got.base_rows, got.view_rows, got.view_files, got.view_columns) == (100, 100, 4, 2)
    assert got.base_bytes == sum(DeltaTable(str(base)).get_add_actions(flatten=True)["size_bytes"].to_pylist())
    assert got.inputs_bytes["dim.c"] == sum(DeltaTable(str(dim)).get_add_actions(flatten=True)["size_bytes"].to_pylist()) > 0
    got = delta_meta.unit_sizes(snap(str(base)), snap(str(mixed)), changes, spec)
    assert got is not None and not got.clustered  # every file spans every customer: nothing to skip
    assert delta_meta.unit_sizes(snap(str(base)), snap(str(tmp_path / "none")), changes, spec) is None
    gone = [delta_meta.input_change("dim.c", str(tmp_path / "no-dim"), None)]  # an input without a table
    assert delta_meta.unit_sizes(snap(str(base)), snap(str(clustered)), gone, spec) is None


def test_recorded_txn_reads_the_newest_commits_and_falls_back_to_the_snapshot(tmp_path: Path):
    """An app's recorded version: from the newest commit that names it (a file read, no snapshot),
    past other writers' commits; from the snapshot when only a checkpoint still holds it; 0 for
    an app never recorded or no table."""
    path = str(tmp_path / "t")
    assert delta_log.recorded_txn(path, "tidemark:a") == 0
    one = pa.table({"v": [1]})

    def write(*txns: tuple[str, int]) -> None:
        write_deltalake(path, one, mode="append",
                        commit_properties=CommitProperties(app_transactions=[Transaction(app_id=a, version=v) for a, v in txns]))

    write(("tidemark:a", 1))
    write(("tidemark:a", 2), ("tidemark:b", 7))
    write(("tidemark:b", 8))
    write()  # another writer, no transaction
    write()
    assert delta_log.recorded_txn(path, "tidemark:a") == 2
    assert delta_log.recorded_txn(path, "tidemark:b") == 8
    assert delta_log.recorded_txn(path, "tidemark:c") == 0
    DeltaTable(path).create_checkpoint()  # at version 4
    for v in range(4):  # log retention: only the checkpoint holds the transactions
        (tmp_path / "t" / "_delta_log" / f"{v:020d}.json").unlink()
    write()
    assert delta_log.recorded_txn(path, "tidemark:a") == 2
    assert delta_log.recorded_txn(path, "tidemark:b") == 8
    broken = tmp_path / "broken"
    write_deltalake(str(broken), one)
    (broken / "_delta_log" / f"{0:020d}.json").write_text("not json\n")
    with pytest.raises(ProcessingError, match="cannot be read now"):  # never taken for "none recorded"
        delta_log.recorded_txn(str(broken), "tidemark:a")


def test_recorded_txn_asked_again_reads_the_log_only_when_it_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Asked again with no new commit, the version is given without reading a commit; a new commit,
    or the table dropped and written anew to the same version, is read."""
    import shutil

    path = str(tmp_path / "t")
    reads: list[int] = []
    real = delta_log.read_commit
    monkeypatch.setattr(delta_log, "read_commit", lambda fs, log, v: reads.append(v) or real(fs, log, v))

    def write(app: str, version: int, rows: int = 1) -> None:
        write_deltalake(path, pa.table({"v": list(range(rows))}), mode="append",
                        commit_properties=CommitProperties(app_transactions=[Transaction(app_id=app, version=version)]))

    write("tidemark:a", 1)
    write("tidemark:b", 5)
    assert delta_log.recorded_txn(path, "tidemark:a") == 1 and reads == [1, 0]
    assert delta_log.recorded_txn(path, "tidemark:a") == 1 and reads == [1, 0]  # nothing new: nothing read
    write("tidemark:a", 2)
    assert delta_log.recorded_txn(path, "tidemark:a") == 2 and reads == [1, 0, 2]
    shutil.rmtree(path)  # dropped, and written anew up to the same version by other writers
    for n in range(3):
        write(f"other:{n}", 1, rows=n + 2)
    assert delta_log.recorded_txn(path, "tidemark:a") == 0


def test_prefetched_snapshots_are_the_ones_open_returns_inside_the_block(tmp_path: Path):
    paths = [str(tmp_path / f"t{i}") for i in range(3)]
    for p in paths:
        write_deltalake(p, pa.table({"v": [1]}))
    missing = str(tmp_path / "none")
    with delta_meta.prefetched([*paths, missing, paths[0]]):
        snap = delta_meta.TableSnapshot.open(paths[0])  # (waits for its read)
        write_deltalake(paths[0], pa.table({"v": [2]}), mode="append")  # after it was read
        assert snap is delta_meta.TableSnapshot.open(paths[0]) and snap.version == 0
        assert delta_meta.TableSnapshot.open(paths[0], version=1).version == 1  # a version asked for is opened
        assert delta_meta.TableSnapshot.open(missing).table is None
        assert delta_meta.TableSnapshot.open(paths[0], at_least=1).version == 1  # older than a block planned since
    assert delta_meta.TableSnapshot.open(paths[0]).version == 1
    # the next block keeps the tables it opened, brought up to date; a table dropped and written
    # anew (here: as many commits, other rows) is opened anew, not taken for the kept one
    write_deltalake(paths[1], pa.table({"v": [3]}), mode="append")
    shutil.rmtree(paths[2])
    write_deltalake(paths[2], pa.table({"v": [7, 8]}))
    with delta_meta.prefetched(paths):
        assert delta_meta.TableSnapshot.open(paths[1]).version == 1
        fresh = delta_meta.TableSnapshot.open(paths[2])
        assert fresh.version == 0 and fresh.row_count == 2


def test_the_newest_snapshot_is_reused_only_while_the_table_has_no_new_commit(tmp_path: Path) -> None:
    """A resident process opens the newest version of a table on every tick: while no commit
    follows it, the same snapshot answers; a new commit, or the table dropped and written anew,
    opens the table again."""
    path = tmp_path / "base"
    _append(path, [(1, 1)])
    first = TableSnapshot.open(str(path))
    assert TableSnapshot.open(str(path)) is first and table_mark(str(path)).version == 0
    assert TableSnapshot.open(str(path), at_least=1) is not first  # asked for a newer one: opened again
    _append(path, [(2, 2)])
    second = TableSnapshot.open(str(path))
    assert second is not first and second.version == 1 and table_mark(str(path)).max_position == _at(2, 2)
    assert TableSnapshot.open(str(path), 0) is not first and first.version == 0  # a version asked for is read
    size = (path / "_delta_log" / f"{1:020d}.json").stat().st_size
    shutil.rmtree(path)
    _append(path, [(1, 1)])
    _append(path, [(3, 3)])  # version 1 again, another table: a commit file of the same size, a newer time
    assert (path / "_delta_log" / f"{1:020d}.json").stat().st_size == size
    third = TableSnapshot.open(str(path))
    assert third is not second and table_mark(str(path)).max_position == _at(3, 3)
    shutil.rmtree(path)
    assert TableSnapshot.open(str(path)).table is None  # gone: no snapshot of it is given


def test_a_kept_snapshot_nobody_holds_is_moved_forward_by_the_new_commits_alone(tmp_path: Path) -> None:
    """A resident process planning a new block reads the commits since its last look, not the
    table's log from its checkpoint: the kept snapshot's table is moved forward when nothing else
    holds it, and answers as a table opened anew. A snapshot still held never changes."""
    import weakref

    path = tmp_path / "base"
    _append(path, [(1, 1)])
    kept = weakref.ref(TableSnapshot.open(str(path)).table)
    _append(path, [(2, 2)])
    moved = TableSnapshot.open(str(path))
    assert moved.version == 1 and moved.table is kept()  # the same deltalake table, one commit further
    assert table_mark(moved).max_position == _at(2, 2) and moved.row_count == 2
    held = moved  # (a plan in progress on version 1)
    _append(path, [(3, 3)])
    newer = TableSnapshot.open(str(path))
    assert newer.version == 2 and newer.table is not held.table  # opened anew: the held one is left alone
    assert held.version == 1 and held.table is not None and held.table.version() == 1 and held.row_count == 2
    del held, moved
    DeltaTable(str(path)).optimize.compact()  # a compaction and a checkpoint after it: moved through them too
    DeltaTable(str(path)).create_checkpoint()
    _append(path, [(4, 4)])
    kept = weakref.ref(newer.table)
    del newer
    again, fresh = TableSnapshot.open(str(path)), TableSnapshot(str(path), DeltaTable(str(path)))
    assert again.table is kept() and again.version == fresh.version == 4
    assert sorted(again.files["path"].to_pylist()) == sorted(fresh.files["path"].to_pylist())
    assert table_mark(again).max_position == _at(4, 4) and again.row_count == fresh.row_count == 4
    # a version asked for is never moved to: the kept newest one is not it, the version is opened
    assert TableSnapshot.open(str(path), 3).version == 3 and TableSnapshot.open(str(path)) is again


def test_snapshots_shared_by_threads_never_change_while_a_writer_commits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads open the newest snapshot while commits land: a kept snapshot is moved forward only
    when no thread holds it, so every snapshot a thread holds keeps its version and its rows."""
    import threading
    import time

    moved: list[int] = []
    real = DeltaTable.update_incremental
    monkeypatch.setattr(DeltaTable, "update_incremental", lambda self: moved.append(1) or real(self))

    path = str(tmp_path / "base")
    _append(Path(path), [(0, 0)])
    done, seen, errors = threading.Event(), set(), []

    def reader() -> None:
        while not done.is_set():
            snap = TableSnapshot.open(path)
            version = snap.version
            time.sleep(0.001)  # (held a while: another thread may look meanwhile)
            try:
                assert version is not None and snap.table is not None
                assert snap.table.version() == version and snap.row_count == version + 1, (version, snap.row_count)
                assert len(snap.files) == version + 1
            except AssertionError as exc:
                errors.append(exc)
            seen.add(version)
            del snap  # (a plan ends: what it held is let go)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for i in range(1, 25):  # one row per commit: version v holds v + 1 rows
            _append(Path(path), [(i, i)])
            time.sleep(0.005)
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert len(seen) > 5 and TableSnapshot.open(path).version == 24
    before = len(moved)  # (how many looks found the kept snapshot free depends on the threads' timing)
    _append(Path(path), [(25, 25)])
    assert TableSnapshot.open(path).version == 25 and len(moved) == before + 1  # nothing holds it now: moved


def test_rows_holding_counts_the_files_whose_statistics_allow_the_values(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    for c, s in ((1, "a"), (2, None), (5, "m"), (None, None)):  # one file each: c's values, s's values
        write_deltalake(path, pa.table({"c": pa.array([c, c], pa.int64()), "s": pa.array([s, "z" if s else None])}),
                        mode="append")
    snap = TableSnapshot.open(path)
    assert snap.rows_holding({"c": [2]}) == 2
    assert snap.rows_holding({"c": [1, 5]}) == 4
    assert snap.rows_holding({"c": [3]}) == 0  # between files: none
    assert snap.rows_holding({"c": [None]}) == 2  # only the file holding nulls
    assert snap.rows_holding({"c": []}) == 0
    assert snap.rows_holding({"s": ["n"]}) == 4  # files "a".."z" and "m".."z"; not the files of only nulls
    assert snap.rows_holding({"s": ["b"]}) == 2  # "m".."z" cannot hold it
    assert snap.rows_holding({"c": [1, 2], "s": ["n"]}) == 2  # both columns: only the first file
    assert snap.rows_holding({}) == 8
    assert snap.rows_holding({"c": ["x"]}) is None  # values that do not compare with the statistics
    assert snap.rows_holding({"nope": [1]}) == 8  # a column without statistics: every file
    sizes = dict(zip(snap.files["path"].to_pylist(), snap.files["size_bytes"].to_pylist(), strict=True))
    assert snap.bytes_holding({"c": [1, 5]}) == sum(sizes[p] for p in snap.files_holding({"c": [1, 5]}) or []) > 0
    assert snap.bytes_holding({}) == snap.size_bytes and snap.bytes_holding({"c": [3]}) == 0
    assert snap.bytes_holding({"c": ["x"]}) is None


def test_files_holding_keeps_a_file_whose_truncated_statistics_may_hold_a_value(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    stamp = dt.datetime(2026, 1, 1, 12, 0, 0, 999_999, tzinfo=dt.UTC)  # the log keeps milliseconds
    long = "k" * 40 + "z"  # a writer may cut a long string's statistics to a prefix
    write_deltalake(path, pa.table({"ts": pa.array([stamp], pa.timestamp("us", tz="UTC")), "s": [long],
                                    "f": pa.array([float("nan")])}))
    snap = TableSnapshot.open(path)
    assert len(snap.files_holding({"ts": [stamp]}) or []) == 1
    assert snap.files_holding({"ts": [stamp + dt.timedelta(seconds=1)]}) == []
    assert len(snap.files_holding({"s": [long]}) or []) == 1
    assert snap.files_holding({"s": ["a"]}) == []  # below the minimum
    assert len(snap.files_holding({"f": [float("nan")]}) or []) == 1  # a float column is not filtered


def test_a_short_string_maximum_rules_a_file_out(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    for country in ("DE", "FR"):
        write_deltalake(path, pa.table({"c": [country]}), mode="append")
    snap = TableSnapshot.open(path)
    assert snap.rows_holding({"c": ["FR"]}) == 1  # "DE".."DE" cannot hold "FR"
    assert snap.rows_holding({"c": ["DF"]}) == 0


def test_a_null_count_without_bounds_rules_a_file_out_only_when_every_row_is_null(tmp_path: Path) -> None:
    """Spark records a boolean column's null count and no bounds: such a file may hold any value,
    unless the count says every row is null."""
    import json

    import pyarrow.parquet as pq
    from deltalake import DeltaTable
    from deltalake.transaction import AddAction

    path = tmp_path / "t"
    write_deltalake(str(path), pa.table({"b": pa.array([], pa.bool_())}))
    adds = []
    for name, values in (("some.parquet", [True, None]), ("nulls.parquet", [None, None])):
        pq.write_table(pa.table({"b": pa.array(values, pa.bool_())}), path / name)
        stats = {"numRecords": 2, "nullCount": {"b": sum(v is None for v in values)}}
        adds.append(AddAction(path=name, size=(path / name).stat().st_size, partition_values={}, modification_time=0,
                              data_change=True, stats=json.dumps(stats)))
    table = DeltaTable(str(path))
    table.create_write_transaction(adds, mode="append", schema=table.schema())
    snap = TableSnapshot.open(str(path))
    assert snap.files_holding({"b": [True]}) == ["some.parquet"]
    assert sorted(snap.files_holding({"b": [None]}) or []) == ["nulls.parquet", "some.parquet"]
    assert snap.rows_holding({"b": [False]}) == 2


def test_exact_rows_only_where_every_file_counts_its_rows_and_no_vector_deletes_any(tmp_path: Path) -> None:
    """``exact_rows`` (what ``count_upto`` and ``tidemark verify`` take for the rows of a version):
    the statistics' count, but None when a file has no ``numRecords`` (it would count 0) or the
    table may hold deletion vectors (the rows they delete still count)."""

    import pyarrow.parquet as pq
    from deltalake.transaction import AddAction

    path = tmp_path / "t"
    _append(path, [(i, i) for i in range(1, 4)])
    assert TableSnapshot.open(str(path)).exact_rows == 3
    pq.write_table(pa.table({"pos": pa.array([(T0 + dt.timedelta(seconds=9)).replace(tzinfo=dt.UTC)],
                                             pa.timestamp("us", tz="UTC")),
                             "id": pa.array([9], pa.int64())}), path / "bare.parquet")
    table = DeltaTable(str(path))
    table.create_write_transaction([AddAction(path="bare.parquet", size=(path / "bare.parquet").stat().st_size,
                                              partition_values={}, modification_time=0, data_change=True, stats=None)],
                                   mode="append", schema=table.schema())
    snap = TableSnapshot.open(str(path))
    assert snap.row_count == 3 and snap.exact_rows is None  # (the file without statistics counted 0)
    dv = tmp_path / "dv"
    write_deltalake(str(dv), pa.table({"id": pa.array([1, 2], pa.int64())}),
                    configuration={"delta.enableDeletionVectors": "true"})
    snap = TableSnapshot.open(str(dv))
    assert snap.row_count == 2 and snap.exact_rows is None
