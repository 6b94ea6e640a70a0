"""The batch event processor on real files and real Delta tables: table patching across batches,
failed events and replay, exactly once across SIGKILL at every point, and a lost status file."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from deltalake import DeltaTable

from lineage.intake.config import load_intake
from platform_assets.intake.units import process_ready, replay, status
from resources.core.settings import Settings
from resources.intake import event_store as store
from resources.intake.incoming_log import file_name, ready_dir
from resources.storage.meta_tables import read_etl_log

ROOT = Path(__file__).resolve().parents[2]
T0 = dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC)

CONFIG = """\
tokens:
  - {id: web, kind: browser, secret_env: T_WEB}
  - {id: srv, kind: server, secret_env: T_SRV}
destinations:
  - id: main
    table_name_template: "events_{{ event_type }}"
    unmapped: UNMAPPED
  - id: audit
    only_keys: [srv]
    table_name_template: "audit"
"""


def config(tmp_path: Path, template: str = "events_{{ event_type }}", unmapped: str = "column") -> Path:
    p = tmp_path / "intake.yaml"
    p.write_text(CONFIG.replace("events_{{ event_type }}", template).replace("UNMAPPED", unmapped))
    return p


def write_file(settings: Settings, token: str, start: dt.datetime, events: list[dict[str, Any]]) -> Path:
    folder = ready_dir(settings.events_dir())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file_name(token, start)
    for i, e in enumerate(events):
        e.setdefault("api_key", token)
        e.setdefault("_timestamp", (start + dt.timedelta(milliseconds=i)).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
    path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    return path


def rows(settings: Settings, table: str) -> list[dict[str, Any]]:
    return DeltaTable(settings.table_path(table)).to_pyarrow_table().to_pylist()


def process(settings: Settings, cfg: Path) -> list:
    return process_ready(settings, load_intake(cfg, secrets=False), until_empty=True)


def test_promotion_across_batches_and_schema_evolution(settings: Settings, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TIDEMARK_EVENT_UNIT_BYTES", "1")  # a unit per file: two batches
    cfg = config(tmp_path)
    write_file(settings, "web", T0, [{"event_type": "pv", "n": 1, "u": {"id": 7}}, {"event_type": "pv", "n": 2}])
    write_file(settings, "web", T0 + dt.timedelta(minutes=5),
               [{"event_type": "pv", "n": "three", "new": True}, {"event_type": "pv", "n": 4.0, "u": {"id": "x"}}])
    done = process(settings, cfg)
    assert [r.written for r in done] == [2, 2]
    got = sorted(rows(settings, "stage.events_pv"), key=lambda r: r["id"])
    assert [r["n"] for r in got] == [1, 2, None, 4]  # bigint since the first file; 4.0 fits
    assert got[2]["new"] is True and got[0]["new"] is None  # a column added by the second file
    assert orjson.loads(got[2]["_unmapped_data"]) == {"n": {"value": "three", "reason": "a string value (three) does not fit a bigint column"}}
    assert orjson.loads(got[3]["_unmapped_data"])["u_id"]["value"] == "x"
    assert [r["id"] >> 32 for r in got] == [1, 1, 2, 2] and [r["id"] & 0xFFFFFFFF for r in got] == [1, 2, 1, 2]
    assert all(r["pos"] == r["_timestamp"] for r in got)
    log = {r["run_id"]: r for r in read_etl_log(settings, "events:main:stage.events_pv")}
    second = log[file_name("web", T0 + dt.timedelta(minutes=5))]
    assert dict(second["changes"])["unmapped_values"] == 2 and dict(second["changes"])["columns_added"] == 2
    assert second["processor"] == "events" and second["rows"] == 2
    assert len(list((settings.events_dir() / "archive" / "2026-03-01").glob("*.log.gz"))) == 2
    assert process(settings, cfg) == []  # nothing left, nothing written twice
    assert len(rows(settings, "stage.events_pv")) == 4


def test_pos_never_goes_back_across_overlapping_files_of_two_tokens(settings: Settings, tmp_path: Path):
    """Files are processed in order of their start; a file of another token that started later
    may hold events received earlier than the last row written: their pos is raised."""
    cfg = config(tmp_path, template="all")
    write_file(settings, "web", T0, [{"k": i, "_timestamp": f"2026-03-01T12:00:0{i * 2}Z"} for i in range(4)])
    write_file(settings, "srv", T0 + dt.timedelta(seconds=1), [{"k": 10 + i, "_timestamp": f"2026-03-01T12:00:0{1 + i}Z"}
                                                                for i in range(3)])
    process(settings, cfg)
    got = sorted(rows(settings, "stage.all"), key=lambda r: r["id"])
    assert [(r["pos"], r["id"]) for r in got] == sorted((r["pos"], r["id"]) for r in got)
    assert got[4]["pos"] == T0 + dt.timedelta(seconds=6) and got[4]["_timestamp"] == T0 + dt.timedelta(seconds=1)
    assert len(rows(settings, "stage.audit")) == 3  # srv events also go to the audit destination (only_keys)


def test_unmapped_fail_sends_the_event_to_failed_events(settings: Settings, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TIDEMARK_EVENT_UNIT_BYTES", "1")  # a unit per file: "bad" meets a bigint column
    cfg = config(tmp_path, unmapped="fail")
    write_file(settings, "web", T0, [{"event_type": "pv", "n": 1}])
    write_file(settings, "web", T0 + dt.timedelta(minutes=1), [{"event_type": "pv", "n": "bad"}, {"event_type": "pv", "n": 3}])
    process(settings, cfg)
    assert sorted(r["n"] for r in rows(settings, "stage.events_pv")) == [1, 3]
    failed = store.read_failed_events(settings.table_path(store.FAILED_EVENTS))
    assert len(failed) == 1 and failed[0]["table"] == "stage.events_pv" and "n: a string value" in failed[0]["error"]
    assert orjson.loads(failed[0]["event"])["n"] == "bad"


def test_template_failure_goes_to_failed_events_and_replays_exactly_once_after_the_fix(settings: Settings, tmp_path: Path):
    cfg = config(tmp_path)
    write_file(settings, "web", T0, [{"event_type": "pv", "i": 1}, {"i": 2}, {"i": 3, "event_type": "pv"}, {"i": 4}])
    process(settings, cfg)
    assert sorted(r["i"] for r in rows(settings, "stage.events_pv")) == [1, 3]
    flog = store.failed_log(settings.events_dir(), "main")
    lines = [orjson.loads(x) for x in flog.read_bytes().splitlines()]
    assert [x["event"]["i"] for x in lines] == [2, 4] and "'event_type' is undefined" in lines[0]["error"]
    assert status(settings, load_intake(cfg, secrets=False))["destinations"]["main"]["failed_events"] == 2
    # replay before the fix: they fail again and stay failed, once each
    replay(settings, load_intake(cfg, secrets=False), "main")
    assert len(store.read_failed_events(settings.table_path(store.FAILED_EVENTS), "main")) == 2
    fixed = load_intake(config(tmp_path, template="events_{{ event_type | default('other') }}"), secrets=False)
    # a replay killed after its first commit (failed set changed, one table landed), then resumed from its plan
    crashed = run_cli(settings, tmp_path / "intake.yaml", "replay", "--destination", "main",
                      env={"TIDEMARK_CRASH_AT": "events_written"})
    assert crashed.returncode == -9, crashed.stderr
    assert status(settings, fixed)["destinations"]["main"]["replay_pending"] is True
    done = replay(settings, fixed, "main")
    assert done["main"].written == 2 and done["main"].failed == 0
    assert sorted(r["i"] for r in rows(settings, "stage.events_other")) == [2, 4]
    assert store.read_failed_events(settings.table_path(store.FAILED_EVENTS)) == [] and flog.read_bytes() == b""
    assert replay(settings, fixed, "main") == {}  # nothing left: a second replay adds nothing
    assert sorted(r["i"] for r in rows(settings, "stage.events_other")) == [2, 4]


def run_cli(settings: Settings, cfg: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "platform_assets.cli", "--home", str(settings.home), "events", *args[:1],
           "--config", str(cfg), *args[1:]]
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          capture_output=True, text=True, timeout=120)


POINTS = ["events_planned", "events_failed_file", "events_failed_written", "events_written", "events_logged",
          "events_archived"]


@pytest.mark.slow
def test_sigkill_at_every_point_no_event_lost_or_doubled(settings: Settings, tmp_path: Path):
    cfg = config(tmp_path)
    expected: dict[str, set[str]] = {"main": set(), "audit": set()}
    for f in range(4):
        evs = []
        for i in range(30):
            eid = f"f{f}-e{i}"
            ev: dict[str, Any] = {"eid": eid, "event_type": ["pv", "cart"][i % 2], "v": i if f < 2 else f"s{i}"}
            if i % 7 == 3:
                del ev["event_type"]  # fails the main destination's template
            evs.append(ev)
            expected["main"].add(eid)
            if f % 2:
                expected["audit"].add(eid)
        write_file(settings, "srv" if f % 2 else "web", T0 + dt.timedelta(minutes=f), evs)
    for point in POINTS:
        out = run_cli(settings, cfg, "process", env={"TIDEMARK_CRASH_AT": point})
        assert out.returncode == -9, (point, out.stdout, out.stderr)
    out = run_cli(settings, cfg, "process", "--until-empty")
    assert out.returncode == 0, out.stderr
    landed: dict[str, list[str]] = {"main": [], "audit": []}
    for table in ("stage.events_pv", "stage.events_cart"):
        landed["main"] += [r["eid"] for r in rows(settings, table)]
    landed["audit"] += [r["eid"] for r in rows(settings, "stage.audit")]
    failed = store.read_failed_events(settings.table_path(store.FAILED_EVENTS))
    landed["main"] += [orjson.loads(r["event"])["eid"] for r in failed if r["destination"] == "main"]
    file_lines = store.failed_log(settings.events_dir(), "main").read_bytes().splitlines()
    for dest in ("main", "audit"):
        assert sorted(landed[dest]) == sorted(expected[dest]), dest  # every event once: in a table or failed
    assert sorted(orjson.loads(x)["event"]["eid"] for x in file_lines) == sorted(
        orjson.loads(r["event"])["eid"] for r in failed)
    assert list(ready_dir(settings.events_dir()).iterdir()) == []


def test_a_lost_status_file_the_delta_log_decides(settings: Settings, tmp_path: Path):
    cfg = config(tmp_path, template="all")
    path = write_file(settings, "web", T0, [{"k": 1}, {"k": 2}])
    out = run_cli(settings, cfg, "process", env={"TIDEMARK_CRASH_AT": "events_written"})
    assert out.returncode == -9 and len(rows(settings, "stage.all")) == 2
    store.status_path(path).unlink()  # the processor's own record is gone; the table's commit says it landed
    process(settings, cfg)
    assert sorted(r["k"] for r in rows(settings, "stage.all")) == [1, 2]


@pytest.mark.slow
@pytest.mark.spark
def test_stage_table_is_the_source_of_a_step_topic(settings: Settings, tmp_path: Path, cli_spark):
    """``tidemark run`` (a process of its own) reads the stage table block by block as it grows,
    with a column added between the runs; every event reaches the fact table once, none late."""
    from tests.platform_assets.shop import tidemark

    lin = tmp_path / "lineage"
    lin.mkdir()
    (tmp_path / "pv.sql").write_text("SELECT pos, id, eid, url, _timestamp AS received FROM block")
    (lin / "events.yaml").write_text(
        "sources:\n  - table: stage.events_pv\n"
        "topics:\n  - table: fact.page_views\n    depends_on: [stage.events_pv]\n    maxstep: 7\n"
        "    transforms: [../pv.sql]\n")
    s = settings.with_(lineage=lin)
    cfg = config(tmp_path)
    write_file(s, "web", T0, [{"event_type": "pv", "eid": i, "url": f"/p/{i}"} for i in range(10)])
    process(s, cfg)
    first = tidemark(s, "run", "fact.page_views", "--until-caught-up")
    assert first.returncode == 0, first.stderr
    write_file(s, "web", T0 + dt.timedelta(minutes=5), [{"event_type": "pv", "eid": 10 + i, "url": f"/p/{10 + i}",
                                                         "extra": {"a": 1}} for i in range(5)])
    process(s, cfg)
    second = tidemark(s, "run", "fact.page_views", "--until-caught-up")
    assert second.returncode == 0, second.stderr
    fact = rows(s, "fact.page_views")
    assert sorted(r["eid"] for r in fact) == list(range(15))
    assert all(r["received"].tzinfo is not None for r in fact)
    assert not (s.home / "warehouse" / "etl" / "quarantine").exists()  # no late rows


def test_many_small_files_are_one_unit_and_a_lost_status_regroups_without_doubling(settings: Settings, tmp_path: Path):
    """Ready files are taken in units of many files (one commit per table per unit). A unit
    killed after its first table landed, whose status file is then lost, is planned again with
    a file more: the tables' commits say per file what landed, so no event is doubled or lost."""
    cfg = config(tmp_path)
    expected: dict[str, list[int]] = {"pv": [], "cart": [], "failed": []}
    paths = []
    for f in range(5):
        evs: list[dict[str, Any]] = []
        for i in range(6):
            k = f * 100 + i
            if i == 5:
                evs.append({"k": k})  # no event_type: fails the template
                expected["failed"].append(k)
            else:
                evs.append({"k": k, "event_type": "pv" if i % 2 else "cart"})
                expected["pv" if i % 2 else "cart"].append(k)
        paths.append(write_file(settings, "web", T0 + dt.timedelta(minutes=f), evs))
    extra = paths.pop()
    moved = extra.with_name(extra.name + ".later")
    extra.rename(moved)  # becomes ready after the crash
    out = run_cli(settings, cfg, "process", env={"TIDEMARK_CRASH_AT": "events_written"})
    assert out.returncode == -9, out.stderr
    status_file = store.status_path(paths[0])
    assert orjson.loads(status_file.read_bytes())["files"] == [p.name for p in paths]  # one unit of four files
    landed = [t for t in ("stage.events_pv", "stage.events_cart") if DeltaTable.is_deltatable(settings.table_path(t))]
    assert len(landed) == 1  # killed after its first table's commit
    status_file.unlink()  # the processor's record of the unit is lost
    moved.rename(extra)
    done = process(settings, cfg)
    assert len(done) == 1 and done[0].files == 5
    for t in ("pv", "cart"):
        got = rows(settings, f"stage.events_{t}")
        assert sorted(r["k"] for r in got) == sorted(expected[t]), t
        assert len({r["id"] for r in got}) == len(got)
    failed = store.read_failed_events(settings.table_path(store.FAILED_EVENTS))
    assert sorted(orjson.loads(r["event"])["k"] for r in failed) == expected["failed"]
    assert {(r["file"], r["line"]) for r in failed} == {(p.name, 6) for p in [*paths, extra]}
    assert {r["failure_id"] for r in failed} == {f"{p.name}:6:main" for p in [*paths, extra]}
    assert list(ready_dir(settings.events_dir()).iterdir()) == []
    log = read_etl_log(settings, "events:main:stage.events_pv")
    assert sum(r["rows"] for r in log) == len(expected["pv"])


