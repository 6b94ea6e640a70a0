"""Event intake benchmark (issue 11): the collector's throughput and latency with durability on.

    .venv/bin/python bench/event_intake.py                 # 15 s per mode; 8 connections batched, 64 single
    .venv/bin/python bench/event_intake.py --seconds 5     # quick check

Starts ``tidemark collect`` (a subprocess, its own throw-away home, port 0) and drives it from
this process with a bare async HTTP/1.1 client (asyncio streams on uvloop, one keep-alive
connection per worker) on loopback,
bounded in time (``--seconds``) and count (``--max-events``). 1 KB events, in two modes: batches
of ``--batch`` (a JSON array per request) and singly. Every request is answered only after its
events are fsynced (the collector always works that way). Prints per mode: events, requests,
events/s, p50/p99 request latency, fsyncs and events per fsync, then checks that every
acknowledged event is in the incoming log exactly once, and the issue's target for the batched
mode (>= 20,000 events/s with p99 < 50 ms) as met or MISSED (a miss still exits 0).

Then processing: ``--process-events`` (default 500,000) generated 1 KB events in ready files,
``tidemark events process`` (in this process, deltalake; ``TIDEMARK_EVENT_WORKERS`` worker processes,
default 2) from the files to the Delta stage table,
and on the same files in the same run Spark Structured Streaming's JSON file source (schema
inferred once, trigger availableNow, local[2]) writing a Delta table with the same flattened
columns; events/s of both, their ratio and the target (>= 2x) as met or MISSED. The JVM's start
is printed, not counted. ``--modes ''`` skips the collector part.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402 - only for /health and /metrics
import orjson  # noqa: E402

from resources.intake.incoming_log import iter_ready_files, read_events  # noqa: E402

SECRET = "bench-secret-4711"
TARGET_EPS, TARGET_P99_MS = 20_000, 50.0


@dataclass
class ModeResult:
    mode: str
    connections: int = 0
    events: int = 0
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    fsyncs: int = 0
    acked: list[str] = field(default_factory=list)

    @property
    def eps(self) -> float:
        return self.events / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        s = sorted(self.latencies)
        return s[min(len(s) - 1, int(q * len(s)))] * 1000


def event(uid: str) -> dict[str, object]:
    """A page view of about 1 KB once enriched."""
    return {"uid": uid, "event_type": "page_view", "user_id": 123456, "session": "s-" + uid,
            "url": "https://shop.example.com/products/12345?utm_source=newsletter&utm_medium=email",
            "referrer": "https://www.example.org/", "screen": {"w": 1920, "h": 1080}, "consent": True,
            "pad": "x" * 640}


class Server:
    def __init__(self, home: Path) -> None:
        cfg = home / "intake.yaml"
        cfg.write_text("collector:\n  max_body: 4MiB\n  rotate_bytes: 256MiB\n"
                       "tokens:\n  - {id: bench, kind: server, secret_env: BENCH_TOKEN}\n")
        self.home, self.out = home, home / "collector.out"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_TOKEN": SECRET}
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "platform_assets.cli", "--home", str(home), "collect",
                                          "--config", str(cfg), "--port", "0"], cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            m = re.search(r"listening on (http://\S+)", self.out.read_text())
            if m:
                try:
                    if httpx.get(m[1] + "/health").status_code == 200:
                        self.url = m[1]
                        return
                except httpx.TransportError:
                    pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the collector did not start:\n{self.out.read_text()}")
            time.sleep(0.05)

    def fsyncs(self) -> int:
        return int(httpx.get(self.url + "/metrics").json()["fsyncs"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, body: bytes) -> int:
    """One keep-alive HTTP/1.1 POST; returns the status. A bare client: httpx's own overhead
    (~2.5 ms of CPU per request here) would measure the client instead of the collector."""
    writer.write(head + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    header = await reader.readuntil(b"\r\n\r\n")
    status = int(header[9:12])
    m = re.search(rb"(?i)content-length: *(\d+)", header)
    await reader.readexactly(int(m[1]) if m else 0)
    return status


async def run_mode(url: str, mode: str, batch: int, connections: int, seconds: float, max_events: int) -> ModeResult:
    res = ModeResult(mode, connections)
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST /api/v1/s2s/event HTTP/1.1\r\nHost: {host}\r\nX-Auth-Token: {SECRET}\r\n"
            "Content-Type: application/json\r\nContent-Length: ").encode()
    stop_at = time.monotonic() + seconds
    budget = [max_events]

    async def worker(n: int) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        i = 0
        try:
            while time.monotonic() < stop_at and budget[0] > 0:
                budget[0] -= batch
                uids = [f"{mode}-{n}-{i + k}" for k in range(batch)]
                i += batch
                body = orjson.dumps([event(u) for u in uids] if batch > 1 else event(uids[0]))
                t0 = time.perf_counter()
                status = await _post(reader, writer, head, body)
                res.latencies.append(time.perf_counter() - t0)
                if status == 200:
                    res.events += batch
                    res.requests += 1
                    res.acked.extend(uids)
                else:
                    res.errors += 1
        finally:
            writer.close()

    t0 = time.monotonic()
    await asyncio.gather(*(worker(n) for n in range(connections)))
    res.seconds = time.monotonic() - t0
    return res


PROCESS_CONFIG = """\
tokens:
  - {id: bench, kind: server, secret_env: BENCH_TOKEN}
