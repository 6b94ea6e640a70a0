"""Freshness under load: how long a source row takes to reach its fact table, from the Delta logs.

    .venv/bin/python bench/freshness.py [--home .tidemark] [--since 10m] [--pair stage.orders:fact.orders ...]
    .venv/bin/python bench/freshness.py --dev 10m     # starts dev.sh itself, measures, stops it
    .venv/bin/python bench/freshness.py --dev 10m --mode follow   # tidemark follow and the feeder instead
    .venv/bin/python bench/freshness.py --dev 10m --mode dagster  # dev.sh in follow mode (a tidemark_follow run)
    .venv/bin/python bench/freshness.py --dev 10m --mode follow,streaming   # beside Spark Structured Streaming
    .venv/bin/python bench/freshness.py --dev 5m --mode follow,streaming,streaming-wait,streaming-naive

Run it beside ``./scripts/dev.sh`` (the feeder appends ``FEED_ORDERS`` orders every
``FEED_INTERVAL`` seconds and Dagster's planner sensor turns them into blocks). It reads the
tables' Delta logs (no JVM), three ways:

- ``--pair source:destination`` (default: the demo's ``stage.orders:fact.orders`` and
  ``stage.order_items:fact.order_items``), per row: the commit time of each row's ``id`` in the
  source and in the destination (a step topic keeps the base's ids);
- ``--hop source:destination`` (default: ``stage.customers:dim.customers``, a reload, and
  ``fact.order_items:mart.daily_revenue``, a view), per source commit: the first destination
  commit whose unit read the source at that version or later (its ``source_version``);
- ``--chain a,b,c,...`` (default ``stage.order_items,fact.order_items,mart.daily_revenue``), per
  row of ``a``: into ``b`` by id, then hop by hop by version, to the last table.

A latency is destination commit time minus source commit time. It prints count, p50, p95 and max
for rows (commits) whose source commit is within ``--since``, against issue 55's targets p95 <= delay +
5 s per hop (the destination topic's ``delay`` from the lineage) and the sum of the delays + 15 s
for the chain. What has not reached the destination (yet, or was dropped by the transform) is
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lineage.core.durations import parse_duration  # noqa: E402
from lineage.spec.loader import load_lineage  # noqa: E402
from resources.core.settings import Settings  # noqa: E402
from resources.storage.warehouse import arrow_filesystem  # noqa: E402

DEFAULT_PAIRS = ("stage.orders:fact.orders", "stage.order_items:fact.order_items")
DEFAULT_HOPS = ("stage.customers:dim.customers", "fact.order_items:mart.daily_revenue")
DEFAULT_CHAIN = "stage.order_items,fact.order_items,mart.daily_revenue"
TARGET_SLACK_S = 5.0  # per hop: issue 55's target is delay + 5 s
CHAIN_SLACK_S = 15.0  # the whole chain: the sum of the delays + 15 s
MODES = ("runs", "follow", "dagster", "streaming", "streaming-wait", "streaming-naive")
STREAMING_JOINS = {"streaming": "stream", "streaming-wait": "wait", "streaming-naive": "naive"}


@dataclass(frozen=True)
class Commit:
    """A commit that changed data: its version, time (unix seconds), the files it added and its
    ``userMetadata`` (a Tidemark unit's: ``base`` and the ``source_version`` it read)."""

    version: int
    at: float
    added: tuple[str, ...]
    meta: dict[str, Any]


def data_commits(path: str, since_ms: int) -> list[Commit]:
    """The commits of the table at ``path`` from ``since_ms`` on that added data, oldest first."""
    import pyarrow.fs as pafs

    fs, root = arrow_filesystem(path)
    log = root.rstrip("/") + "/_delta_log"
    out = []
    try:
        names = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(log)) if i.path.endswith(".json"))
    except FileNotFoundError:
        return []
    for name in names:
        with fs.open_input_stream(name) as f:
            actions = [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        ts = int(info.get("timestamp") or 0)
        added = tuple(a["add"]["path"] for a in actions if "add" in a and a["add"].get("dataChange", True))
        if ts < since_ms or not added:
            continue
        try:
            meta = json.loads(info.get("userMetadata") or "{}")
        except ValueError:
            meta = {}
        out.append(Commit(int(name.rsplit("/", 1)[-1].split(".")[0]), ts / 1000, added, meta if isinstance(meta, dict) else {}))
    return out


def landed_at(path: str, since_ms: int, commits: list[Commit] | None = None) -> dict[int, tuple[float, int]]:
    """``id`` -> (unix seconds, version) of the first commit (at or after ``since_ms``) that added it
    (``commits``: the table's :func:`data_commits`, when read already)."""
    import pyarrow.parquet as pq

    fs, root = arrow_filesystem(path)
    out: dict[int, tuple[float, int]] = {}
    for c in data_commits(path, since_ms) if commits is None else commits:
        for added in c.added:
            table = pq.read_table(f"{root.rstrip('/')}/{added}", columns=["id"], filesystem=fs)
            for i in table.column("id").to_pylist():
                if i is not None:
                    out.setdefault(int(i), (c.at, c.version))
    return out


def reached_version(src: str, dest_commits: list[Commit]) -> Callable[[int], tuple[float, int] | None]:
    """For a version of ``src``: the time and version of the first commit of the destination whose
    unit read ``src`` (its base) at that version or later; None while none has."""
    units = [(int(c.meta["source_version"]), c.at, c.version) for c in dest_commits
             if c.meta.get("base") == src and c.meta.get("source_version") is not None]

    def first(version: int) -> tuple[float, int] | None:
        found = [(at, v) for read, at, v in units if read >= version]
        return min(found) if found else None
    return first


def quarantined_ids(settings: Settings, source: str) -> set[int]:
    """Ids of ``source`` rows in ``etl.quarantine`` (late or without a position): they are
    accounted for, not waiting."""
    from resources.storage.delta_log import open_table
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


class DevExited(SystemExit):
    """``dev.sh`` ended before the measurement's time was up (its log's end in the message)."""


def run_dev(home: Path, seconds: float, warmup_s: float, mode: str = "runs") -> None:
    """``./scripts/dev.sh`` (Dagster, its daemon, a warm Spark Connect server, the feeder) on a
    fresh state dir and free ports for ``seconds``, then stopped as Ctrl-C stops it. Its output
    goes to ``<home>/dev.log``. The first ``warmup_s`` (seeding, first blocks of the backlog)
    are left out of the measurement by the caller. ``mode``: its ``TIDEMARK_MODE`` (``runs``: a run per
    unit; ``follow``: one long-lived ``tidemark_follow`` run)."""
    import signal
    import subprocess

    # A fresh state and instance; the planner's settings (TIDEMARK_PLANNER_*) pass through.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TIDEMARK_", "DAGSTER_")) or k.startswith("TIDEMARK_PLANNER_")}
    env["TIDEMARK_MODE"] = mode
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
                    log.flush()
                    tail = (home / "dev.log").read_text(errors="replace").splitlines()[-30:]
                    raise DevExited(f"dev.sh exited with {proc.returncode} early; the end of {home / 'dev.log'} "
                                    f"(the state dir is kept):\n" + "\n".join(f"  | {line}" for line in tail))
                time.sleep(2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def run_follow(home: Path, seconds: float, warmup_s: float, streaming: str | None = None) -> None:
    """Continuous mode: the demo's sources seeded, the feeder, and ``tidemark follow`` (one resident
    process and Spark session running every unit as it becomes due; local Spark, or
    ``TIDEMARK_SPARK_MASTER``) on a fresh state dir for ``seconds``, then stopped (SIGTERM). Their
    output goes to ``<home>/follow.log``. ``streaming``: ``bench/streaming_chain.py`` (Spark
    Structured Streaming, the baseline) instead of ``tidemark follow``, with that ``--join``."""
    import signal
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDEMARK_", "DAGSTER_"))
           or k in ("TIDEMARK_SPARK_MASTER", "TIDEMARK_FOLLOW_THREADS", "TIDEMARK_SPARK_CONF", "TIDEMARK_FOLLOW_CHECKPOINT_EVERY")}
    env["TIDEMARK_HOME"] = str(home)
    home.mkdir(parents=True, exist_ok=True)
    py = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
    subprocess.run([py, "-m", "platform_assets.demo.feeder", "--seed", os.environ.get("SEED_ORDERS", "3000"),
                    "--iterations", "0"], cwd=ROOT, env=env, check=True, capture_output=True)
    runner = ([py, str(ROOT / "bench" / "streaming_chain.py"), "--join", streaming] if streaming
              else [py, "-m", "platform_assets.cli", "follow"])
    what = "the Structured Streaming chain" if streaming else "tidemark follow"
    with open(home / "follow.log", "wb") as log:
        procs = [subprocess.Popen(runner, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True),
                 subprocess.Popen([py, "-m", "platform_assets.demo.feeder", "--interval", os.environ.get("FEED_INTERVAL", "5"),
                                   "--orders", os.environ.get("FEED_ORDERS", "20")], cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)]
        try:
            print(f"{what} and the feeder running (state in {home}, log {home / 'follow.log'}); measuring "
                  f"after {warmup_s:.0f}s, stopping after {seconds:.0f}s", flush=True)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if any(p.poll() is not None for p in procs):
                    log.flush()
                    tail = (home / "follow.log").read_text(errors="replace").splitlines()[-30:]
                    raise DevExited(f"{what} or the feeder exited early; the end of "
                                    f"{home / 'follow.log'} (the state dir is kept):\n" + "\n".join(f"  | {x}" for x in tail))
                time.sleep(2)
        finally:
            for p in procs:  # the processes only, not their groups: Spark's JVM ends with the follower
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def _row(label: str, lat: list[float], waiting: list[float], goal: float) -> str:
    if not lat:
        return f"{label:52} {0:>6} {len(waiting):>7}  nothing reached the destination in the window"
    p95 = pct(lat, 0.95)
    oldest = f"  (oldest waiting {max(waiting):.0f} s)" if waiting else ""
    return (f"{label:52} {len(lat):>6} {len(waiting):>7} {statistics.median(lat):7.1f} {p95:7.1f} {max(lat):7.1f} "
            f"{goal:8.0f}  {'PASS' if p95 <= goal else 'MISS'}{oldest}")


def _delay_s(lineage: Any, dest: str) -> float:
    delay = max((lineage.topic(t).spec.delay for t in lineage.destinations().get(dest, [])), default=None)
    return delay.total_seconds() if delay else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", help="state dir (default: TIDEMARK_HOME or .tidemark)")
    p.add_argument("--since", default="10m", help="only rows whose source commit is this recent (default 10m)")
    p.add_argument("--pair", action="append", help="source:destination, per row by id (repeatable)")
    p.add_argument("--hop", action="append", help="source:destination, per source commit by the versions the "
                                                  "destination's units read (repeatable)")
    p.add_argument("--chain", help="table,table,...: per row of the first table (a step hop by id first, then "
                                   "hops by version) to the last")
    p.add_argument("--dev", metavar="DURATION",
                   help="start the pipeline on a fresh state dir (under --home, default a temporary one, "
                        "removed after) for DURATION (e.g. 10m), then measure its rows after the first 3 minutes")
    p.add_argument("--mode", default="runs",
                   help="with --dev, one or more of (comma-separated, run one after the other, each on a fresh state "
                        "dir, then their p95s side by side with the ratio of the first to each other): runs "
                        "(./scripts/dev.sh with TIDEMARK_MODE=runs: Dagster's planner sensor, a run per unit; default), "
                        "follow (tidemark follow: one resident process runs every unit, and the feeder), dagster "
                        "(./scripts/dev.sh with TIDEMARK_MODE=follow: a tidemark_follow run), streaming (the same "
                        "chain as Spark Structured Streaming runs it: bench/streaming_chain.py, and the feeder; order "
                        "lines wait for their order by a stream-stream join), streaming-wait (each micro-batch of order lines "
                        "joined once fact.orders holds what stage.orders held) or streaming-naive (the same with each "
                        "micro-batch of order lines joined to fact.orders of that moment: faster, and lines whose order "
                        "is not there yet get nulls)")
    args = p.parse_args()
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--mode {args.mode!r}: use one or more of {', '.join(MODES)}, comma-separated")
    if not args.dev:
        measure(args)
        return 0
    import shutil
    import tempfile

    seconds = parse_duration(args.dev).total_seconds()
    warmup = min(180.0, seconds / 2)
    results: dict[str, dict[str, float | None]] = {}
    for mode in modes:
        home = (Path(args.home) / mode if len(modes) > 1 else Path(args.home)) if args.home else \
            Path(tempfile.mkdtemp(prefix=f"tidemark-freshness-{mode}-"))
        print(f"== mode {mode}", flush=True)
        if mode == "follow" or mode in STREAMING_JOINS:
            # (DevExited keeps the state dir)
            run_follow(home, seconds, warmup, streaming=STREAMING_JOINS.get(mode))
        else:
            run_dev(home, seconds, warmup, mode="follow" if mode == "dagster" else "runs")
        results[mode] = measure(argparse.Namespace(**{**vars(args), "home": str(home),
                                                      "since": f"{int(seconds - warmup)}s"}))
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)
    if len(modes) > 1:
        first, others = modes[0], modes[1:]
        print(f"\np95 s per mode, in one run; ratio = {first} / each other mode")
        widths = [max(9, len(m)) for m in modes]
        print(f"{'source -> destination':52} " + " ".join(f"{m:>{w}}" for m, w in zip(modes, widths, strict=True))
              + "".join(f" {'/ ' + m:>{w + 2}}" for m, w in zip(others, widths[1:], strict=True)))
        for label in results[first]:
            got = [results[m].get(label) for m in modes]
            ratios = "".join(f" {got[0] / b:{w + 2}.2f}" if got[0] is not None and b else f" {'-':>{w + 2}}"
                             for b, w in zip(got[1:], widths[1:], strict=True))
            print(f"{label:52} " + " ".join(f"{g:{w}.1f}" if g is not None else f"{'-':>{w}}"
                                            for g, w in zip(got, widths, strict=True)) + ratios)
    return 0


