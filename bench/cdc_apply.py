"""The cdc processor's throughput against AUTO CDC's algorithm, and end-to-end lag from PostgreSQL.

1. Throughput: ``--events`` change events (60 % update, 20 % insert, 20 % delete, random keys, in
   transactions of 1-9 events) applied to a replica of ``--rows`` rows, by the cdc processor (Debezium
   JSON files -> read + reduce + one MERGE per unit) and, on the same events over the same starting
   rows in the same warm session, by AUTO CDC's SCD1 algorithm on Delta (see ``autocdc_on_delta``:
   ``spark-pipelines run`` with ``create_auto_cdc_flow`` refuses a Delta target, and the bench
   probes that and prints why). Both results are compared (count + checksum).
2. Lag: a throw-away PostgreSQL, a writer committing ``--lag-rate`` changes/s in transactions of
   ``--lag-tx``, the replicator running units back to back in one warm session; per source
   transaction, the replica commit's time minus the source commit's time; p50/p95/max.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.shared import BenchError, make_sdp_project, observed_replicator, sdp_update  # noqa: E402
from resources.core.settings import Settings  # noqa: E402
from resources.spark.session import cached_delta_jars  # noqa: E402

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

REPLICATOR, TABLE, REPLICA = "bench", "public.items", "replica.items"
COLUMNS = ["id", "name", "amount", "v"]
MIX = (0.6, 0.2, 0.2)  # update, insert, delete
TARGET_RATIO, TARGET_LAG_P95 = 1.5, 60.0
MS0 = 1_767_225_600_000  # 2026-01-01, the events' source commit times
UPD, INS, DEL = 0, 1, 2  # event kinds


# ------------------------------------------------------------------ timing of the processor's parts


class Timer:
    """Seconds per named part, summed; parts are wrapped in the bench process only."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.s[name] = self.s.get(name, 0.0) + time.monotonic() - t0

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            with self.part(name):
                return fn(*a, **kw)

        setattr(owner, attr, timed)

    def text(self) -> str:
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.s.items())


# ------------------------------------------------------------------ the events


@dataclass
class Events:
    ids: np.ndarray  # key of each event
    ops: np.ndarray  # UPD / INS / DEL
    tx: np.ndarray  # transaction number of each event (consecutive events share it)

    def values(self, j: int) -> tuple[str, float, int]:
        """The row values event ``j`` writes (inserts and updates)."""
        return f"e{j}", j * 0.25 + 0.5, j


def base_values_sql() -> list[str]:
    """The starting rows' values as Spark SQL over ``id`` (the same for both sides)."""
    return ["id", "concat('n', id) AS name", "CAST(id AS DOUBLE) * 0.5 AS amount", "id % 1000 AS v"]


def make_events(rows: int, n: int, seed: int, hot: float = 0.0) -> Events:
    """``n`` events over keys ``1..rows``: updates and deletes of a random live key, inserts of new
    keys; grouped in transactions of 1-9 events. ``hot`` (0 < hot < 1): updates and deletes take
    a live key among the newest ``hot`` share of the keys (recent rows change, old ones rest)."""
    rng = np.random.default_rng(seed)
    ops = rng.choice(3, size=n, p=MIX).astype(np.int8)
    picks = rng.random(n)
    live = np.arange(1, rows + n + 1, dtype=np.int64)  # live keys in live[:count]
    where = np.arange(-1, rows + n, dtype=np.int64)  # where[key] = index in live
    count, next_id = rows, rows + 1
    ids = np.empty(n, dtype=np.int64)
    for j in range(n):
        op = ops[j]
        if op == INS or count == 0:
            ops[j] = INS
            key = next_id
            next_id += 1
            live[count], where[key] = key, count
            count += 1
        else:
            i = int(picks[j] * count)
            if hot:  # a live key among the newest: drawn until one is live (most are)
                span = max(1, int(hot * (next_id - 1)))
                while True:
                    cand = int(next_id - 1 - rng.integers(0, span))
                    if cand >= 1 and where[cand] < count and live[where[cand]] == cand:
                        i = int(where[cand])
                        break
            key = int(live[i])
            if op == DEL:  # swap-remove
                last = live[count - 1]
                live[i], where[last] = last, i
                count -= 1
        ids[j] = key
    sizes = rng.integers(1, 10, size=n)
    tx = np.repeat(np.arange(len(sizes)), sizes)[:n]
    return Events(ids, ops, tx)


