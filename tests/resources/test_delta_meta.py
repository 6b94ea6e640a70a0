"""JVM-free facts about Delta tables, on real tables written with ``deltalake``."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from lineage.positions import Position
from resources.delta_meta import (
    RECENT_COMMITS,
    BlockEnd,
    CommitUnavailableError,
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
    from resources.delta_meta import find_txn_commit

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
    from resources.delta_meta import find_txn_commit

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
