"""Typing a file in worker processes gives the tables a single pass gives: the same rows, ids,
positions, columns, unmapped values and failed events, also when chunks type a new column
differently (the whole file's promotion is applied to them)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import orjson
import pytest

from lineage.intake.config import load_intake
from platform_assets.intake.units import process_ready
from platform_assets.intake.workers import shutdown_pool, split_file
from resources.core.settings import Settings
from resources.intake import event_store as store
from resources.intake.incoming_log import ready_dir
from resources.storage.delta_log import open_table
from tests.platform_assets.test_events import T0, config, write_file


def _big_file(settings: Settings, minutes: int = 5, extra: str = "late", w_text: bool = False) -> Path:
    evs: list[dict[str, Any]] = []
    for i in range(3000):
        ev: dict[str, Any] = {"eid": i, "event_type": ["pv", "cart"][i % 2], "n": i, "u": {"id": i, "tags": [i, "x"]}}
        ev["v"] = i if i < 1500 else f"s{i}"  # bigint in the first chunks, string later: promoted for the file
        ev["w"] = f"w{i}" if w_text else i  # a new bigint column of the first file; text in the second
        if i % 97 == 5:
            ev["n"] = "not a number"  # fits no existing bigint column: _unmapped_data
        if i % 101 == 7:
            del ev["event_type"]  # fails the template
        if i % 89 == 3:
            ev["_timestamp"] = "garbage"  # no receive time: pos is the running maximum
        if i == 2000:
            ev[extra] = {"deep": True}  # a column the next file, typed ahead, did not see in the table
        evs.append(ev)
    path = write_file(settings, "web", T0 + dt.timedelta(minutes=minutes), evs)
    with open(path, "ab") as f:  # a corrupt line and a torn tail
        f.write(b"not json\n")
        f.write(b'{"eid": 99999, "event')
    return path


def _snapshot(settings: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for table in ("stage.events_pv", "stage.events_cart"):
        t = open_table(settings.table_path(table))
        assert t is not None
        data = t.to_pyarrow_table()
        out[table] = (data.schema.names, sorted(data.to_pylist(), key=lambda r: r["id"]))
    failed = store.read_failed_events(settings.table_path(store.FAILED_EVENTS))
    out["failed"] = sorted(({k: v for k, v in r.items() if k != "failed_at"} for r in failed), key=lambda r: r["failure_id"])
    return out


def test_split_file_cuts_after_newlines_and_counts_lines(tmp_path: Path):
    p = tmp_path / "f.log"
    p.write_bytes(b"".join(orjson.dumps({"i": i, "pad": "x" * (i % 13)}) + b"\n" for i in range(100)) + b"torn")
    parts = split_file(p, 4)
    assert len(parts) == 4 and parts[0][0] == 0 and parts[-1][1] == p.stat().st_size
    data = p.read_bytes()
    for (a, b, first), nxt in zip(parts, [*parts[1:], None], strict=True):
        assert a == 0 or data[a - 1:a] == b"\n"
        assert first == data[:a].count(b"\n") + 1
        if nxt:
            assert nxt[0] == b
    assert sum(data[a:b].count(b"\n") for a, b, _ in parts) == 100


@pytest.mark.slow
def test_workers_write_what_a_single_pass_writes(tmp_path: Path, monkeypatch):
    from platform_assets.intake import workers as event_workers

    merges: list[tuple[int, bool]] = []  # (chunks, promoted again) of each merge in the main process
    real_merge = event_workers.merge_chunks

    def spy(chunks):  # noqa: ANN001, ANN202
        out = real_merge(chunks)
        merges.append((len(chunks), bool(out[1])))
        return out

    monkeypatch.setattr(event_workers, "merge_chunks", spy)
    stale: list[bool] = []  # files typed ahead: were the tables they were typed against changed since?
    real_stale = event_workers.ParallelTyper._stale

    def stale_spy(self, chunks):  # noqa: ANN001, ANN202
        stale.append(real_stale(self, chunks))
        return stale[-1]

    monkeypatch.setattr(event_workers.ParallelTyper, "_stale", stale_spy)
    real_prefetch = event_workers.ParallelTyper.prefetch

    def prefetch_done(self, files):  # noqa: ANN001, ANN202
        # The file typed ahead is typed before the unit it was prefetched beside is written, as
        # on a busy machine: without this wait, a worker that starts late sees the new columns.
        real_prefetch(self, files)
        for future in self.ahead.get(tuple(p for p, _ in files), ((), ()))[1]:
            future.result()

    monkeypatch.setattr(event_workers.ParallelTyper, "prefetch", prefetch_done)
    homes = {}
    for mode in ("single", "workers"):
        settings = Settings.from_env({}, home=tmp_path / mode / "home", lineage=tmp_path / "lineage")
        (tmp_path / mode).mkdir()
        cfg = config(tmp_path / mode)
        # an existing table: n is bigint there, so "not a number" fits no column
        write_file(settings, "web", T0, [{"event_type": "pv", "n": 1}, {"event_type": "cart", "n": 2}])
        monkeypatch.setenv("TIDEMARK_EVENT_WORKERS", "1")
        process_ready(settings, load_intake(cfg, secrets=False))
        _big_file(settings)
        _big_file(settings, 10, "later", w_text=True)
        monkeypatch.setenv("TIDEMARK_EVENT_WORKERS", "1" if mode == "single" else "2")
        monkeypatch.setenv("TIDEMARK_EVENT_PARALLEL_BYTES", "1")
        try:
            done = process_ready(settings, load_intake(cfg, secrets=False))
        finally:
            shutdown_pool()
        assert len(done) == 2 and all(r.written > 2500 for r in done)
        assert not list(ready_dir(settings.events_dir()).glob("*.log"))
        homes[mode] = settings
    # 2 workers x 2 chunks; v typed bigint and string: typed again with the file's promotion; the
    # second file, typed ahead before the first added its columns, was typed again
    assert merges == [(4, True), (4, False), (4, False)] and stale == [True]
    single, workers = _snapshot(homes["single"]), _snapshot(homes["workers"])
    assert single["stage.events_pv"][0] == workers["stage.events_pv"][0]  # same columns, same order
    for table in ("stage.events_pv", "stage.events_cart"):
        assert single[table] == workers[table], table
    assert single["failed"] == workers["failed"] and len(single["failed"]) == 60
    rows = single["stage.events_pv"][1]
    assert sum(1 for r in rows if r["_unmapped_data"] and '"w"' in r["_unmapped_data"]) > 1000  # text in bigint w
    assert any(r["_unmapped_data"] for r in rows) and {type(r["v"]) for r in rows if r["v"] is not None} == {str}


def test_a_unit_of_many_files_typed_by_workers_writes_what_a_single_pass_writes(tmp_path: Path, monkeypatch):
    """Small files grouped into one unit, typed in worker processes (runs of whole files) or in
    this process: the same rows, ids, failures and columns; torn tails and corrupt lines inside
    the unit keep every later file's line numbers."""
    from platform_assets.intake import workers as event_workers

    runs: list[int] = []  # chunks of each unit sent to the workers
    real_split = event_workers.split_unit

    def spy(files, parts):  # noqa: ANN001, ANN202
        out = real_split(files, parts)
        runs.append(len(out))
        return out

    monkeypatch.setattr(event_workers, "split_unit", spy)
    homes = {}
    for mode in ("single", "workers"):
        settings = Settings.from_env({}, home=tmp_path / mode / "home", lineage=tmp_path / "lineage")
        (tmp_path / mode).mkdir()
        cfg = config(tmp_path / mode)
        sizes = []
        for f in range(5):
            evs: list[dict[str, Any]] = []
            for i in range(200):
                ev: dict[str, Any] = {"eid": f * 1000 + i, "event_type": ["pv", "cart"][i % 2], "v": i if f < 3 else f"s{i}"}
                if i % 37 == 5:
                    del ev["event_type"]  # fails the template
                evs.append(ev)
            path = write_file(settings, "web", T0 + dt.timedelta(minutes=f), evs)
            if f in (1, 3):
                with open(path, "ab") as fh:
                    fh.write(b"not json\n" + b'{"eid": -1, "torn')
            sizes.append(path.stat().st_size)
        monkeypatch.setenv("TIDEMARK_EVENT_WORKERS", "1" if mode == "single" else "2")
        monkeypatch.setenv("TIDEMARK_EVENT_PARALLEL_BYTES", str(max(sizes) + 1))  # each file small, the unit not
        try:
            done = process_ready(settings, load_intake(cfg, secrets=False))
        finally:
            shutdown_pool()
        assert [r.files for r in done] == [5] and done[0].written == 5 * 200 - 5 * 6
        assert runs == ([] if mode == "single" else [4])  # 2 workers x 2 runs of whole files
        homes[mode] = settings
    single, workers = _snapshot(homes["single"]), _snapshot(homes["workers"])
    for table in ("stage.events_pv", "stage.events_cart"):
        assert single[table] == workers[table], table
    assert single["failed"] == workers["failed"] and len(single["failed"]) == 30
    assert {(r["file"].split(".")[2], r["line"]) for r in single["failed"]} >= {("20260301T120100000000Z", 6)}
    rows = single["stage.events_pv"][1]
    assert {type(r["v"]) for r in rows} == {str}  # promoted across the unit's files
