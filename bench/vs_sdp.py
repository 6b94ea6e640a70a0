"""End to end against Spark Declarative Pipelines: the same incremental workload run by
``spark-pipelines run`` (a streaming table) and by Tidemark through Dagster (planner sensor
tick -> ``dagster asset materialize`` -> commit), in the same run, with the results checked equal.

    .venv/bin/python bench/vs_sdp.py                                   # 1M rows, 100k customers
    .venv/bin/python bench/vs_sdp.py --rows 100000 --customers 10000   # quick (updates scale with --rows)

Workload (issue 8): an orders stream ``(pos, id, customer_id, amount)`` left-joined to a
customers table (``customer_id, name, segment``), Delta in and out. Both read the same source
Delta tables, written by ``deltalake`` between updates (untimed). Four updates: the initial load
(``--rows``), +``--rows``/10, no new rows, +``--rows``.

* SDP: a pipeline project (``spark-pipeline.yml`` + one Python file with a ``@dp.table``
  streaming table over ``spark.readStream`` of the orders, joined to a batch read of the
  customers), run by a fresh ``spark-pipelines run`` per update, as a scheduler would start it.
  Its Spark settings (Delta jars from the cache, Delta's extension and catalog, ``local[2]``,
  a Hive metastore in Derby so the streaming table survives between runs) are in a
  ``spark-defaults.conf`` under ``SPARK_CONF_DIR``: pyspark 4.2's local Connect start keeps
  only part of the ``--conf`` options it is given on the command line.
* Tidemark: one step topic ``fact.orders`` (``maxstep`` = ``--maxstep``) over a warm Spark Connect
  server (started once, untimed, ``local[2]``, like the daemon's infrastructure; warmed up by a
  small untimed Delta append and join, as earlier blocks would have, unless ``--no-warmup``).
  Per update: the ``tidemark_planner`` sensor is ticked in this process as the daemon does, its
  partitions are added, each requested run is a fresh ``dagster asset materialize`` process, and
  the sensor is ticked again until it requests nothing (that last tick is timed too).

Wall time per update is from the start of the first process (or tick) to the exit of the last.
The script exits 1 if the two output tables differ (row count, ``exceptAll`` both ways) or
either side fails; missed targets are reported but exit 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dagster as dg  # noqa: E402

from bench.shared import (  # noqa: E402
    BenchError,
    append_orders,
    diff_counts,
    make_sdp_project,
    run_logged,
    sdp_table_path,
    sdp_update,
)
from platform_assets.dagster.definitions import build_definitions  # noqa: E402
from resources.core.settings import Settings  # noqa: E402
from resources.spark import server as spark_server  # noqa: E402
from resources.spark.session import cached_delta_jars  # noqa: E402
from tests.platform_assets.shop import materialize_command  # noqa: E402

COLUMNS = ["pos", "id", "customer_id", "amount", "customer_name", "segment"]
TRANSFORM_SQL = """
SELECT o.pos, o.id, o.customer_id, o.amount, c.name AS customer_name, c.segment
FROM block o LEFT JOIN dim.customers c ON c.customer_id = o.customer_id
"""
SDP_TABLE = "orders_enriched"
TARGETS = {"initial": 1.0, "+small": 0.5, "no-op": 0.5}  # Tidemark / SDP wall time, at most


@dataclass
class Update:
    name: str
    new_rows: int
    sdp_s: float = 0.0
    sdp_phases: dict[str, float] = field(default_factory=dict)
    tm_s: float = 0.0
    tm_runs: int = 0
    tm_ticks: float = 0.0  # seconds spent in sensor ticks


# ------------------------------------------------------------------ data


def write_customers(path: str, n: int) -> None:
    import numpy as np
    import pyarrow as pa
    from deltalake import write_deltalake

    ids = np.arange(n, dtype=np.int64)
    segments = np.array(["retail", "smb", "enterprise", None], dtype=object)[ids % 4]
    write_deltalake(path, pa.table({"customer_id": ids, "name": pa.array([f"customer-{i}" for i in ids]),
                                    "segment": pa.array(segments, type=pa.string())}), mode="overwrite")


# ------------------------------------------------------------------ SDP


def sdp_code(orders: str, customers: str) -> str:
    """The pipeline's transformation: a streaming table over the orders, joined to the customers."""
    return textwrap.dedent(f'''\
        from pyspark import pipelines as dp
        from pyspark.sql import functions as F


        @dp.table(name="{SDP_TABLE}")
        def {SDP_TABLE}():
            o = spark.readStream.format("delta").load("{orders}").alias("o")  # noqa: F821 - set by the CLI
            c = spark.read.format("delta").load("{customers}").alias("c")  # noqa: F821
            return o.join(c, F.col("o.customer_id") == F.col("c.customer_id"), "left").select(
                "o.pos", "o.id", "o.customer_id", "o.amount", F.col("c.name").alias("customer_name"), "c.segment")
        ''')