def measure(args: argparse.Namespace) -> dict[str, float | None]:
    """Print each pair, hop and the chain; returns their p95 (None: nothing reached the destination)."""
    settings = Settings.from_env(home=args.home)
    lineage = load_lineage(settings.lineage)
    now = time.time()
    since_ms = int((now - parse_duration(args.since).total_seconds()) * 1000)
    print(f"rows whose source commit is from the last {args.since}; latency = destination commit - source commit")
    print(f"{'source -> destination':52} {'rows':>6} {'waiting':>7} {'p50 s':>7} {'p95 s':>7} {'max s':>7} {'target s':>8}  verdict")
    commits: dict[str, list[Commit]] = {}  # each table's log read once
    landed: dict[str, dict[int, tuple[float, int]]] = {}
    p95s: dict[str, float | None] = {}

    def row(label: str, lat: list[float], waiting: list[float], goal: float) -> None:
        p95s[label] = pct(lat, 0.95) if lat else None
        print(_row(label, lat, waiting, goal))

    def commits_of(table: str) -> list[Commit]:
        if table not in commits:
            commits[table] = data_commits(settings.table_path(table), since_ms)
        return commits[table]

    def rows_of(table: str) -> dict[int, tuple[float, int]]:
        if table not in landed:
            landed[table] = landed_at(settings.table_path(table), since_ms, commits_of(table))
        return landed[table]

    def source_rows(table: str) -> dict[int, tuple[float, int]]:
        """The rows of a source table, less the quarantined ones (accounted for, not waiting)."""
        quarantined = quarantined_ids(settings, table)
        return {i: r for i, r in rows_of(table).items() if i not in quarantined}

    for pair in args.pair or DEFAULT_PAIRS:  # per row, by id
        src, _, dest = pair.partition(":")
        source, target = source_rows(src), rows_of(dest)
        lat = [target[i][0] - t for i, (t, _) in source.items() if i in target]
        waiting = [now - t for i, (t, _) in source.items() if i not in target]
        row(f"{src} -> {dest}", lat, waiting, _delay_s(lineage, dest) + TARGET_SLACK_S)
    for hop in args.hop or DEFAULT_HOPS:  # per source commit, by the versions the destination's units read
        src, _, dest = hop.partition(":")
        first = reached_version(src, commits_of(dest))
        lat, waiting = [], []
        for c in commits_of(src):
            reached = first(c.version)
            (waiting.append(now - c.at) if reached is None else lat.append(reached[0] - c.at))
        row(f"{src} -> {dest} (per commit)", lat, waiting, _delay_s(lineage, dest) + TARGET_SLACK_S)
    chain = (args.chain or DEFAULT_CHAIN).split(",")
    if len(chain) >= 3:  # per row of the first table: by id into the second, then by version to the last
        hops = [reached_version(src, commits_of(dest)) for src, dest in zip(chain[1:], chain[2:], strict=False)]
        lat, waiting = [], []
        second = rows_of(chain[1])
        for i, (t, _) in source_rows(chain[0]).items():
            reached = second.get(i)
            for follow in hops:
                if reached is None:
                    break
                reached = follow(reached[1])
            (waiting.append(now - t) if reached is None else lat.append(reached[0] - t))
        goal = sum(_delay_s(lineage, d) for d in chain[1:]) + CHAIN_SLACK_S
        row(" -> ".join(chain), lat, waiting, goal)
    if not args.chain:
        print(lines_check(settings))
    return p95s