def write_debezium(ev: Events, path: Path) -> None:
    """The events as Debezium writes them for PostgreSQL (record key + value payload, default
    replica identity: an update carries no before-image, a delete only the key)."""
    with path.open("w") as out:
        for j in range(len(ev.ids)):
            k, op, tx = int(ev.ids[j]), int(ev.ops[j]), int(ev.tx[j])
            if op == DEL:
                before, after, code = f'{{"id": {k}}}', "null", "d"
            else:
                name, amount, v = ev.values(j)
                before, after, code = "null", f'{{"id": {k}, "name": "{name}", "amount": {amount!r}, "v": {v}}}', \
                    "u" if op == UPD else "c"
            out.write(f'{{"key": {{"id": {k}}}, "value": {{"payload": {{"op": "{code}", "before": {before}, '
                      f'"after": {after}, "ts_ms": {MS0 + tx}, "source": {{"connector": "postgresql", '
                      f'"schema": "public", "table": "items", "txId": {tx + 1}}}}}}}}}\n')


def write_change_table(ev: Events, path: str) -> None:
    """The events as a change table (columns + op + seq: the event's order), AUTO CDC's input."""
    import pyarrow as pa
    from deltalake import write_deltalake

    j = np.arange(len(ev.ids), dtype=np.int64)
    gone = ev.ops == DEL
    write_deltalake(path, pa.table({
        "id": ev.ids,
        "name": pa.array([None if g else f"e{i}" for i, g in zip(j.tolist(), gone.tolist(), strict=True)], pa.string()),
        "amount": pa.array(np.where(gone, np.nan, j * 0.25 + 0.5), mask=gone),
        "v": pa.array(j, mask=gone),
        "op": pa.array(np.array(["u", "c", "d"])[ev.ops]),
        "seq": j + 1}))


# ------------------------------------------------------------------ side 1: the cdc processor


def write_replica(spark: SparkSession, settings: Settings, rows: int, change_feed: bool,
                  deletion_vectors: bool = False, files: int = 0) -> str:
    """The replica of ``rows`` starting rows, written directly in the processor's layout (source
    columns, ``_sequence_num`` 0, ``_commit_ts`` null, replica properties), in one commit carrying
    what a snapshot commit carries: ``txnAppId tidemark:<replica>``/``txnVersion 1`` and the source
    position 0 in ``userMetadata``. The processor's reconcile adopts it from the Delta log as it
    does after a lost offset store; the events files hold every change after position 0."""
    from lineage.cdc.changes import Column, TableSchema
    from platform_assets.cdc.apply import Layout, ensure_replica

    path = settings.table_path(REPLICA)
    schema = TableSchema(TABLE, (Column("id", "bigint"), Column("name", "string"), Column("amount", "double"),
                                 Column("v", "bigint")), ("id",))
    ensure_replica(spark, path, Layout(schema, ("id",), change_feed=change_feed, deletion_vectors=deletion_vectors))
    meta = json.dumps({"replicator": REPLICATOR, "processor": "cdc", "unit": 1, "lsn": 0, "lsn_text": "0/0",
                       "kind": "snapshot", "owner": "bench"})
    (starting_rows(spark, rows, files).selectExpr(*base_values_sql(), "CAST(0 AS BIGINT) AS _sequence_num",
                                                  "CAST(NULL AS TIMESTAMP) AS _commit_ts")
     .write.format("delta").mode("append").option("txnAppId", f"tidemark:{REPLICA}").option("txnVersion", 1)
     .option("userMetadata", meta).save(path))
    return path


def make_lineage(base: Path, events_dir: Path, maxstep: int, change_feed: bool = True,
                 deletion_vectors: bool = False) -> Path:
    lineage = base / "lineage.yaml"
    lineage.write_text(textwrap.dedent(f"""\
        cdc:
          - name: {REPLICATOR}
            source: debezium
            path: {events_dir}
            tables: [{TABLE}]
            maxstep: {maxstep}
            change_feed: {str(change_feed).lower()}
            deletion_vectors: {str(deletion_vectors).lower()}
        """))
    return lineage