destinations:
  - id: bench
    table_name_template: "events_{{ event_type }}"
    schema: stage
"""


def write_incoming(folder: Path, n: int, per_file: int) -> tuple[int, int]:
    """``n`` enriched 1 KB events (as the collector writes them) in ready files of ``per_file``
    events; returns (files, bytes)."""
    from lineage.intake.bodies import utc_timestamp
    from resources.intake.incoming_log import file_name

    folder.mkdir(parents=True, exist_ok=True)
    t0 = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)
    files = size = 0
    for start in range(0, n, per_file):
        lines = []
        for i in range(start, min(n, start + per_file)):
            e = event(f"p-{i}")
            e.update({"source_ip": "10.1.2.3", "_timestamp": utc_timestamp(t0 + dt.timedelta(microseconds=100 * i)),
                      "api_key": "bench", "src": "api", "eventn_ctx": {"event_id": f"00000000-0000-4000-8000-{i:012d}"}})
            lines.append(orjson.dumps(e) + b"\n")
        data = b"".join(lines)
        (folder / file_name("bench", t0 + dt.timedelta(seconds=start))).write_bytes(data)
        files, size = files + 1, size + len(data)
    return files, size


def _flat_select(schema: object, prefix: str = "", path: str = "") -> list[object]:
    """Spark columns that flatten a JSON schema as the intake does (``a.b`` -> ``a_b``, arrays as
    JSON strings, names lower-case with special characters replaced)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, StructType

    from lineage.intake.pipeline import column_name

    out: list[object] = []
    for f in schema.fields:  # type: ignore[attr-defined]
        name, ref = prefix + column_name(f.name), f"{path}`{f.name}`"
        if isinstance(f.dataType, StructType):
            out += _flat_select(f.dataType, name + "_", ref + ".")
        elif isinstance(f.dataType, ArrayType):
            out.append(F.to_json(F.col(ref)).alias(name))
        elif name == "_timestamp":
            out.append(F.to_timestamp(F.col(ref)).alias(name))
        else:
            out.append(F.col(ref).alias(name))
    return out