def lines_check(settings: Settings) -> str:
    """Whether the demo's order lines carry their order's customer attributes: a fast chain that
    joins a line before its order has reached ``fact.orders`` writes nulls there instead (read with
    ``deltalake``'s DataFusion reader, no JVM)."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    q = QueryBuilder()  # (DataFusion's parser: each comparison in parentheses)
    for table in ("fact.orders", "fact.order_items"):
        q.register(table.replace(".", "_"), DeltaTable(settings.table_path(table)))
    got = pa.table(q.execute(
        "SELECT count(*) AS n, sum(CASE WHEN (o.order_id IS NOT NULL) AND ((i.customer_id IS DISTINCT FROM o.customer_id) "
        "OR (i.country IS DISTINCT FROM o.country)) THEN 1 ELSE 0 END) AS wrong FROM fact_order_items i "
        "LEFT JOIN fact_orders o ON o.order_id = i.order_id").read_all()).to_pylist()[0]
    n, wrong = int(got["n"]), int(got["wrong"] or 0)
    return (f"fact.order_items: {n:,} order lines, " + ("each with its order's customer and country" if not wrong else
            f"{wrong:,} WITHOUT their order's customer and country (joined before the order reached fact.orders)"))


if __name__ == "__main__":
    # As the CLI does: deltalake/pyarrow's native runtimes can abort in exit-time destructors.
    code = main()
    sys.stdout.flush()
    os._exit(code)
