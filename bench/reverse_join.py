"""Reverse join: the cost of keeping a wide view current when rows of its reference table change,
against a full rebuild of the view and against Spark Declarative Pipelines' materialized view,
in the same run, with the three results checked equal.

    .venv/bin/python bench/reverse_join.py                                  # 5M orders, 100k customers
    .venv/bin/python bench/reverse_join.py --rows 200000 --customers 10000  # quick (changes scale too)

Workload (issue 9): ``mart.orders_wide`` = an orders fact ``stage.orders (pos, id, customer_id,
amount)`` left-joined to ``dim.customers (id, name, segment, country)`` (Change Data Feed on);
~5 % of the orders have no customer. Sources are written untimed (orders by ``deltalake`` in
1M-row appends, customers by Spark). The view is built once (untimed, printed), then three
changes each update N customers in place (one Delta MERGE, untimed; N = 10, 1,000, 100,000 at
100k customers, scaled with ``--customers``, or ``--changes``). After each change, timed:

* Tidemark: ``Engine.run_until_caught_up`` of the ``merge`` topic (``refresh: incremental``) in
  this process's warm SparkSession (``local[2]``); the strategy it chose and why, the keys it
  re-derived, the reference rows that changed and its phases are printed from the unit's statistics;
* full rebuild: the same SQL computed from scratch over the whole orders table (``block`` bound
  to all of ``stage.orders``) and written with one Delta overwrite, in the same session: the
  cheapest full rebuild, with none of Tidemark's bookkeeping;
* SDP: the same view as a ``@dp.materialized_view`` in a pipeline project, run by a fresh
  ``spark-pipelines run`` (as a scheduler starts it: the time includes its JVMs' start); the
  phases from its log (``flow`` = SDP's own refresh) are printed too.

Tidemark and the full rebuild share a session, so they alternate which goes first after each
change. For a MERGE, Delta's own timings of the commit (``executionTimeMs``, ``scanTimeMs``,
``rewriteTimeMs`` ...) are printed next to Tidemark's phases.

Then the three tables are compared (row counts, ``exceptAll`` both ways, untimed): if any differ,
the script exits 1. Targets: 10 changed rows (the smallest change) cost < 5 % of the full
rebuild; at 100,000 (the largest) Tidemark <= 1.10 x the full rebuild. A miss is printed and
exits 0. ``--sides`` leaves Tidemark or SDP out (e.g. ``--sides full,sdp``); ``--keep`` keeps
the temp dir.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.shared import (  # noqa: E402
    BenchError,
    append_orders,
    close_run,
    diff_counts,
    make_sdp_project,
    sdp_table_path,
    sdp_update,
    spark_job_mark,
)
from resources.core.settings import Settings  # noqa: E402
from resources.spark.session import cached_delta_jars  # noqa: E402

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from platform_assets.engine.runner import Engine

TOPIC = "mart.orders_wide"
ORDERS, CUSTOMERS = "stage.orders", "dim.customers"
COLUMNS = ["pos", "id", "customer_id", "amount", "name", "segment", "country"]
TRANSFORM_SQL = """\
SELECT b.pos, b.id, b.customer_id, b.amount, c.name, c.segment, c.country
FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id
"""
SDP_TABLE = "orders_wide"
CHANGES = [10, 1_000, 100_000]  # changed customers at 100k customers
SMALL_TARGET, LARGE_TARGET = 0.05, 1.10  # Tidemark / full rebuild, at most
SIDES = ("tidemark", "full", "sdp")
#: the block statistics printed next to the strategy, those present
STAT_KEYS = ("rows_rederived", "keys_rederived", "reference_rows_read", "reference_rows_changed", "rows_inserted",
             "rows_updated", "rows_deleted", "phases_s")


@dataclass
class Change:
    customers: int  # customers updated in place
    tm_s: float | None = None
    full_s: float = 0.0
    sdp_s: float | None = None
    sdp_phases: dict[str, float] = field(default_factory=dict)
    strategy: str = "-"
    detail: str = ""  # Tidemark's reason and figures


# ------------------------------------------------------------------ data


def write_customers(spark: SparkSession, path: str, n: int) -> None:
    """``n`` customers ``(id, name, segment, country)`` with the Change Data Feed on (a merge topic
    reads a reference table's changes from it)."""
    spark.range(n).selectExpr(
        "id", "concat('customer-', id) AS name",
        "element_at(array('retail', 'smb', 'enterprise'), CAST(id % 3 + 1 AS INT)) AS segment",
        "element_at(array('DE', 'FR', 'NL', 'PL', 'SE', 'US', 'BR'), CAST(id % 7 + 1 AS INT)) AS country",
    ).write.format("delta").option("delta.enableChangeDataFeed", "true").save(path)


def update_customers(spark: SparkSession, path: str, customers: int, n: int, round_no: int) -> None:
    """Update ``n`` distinct random customers in place with one Delta MERGE (name, segment and
    country all change)."""
    import numpy as np
    from delta.tables import DeltaTable

    ids = np.random.default_rng(1000 + round_no).choice(customers, size=n, replace=False)
    src = spark.createDataFrame([(int(i),) for i in ids], "id BIGINT").selectExpr(
        "id", f"concat('customer-', id, '-r{round_no}') AS name",
        f"element_at(array('retail', 'smb', 'enterprise', 'public'), CAST((id + {round_no}) % 4 + 1 AS INT)) AS segment",
        f"element_at(array('DE', 'FR', 'NL', 'PL', 'SE', 'US', 'BR', 'JP'), CAST((id + {round_no}) % 8 + 1 AS INT))"
        " AS country")
    (DeltaTable.forPath(spark, path).alias("t").merge(src.alias("s"), "t.id = s.id")
     .whenMatchedUpdate(set={"name": "s.name", "segment": "s.segment", "country": "s.country"}).execute())


# ------------------------------------------------------------------ the three sides


def make_lineage(base: Path, maxstep: int) -> Path:
    (base / "sql").mkdir(parents=True)
    (base / "sql" / "orders_wide.sql").write_text(TRANSFORM_SQL)
    lin = base / "lineage"
    lin.mkdir()
    (lin / "orders_wide.yaml").write_text(textwrap.dedent(f"""\
        sources:
          - table: {ORDERS}
          - table: {CUSTOMERS}
        topics:
          - table: {TOPIC}
            depends_on: [{ORDERS}, {CUSTOMERS}]
            processor: merge
            transforms: [../sql/orders_wide.sql]
            key: [id]
            join_keys:
              {CUSTOMERS}: {{customer_id: id}}
            refresh: incremental
            maxstep: {maxstep}
            delay: 0
            repeat: 0
            comment: orders joined to customers, kept current by reverse join (bench/reverse_join.py)
        """))
    return lin


def tidemark_refresh(engine: Engine, topic: str = TOPIC) -> tuple[float, str, str]:
    """Bring the view up to date: (seconds, strategies, what the blocks' statistics say)."""
    before = spark_job_mark(engine.spark)
    t0 = time.monotonic()
    results = [r for r in engine.run_until_caught_up([topic]) if r.processed]
    took = time.monotonic() - t0
    after = spark_job_mark(engine.spark)
    if not results:
        raise BenchError(f"Tidemark processed nothing for {topic} after the change")
    strategies = "+".join(str(r.stats.get("strategy", "?")) for r in results)
    detail = "; ".join(f"{r.stats.get('strategy_reason', r.reason)} ("
                       + ", ".join(f"{k} {r.stats[k]}" for k in STAT_KEYS if r.stats.get(k) not in (None, {}))
                       + ")" for r in results)
    if before is not None and after is not None:
        detail += f"; Spark jobs {after - before}"
    return took, strategies, detail


def merge_metrics(view: str) -> str:
    """Delta's own timings of the view's newest commit, when it is a MERGE (where its time went)."""
    from deltalake import DeltaTable

    from platform_assets.core.merge_layout import is_resort, newest_unit_commit

    table = DeltaTable(view)
    last = newest_unit_commit(table)  # (not the re-sort of the files a MERGE packed)
    if last.get("operation") != "MERGE":
        return ""
    m = last.get("operationMetrics") or {}
    keys = ("executionTimeMs", "materializeSourceTimeMs", "scanTimeMs", "rewriteTimeMs", "numTargetFilesAdded",
            "numTargetFilesRemoved", "numTargetDeletionVectorsAdded",  # Spark's names, then deltalake's
            "execution_time_ms", "scan_time_ms", "rewrite_time_ms", "num_target_files_scanned",
            "num_target_files_added", "num_target_files_removed", "num_target_rows_copied")
    resorted = "; its packed files sorted again" if is_resort(table.history(1)[0]) else ""
    return "; Delta MERGE metrics: " + ", ".join(f"{k} {m[k]}" for k in keys if k in m) + resorted


def full_rebuild(spark: SparkSession, orders: str, dest: str, sql: str = TRANSFORM_SQL) -> float:
    """The view's SQL over all of the orders, written with one overwrite: seconds."""
    t0 = time.monotonic()
    spark.read.format("delta").load(orders).createOrReplaceTempView("block")
    spark.sql(sql).write.format("delta").mode("overwrite").save(dest)
    return time.monotonic() - t0


def sdp_code(orders: str, customers: str) -> str:
    """The pipeline's transformation: the view as a materialized view (recomputed by every run)."""
    return textwrap.dedent(f'''\
        from pyspark import pipelines as dp
        from pyspark.sql import functions as F


        @dp.materialized_view(name="{SDP_TABLE}")
        def {SDP_TABLE}():
            b = spark.read.format("delta").load("{orders}").alias("b")  # noqa: F821 - set by the CLI
            c = spark.read.format("delta").load("{customers}").alias("c")  # noqa: F821
            return b.join(c, F.col("b.customer_id") == F.col("c.id"), "left").select(
                "b.pos", "b.id", "b.customer_id", "b.amount", "c.name", "c.segment", "c.country")
        ''')


def compare(spark: SparkSession, tables: dict[str, str], expected_rows: int | None,
            columns: list[str] = COLUMNS) -> str:
    """Every table against the first: row counts (``expected_rows``, None: any) and ``exceptAll`` both ways."""
    (first, first_path), *others = tables.items()
    ref = spark.read.format("delta").load(first_path)
    texts = []
    for name, path in others:
        n_a, n_b, only_a, only_b = diff_counts(ref, spark.read.format("delta").load(path), columns)
        text = f"{first} {n_a:,} rows, {name} {n_b:,}, only in {first} {only_a:,}, only in {name} {only_b:,}"
        if not (n_a == n_b == (n_a if expected_rows is None else expected_rows) and only_a == only_b == 0):
            raise BenchError(f"the results differ (expected {expected_rows or n_a:,} rows): {text}")
        texts.append(text)
    return "; ".join(texts)


# ------------------------------------------------------------------ main


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def verdict(ratio: float | None, target: float, strict: bool) -> str:
    if ratio is None:
        return "not measured"
    ok = ratio < target if strict else ratio <= target
    return "PASS" if ok else "MISS"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=5_000_000, help="orders (the fact)")
    p.add_argument("--customers", type=int, default=100_000, help="rows of the reference table")
    p.add_argument("--changes", default="",
                   help="customers updated per change, comma-separated (default 10,1000,100000 scaled to --customers)")
    p.add_argument("--maxstep", type=int, default=10_000_000, help="Tidemark's base rows per block")
    p.add_argument("--sides", default=",".join(SIDES), help="which of tidemark,full,sdp to run (full always runs)")
    p.add_argument("--driver-memory", default="2g", help="driver memory of both Spark drivers")
    p.add_argument("--master", default="local[2]", help="Spark master of both drivers")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (data, logs)")
    args = p.parse_args()
    sides = {s.strip() for s in args.sides.split(",") if s.strip()} | {"full"}
    if not sides <= set(SIDES):
        p.error(f"--sides: unknown {sorted(sides - set(SIDES))}; choose from {', '.join(SIDES)}")
    sizes = ([int(x) for x in args.changes.split(",")] if args.changes
             else [max(1, round(n * args.customers / 100_000)) for n in CHANGES])
    if any(not 0 < n <= args.customers for n in sizes):
        p.error(f"--changes: each must be between 1 and --customers ({args.customers}), got {sizes}")
    if not cached_delta_jars():
        print("error: no cached Delta jars; start Spark once first (e.g. ./scripts/setup.sh or `tidemark spark up`)",
              file=sys.stderr)
        return 1

    base = Path(tempfile.mkdtemp(prefix="tidemark-reverse-join-"))
    print(f"work dir {base}; {args.rows:,} orders, {args.customers:,} customers, changes {sizes}, "
          f"master {args.master}", flush=True)
    os.environ["TIDEMARK_DRIVER_MEMORY"] = args.driver_memory
    changes = [Change(n) for n in sizes]
    engine: Engine | None = None
    spark: SparkSession | None = None
    try:
        settings = Settings.from_env({}, home=base / "home", lineage=make_lineage(base / "tidemark", args.maxstep),
                                     spark_master=args.master)
        orders, customers = settings.table_path(ORDERS), settings.table_path(CUSTOMERS)
        full_path = str(base / "full" / SDP_TABLE)
        from platform_assets.core import spark_io
        from resources.spark.session import build_spark_session

        t = time.monotonic()
        spark = build_spark_session(settings, app_name="tidemark-bench-reverse-join")
        t0 = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
        for start in range(0, args.rows, 1_000_000):
            append_orders(orders, start + 1, min(1_000_000, args.rows - start), args.customers, t0)
        write_customers(spark, customers, args.customers)
        spark_io.register_table(spark, CUSTOMERS, customers)  # the full rebuild's SQL reads it by name
        print(f"sources written in {time.monotonic() - t:.1f} s (untimed; includes the Spark session's start)",
              flush=True)

        # Initial build of each side, untimed for the comparison but printed.
        init = [f"full rebuild {full_rebuild(spark, orders, full_path):.1f} s"]
        if "tidemark" in sides:
            from lineage.spec.loader import load_lineage
            from platform_assets.engine.runner import Engine

            engine = Engine(settings, load_lineage(settings.lineage), spark=spark, owner="bench-reverse-join")
            t = time.monotonic()
            blocks = [r for r in engine.run_until_caught_up([TOPIC]) if r.processed]
            init.append(f"Tidemark {time.monotonic() - t:.1f} s ({len(blocks)} blocks)")
        if "sdp" in sides:
            sdp_base = base / "sdp"
            project, conf = make_sdp_project(sdp_base, "reverse_join", sdp_code(orders, customers), args.driver_memory)
            sdp_s, phases = sdp_update(sdp_base, project, conf, args.master, 0)
            init.append(f"SDP {sdp_s:.1f} s ({', '.join(f'{k} {v:.0f}' for k, v in phases.items())})")
        print(f"initial build (untimed for the table): {'; '.join(init)}", flush=True)

        for i, ch in enumerate(changes, 1):
            update_customers(spark, customers, args.customers, ch.customers, i)
            # The two in-session measurements alternate which goes first, so neither always pays
            # (or is spared) what the first query after a change costs.
            if i % 2 == 0:
                ch.full_s = full_rebuild(spark, orders, full_path)
            if engine is not None:
                ch.tm_s, ch.strategy, ch.detail = tidemark_refresh(engine)
                ch.detail += merge_metrics(settings.table_path(TOPIC))
            if i % 2 == 1:
                ch.full_s = full_rebuild(spark, orders, full_path)
            if "sdp" in sides:
                ch.sdp_s, ch.sdp_phases = sdp_update(sdp_base, project, conf, args.master, i)
            tables = {"full rebuild": full_path}
            if engine is not None:
                tables = {"Tidemark": settings.table_path(TOPIC), **tables}
            if "sdp" in sides:
                tables["SDP"] = str(sdp_table_path(sdp_base, SDP_TABLE))
            check = compare(spark, tables, args.rows)
            sdp_text = ", ".join(f"{k} {v:.0f}" for k, v in ch.sdp_phases.items())
            print(f"  change {i}: {ch.customers:,} customers updated: Tidemark {_fmt(ch.tm_s)} s "
                  f"[{ch.detail or '-'}]; full rebuild {ch.full_s:.1f} s; "
                  f"SDP {_fmt(ch.sdp_s)} s ({sdp_text or '-'})\n    equal: {check}", flush=True)
    except BenchError as exc:
        print(f"\nFAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        close_run(engine, spark, base, keep=args.keep)

    print_table(args.rows, args.customers, changes)
    return 0


def print_table(rows: int, customers: int, changes: list[Change]) -> None:
    print(f"\nwall time to bring the view up to date ({rows:,} orders, {customers:,} customers; "
          "Tidemark: merge topic in a warm session; full: SQL from scratch + overwrite, same session; "
          "SDP: a fresh `spark-pipelines run` of a materialized view, JVM start included)")
    print(f"{'changed':>9} {'Tidemark s':>11} {'full s':>8} {'SDP s':>8} {'SDP flow s':>11} {'TM/full':>8} "
          f"{'TM/SDP':>7}  strategy")
    for ch in changes:
        flow = ch.sdp_phases.get("flow")
        r_full = None if ch.tm_s is None else ch.tm_s / ch.full_s
        r_sdp = None if ch.tm_s is None or ch.sdp_s is None else ch.tm_s / ch.sdp_s
        print(f"{ch.customers:>9,} {_fmt(ch.tm_s):>11} {ch.full_s:8.1f} {_fmt(ch.sdp_s):>8} {_fmt(flow):>11} "
              f"{_fmt(r_full, '.3f'):>8} {_fmt(r_sdp, '.3f'):>7}  {ch.strategy}")
    small, large = changes[0], changes[-1]
    r_small = None if small.tm_s is None else small.tm_s / small.full_s
    r_large = None if large.tm_s is None else large.tm_s / large.full_s
    print(f"target: {small.customers:,} changed rows < {SMALL_TARGET:.0%} of the full rebuild: "
          f"{_fmt(r_small, '.3f')} -> {verdict(r_small, SMALL_TARGET, strict=True)}")
    print(f"target: {large.customers:,} changed rows, Tidemark <= {LARGE_TARGET:.2f} x the full rebuild: "
          f"{_fmt(r_large, '.3f')} -> {verdict(r_large, LARGE_TARGET, strict=False)}")


if __name__ == "__main__":
    raise SystemExit(main())
