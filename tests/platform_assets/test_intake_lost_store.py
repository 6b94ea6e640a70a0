"""The intake after its offset store is lost or restored from a backup (issue 57: the Delta log is
the truth, the store never the master). Two "hosts" share a warehouse and a store, as in
``test_intake_lock.py``. No JVM: the intake writes with deltalake."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from lineage.intake.config import load_intake
from platform_assets.intake.stream import STREAMED
from platform_assets.intake.units import process_ready
from tests.platform_assets.test_events import T0, config, write_file
from tests.platform_assets.test_intake_lock import STREAM, _copy_db, _hosts, _ids, _open_file, _stream, _urls


def _lose(tmp_path: Path) -> None:
    for f in tmp_path.glob("offsets.db*"):  # with its WAL files
        f.unlink()


@pytest.mark.parametrize("store_is", ["lost", "restored"])
def test_row_ids_stay_unique_when_the_store_forgot_another_hosts_ordinals(tmp_path: Path, store_is: str):
    """Host A lands a unit (ordinal 1); the store is backed up; host B lands one (ordinal 2); the
    store is lost, or restored from the backup. Neither the store's counter nor A's folder knows
    ordinal 2 any more: A's next unit takes its floor from the stage tables' Delta statistics, and
    no row id is given twice."""
    a, b = _hosts(tmp_path)
    intake = load_intake(config(tmp_path), secrets=False)

    def unit(s, k: int) -> None:  # noqa: ANN001
        at = T0 + dt.timedelta(seconds=10 * k + (100 if s is b else 0))  # file names differ (docs/limits.md)
        write_file(s, "web", at, [{"event_type": "pv", "url": f"/{s.home.name}/{k}/{j}"} for j in range(3)])
        assert [r.written for r in process_ready(s, intake)] == [3]

    unit(a, 0)
    _copy_db(tmp_path / "offsets.db", tmp_path / "offsets.backup.db")
    unit(b, 0)
    if store_is == "lost":
        _lose(tmp_path)
    else:
        _copy_db(tmp_path / "offsets.backup.db", tmp_path / "offsets.db")
    unit(a, 1)
    unit(b, 1)
    ids = _ids(a, "stage.events_pv")
    assert len(ids) == 12 and len(set(ids)) == 12, sorted(ids)
    assert sorted({i >> 32 for i in ids}) == [1, 2, 3, 4]


def test_a_table_another_writer_keeps_in_a_stage_schema_does_not_move_the_ordinals(tmp_path: Path):
    """Only the tables the intake's destinations wrote floor the ordinals: a table of another
    writer in the same schema (a replica, the shop's tables), whatever its ids, is not counted."""
    a, _ = _hosts(tmp_path)
    intake = load_intake(config(tmp_path), secrets=False)
    big = pa.table({"pos": pa.array([dt.datetime(2026, 1, 1, tzinfo=dt.UTC)], pa.timestamp("us", tz="UTC")),
                    "id": pa.array([2**62 + 7], pa.int64())})
    write_deltalake(a.table_path("stage.someone_elses"), big)
    write_file(a, "web", T0, [{"event_type": "pv", "url": "/x"}])
    assert [r.written for r in process_ready(a, intake)] == [1]
    _lose(tmp_path)
    write_file(a, "web", T0 + dt.timedelta(seconds=10), [{"event_type": "pv", "url": "/y"}])
    assert [r.written for r in process_ready(a, intake)] == [1]
    assert sorted(i >> 32 for i in _ids(a, "stage.events_pv")) == [1, 2]


def _past_retention(s, table: str) -> None:  # noqa: ANN001
    """What log retention does to ``table`` once another writer committed: a checkpoint, and the
    commits before it gone from the log (``delta.logRetentionDuration`` of no time)."""
    t = DeltaTable(s.table_path(table))
    t.alter.set_table_properties({"delta.logRetentionDuration": "interval 0 seconds"})
    t = DeltaTable(s.table_path(table))
    t.create_checkpoint()
    t.cleanup_metadata()
    assert len(t.history()) == 1, t.history()  # only the property change is left


def test_a_lost_store_and_a_log_past_retention_refuse_to_stream_a_folder_again_from_its_start(tmp_path: Path):
    """The stream loop streamed part of a file the collector still writes; the store is lost and the
    stage table's log no longer holds a micro-batch of the folder. Where the queue stood is known
    nowhere: the loop refuses, naming the folder's marker, and writes nothing. Removing the marker
    says to read the folder from its start (events that landed land twice); a folder that never
    streamed is read from its start without asking."""
    a, b = _hosts(tmp_path)
    cfg = tmp_path / "stream.yaml"
    cfg.write_text(STREAM)
    _open_file(a, ["/0", "/1", "/2"])
    out = _stream(a, cfg)
    assert out.returncode == 0, out.stderr[-2000:]
    marker = a.events_dir() / "queue.dst=live" / STREAMED
    assert marker.exists()
    _past_retention(a, "stage.live_pv")
    _lose(tmp_path)
    _open_file(a, ["/3"])
    out = _stream(a, cfg)
    assert out.returncode != 0
    assert "holds no read position" in out.stderr and str(marker) in out.stderr, out.stderr[-2000:]
    assert _urls(a, "stage.live_pv") == ["/0", "/1", "/2"]  # nothing written
    _open_file(b, ["/b"])  # B's folder never streamed: read from its start
    out = _stream(b, cfg)
    assert out.returncode == 0, out.stderr[-2000:]
    marker.unlink()  # the user's word: read it from its start
    out = _stream(a, cfg)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _urls(a, "stage.live_pv") == ["/0", "/0", "/1", "/1", "/2", "/2", "/3", "/b"]


def test_a_lost_store_with_the_folders_micro_batches_in_the_log_streams_on_without_asking(tmp_path: Path):
    """The marker alone refuses nothing: with the folder's newest micro-batch still in the log, the
    loop takes its positions from there (``test_intake_lock.py`` covers how) and goes on."""
    a, _ = _hosts(tmp_path)
    cfg = tmp_path / "stream.yaml"
    cfg.write_text(STREAM)
    _open_file(a, ["/0", "/1"])
    assert _stream(a, cfg).returncode == 0
    _lose(tmp_path)
    _open_file(a, ["/2"])
    out = _stream(a, cfg)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _urls(a, "stage.live_pv") == ["/0", "/1", "/2"]
