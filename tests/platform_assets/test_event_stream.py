"""Stream mode on real files, a real collector and real Delta tables: events posted are in the
stage table while the loop runs (within 20 s); SIGKILL of the stream loop at every point of a micro-batch loses and
doubles nothing; files read by a batch and a stream destination are archived once both are done."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from lineage.intake.config import load_intake
from platform_assets.core import locks
from platform_assets.intake.record import folder_tag
from platform_assets.intake.stream import StreamLoop
from platform_assets.intake.units import process_ready, status
from resources.core.settings import Settings
from resources.intake import event_queue as q
from resources.intake import event_store as store
from resources.intake.incoming_log import file_name, incoming_dir, ready_dir
from resources.state.offset_sql import open_settings_store
from resources.storage.delta_log import open_table
from tests.platform_assets.test_events import T0, run_cli, write_file
from tests.resources.test_collector import API, WEB, Collector

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """\
collector: {fsync_group_ms: 1}
tokens:
  - {id: web, kind: browser, secret_env: T_WEB}
  - {id: api, kind: server, secret_env: T_API}
destinations:
  - id: live
    mode: stream
    table_name_template: "live_{{ event_type }}"
  - id: main
    mode: batch
    only_keys: [api]
    table_name_template: "batch_all"
"""


def config(tmp_path: Path) -> Path:
    p = tmp_path / "intake.yaml"
    p.write_text(CONFIG)
    return p


def queue_state(settings: Settings, dest: str) -> q.QueueState:
    """A stream destination's read positions in ``settings``' events folder: its queue record."""
    offsets = open_settings_store(settings)
    try:
        rec = offsets.get(locks.intake_queue_key(dest, folder_tag(settings.events_dir())))
    finally:
        offsets.close()
    assert rec is not None
    return q.state_of(rec.seq, rec.inputs)


def table_rows(settings: Settings, table: str) -> list[dict[str, Any]]:
    t = open_table(settings.table_path(table))
    return [] if t is None else t.to_pyarrow_table().to_pylist()


def test_events_posted_reach_the_stage_table_while_the_loop_runs(settings: Settings, tmp_path: Path):
    cfg = config(tmp_path)
    collector = Collector(settings.home, cfg)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    loop = subprocess.Popen([sys.executable, "-m", "platform_assets.cli", "--home", str(settings.home), "events", "stream",
                             "--config", str(cfg), "--interval-ms", "200"], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        time.sleep(1.0)  # the loop is up (its imports) before the clock starts
        t0 = time.monotonic()
        for i in range(5):
            r = httpx.post(f"{collector.url}/api/v1/event?token={WEB}", timeout=10,
                           json=[{"event_type": "pv", "n": i * 10 + k} for k in range(10)])
            assert r.status_code == 200
        seen = 0
        while time.monotonic() - t0 < 20 and seen < 50:
            seen = len(table_rows(settings, "stage.live_pv"))
            time.sleep(0.1)
        latency = time.monotonic() - t0
        # the latency is printed, not asserted: a bound of 5 s failed on the loaded 2-core CI machine (7.5-12.6 s)
        print(f"50 events in stage.live_pv {latency:.1f} s after they were posted")
        assert seen == 50, f"only {seen} of 50 events in stage.live_pv after {latency:.1f} s"
        r = httpx.post(f"{collector.url}/api/v1/s2s/event", headers={"X-Auth-Token": API}, timeout=10,
                       json=[{"event_type": "cart", "n": 100 + k} for k in range(5)])
        assert r.status_code == 200
        assert collector.stop() in (0, -signal.SIGTERM)  # a graceful stop: the open files rotate to ready/
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(table_rows(settings, "stage.live_cart")) < 5:
            time.sleep(0.1)
        # the batch destination reads the api file too: whoever finishes last archives it
        done = process_ready(settings, load_intake(cfg, secrets=False), until_empty=True)
        assert sum(r.written for r in done) == 5
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and list(ready_dir(settings.events_dir()).glob("*.log")):
            time.sleep(0.1)
        assert not list(ready_dir(settings.events_dir()).glob("*.log")), "incoming files were not archived"
        assert len(list((settings.events_dir() / "archive").glob("*/*.log.gz"))) == 2
    finally:
        collector.stop(signal.SIGKILL)
        loop.send_signal(signal.SIGTERM)
        out, _ = loop.communicate(timeout=30)
    assert loop.returncode == 0, out
    assert "stream stopped after" in out
    got = sorted(r["n"] for r in table_rows(settings, "stage.live_pv") + table_rows(settings, "stage.live_cart"))
    assert got == list(range(50)) + list(range(100, 105))
    assert sorted(r["n"] for r in table_rows(settings, "stage.batch_all")) == list(range(100, 105))


POINTS = ["stream_planned", "events_planned", "events_failed_file", "events_failed_written", "events_written",
          "events_logged", "stream_landed", "stream_committed"]


@pytest.mark.slow
def test_sigkill_at_every_point_of_a_micro_batch_no_event_lost_or_doubled(settings: Settings, tmp_path: Path):
    cfg = config(tmp_path)
    expected = set()
    for f in range(3):
        evs = []
        for i in range(12):
            eid = f"f{f}-e{i}"
            ev: dict[str, Any] = {"eid": eid, "event_type": ["pv", "cart"][i % 2], "v": i if f < 2 else f"s{i}"}
            if i % 5 == 3:
                del ev["event_type"]  # fails the template: a failed event of the stream destination
            evs.append(ev)
            expected.add(eid)
        write_file(settings, "web", T0 + dt.timedelta(minutes=f), evs)
    # a file still being written: complete lines are read, the unterminated tail waits
    open_file = incoming_dir(settings.events_dir()) / file_name("web", T0 + dt.timedelta(minutes=9))
    lines = [orjson.dumps({"eid": f"open-{i}", "event_type": "pv", "api_key": "web",
                           "_timestamp": "2026-03-01T12:09:00Z"}) + b"\n" for i in range(4)]
    open_file.write_bytes(b"".join(lines) + b'{"eid": "torn')
    expected |= {f"open-{i}" for i in range(4)}
    for point in POINTS:
        out = run_cli(settings, cfg, "stream", "--once", "--max-events", "7", env={"TIDEMARK_CRASH_AT": point})
        assert out.returncode == -9, (point, out.stdout, out.stderr)
    out = run_cli(settings, cfg, "stream", "--once", "--max-events", "7")
    assert out.returncode == 0, out.stderr
    landed = [r["eid"] for t in ("stage.live_pv", "stage.live_cart") for r in table_rows(settings, t)]
    failed = store.read_failed_events(settings.table_path(store.FAILED_EVENTS), "live")
    landed += [orjson.loads(r["event"])["eid"] for r in failed]
    assert sorted(landed) == sorted(expected)  # every event once: in a table or failed
    assert len(failed) == 6 and all("table_name_template" in r["error"] for r in failed)
    file_ids = [orjson.loads(x)["failure_id"] for x in store.failed_log(settings.events_dir(), "live").read_bytes().splitlines()]
    assert sorted(file_ids) == sorted(r["failure_id"] for r in failed)
    ids = [r["id"] for t in ("stage.live_pv", "stage.live_cart") for r in table_rows(settings, t)]
    assert len(set(ids)) == len(ids)
    st = status(settings, load_intake(cfg, secrets=False))["destinations"]["live"]["stream"]
    assert st["files_read"] == 3 and not st["micro_batch_under_way"] and st["bytes_waiting"] == len(b'{"eid": "torn')
    state = queue_state(settings, "live")
    assert open_file.name not in state.done and state.offsets[open_file.name] == [sum(map(len, lines)), 4]
    # the closed files wait in ready/ for the batch destination (it reads api's events only)
    assert len(list(ready_dir(settings.events_dir()).glob("*.log"))) == 3
    process_ready(settings, load_intake(cfg, secrets=False), until_empty=True)
    assert not list(ready_dir(settings.events_dir()).glob("*.log"))


def test_a_batch_destination_is_refused_and_a_config_without_stream_destinations_says_so(settings: Settings, tmp_path: Path):
    intake = load_intake(config(tmp_path), secrets=False)
    from lineage.core.errors import TidemarkError

    with pytest.raises(TidemarkError, match="'main' is in batch mode"):
        StreamLoop(settings, intake, ["main"])
    (tmp_path / "b.yaml").write_text(CONFIG.replace("mode: stream", "mode: batch"))
    with pytest.raises(TidemarkError, match="no destination has `mode: stream`"):
        StreamLoop(settings, load_intake(tmp_path / "b.yaml", secrets=False))