# ------------------------------------------------------------------ Tidemark


def make_lineage(base: Path, maxstep: int) -> Path:
    (base / "sql").mkdir(parents=True)
    (base / "sql" / "fact_orders.sql").write_text(TRANSFORM_SQL)
    lin = base / "lineage"
    lin.mkdir()
    (lin / "orders.yaml").write_text(textwrap.dedent(f"""\
        sources:
          - table: stage.orders
          - table: dim.customers
            freshness: static
        topics:
          - table: fact.orders
            depends_on: [stage.orders]
            transforms: [../sql/fact_orders.sql]
            maxstep: {maxstep}
            delay: 0
            repeat: 0
            comment: orders joined to customers (bench/vs_sdp.py)
        """))
    return lin


def tidemark_update(defs: dg.Definitions, settings: Settings, dagster_home: Path, master: str, logs: Path,
                    n: int) -> tuple[float, int, float]:
    """One update through Dagster: tick, run each requested block in a fresh process, until a
    tick requests nothing. Returns (wall seconds, runs, seconds in ticks)."""
    from platform_assets.dagster.local_daemon import PLANNER, apply_partition_requests

    t0 = time.monotonic()
    ticks = 0.0
    runs = 0
    sensor = defs.resolve_sensor_def(PLANNER)
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        while True:
            t_tick = time.monotonic()
            ctx = dg.build_sensor_context(instance=instance, instance_ref=instance.get_ref(), definitions=defs)
            tick = sensor.evaluate_tick(ctx)
            apply_partition_requests(instance, tick.dynamic_partitions_requests or [])
            ticks += time.monotonic() - t_tick
            if not tick.run_requests:
                break
            for req in tick.run_requests:
                if req.partition_key is None:
                    raise BenchError(f"the planner requested an unpartitioned run: {req}")
                runs += 1
                cmd, env = materialize_command(settings, dagster_home, "fact/orders", req.partition_key, master=master)
                env["TIDEMARK_DRIVER_MEMORY"] = os.environ["TIDEMARK_DRIVER_MEMORY"]
                run_logged(cmd, env, ROOT, logs / f"update{n}-run{runs}.log",
                           f"dagster asset materialize fact/orders --partition {req.partition_key}")
            if runs > 1000:
                raise BenchError("more than 1000 runs in one update; is the planner stuck?")
    return time.monotonic() - t0, runs, ticks


def warm_up(url: str, scratch: Path) -> float:
    """A small Delta append, join and read through the server, as a long-lived server has done
    before (a daemon's earlier blocks): loads Delta's classes once. Returns seconds."""
    from pyspark.sql import SparkSession

    t0 = time.monotonic()
    spark = SparkSession.builder.remote(url).getOrCreate()
    try:
        spark.range(1000).selectExpr("id", "id % 7 AS k").write.format("delta").mode("append").save(str(scratch))
        df = spark.read.format("delta").load(str(scratch))
        df.join(df.selectExpr("k AS id", "k AS k2"), "id", "left").count()
    finally:
        spark.stop()
    return time.monotonic() - t0


# ------------------------------------------------------------------ compare


def compare(url: str, tidemark_path: str, sdp_path: str, expected_rows: int) -> str:
    """Row counts and ``exceptAll`` both ways, over the warm Connect server."""
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(url).getOrCreate()
    try:
        n_tm, n_sdp, only_tm, only_sdp = diff_counts(spark.read.format("delta").load(tidemark_path),
                                                     spark.read.format("delta").load(sdp_path), COLUMNS)
    finally:
        spark.stop()
    text = (f"Tidemark {n_tm:,} rows, SDP {n_sdp:,} rows, orders {expected_rows:,}; "
            f"only in Tidemark {only_tm:,}, only in SDP {only_sdp:,}")
    if not (n_tm == n_sdp == expected_rows and only_tm == only_sdp == 0):
        raise BenchError(f"the results differ: {text}")
    return text