def run_cdc(spark: SparkSession, settings: Settings, reader: str) -> tuple[float, list[Any], Timer]:
    """The replicator until caught up, timed; its parts timed by wrappers. ``reader``: ``columns``
    (the source's columnar read and reduction, where they apply) or ``python`` (the change-by-change
    path every source has: the columnar read hidden from the processor)."""
    from lineage.cdc import columns as cdc_columns
    from lineage.spec.loader import load_lineage
    from platform_assets.cdc import apply as cdc_apply
    from platform_assets.cdc import replicator as cdc
    from platform_assets.cdc import run as cdc_run
    from platform_assets.core import keyed_merge, spark_io
    from platform_assets.engine.runner import Engine
    from resources.cdc.debezium import DebeziumFileSource

    timer = Timer()
    timer.wrap(DebeziumFileSource, "tables", "source schemas")
    timer.wrap(DebeziumFileSource, "read", "read+parse")
    timer.wrap(cdc, "reduce_keyed", "reduce")
    timer.wrap(cdc_apply, "arrow_table", "local relation")
    if reader == "python":
        DebeziumFileSource.read_columns = None  # type: ignore[assignment,method-assign]
    else:
        timer.wrap(DebeziumFileSource, "read_columns", "read columns")
        timer.wrap(cdc_columns, "reduce_scd1", "reduce columns")
    timer.wrap(spark_io, "run_merge", "MERGE")
    timer.wrap(keyed_merge, "merge_arrow", "MERGE from the driver (or declined)")
    engine = Engine(settings, load_lineage(settings.lineage), spark=spark, owner="bench-cdc")
    try:
        t0 = time.monotonic()
        results = list(cdc_run.run_replicator(engine, engine.lineage.replicators[REPLICATOR], until_caught_up=True))
        took = time.monotonic() - t0
    finally:
        engine.close()
    return took, results, timer


# ------------------------------------------------------------------ side 2: AUTO CDC's algorithm on Delta


def starting_rows(spark: SparkSession, rows: int, files: int) -> Any:
    """Keys ``1..rows``, in ``files`` files of consecutive keys (0: Spark's default split, 4 here)."""
    ids = spark.range(1, rows + 1)
    return ids.repartitionByRange(files, "id") if files else ids


def write_autocdc_target(spark: SparkSession, path: str, rows: int, deletion_vectors: bool = False,
                         files: int = 0) -> None:
    """The same starting rows, with the sequence column AUTO CDC keeps per row."""
    (starting_rows(spark, rows, files).selectExpr(*base_values_sql(), "CAST(0 AS BIGINT) AS seq").write.format("delta")
     .option("delta.enableDeletionVectors", str(deletion_vectors).lower()).save(path))


