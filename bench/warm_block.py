"""How long a 100-row block takes through ``dagster asset materialize``, from process start to
RUN_SUCCESS: with in-process local Spark (a JVM per run, Delta warmed from cold) and with a warm
local Spark Connect server (``TIDEMARK_SPARK_MASTER=sc://...``). Target (issue 20): <= 3 s warm
(issue 8 set 5 s).

    .venv/bin/python bench/warm_block.py [--repeat 3] [--warmup 1] [--rows 100] [--keep]

Each mode gets its own throw-away home, lineage (``tests/platform_assets/shop.py``: stage.events
joined with dim.users into fact.events) and Dagster instance. Every block is planned first
(``tidemark plan``, no JVM, untimed), then materialized in a fresh ``dagster asset materialize``
process; the time is from ``Popen`` to the line that reports RUN_SUCCESS. ``--warmup`` blocks
per mode run first, untimed (for local Spark every run is cold anyway; for Connect the first
block loads Delta's classes into the server). The Connect server is started by the bench
(its start time is printed) and stopped at the end, also on failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resources.core.settings import Settings  # noqa: E402
from resources.spark import server as spark_server  # noqa: E402
from tests.platform_assets.shop import (  # noqa: E402
    make_events,
    materialize_command,
    write_lineage,
    write_rows,
    write_users,
)

TARGET_S = 3.0


def prepare(home: Path, blocks: int, rows: int) -> tuple[Settings, Path]:
    """A home with ``blocks * rows`` events (one block = ``rows`` rows) and a Dagster instance."""
    settings = Settings.from_env({}, home=home / "home", lineage=write_lineage(home, maxstep=rows))
    write_users(settings)
    write_rows(settings, "stage.events", make_events(blocks * rows, distinct_pos=blocks * rows, seed=8))
    dagster_home = home / "dagster"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    return settings, dagster_home


def plan(settings: Settings, dagster_home: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "platform_assets.cli", "--home", str(settings.home), "--lineage",
                          str(settings.lineage), "plan", "fact.events"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "DAGSTER_HOME": str(dagster_home)}, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"tidemark plan failed:\n{out.stderr[-3000:]}")
    return out.stdout.split()[-1]


PHASES = ("process", "dagster", "spark", "lock", "plan", "transform", "write", "log", "after", "commit")


def breakdown(dagster_home: Path, started: float, took: float) -> dict[str, float]:
    """Where the newest run's ``took`` seconds (from ``started``, unix time) went."""
    import dagster as dg

    os.environ["DAGSTER_HOME"] = str(dagster_home)
    with dg.DagsterInstance.get() as instance:
        run = instance.get_runs(limit=1)[0]
        records = instance.all_logs(run.run_id)
    first = records[0].timestamp
    kinds: dict[str, Any] = {}  # the first event of each kind: the block's step (a check may run in a later step)
    for r in records:
        if r.dagster_event:
            kinds.setdefault(r.dagster_event.event_type_value, r)
    step = kinds["STEP_SUCCESS"].timestamp - kinds["STEP_START"].timestamp
    mat = kinds["ASSET_MATERIALIZATION"].dagster_event.event_specific_data.materialization  # type: ignore[union-attr]
    phases = {k: float(v) for k, v in mat.metadata["phases_s"].value.items()}
    out = {"process": first - started, **phases}
    out["dagster"] = took - out["process"] - sum(phases.values())
    assert step >= sum(phases.values()) - 0.05, (step, phases)
    return out


def materialize(settings: Settings, dagster_home: Path, key: str, master: str) -> tuple[float, dict[str, float]]:
    """Seconds from process start to the RUN_SUCCESS line of one block's materialization, and where
    they went."""
    cmd, env = materialize_command(settings, dagster_home, "fact/events", key, master=master)
    started = time.time()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen: float | None = None
    tail: list[str] = []
    for line in proc.stdout:
        tail = [*tail[-40:], line]
        if seen is None and "RUN_SUCCESS" in line:
            seen = time.monotonic() - t0
    proc.wait()
    if seen is None or proc.returncode != 0:
        raise SystemExit(f"block {key} with master {master} failed (exit {proc.returncode}):\n{''.join(tail)}")
    return seen, breakdown(dagster_home, started, seen)


def run_mode(name: str, base: Path, master: str | None,
             args: argparse.Namespace) -> tuple[list[float], list[dict[str, float]], float | None]:
    """The timed blocks of one mode, where their time went, and the server's start time (Connect only)."""
    settings, dagster_home = prepare(base / name, args.warmup + args.repeat, args.rows)
    started: float | None = None
    if master is None:  # Connect: a warm server of our own for this mode
        t0 = time.monotonic()
        server = spark_server.start(base / name / "server", port=spark_server.free_port(), master=args.server_master)
        started = time.monotonic() - t0
        master = server.url
    try:
        times, parts = [], []
        for i in range(args.warmup + args.repeat):
            took, where = materialize(settings, dagster_home, plan(settings, dagster_home), master)
            label = "warmup" if i < args.warmup else "timed"
            print(f"  {name:8} block {i + 1}: {took:6.2f} s ({label}; "
                  + ", ".join(f"{k} {v:.2f}" for k, v in where.items() if v >= 0.005) + ")", flush=True)
            if i >= args.warmup:
                times.append(took)
                parts.append(where)
        return times, parts, started
    finally:
        spark_server.stop(base / name / "server")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="timed blocks per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed blocks per mode first")
    p.add_argument("--rows", type=int, default=100, help="rows per block")
    p.add_argument("--local-master", default="local[2]", help="master of the in-process runs")
    p.add_argument("--server-master", default="local[2]", help="master of the Connect server")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tidemark-warm-"))
    os.environ.setdefault("TIDEMARK_DRIVER_MEMORY", "1g")
    try:
        local, local_parts, _ = run_mode("local", base, args.local_master, args)
        connect, connect_parts, started = run_mode("connect", base, None, args)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    lm, cm = statistics.median(local), statistics.median(connect)
    print(f"\n{args.rows}-row block, `dagster asset materialize`, process start -> RUN_SUCCESS "
          f"(median of {args.repeat}; Connect server start, once: {started:.1f} s)")
    print(f"{'mode':10} {'median s':>9} {'min s':>7} {'max s':>7} {'vs local':>9}")
    for name, t in (("local", local), ("connect", connect)):
        print(f"{name:10} {statistics.median(t):9.2f} {min(t):7.2f} {max(t):7.2f} {statistics.median(t) / lm:9.2f}")
    print("\nwhere a block's time goes (median s of the timed blocks; the medians need not add up to the total)")
    print(f"{'part':10} {'local':>8} {'connect':>8}")
    for part in PHASES:
        lv = [p.get(part, 0.0) for p in local_parts]
        cv = [p.get(part, 0.0) for p in connect_parts]
        if max(lv + cv) >= 0.005:
            print(f"{part:10} {statistics.median(lv):8.2f} {statistics.median(cv):8.2f}")
    verdict = "PASS" if cm <= TARGET_S else "MISS"
    print(f"\nwarm Connect block {cm:.2f} s vs target <= {TARGET_S:.0f} s: {verdict}  (local / connect = {lm / cm:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
