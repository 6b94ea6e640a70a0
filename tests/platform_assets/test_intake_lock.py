"""The intake's processors take the one lock every processor takes: a record of the offset store
(``intake:batch``; ``intake:stream:<destination>``), which holds across hosts, not a pid file.

Two "hosts" here are two Tidemark homes (each its own events folder, as two collectors on two
machines) sharing one warehouse and one offset store. No JVM: the intake writes with deltalake."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from lineage.core.errors import OffsetError, TopicLockedError
from lineage.intake.config import load_intake
from platform_assets.core import locks
from platform_assets.intake.record import folder_tag
from platform_assets.intake.stream import StreamLoop
from platform_assets.intake.units import process_ready
from resources.core.settings import Settings
from resources.intake.incoming_log import ready_dir
from resources.state.offset_sql import make_owner, open_offset_store
from tests.platform_assets.test_events import T0, config, write_file

ROOT = Path(__file__).resolve().parents[2]
OTHER_HOST = "otherhost:4242:cafe0001"  # a holder on another machine: never taken as dead here


def _hosts(tmp_path: Path) -> tuple[Settings, Settings]:
    warehouse, offsets = tmp_path / "warehouse", f"sqlite:///{tmp_path / 'offsets.db'}"
    return tuple(Settings.from_env({}, home=tmp_path / name, warehouse=str(warehouse), offsets_url=offsets)  # type: ignore[return-value]
                 for name in ("host_a", "host_b"))


def _events(s: Settings, cfg: Path, command: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``tidemark events <command>`` of host ``s`` (its home, the shared warehouse and store), started."""
    cmd = [sys.executable, "-m", "platform_assets.cli", "--home", str(s.home), "--warehouse", s.warehouse,
           "--offsets-url", s.offsets_url, "events", command, "--config", str(cfg), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _cli(s: Settings, cfg: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return _events(s, cfg, "process", *args, env=env)


def _files_of_both(hosts: tuple[Settings, Settings], files: int, events: int) -> list[str]:
    """``files`` ready files of ``events`` page views on each host (names differ between the hosts:
    the intake recognises a file its tables hold by its name, docs/limits.md); their urls."""
    expected = []
    for k, s in enumerate(hosts):
        for i in range(files):
            url = [f"/{s.home.name}/{i}/{j}" for j in range(events)]
            expected += url
            write_file(s, "web", T0 + dt.timedelta(seconds=100 * k + i), [{"event_type": "pv", "url": u} for u in url])
    return expected


def _urls(s: Settings, table: str) -> list[str]:
    return sorted(DeltaTable(s.table_path(table)).to_pyarrow_table().column("url").to_pylist())


def test_two_hosts_processors_on_one_store_take_turns_and_land_every_event_once(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    a, b = _hosts(tmp_path)
    cfg = config(tmp_path)
    expected = _files_of_both((a, b), 12, 3)  # many small files each (units of one file: many commits, so the runs overlap)
    monkeypatch.setenv("TIDEMARK_EVENT_UNIT_BYTES", "1")
    refused = 0
    pending = {a.home.name: a, b.home.name: b}
    deadline = time.monotonic() + 240
    while pending and time.monotonic() < deadline:
        procs = {name: _cli(s, cfg, "--until-empty") for name, s in pending.items()}  # at once
        for name, p in procs.items():
            out, err = p.communicate(timeout=180)
            if p.returncode == 0:
                assert not list(ready_dir(pending[name].events_dir()).glob("*.log")), out
                del pending[name]
            else:  # refused while the other host's processor held the lock: nothing done, the holder named
                assert "topic 'intake:batch' is being processed by" in err, err[-2000:]
                refused += 1
    assert not pending, "a host's processor never got the lock"
    assert sorted(expected) == _urls(a, "stage.events_pv")  # each event once: none lost, none doubled
    store = open_offset_store(a.offsets_url)
    try:
        rec = store.get(locks.INTAKE_BATCH)
        assert rec is not None and rec.owner == "" and rec.processor == "intake"  # released
        print(f"refused runs: {refused}")
    finally:
        store.close()


def test_a_holder_on_another_host_keeps_the_intake_out_until_its_lock_is_cleared(tmp_path: Path):
    a, _ = _hosts(tmp_path)
    cfg = config(tmp_path)
    write_file(a, "web", T0, [{"event_type": "pv", "url": "/x"}])
    store = open_offset_store(a.offsets_url)
    try:
        locks.acquire(store, locks.INTAKE_BATCH, OTHER_HOST, processor="intake", note="a processor elsewhere")
        intake = load_intake(cfg, secrets=False)
        with pytest.raises(TopicLockedError, match=OTHER_HOST) as exc:
            process_ready(a, intake)
        assert "tidemark offsets unlock intake:batch" in str(exc.value)
        assert locks.holder(a, locks.INTAKE_BATCH) == OTHER_HOST
        assert len(list(ready_dir(a.events_dir()).glob("*.log"))) == 1  # untouched
        assert not Path(a.table_path("stage.events_pv")).exists()
        cleared = subprocess.run([sys.executable, "-m", "platform_assets.cli", "--home", str(a.home), "--warehouse",
                                  a.warehouse, "--offsets-url", a.offsets_url, "offsets", "unlock", locks.INTAKE_BATCH],
                                 cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
        assert cleared.returncode == 0 and f"was held by {OTHER_HOST}" in cleared.stdout, cleared.stderr[-2000:]
        assert locks.holder(a, locks.INTAKE_BATCH) is None
        (done,) = process_ready(a, intake)
        assert done.written == 1 and _urls(a, "stage.events_pv") == ["/x"]
        # a holder of this host whose process is gone is taken over at once (no lease to wait out)
        gone = subprocess.Popen(["true"])
        gone.wait()
        dead = make_owner().replace(f":{os.getpid()}@", f":{gone.pid}@", 1)
        assert dead != make_owner()
        locks.acquire(store, locks.INTAKE_BATCH, dead, processor="intake", note="killed")
        assert locks.holder(a, locks.INTAKE_BATCH) is None
        write_file(a, "web", T0 + dt.timedelta(seconds=5), [{"event_type": "pv", "url": "/y"}])
        assert [r.written for r in process_ready(a, intake)] == [1]
    finally:
        store.close()


def test_a_stream_loop_holds_its_destinations_record(tmp_path: Path):
    a, _ = _hosts(tmp_path)
    cfg = tmp_path / "stream.yaml"
    cfg.write_text("tokens:\n  - {id: web, kind: browser, secret_env: T_WEB}\ndestinations:\n"
                   "  - id: live\n    mode: stream\n    table_name_template: live_events\n")
    intake = load_intake(cfg, secrets=False)
    store = open_offset_store(a.offsets_url)
    try:
        key = locks.intake_stream_key("live")
        locks.acquire(store, key, OTHER_HOST, processor="intake", note="a stream loop elsewhere")
        with pytest.raises(TopicLockedError, match="intake:stream:live"):
            list(StreamLoop(a, intake).run(once=True))
        store.unlock(key, who="test")
        write_file(a, "web", T0, [{"event_type": "pv", "url": "/s"}])
        assert sum(mb.result.written for mb in StreamLoop(a, intake).run(once=True)) == 1
        assert store.get(key).owner == ""  # type: ignore[union-attr]
    finally:
        store.close()


def _ids(s: Settings, table: str) -> list[int]:
    return DeltaTable(s.table_path(table)).to_pyarrow_table().column("id").to_pylist()


def test_units_are_planned_in_the_record_and_row_ids_stay_unique_across_hosts(tmp_path: Path):
    """Each unit is planned and committed in ``intake:batch``, and its ordinal (the high 32 bits of
    its row ids) comes from the store's one counter: two hosts' folders never give the same one."""
    a, b = _hosts(tmp_path)
    intake = load_intake(config(tmp_path), secrets=False)
    for k in range(2):
        for s in (a, b):
            at = T0 + dt.timedelta(seconds=10 * k + (100 if s is b else 0))  # file names differ (docs/limits.md)
            write_file(s, "web", at, [{"event_type": "pv", "url": f"/{s.home.name}/{k}/{j}"} for j in range(3)])
            assert [r.written for r in process_ready(s, intake)] == [3]
    ids = _ids(a, "stage.events_pv")
    assert len(ids) == 12 and len(set(ids)) == 12, ids
    assert sorted({i >> 32 for i in ids}) == [1, 2, 3, 4]  # one ordinal per unit, in the order they ran
    store = open_offset_store(a.offsets_url)
    try:
        rec = store.get(locks.INTAKE_BATCH)
        assert rec is not None and not rec.pending and rec.seq == 4 and rec.rows == 3, rec
        assert store.get(locks.INTAKE_ORDINALS).seq == 4  # type: ignore[union-attr]
        actions = [(e.action, e.note) for e in reversed(store.history(locks.INTAKE_BATCH, limit=50))
                   if e.action in ("plan", "commit")]
        assert [x for x, _ in actions] == ["plan", "commit"] * 4, actions
        assert "3 rows" in actions[-1][1]
    finally:
        store.close()


def _a_dies_with_a_unit_planned(tmp_path: Path) -> tuple[Settings, Settings, Path]:
    """Three events of host A and two of host B wait; A's processor dies once it planned its unit."""
    a, b = _hosts(tmp_path)
    cfg = config(tmp_path)
    write_file(a, "web", T0, [{"event_type": "pv", "url": f"/a/{j}"} for j in range(3)])
    write_file(b, "web", T0 + dt.timedelta(seconds=1), [{"event_type": "pv", "url": f"/b/{j}"} for j in range(2)])
    crashed = _cli(a, cfg, env={"TIDEMARK_CRASH_AT": "events_planned"})
    crashed.communicate(timeout=120)
    assert crashed.returncode == -9, "A was to die at events_planned"
    return a, b, cfg


def test_a_unit_planned_before_a_crash_lands_after_another_host_took_the_lock_over(tmp_path: Path):
    """Host A plans a unit (each table's next Delta transaction version) and dies before writing.
    Host B takes the lock over and lands its own files in the same table: its units take those very
    transaction versions. When A runs again, its plan is stale (the record planned B's units
    since), so it plans the unit anew from what the table holds: nothing of A is skipped as
    "landed before the crash", nothing lands twice."""
    a, b, cfg = _a_dies_with_a_unit_planned(tmp_path)
    status = next(ready_dir(a.events_dir()).glob("*.log.status"))
    planned = json.loads(status.read_text())["destinations"]["main"]["tables"]["stage.events_pv"]
    assert planned["state"] == "planned"
    intake = load_intake(cfg, secrets=False)
    assert [r.written for r in process_ready(b, intake)] == [2]  # A is dead: B takes its lock over at once
    version = DeltaTable(b.table_path("stage.events_pv")).transaction_version("tidemark-intake:main:stage.events_pv")
    assert version == planned["version"]  # B's unit took the version A's plan names
    (again,) = process_ready(a, intake)
    assert again.written == 3
    assert _urls(a, "stage.events_pv") == ["/a/0", "/a/1", "/a/2", "/b/0", "/b/1"]
    ids = _ids(a, "stage.events_pv")
    assert len(set(ids)) == len(ids) == 5
    store = open_offset_store(a.offsets_url)
    try:
        notes = [e.note for e in store.history(locks.INTAKE_BATCH, limit=50) if e.action == "commit"]
        assert any("superseded by" in n for n in notes), notes
        assert not store.get(locks.INTAKE_BATCH).pending  # type: ignore[union-attr]
    finally:
        store.close()


def test_a_micro_batch_planned_before_a_crash_lands_after_another_hosts_stream_loop_took_over(tmp_path: Path):
    """The stream loop's units go through the same record (``intake:stream:<dest>``): host A's loop
    dies with a micro-batch planned; host B's loop for the same destination takes over and lands
    its own events in the same table; A's micro-batch still lands, once, when A runs again. Each
    loop names its micro-batches with its folder's tag, so B's micro-batch 1 is not taken for A's."""
    a, b = _hosts(tmp_path)
    cfg = tmp_path / "stream.yaml"
    cfg.write_text("tokens:\n  - {id: web, kind: browser, secret_env: T_WEB}\ndestinations:\n"
                   "  - id: live\n    mode: stream\n    table_name_template: live_events\n")
    intake = load_intake(cfg, secrets=False)
    write_file(a, "web", T0, [{"event_type": "pv", "url": f"/a/{j}"} for j in range(3)])
    write_file(b, "web", T0 + dt.timedelta(seconds=1), [{"event_type": "pv", "url": f"/b/{j}"} for j in range(2)])
    cmd = [sys.executable, "-m", "platform_assets.cli", "--home", str(a.home), "--warehouse", a.warehouse,
           "--offsets-url", a.offsets_url, "events", "stream", "--once", "--config", str(cfg)]
    crashed = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "TIDEMARK_CRASH_AT": "events_planned"},
                             capture_output=True, text=True, timeout=120)
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    assert sum(mb.result.written for mb in StreamLoop(b, intake).run(once=True)) == 2
    assert sum(mb.result.written for mb in StreamLoop(a, intake).run(once=True)) == 3
    assert _urls(a, "stage.live_events") == ["/a/0", "/a/1", "/a/2", "/b/0", "/b/1"]
    ids = _ids(a, "stage.live_events")
    assert len(set(ids)) == len(ids) == 5


def test_a_store_restored_from_a_backup_does_not_let_a_taken_version_pass_for_landed(tmp_path: Path):
    """Host A plans a unit and dies; the offset store is backed up; host B takes the lock over and
    lands its own unit with the transaction version A's plan names; the store is restored from
    the backup, so the record again shows A's unit pending and knows nothing of B's. A resumes its
    plan as it stands, and the table's version alone would say A's unit landed: its commits, which
    name B's file, say it did not."""
    a, b, cfg = _a_dies_with_a_unit_planned(tmp_path)
    db = tmp_path / "offsets.db"
    backup = tmp_path / "offsets.backup.db"
    with sqlite3.connect(db) as src, sqlite3.connect(backup) as dst:
        src.backup(dst)
    intake = load_intake(cfg, secrets=False)
    assert [r.written for r in process_ready(b, intake)] == [2]
    with sqlite3.connect(backup) as src, sqlite3.connect(db) as dst:
        src.backup(dst)
    (again,) = process_ready(a, intake)
    assert again.written == 3
    assert _urls(a, "stage.events_pv") == ["/a/0", "/a/1", "/a/2", "/b/0", "/b/1"]
    ids = _ids(a, "stage.events_pv")
    assert len(set(ids)) == len(ids) == 5


def _a_dies_after_writing_then_others_commit(tmp_path: Path, commits: int) -> tuple[Settings, Path, str]:
    """A's processor dies right after ``stage.events_pv`` took its unit (before its status said so);
    then another writer makes ``commits`` commits to that table (a row of ``/other/<i>`` each)."""
    from deltalake import write_deltalake

    a, _ = _hosts(tmp_path)
    cfg = config(tmp_path)
    write_file(a, "web", T0, [{"event_type": "pv", "url": f"/a/{j}"} for j in range(3)])
    crashed = _cli(a, cfg, env={"TIDEMARK_CRASH_AT": "events_written"})
    crashed.communicate(timeout=120)
    assert crashed.returncode == -9
    path = a.table_path("stage.events_pv")
    one = DeltaTable(path).to_pyarrow_table().slice(0, 1)
    for i in range(commits):
        write_deltalake(path, one.set_column(one.column_names.index("url"), "url", pa.array([f"/other/{i}"])), mode="append")
    return a, cfg, path


def test_a_unit_that_landed_before_a_crash_is_found_however_many_commits_came_since(tmp_path: Path):
    """A dies right after a table took its unit, before its status said so; then more than 200
    other commits reach that table (another writer). Its retry finds its own commit among every
    commit since the plan, not only among the newest ones, and does not land it twice."""
    a, cfg, _ = _a_dies_after_writing_then_others_commit(tmp_path, 205)
    process_ready(a, load_intake(cfg, secrets=False))
    assert [u for u in _urls(a, "stage.events_pv") if u.startswith("/a/")] == ["/a/0", "/a/1", "/a/2"]


def test_a_taken_version_whose_commits_the_log_no_longer_holds_stops_the_unit_saying_what_to_do(tmp_path: Path):
    """A dies right after a table took its unit; later commits follow, a checkpoint is written and
    the log's older commit files are removed (log retention). The retry cannot tell from the log
    whether the taken version is its unit's: it stops, writes nothing, and says what to check."""
    from lineage.core.errors import ProcessingError

    a, cfg, path = _a_dies_after_writing_then_others_commit(tmp_path, 3)
    DeltaTable(path).create_checkpoint()
    for v in range(3):  # what log retention removes once a checkpoint covers them
        (Path(path) / "_delta_log" / f"{v:020d}.json").unlink()
    before = _urls(a, "stage.events_pv")
    with pytest.raises(ProcessingError, match="no longer all in its Delta log") as exc:
        process_ready(a, load_intake(cfg, secrets=False))
    assert "incoming.tok=web." in str(exc.value) and "remove the unit's status file" in str(exc.value)
    assert _urls(a, "stage.events_pv") == before  # nothing written


STREAM = ("tokens:\n  - {id: web, kind: browser, secret_env: T_WEB}\ndestinations:\n"
          "  - id: live\n    mode: stream\n    table_name_template: live_{{ event_type }}\n")


def _stream(s: Settings, cfg: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    p = _events(s, cfg, "stream", "--once", *args, env=env)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.parametrize("point", ["stream_planned", "events_written", "stream_landed"])
def test_stream_positions_are_records_of_the_store_one_per_events_folder(tmp_path: Path, point: str):
    """Host A's stream loop dies mid micro-batch; host B's loop takes the destination's lock over and
    streams its own folder; A resumes the very ranges its record planned. Each folder's positions
    are a record of the store (no file beside the log), and every event lands once."""
    a, b = _hosts(tmp_path)
    cfg = tmp_path / "stream.yaml"
    cfg.write_text(STREAM)
    expected = _files_of_both((a, b), 2, 5)
    died = _stream(a, cfg, "--max-events", "3", env={"TIDEMARK_CRASH_AT": point})
    assert died.returncode == -9, died.stderr[-2000:]
    store = open_offset_store(a.offsets_url)
    try:
        key_a = locks.intake_queue_key("live", folder_tag(a.events_dir()))
        planned = store.get(key_a)
        assert planned is not None and planned.pending and planned.seq == 1, planned
        assert planned.inputs_next is not None and sorted(planned.inputs_next.values()) != []
        assert not list((a.events_dir() / "queue.dst=live").glob("*.json"))  # no positions in files
        out = _stream(b, cfg)
        assert out.returncode == 0, out.stderr[-2000:]
        out = _stream(a, cfg, "--max-events", "3")
        assert out.returncode == 0, out.stderr[-2000:]
        assert sorted(expected) == _urls(a, "stage.live_pv")
        for s in (a, b):
            rec = store.get(locks.intake_queue_key("live", folder_tag(s.events_dir())))
            assert rec is not None and not rec.pending and rec.owner == "", rec
            # an archived file is forgotten at the next commit: only the last micro-batch's files are still named
            named = {k.split("#")[0] for k in rec.inputs}
            assert 1 <= len(named) <= 2 and rec.inputs.keys() >= {f"{n}#done" for n in named}, rec.inputs
            assert not list(ready_dir(s.events_dir()).glob("*.log"))
        plans = [e.note for e in store.history(key_a, limit=50) if e.action == "plan"]
        assert len(plans) == 4, plans  # 10 lines in micro-batches of at most 3
    finally:
        store.close()


def test_a_queue_kept_in_files_is_adopted_into_its_record_once(tmp_path: Path):
    """A stream queue from before its positions were records (``state.json``, and ``pending.json``
    naming the micro-batch under way) goes on from exactly there: nothing read twice or skipped."""
    a, _ = _hosts(tmp_path)
    cfg = tmp_path / "stream.yaml"
    cfg.write_text(STREAM)
    lines = [{"event_type": "pv", "url": f"/{i}"} for i in range(6)]
    path = write_file(a, "web", T0, lines)
    second = write_file(a, "web", T0 + dt.timedelta(seconds=1), [{"event_type": "pv", "url": "/next"}])
    body = path.read_bytes().splitlines(keepends=True)
    two, four = len(b"".join(body[:2])), len(b"".join(body[:4]))
    folder = a.events_dir() / "queue.dst=live"
    folder.mkdir(parents=True)
    # two lines were consumed (micro-batch 1); lines 3-4 are planned as micro-batch 2 and did not land
    (folder / "state.json").write_text(json.dumps({"seq": 1, "offsets": {path.name: [two, 2]}, "done": []}))
    (folder / "pending.json").write_text(json.dumps({"seq": 2, "unit": f"stream.dst=live.{2:012d}.{folder_tag(a.events_dir())}", "ranges": [[path.name, two, four, 3, 2]],
                                                    "done": []}))
    died = _stream(a, cfg, env={"TIDEMARK_CRASH_AT": "stream_adopting"})  # between the plan and the commit
    assert died.returncode == -9 and (folder / "state.json").exists(), died.stderr[-2000:]
    out = _stream(a, cfg)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _urls(a, "stage.live_pv") == sorted(["/2", "/3", "/4", "/5", "/next"])
    assert not (folder / "state.json").exists() and not (folder / "pending.json").exists()
    store = open_offset_store(a.offsets_url)
    try:
        key = locks.intake_queue_key("live", folder_tag(a.events_dir()))
        history = [(e.action, e.note) for e in reversed(store.history(key, limit=50))]
        assert [a for a, n in history if "adopted" in n] == ["commit"], history  # one adoption, finished after the crash
        assert ("commit", "micro-batch 2: 2 lines of 1 files") in history, history  # the planned range, as planned
        rec = store.get(key)
        assert rec is not None and rec.seq >= 3 and not rec.pending and not second.exists()
        assert rec.inputs[path.name] == len(b"".join(body)) and rec.inputs[second.name + "#done"] == 1
    finally:
        store.close()


def test_a_pending_micro_batch_an_older_tidemark_named_otherwise_is_refused_untouched(tmp_path: Path):
    a, _ = _hosts(tmp_path)
    cfg = tmp_path / "stream.yaml"
    cfg.write_text(STREAM)
    path = write_file(a, "web", T0, [{"event_type": "pv", "url": "/0"}])
    folder = a.events_dir() / "queue.dst=live"
    folder.mkdir(parents=True)
    pending = {"seq": 1, "unit": "stream.dst=live.000000000001", "ranges": [[path.name, 0, path.stat().st_size, 1, 1]],
               "done": []}
    (folder / "pending.json").write_text(json.dumps(pending))
    out = _stream(a, cfg)
    assert out.returncode != 0 and "planned by an older Tidemark as unit 'stream.dst=live.000000000001'" in out.stderr, out.stderr
    assert json.loads((folder / "pending.json").read_text()) == pending and not Path(a.table_path("stage.live_pv")).exists()


def test_the_folder_tag_is_kept_in_the_events_folder_and_survives_a_new_host_name(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch):
    events = tmp_path / "events"
    tag = folder_tag(events)
    assert (events / ".folder_tag").read_text() == tag and len(tag) == 8
    monkeypatch.setenv("TIDEMARK_OWNER_HOST", "renamed-host")
    assert folder_tag(events) == tag
    assert folder_tag(tmp_path / "other") != tag
    # two hosts of one name and one home path (containers) still get two tags: drawn at random
    (events / ".folder_tag").unlink()
    assert folder_tag(events) != tag
    # a folder whose queues still keep files of an older Tidemark draws it as that version did
    legacy = tmp_path / "legacy"
    (legacy / "queue.dst=live").mkdir(parents=True)
    (legacy / "queue.dst=live" / "state.json").write_text('{"seq": 1, "offsets": {}, "done": []}')
    expected = hashlib.sha1(f"renamed-host:{legacy.resolve()}".encode()).hexdigest()[:8]
    assert folder_tag(legacy) == expected
    (events / ".folder_tag").write_text("")  # lost by hand: refused, naming the file and what to write back
    with pytest.raises(OffsetError, match=r"\.folder_tag: '' is not an events folder's tag"):
        folder_tag(events)


def _open_file(s: Settings, urls: list[str]) -> Path:
    """A file the collector is still writing (in ``incoming/``, never done, never archived), with
    a page view per url appended."""
    from resources.intake.incoming_log import file_name, incoming_dir

    folder = incoming_dir(s.events_dir())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name("web", T0)
    with path.open("ab") as fh:
        for u in urls:
            fh.write(json.dumps({"event_type": "pv", "url": u, "api_key": "web",
                                 "_timestamp": "2026-01-01T00:00:00.000000Z"}).encode() + b"\n")
    return path


def _copy_db(src: Path, dst: Path) -> None:
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)


def _streamed_past_a_backup(tmp_path: Path, lines: int, *, closed: bool = False,
                            crash_at: str | None = None) -> tuple[Settings, Path, Path, Path]:
    """``lines`` page views streamed in micro-batches of 2, the store backed up after the first:
    host A, the config, the store's file and its backup. ``closed``: the file is closed (in
    ``ready/``), so the micro-batch that reads its end archives it; ``crash_at``: the second run
    dies there (its first micro-batch after the backup)."""
    a, _ = _hosts(tmp_path)
    cfg = tmp_path / "stream.yaml"
    cfg.write_text(STREAM)
    urls = [f"/{i}" for i in range(lines)]
    if closed:
        write_file(a, "web", T0, [{"event_type": "pv", "url": u} for u in urls])
    else:
        _open_file(a, urls)
    died = _stream(a, cfg, "--max-events", "2", env={"TIDEMARK_CRASH_AT": "stream_committed"})
    assert died.returncode == -9, died.stderr[-2000:]
    db, backup = tmp_path / "offsets.db", tmp_path / "offsets.backup.db"
    _copy_db(db, backup)
    out = _stream(a, cfg, "--max-events", "2", env={"TIDEMARK_CRASH_AT": crash_at} if crash_at else None)
    assert out.returncode == (-9 if crash_at else 0), out.stderr[-2000:]
    if not crash_at:
        assert _urls(a, "stage.live_pv") == sorted(urls)
        assert not closed or not list(ready_dir(a.events_dir()).glob("*.log"))  # read to its end: archived
    return a, cfg, db, backup


@pytest.mark.parametrize(("store_is", "closed", "crash_at", "newest"), [
    ("restored", False, None, 3),  # the collector still writes the file
    ("restored", True, None, 3),  # the newest micro-batch read the file to its end and archived it
    ("lost", True, None, 3),  # a new, empty store
    ("restored", True, "stream_landed", 2),  # the newest micro-batch landed, its commit did not
])
def test_stream_positions_behind_the_log_are_caught_up_from_it(tmp_path: Path, store_is: str, closed: bool,
                                                               crash_at: str | None, newest: int):
    """The store is backed up after the first micro-batch; more land; new events arrive; then the
    store is restored from the backup (or lost). The record would plan its next micro-batch from
    the old positions under a number the tables already hold: the loop takes the positions from
    the newest micro-batch its tables hold instead (and finishes it when it did not commit), and
    every event lands once."""
    a, cfg, db, backup = _streamed_past_a_backup(tmp_path, 6, closed=closed, crash_at=crash_at)
    if closed:
        write_file(a, "web", T0 + dt.timedelta(seconds=5), [{"event_type": "pv", "url": u} for u in ("/6", "/7")])
    else:
        _open_file(a, ["/6", "/7"])
    if store_is == "restored":
        _copy_db(backup, db)
    else:
        for f in tmp_path.glob("offsets.db*"):  # with its WAL files
            f.unlink()
    out = _stream(a, cfg, "--max-events", "100")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "the offset store was behind the Delta log" in out.stderr, out.stderr
    assert _urls(a, "stage.live_pv") == sorted(f"/{i}" for i in range(8))
    assert not closed or not list(ready_dir(a.events_dir()).glob("*.log"))
    store = open_offset_store(a.offsets_url)
    try:
        key = locks.intake_queue_key("live", folder_tag(a.events_dir()))
        actions = [(e.action, e.note) for e in reversed(store.history(key, limit=50))]
        found = f"micro-batch {newest} is in stage.live_pv"
        assert any(act == "recover" and found in note for act, note in actions) or crash_at, actions
        assert not crash_at or any(act == "plan" for act, _ in actions[-3:]), actions  # planned again, as it was
    finally:
        store.close()


def test_a_record_restored_under_a_running_loop_stops_it_before_it_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Were the record behind the log while the loop runs (restored under it), the micro-batch
    it plans would take a number a table holds under another plan: the unit stops, writes nothing
    and says why; the next start catches the record up (above)."""
    from lineage.core.errors import ProcessingError

    a, cfg, db, backup = _streamed_past_a_backup(tmp_path, 4)
    _copy_db(backup, db)
    _open_file(a, ["/4"])
    version = DeltaTable(a.table_path("stage.live_pv")).version()
    monkeypatch.setattr(StreamLoop, "_recover", lambda self, dest: None)  # as if restored after the start
    loop = StreamLoop(a, load_intake(cfg, secrets=False), max_events=100)
    with pytest.raises(ProcessingError, match="the offset store is behind the Delta log"):
        list(loop.run(once=True))
    assert DeltaTable(a.table_path("stage.live_pv")).version() == version
    assert _urls(a, "stage.live_pv") == sorted(f"/{i}" for i in range(4))