def autocdc_on_delta(spark: SparkSession, changes: str, target: str, checkpoint: str) -> tuple[float, int]:
    """AUTO CDC's SCD1 flow as Spark 4.2 runs it (``Scd1BatchProcessor`` in a ``foreachBatch``), on a
    Delta target: a streaming read of the change table (``availableNow``), per micro-batch the latest
    event per key (``max_by`` over ``sequence_by``), then one MERGE that applies it only when it is
    newer than the row (``apply_as_deletes``: ``op = 'd'`` deletes). Seconds, micro-batches."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    batches = [0]

    def apply(df: Any, _batch_id: int) -> None:
        latest = (df.groupBy("id").agg(F.max_by(F.struct("name", "amount", "v", "op", "seq"), "seq").alias("e"))
                  .select("id", "e.*"))
        (DeltaTable.forPath(spark, target).alias("t").merge(latest.alias("s"), "t.id = s.id")
         .whenMatchedDelete("s.op = 'd' AND s.seq > t.seq")
         .whenMatchedUpdate("s.op <> 'd' AND s.seq > t.seq",
                            {"name": "s.name", "amount": "s.amount", "v": "s.v", "seq": "s.seq"})
         .whenNotMatchedInsert("s.op <> 'd'", {"id": "s.id", "name": "s.name", "amount": "s.amount", "v": "s.v",
                                               "seq": "s.seq"})
         .execute())
        batches[0] += 1

    t0 = time.monotonic()
    query = (spark.readStream.format("delta").load(changes).writeStream.foreachBatch(apply)
             .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())
    query.awaitTermination()
    return time.monotonic() - t0, batches[0]


def sdp_probe(base: Path, driver_memory: str, master: str) -> str:
    """Run ``create_auto_cdc_flow`` with ``spark-pipelines run`` on a tiny Delta change table; what
    it says (Spark 4.2 refuses a Delta target: AUTO CDC needs a DSv2 table with row-level operations)."""
    ev = make_events(10, 10, 1)
    changes = base / "changes"
    write_change_table(ev, str(changes))
    code = textwrap.dedent(f'''\
        from pyspark import pipelines as dp


        @dp.temporary_view(name="changes")
        def changes():
            return spark.readStream.format("delta").load("{changes}")  # noqa: F821 - set by the CLI


        dp.create_streaming_table("replica")
        dp.create_auto_cdc_flow(target="replica", source="changes", keys=["id"], sequence_by="seq",
                                apply_as_deletes="op = 'd'", except_column_list=["op", "seq"], stored_as_scd_type=1)
        ''')
    project, conf = make_sdp_project(base, "cdc", code, driver_memory)
    try:
        took, _ = sdp_update(base, project, conf, master, 0)
    except BenchError as exc:
        text = (base / "run0.log").read_text(errors="replace")
        for line in text.splitlines():
            if line.startswith("pyspark.errors") or "AUTOCDC_" in line:
                return f"fails: {line.split(': ', 1)[-1][:300]}"
        return f"fails: {str(exc).splitlines()[0]}"
    return f"ran ({took:.1f} s on 10 events): AUTO CDC on Delta works here; compare it with this bench's stand-in"


# ------------------------------------------------------------------ compare


def checksum(spark: SparkSession, path: str) -> tuple[int, int]:
    """(rows, sum of xxhash64 over the columns) of a table."""
    from pyspark.sql import functions as F

    row = spark.read.format("delta").load(path).agg(
        F.count(F.lit(1)), F.sum(F.xxhash64(*COLUMNS).cast("decimal(38,0)"))).first()
    return int(row[0]), int(row[1] or 0)


def expected_rows(rows: int, ev: Events) -> int:
    return rows + int((ev.ops == INS).sum()) - int((ev.ops == DEL).sum())


# ------------------------------------------------------------------ 2: lag from PostgreSQL


@dataclass
class Lag:
    lags: list[float] = field(default_factory=list)  # per source transaction, seconds
    units: list[float] = field(default_factory=list)  # unit durations with changes
    changes: int = 0
    txs: int = 0
    written: int = 0
    write_s: float = 0.0
    equal: str = ""


def _writer(url: str, rows: int, rate: float, per_tx: int, seconds: float, out: Lag,
            stop: threading.Event) -> None:
    """Small transactions at ``rate`` changes/s for ``seconds`` (paced by the clock, never more)."""
    import psycopg

    rnd = random.Random(7)
    live = list(range(1, rows + 1))  # the table's keys, kept as the writer changes them
    next_id = rows + 1
    t0 = time.monotonic()
    n = 0
    with psycopg.connect(url, autocommit=True) as conn:
        while not stop.is_set() and time.monotonic() - t0 < seconds:
            due = t0 + n / rate
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            with conn.transaction():
                for _ in range(per_tx):
                    r = rnd.random()
                    if r < MIX[1] or len(live) < 2:
                        conn.execute("INSERT INTO public.items VALUES (%s, %s, %s, %s)", (next_id, f"w{n}", n * 0.5, n))
                        live.append(next_id)
                        next_id += 1
                    else:
                        i = rnd.randrange(len(live))
                        if r < MIX[1] + MIX[2]:
                            conn.execute("DELETE FROM public.items WHERE id = %s", (live[i],))
                            live[i] = live[-1]
                            live.pop()
                        else:
                            conn.execute("UPDATE public.items SET name = %s, amount = %s, v = %s WHERE id = %s",
                                         (f"w{n}", n * 0.5, n, live[i]))
                    n += 1
    out.written, out.write_s = n, time.monotonic() - t0


def run_lag(spark: SparkSession, base: Path, rows: int, rate: float, per_tx: int, seconds: float) -> Lag:
    import psycopg

    from platform_assets.cdc.replicator import ReplicatorUnit
    from resources.state import local_pg

    pg_home = base / "pg"
    pg_home.mkdir()
    os.chmod(base, 0o755)  # as root, the server's user must be able to enter it
    os.chmod(pg_home, 0o755)
    server = local_pg.start(pg_home, port=local_pg.free_port(), options={"wal_level": "logical"})
    out = Lag()
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE public.items (id bigint PRIMARY KEY, name text, amount double precision, v bigint)")
            conn.execute("INSERT INTO public.items SELECT g, 'n' || g, g * 0.5, g %% 1000 FROM generate_series(1, %s) g",
                         (rows,))
        lineage = base / "lag-lineage.yaml"
        lineage.write_text(f"cdc:\n  - name: lagb\n    dsn_env: TIDEMARK_BENCH_CDC_DSN\n    tables: [{TABLE}]\n")
        os.environ["TIDEMARK_BENCH_CDC_DSN"] = server.url
        settings = Settings.from_env({}, home=base / "lag-home", lineage=lineage, spark_master="local[2]")
        engine, rep, source, seen = observed_replicator(settings, "lagb", spark, "bench-lag")
        path = settings.table_path("replica.items")
        try:
            t = time.monotonic()
            while ReplicatorUnit(engine, rep, source).run_once().processed:  # the snapshot, untimed
                pass
            print(f"lag: snapshot of {rows:,} rows in {time.monotonic() - t:.1f} s (untimed)", flush=True)
            seen.clear()
            stop = threading.Event()
            writer = threading.Thread(target=_writer, args=(server.url, rows, rate, per_tx, seconds, out, stop),
                                      daemon=True)
            writer.start()
            deadline = time.monotonic() + seconds + 300
            try:
                while True:
                    running = writer.is_alive()
                    t = time.monotonic()
                    result = ReplicatorUnit(engine, rep, source).run_once()
                    if result.tables:
                        from deltalake import DeltaTable

                        committed = DeltaTable(path).history(1)[0]["timestamp"] / 1000.0
                        out.units.append(time.monotonic() - t)
                        out.changes += result.changes
                        for tx in seen:
                            out.lags.append(committed - tx.commit_time.replace(tzinfo=dt.UTC).timestamp())
                        out.txs += len(seen)
                    seen.clear()
                    if not running and not result.tables:
                        break
                    if time.monotonic() > deadline:
                        raise BenchError(f"the replicator did not catch up within {seconds + 300:.0f} s")
            finally:
                stop.set()
                writer.join()
            with psycopg.connect(server.url) as conn:
                src = conn.execute("SELECT count(*), coalesce(sum(id * 7 + v), 0) FROM public.items").fetchone()
            rep_row = spark.read.format("delta").load(path).selectExpr("count(*)", "coalesce(sum(id * 7 + v), 0)").first()
            got = (int(rep_row[0]), int(rep_row[1]))
            if src is None or (int(src[0]), int(src[1])) != got:
                raise BenchError(f"lag: the replica differs from the source: source {src}, replica {got}")
            out.equal = f"{got[0]:,} rows, checksum equal"
        finally:
            source.close()
            engine.close()
    finally:
        local_pg.stop(pg_home)
    return out


# ------------------------------------------------------------------ main


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rows", type=int, default=5_000_000, help="rows of the replica before the events")
    p.add_argument("--events", type=int, default=1_000_000, help="change events applied")
    p.add_argument("--maxstep", type=int, default=0, help="the replicator's maxstep (default: --events, one unit)")
    p.add_argument("--lag-seconds", type=float, default=60.0, help="how long the writer runs (0: no lag part)")
    p.add_argument("--lag-rate", type=float, default=1000.0, help="changes/s the writer commits")
    p.add_argument("--lag-tx", type=int, default=10, help="changes per source transaction")
    p.add_argument("--lag-rows", type=int, default=100_000, help="rows of the PostgreSQL table before the load")
    p.add_argument("--sdp-probe", action=argparse.BooleanOptionalAction, default=True,
                   help="run `spark-pipelines run` with create_auto_cdc_flow on a Delta table and print what it says")
    p.add_argument("--driver-memory", default="4g", help="the bench's Spark driver memory")
    p.add_argument("--reader", choices=["columns", "python"], default="columns",
                   help="the processor's path: the columnar read and reduction (default), or change by change")
    p.add_argument("--change-feed", action=argparse.BooleanOptionalAction, default=True,
                   help="the replica keeps Delta's Change Data Feed (the default; AUTO CDC's target has none)")
    p.add_argument("--deletion-vectors", choices=["off", "replica", "both"], default="off",
                   help="Delta deletion vectors on the replica (`deletion_vectors: true`, an opt-in) or on both "
                        "sides' tables (AUTO CDC's target too)")
    p.add_argument("--hot", type=float, default=0.0, metavar="SHARE",
                   help="updates and deletes change only the newest SHARE of the keys (e.g. 0.02; default: any key)")
    p.add_argument("--files", type=int, default=0, help="starting files of both tables, each of consecutive keys "
                                                         "(default 0: Spark's split, 4 files; a snapshot writes ~50k rows per file)")
    p.add_argument("--seed", type=int, default=10)
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = p.parse_args(argv)
    if not cached_delta_jars():
        print("error: no cached Delta jars; start Spark once first (./scripts/setup.sh or `tidemark spark up`)",
              file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix="tidemark-cdc-bench-"))
    print(f"work dir {base}; {args.rows:,} rows, {args.events:,} events; load: {os.getloadavg()[0]:.2f}", flush=True)
    os.environ["TIDEMARK_DRIVER_MEMORY"] = args.driver_memory
    spark = None
    thr: Throughput | None = None
    lag: Lag | None = None
    try:
        from resources.spark.session import build_spark_session

        settings = Settings.from_env({}, home=base / "home", lineage=make_lineage(base, base / "events",
                                                                                 args.maxstep or args.events,
                                                                                 args.change_feed,
                                                                                 args.deletion_vectors != "off"),
                                     spark_master="local[2]")
        t = time.monotonic()
        spark = build_spark_session(settings, app_name="tidemark-bench-cdc")
        print(f"Spark session started in {time.monotonic() - t:.1f} s", flush=True)
        if args.events > 0:
            thr = throughput(spark, settings, base, args)
        if args.lag_seconds > 0:
            lag = run_lag(spark, base, args.lag_rows, args.lag_rate, args.lag_tx, args.lag_seconds)
    except BenchError as exc:
        print(f"\nFAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if spark is not None:
            spark.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    print_table(args, thr, lag)
    return 0


@dataclass
class Throughput:
    cdc_s: float
    auto_s: float
    units: int
    batches: int
    probe: str


def throughput(spark: SparkSession, settings: Settings, base: Path, args: argparse.Namespace) -> Throughput:
    """Part 1: the same events by both sides from the same starting rows; results compared."""
    events_dir = base / "events"
    events_dir.mkdir()
    t = time.monotonic()
    ev = make_events(args.rows, args.events, args.seed, args.hot)
    write_debezium(ev, events_dir / "0001.json")
    changes = str(base / "changes")
    write_change_table(ev, changes)
    mix = ", ".join(f"{k} {int((ev.ops == o).sum()):,}" for k, o in (("update", UPD), ("insert", INS), ("delete", DEL)))
    print(f"events: {args.events:,} ({mix}) in {int(ev.tx[-1]) + 1:,} transactions; generated in "
          f"{time.monotonic() - t:.1f} s (untimed)", flush=True)
    t = time.monotonic()
    replica = write_replica(spark, settings, args.rows, args.change_feed, args.deletion_vectors != "off", args.files)
    target = str(base / "autocdc" / "items")
    write_autocdc_target(spark, target, args.rows, args.deletion_vectors == "both", args.files)
    print(f"starting tables written in {time.monotonic() - t:.1f} s (untimed)", flush=True)

    # Whichever side goes first pays the first query's costs (JIT, caches): AUTO CDC's goes first.
    auto_s, batches = autocdc_on_delta(spark, changes, target, str(base / "autocdc" / "_checkpoint"))
    print(f"AUTO CDC algorithm on Delta: {auto_s:.1f} s, {batches} micro-batch(es)", flush=True)
    cdc_s, results, timer = run_cdc(spark, settings, args.reader)
    units = [r for r in results if r.processed]
    print(f"cdc processor ({args.reader}, change feed {'on' if args.change_feed else 'off'}, deletion vectors "
          f"{args.deletion_vectors}): {cdc_s:.1f} s, {len(units)} unit(s) with changes + {len(results) - len(units)} "
          f"caught-up check; {timer.text()}", flush=True)
    applied = sum(r.changes for r in units)
    if applied != args.events:
        raise BenchError(f"the cdc processor applied {applied:,} changes, expected {args.events:,}")
    a, b = checksum(spark, replica), checksum(spark, target)
    want = expected_rows(args.rows, ev)
    equal = a == b and a[0] == want
    print(f"equal: cdc {a[0]:,} rows checksum {a[1]}, AUTO CDC algorithm {b[0]:,} rows checksum {b[1]}; "
          f"expected {want:,} rows -> {'EQUAL' if equal else 'DIFFERENT'}", flush=True)
    if not equal:
        raise BenchError("the two results differ")
    probe = "not run (--no-sdp-probe)"
    if args.sdp_probe:
        probe = sdp_probe(base / "sdp", "2g", "local[2]")
        print(f"spark-pipelines run with create_auto_cdc_flow on Delta: {probe}", flush=True)
    return Throughput(cdc_s, auto_s, len(units), batches, probe)


def print_table(args: argparse.Namespace, thr: Throughput | None, lag: Lag | None) -> None:
    if thr is not None:
        cdc_eps, auto_eps = args.events / thr.cdc_s, args.events / thr.auto_s
        ratio = cdc_eps / auto_eps
        print(f"\nthroughput: {args.events:,} events onto {args.rows:,} rows (60/20/20 update/insert/delete), one warm "
              f"local[2] session, load {os.getloadavg()[0]:.2f}")
        print(f"{'side':<40} {'s':>8} {'events/s':>10}  runs")
        dv = args.deletion_vectors
        side = f"cdc processor ({args.reader}, feed {'on' if args.change_feed else 'off'}{', DVs' if dv != 'off' else ''})"
        print(f"{side:<40} {thr.cdc_s:8.1f} {cdc_eps:10,.0f}  {thr.units} unit(s)")
        print(f"{'AUTO CDC algorithm on Delta' + (' (DVs)' if dv == 'both' else ''):<40} {thr.auto_s:8.1f} {auto_eps:10,.0f}  "
              f"{thr.batches} micro-batch(es)")
        print(f"target: cdc >= {TARGET_RATIO}x AUTO CDC: {ratio:.2f}x -> {'met' if ratio >= TARGET_RATIO else 'MISSED'}")
        print(f"spark-pipelines AUTO CDC on Delta: {thr.probe}")
    if lag is None:
        return
    rate = lag.written / lag.write_s if lag.write_s else 0.0
    p95 = pct(lag.lags, 95)
    print(f"\nlag: source commit -> replica commit, {lag.written:,} changes written at {rate:,.0f}/s "
          f"({args.lag_tx} per transaction) for {lag.write_s:.0f} s onto {args.lag_rows:,} rows")
    print(f"{'transactions':>12} {'changes':>9} {'units':>6} {'unit p50 s':>11} {'p50 s':>7} {'p95 s':>7} {'max s':>7}")
    print(f"{lag.txs:>12,} {lag.changes:>9,} {len(lag.units):>6} {pct(lag.units, 50):>11.1f} {pct(lag.lags, 50):>7.1f} "
          f"{p95:>7.1f} {max(lag.lags, default=float('nan')):>7.1f}")
    print(f"replica equal to the source after the load: {lag.equal}")
    print(f"target: lag p95 < {TARGET_LAG_P95:.0f} s: {p95:.1f} s -> {'met' if p95 < TARGET_LAG_P95 else 'MISSED'}")


if __name__ == "__main__":
    raise SystemExit(main())