# ------------------------------------------------------------------ main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000, help="initial orders; then +rows/10, +0, +rows")
    p.add_argument("--customers", type=int, default=100_000, help="rows of the customers table")
    p.add_argument("--maxstep", type=int, default=1_000_000, help="Tidemark's rows per block (the default maxstep)")
    p.add_argument("--driver-memory", default="2g", help="driver memory of both Spark drivers")
    p.add_argument("--master", default="local[2]", help="Spark master of both drivers")
    p.add_argument("--no-warmup", action="store_true", help="measure the first block on a server that did no Delta work")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (data, logs)")
    args = p.parse_args()
    if not cached_delta_jars():
        print("error: no cached Delta jars; start Spark once first (e.g. ./scripts/setup.sh or `tidemark spark up`)",
              file=sys.stderr)
        return 1

    base = Path(tempfile.mkdtemp(prefix="tidemark-vs-sdp-"))
    print(f"work dir {base}; {args.rows:,} orders, {args.customers:,} customers, master {args.master}", flush=True)
    os.environ["TIDEMARK_DRIVER_MEMORY"] = args.driver_memory
    updates = [Update("initial", args.rows), Update("+small", args.rows // 10), Update("no-op", 0),
               Update("+large", args.rows)]
    server_home = base / "server"
    try:
        tm_base = base / "tidemark"
        settings = Settings.from_env({}, home=tm_base / "home", lineage=make_lineage(tm_base, args.maxstep))
        dagster_home = tm_base / "dagster"
        dagster_home.mkdir(parents=True)
        (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
        logs = tm_base / "logs"
        logs.mkdir()
        orders, customers = settings.table_path("stage.orders"), settings.table_path("dim.customers")
        write_customers(customers, args.customers)
        sdp_base = base / "sdp"
        project, conf = make_sdp_project(sdp_base, "vs_sdp", sdp_code(orders, customers), args.driver_memory)

        t_server = time.monotonic()
        server = spark_server.start(server_home, port=spark_server.free_port(), master=args.master,
                                    driver_memory=args.driver_memory)
        print(f"warm Spark Connect server for Tidemark: {server.url}, started in {time.monotonic() - t_server:.1f} s "
              "(once, untimed)", flush=True)
        if not args.no_warmup:
            print(f"  warmed up with a small Delta append and join in {warm_up(server.url, base / 'warmup'):.1f} s "
                  "(untimed; --no-warmup skips it)", flush=True)

        # The daemon's code server keeps the definitions loaded between ticks: built once, untimed.
        defs = build_definitions(settings)
        t0 = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
        next_id = 1
        for i, up in enumerate(updates, 1):
            append_orders(orders, next_id, up.new_rows, args.customers, t0)
            next_id += up.new_rows
            up.sdp_s, up.sdp_phases = sdp_update(sdp_base, project, conf, args.master, i)
            up.tm_s, up.tm_runs, up.tm_ticks = tidemark_update(defs, settings, dagster_home, server.url, logs, i)
            phases = ", ".join(f"{k} {v:.0f}" for k, v in up.sdp_phases.items())
            print(f"  {up.name:8} +{up.new_rows:>9,} rows: SDP {up.sdp_s:6.1f} s ({phases}); Tidemark {up.tm_s:6.1f} s "
                  f"({up.tm_runs} runs, ticks {up.tm_ticks:.1f} s)", flush=True)

        sdp_path = sdp_table_path(sdp_base, SDP_TABLE)
        check = compare(server.url, settings.table_path("fact.orders"), str(sdp_path), next_id - 1)
    except BenchError as exc:
        print(f"\nFAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        spark_server.stop(server_home)
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    print(f"\nwall time per update ({args.rows:,} initial orders, {args.customers:,} customers; "
          f"SDP: a fresh `spark-pipelines run`; Tidemark: sensor tick -> `dagster asset materialize` -> commit)")
    print(f"{'update':8} {'new rows':>10} {'SDP s':>8} {'Tidemark s':>11} {'runs':>5} {'TM/SDP':>7} {'target':>7}  verdict")
    for up in updates:
        ratio = up.tm_s / up.sdp_s
        target = TARGETS.get(up.name)
        verdict = "-" if target is None else ("PASS" if ratio <= target else "MISS")
        tgt = "-" if target is None else f"<={target:.1f}"
        print(f"{up.name:8} {up.new_rows:>10,} {up.sdp_s:8.1f} {up.tm_s:11.1f} {up.tm_runs:>5} {ratio:7.2f} {tgt:>7}  {verdict}")
    print(f"\nresults equal: {check}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
