"""Freshness under load: how long a source row takes to reach its fact table, from the Delta logs.

    .venv/bin/python bench/freshness.py [--home .tidemark] [--since 10m] [--pair stage.orders:fact.orders ...]
    .venv/bin/python bench/freshness.py --dev 10m     # starts dev.sh itself, measures, stops it

Run it beside ``./scripts/dev.sh`` (the feeder appends ``FEED_ORDERS`` orders every
``FEED_INTERVAL`` seconds and Dagster's planner sensor turns them into blocks). For every
``source:destination`` pair (default: the demo's ``stage.orders:fact.orders`` and
``stage.order_items:fact.order_items``) it reads both tables' Delta logs (no JVM): the commit
time of each row's ``id`` in the source and in the destination. A row's latency is destination
commit time minus source commit time. It prints count, p50, p95 and max per pair for rows whose
source commit is within ``--since``, against the target p95 <= delay + 10 s (the topic's
``delay`` from the lineage). Rows not in the destination (yet, or dropped by the transform) are
counted as waiting, with the oldest one's age, so a stalled pipeline shows; quarantined rows
(late, no position) are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lineage.core.durations import parse_duration  # noqa: E402
from lineage.spec.loader import load_lineage  # noqa: E402
from resources.core.settings import Settings  # noqa: E402
from resources.storage.warehouse import arrow_filesystem  # noqa: E402

DEFAULT_PAIRS = ("stage.orders:fact.orders", "stage.order_items:fact.order_items")
TARGET_SLACK_S = 10.0  # per hop: the target is delay + 10 s


def landed_at(path: str, since_ms: int) -> dict[int, float]:
    """``id`` -> unix seconds of the first commit (at or after ``since_ms``) that added it."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, root = arrow_filesystem(path)
    log = root.rstrip("/") + "/_delta_log"
    out: dict[int, float] = {}
    names = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(log))
                   if i.path.endswith(".json"))
    for name in names:
        with fs.open_input_stream(name) as f:
            actions = [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        ts = int(info.get("timestamp") or 0)
        if ts < since_ms:
            continue
        for a in actions:
            if "add" in a and a["add"].get("dataChange", True):
                table = pq.read_table(f"{root.rstrip('/')}/{a['add']['path']}", columns=["id"], filesystem=fs)
                for i in table.column("id").to_pylist():
                    if i is not None:
                        out.setdefault(int(i), ts / 1000)
    return out


def quarantined_ids(settings: Settings, source: str) -> set[int]:
    """Ids of ``source`` rows in ``etl.quarantine`` (late or without a position): they are
    accounted for, not waiting."""
    from resources.storage.delta_meta import open_table
    from resources.storage.meta_tables import QUARANTINE

    table = open_table(settings.table_path(QUARANTINE))
    if table is None:
        return set()
    rows = table.to_pyarrow_table(columns=["source", "row"]).to_pylist()
    ids = (json.loads(r["row"]).get("id") for r in rows if r["source"] == source and r["row"])
    return {int(i) for i in ids if i is not None}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_dev(home: Path, seconds: float, warmup_s: float) -> None:
    """``./scripts/dev.sh`` (Dagster, its daemon, a warm Spark Connect server, the feeder) on a
    fresh state dir and free ports for ``seconds``, then stopped as Ctrl-C stops it. Its output
    goes to ``<home>/dev.log``. The first ``warmup_s`` (seeding, first blocks of the backlog)
    are left out of the measurement by the caller."""
    import signal
    import subprocess

    # A fresh state and instance; the planner's settings (TIDEMARK_PLANNER_*) pass through.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TIDEMARK_", "DAGSTER_")) or k.startswith("TIDEMARK_PLANNER_")}
    env.update({"TIDEMARK_HOME": str(home), "PORT": str(_free_port()), "SPARK_PORT": str(_free_port()),
                "COLLECTOR_PORT": str(_free_port()), "FEED_INTERVAL": os.environ.get("FEED_INTERVAL", "5"),
                "FEED_ORDERS": os.environ.get("FEED_ORDERS", "20")})
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "dev.log", "wb") as log:
        proc = subprocess.Popen([str(ROOT / "scripts" / "dev.sh")], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            print(f"dev.sh running (state in {home}, log {home / 'dev.log'}); measuring after {warmup_s:.0f}s, "
                  f"stopping after {seconds:.0f}s", flush=True)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if proc.poll() is not None:
                    raise SystemExit(f"dev.sh exited with {proc.returncode} early; see {home / 'dev.log'}")
                time.sleep(2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", help="state dir (default: TIDEMARK_HOME or .tidemark)")
    p.add_argument("--since", default="10m", help="only rows whose source commit is this recent (default 10m)")
    p.add_argument("--pair", action="append", help="source:destination (repeatable)")
    p.add_argument("--dev", metavar="DURATION",
                   help="start ./scripts/dev.sh on a fresh state dir (under --home, default a temporary one) for "
                        "DURATION (e.g. 10m), then measure its rows after the first 3 minutes")
    args = p.parse_args()
    if args.dev:
        import tempfile

        seconds = parse_duration(args.dev).total_seconds()
        warmup = min(180.0, seconds / 2)
        home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="tidemark-freshness-"))
        run_dev(home, seconds, warmup)
        args.home, args.since = str(home), f"{int(seconds - warmup)}s"
    settings = Settings.from_env(home=args.home)
    lineage = load_lineage(settings.lineage)
    now = time.time()
    since_ms = int((now - parse_duration(args.since).total_seconds()) * 1000)
    print(f"rows whose source commit is from the last {args.since}; latency = destination commit - source commit")
    print(f"{'source -> destination':42} {'rows':>6} {'waiting':>7} {'p50 s':>7} {'p95 s':>7} {'max s':>7} {'target s':>8}  verdict")
    for pair in args.pair or DEFAULT_PAIRS:
        src, _, dest = pair.partition(":")
        delay = max((lineage.topic(t).spec.delay for t in lineage.destinations().get(dest, [])), default=None)
        delay_s = delay.total_seconds() if delay else 0.0
        source = landed_at(settings.table_path(src), since_ms)
        target = landed_at(settings.table_path(dest), since_ms)
        for i in quarantined_ids(settings, src):
            source.pop(i, None)
        lat = [target[i] - t for i, t in source.items() if i in target]
        waiting = [now - t for i, t in source.items() if i not in target]
        if not lat:
            print(f"{src + ' -> ' + dest:42} {0:>6}  no source rows in the window")
            continue
        goal = delay_s + TARGET_SLACK_S
        p95 = pct(lat, 0.95)
        verdict = "PASS" if p95 <= goal else "MISS"
        oldest = f"  (oldest waiting {max(waiting):.0f} s)" if waiting else ""
        print(f"{src + ' -> ' + dest:42} {len(lat):>6} {len(waiting):>7} {statistics.median(lat):7.1f} {p95:7.1f} "
              f"{max(lat):7.1f} {goal:8.0f}  {verdict}{oldest}")
    return 0


if __name__ == "__main__":
    # As the CLI does: deltalake/pyarrow's native runtimes can abort in exit-time destructors.
    code = main()
    sys.stdout.flush()
    os._exit(code)