def processing_vs_structured_streaming(home: Path, n: int, per_file: int) -> None:
    """``tidemark events process`` vs Spark Structured Streaming's JSON file source, on the same
    files, both writing a Delta table with the same flattened columns."""
    from lineage.intake.config import load_intake
    from platform_assets.intake.units import process_ready
    from resources.core.settings import Settings
    from resources.intake.incoming_log import ready_dir
    from resources.spark.session import build_spark_session

    settings = Settings.from_env({}, home=home / "proc", spark_master="local[2]")
    src = home / "ss-input"
    files, size = write_incoming(src, n, per_file)
    ready = ready_dir(settings.events_dir())
    ready.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        shutil.copy(p, ready / p.name)
    cfg = home / "process.yaml"
    cfg.write_text(PROCESS_CONFIG)
    print(f"\nprocessing: {n:,} events of ~1 KB in {files} ready files ({size / 1e6:,.0f} MB); load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    t0 = time.perf_counter()
    results = process_ready(settings, load_intake(cfg, secrets=False), until_empty=True)
    ours = time.perf_counter() - t0
    written = sum(r.written for r in results)
    t1 = time.perf_counter()
    os.environ.setdefault("TIDEMARK_DRIVER_MEMORY", "2g")
    spark = build_spark_session(Settings.from_env({}, home=home / "spark", spark_master="local[2]"), app_name="bench")
    jvm = time.perf_counter() - t1
    try:
        t2 = time.perf_counter()
        schema = spark.read.json(str(next(iter(sorted(src.iterdir()))))).schema  # inferred once, from one file
        out = str(home / "spark" / "stage_events_page_view")
        q = (spark.readStream.format("json").schema(schema).load(str(src))
             .select(F_col_pos(), *_flat_select(schema))
             .writeStream.format("delta").option("checkpointLocation", str(home / "spark" / "checkpoint"))
             .trigger(availableNow=True).start(out))
        q.awaitTermination()
        theirs = time.perf_counter() - t2
        ss_rows = spark.read.format("delta").load(out).count()
    finally:
        spark.stop()
    ours_eps, theirs_eps = written / ours, ss_rows / theirs
    ratio = ours_eps / theirs_eps if theirs_eps else float("inf")
    print(f"\n{'pipeline':<42} {'rows':>9} {'seconds':>8} {'events/s':>10}")
    from platform_assets.intake.workers import workers_setting

    label = f"tidemark events process ({workers_setting()} workers)"
    print(f"{label:<42} {written:>9,} {ours:>8.1f} {ours_eps:>10,.0f}")
    print(f"{'Structured Streaming JSON -> Delta':<42} {ss_rows:>9,} {theirs:>8.1f} {theirs_eps:>10,.0f}"
          f"   (+{jvm:.1f} s JVM start, not counted)")
    print(f"target: processing >= 2x Structured Streaming: {ratio:.2f}x -> {'met' if ratio >= 2 else 'MISSED'}"
          f"; load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def F_col_pos() -> object:  # noqa: N802 - reads like the Spark column it builds
    """``pos``: the receive time, as the intake writes it."""
    from pyspark.sql import functions as F

    return F.to_timestamp(F.col("_timestamp")).alias("pos")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=15.0, help="time per mode (default 15)")
    p.add_argument("--max-events", type=int, default=2_000_000, help="events per mode at most (default 2,000,000)")
    p.add_argument("--connections", type=int, default=8, help="connections of the batched mode (default 8)")
    p.add_argument("--single-connections", type=int, default=64, help="connections of the single mode (default 64)")
    p.add_argument("--batch", type=int, default=100, help="events per request in the batched mode (default 100)")
    p.add_argument("--modes", default="batched,single", help="batched,single")
    p.add_argument("--home", help="state dir to use (default: a temp dir, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--process-events", type=int, default=500_000,
                   help="events for processing vs Structured Streaming (default 500,000; 0: skip)")
    p.add_argument("--per-file", type=int, default=60_000, help="events per incoming file (default 60,000, ~64 MB)")
    args = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="tidemark-bench-intake-"))
    home.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores); home {home}")
    server = Server(home)
    results: list[ModeResult] = []
    try:
        for mode in [m for m in args.modes.split(",") if m]:
            batch = args.batch if mode == "batched" else 1
            before = server.fsyncs()
            conns = args.connections if mode == "batched" else args.single_connections
            r = asyncio.run(run_mode(server.url, mode, batch, conns, args.seconds, args.max_events))
            r.fsyncs = server.fsyncs() - before
            results.append(r)
    finally:
        server.stop()
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"\n{'mode':<8} {'conns':>5} {'events':>10} {'requests':>9} {'errors':>6} {'events/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'fsyncs':>7} {'ev/fsync':>8}")
    for r in results:
        print(f"{r.mode:<8} {r.connections:>5} {r.events:>10,} {r.requests:>9,} {r.errors:>6} {r.eps:>10,.0f} {r.pct(0.5):>8.1f} "
              f"{r.pct(0.99):>8.1f} {r.fsyncs:>7,} {r.events / max(r.fsyncs, 1):>8.1f}")
    logged = Counter(e["uid"] for f in iter_ready_files(home / "events") for _, e in read_events(f.path))
    acked = [u for r in results for u in r.acked]
    bad = sum(1 for u in acked if logged[u] != 1)
    print(f"\ndurability: {len(acked):,} acknowledged events, {sum(logged.values()):,} in the incoming log, "
          f"{bad} acknowledged but not there exactly once -> {'OK' if bad == 0 else 'LOST/DOUBLED'}")
    for r in results:
        if r.mode == "batched":
            ok = r.eps >= TARGET_EPS and r.pct(0.99) < TARGET_P99_MS
            print(f"target: batched >= {TARGET_EPS:,} events/s with p99 < {TARGET_P99_MS:.0f} ms: "
                  f"{r.eps:,.0f} events/s, p99 {r.pct(0.99):.1f} ms -> {'met' if ok else 'MISSED'}")
    if args.process_events:
        processing_vs_structured_streaming(home, args.process_events, args.per_file)
    if not args.home and not args.keep:
        shutil.rmtree(home, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