def test_units_follow_the_byte_budget(settings: Settings, tmp_path: Path, monkeypatch):
    cfg = config(tmp_path, template="all")
    for f in range(7):
        write_file(settings, "web", T0 + dt.timedelta(minutes=f), [{"k": f, "pad": "x" * 900}])
    size = next(iter(ready_dir(settings.events_dir()).iterdir())).stat().st_size
    monkeypatch.setenv("TIDEMARK_EVENT_UNIT_BYTES", str(3 * size))
    done = process(settings, cfg)
    assert [r.files for r in done] == [3, 3, 1]
    assert sorted(r["k"] for r in rows(settings, "stage.all")) == list(range(7))
    assert len(DeltaTable(settings.table_path("stage.all")).history()) == 3  # a commit per unit (the first creates it)


def test_collided_and_unmapped_values_are_counted_in_the_log_status_and_cli(settings: Settings, tmp_path: Path):
    cfg = config(tmp_path)
    write_file(settings, "web", T0, [{"event_type": "pv", "a.b": 1, "a_b": 2, "A-B": 3, "n": 5}])
    write_file(settings, "web", T0 + dt.timedelta(minutes=1), [{"event_type": "pv", "n": "x", "u.v": 1, "u_v": 2}])
    out = run_cli(settings, cfg, "process", env={"TIDEMARK_EVENT_UNIT_BYTES": "1"})  # a unit per file
    assert out.returncode == 0, out.stderr
    assert "2 collided values" in out.stdout and "1 unmapped values, 1 collided values" in out.stdout, out.stdout
    got = rows(settings, "stage.events_pv")
    unmapped = [orjson.loads(r["_unmapped_data"]) for r in got]
    assert {k for u in unmapped for k in u} == {"/a.b", "/A-B", "n", "/u.v"}
    log = read_etl_log(settings, "events:main:stage.events_pv")
    assert sorted((dict(r["changes"])["collided_values"], dict(r["changes"])["unmapped_values"]) for r in log) == [
        (1, 1), (2, 0)]
    assert sorted(r["bad_rows"] for r in log) == [2, 2]
    st = status(settings, load_intake(cfg, secrets=False))["destinations"]["main"]
    assert (st["collided_values"], st["unmapped_values"]) == (3, 1)
