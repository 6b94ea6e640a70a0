"""The demo's chain as Spark Structured Streaming runs it: the baseline ``bench/freshness.py --mode
streaming`` measures Tidemark's continuous mode against (issue 55).

    .venv/bin/python bench/streaming_chain.py [--home .tidemark] [--trigger 1] [--seconds 600] [--join stream|wait|naive]

One SparkSession (local, as ``tidemark follow`` starts it, or ``TIDEMARK_SPARK_MASTER``), four
queries on Delta ``readStream`` sources with ``foreachBatch`` running the demo's own SQL
(``demo/sql``), each on a ``processingTime`` trigger (default 1 s):

- ``stage.customers`` -> ``dim.customers``: each micro-batch rebuilds the dimension from the whole
  source (the demo's ``reload``), one overwrite;
- ``stage.orders`` -> ``fact.orders``: each micro-batch is the block, joined as the demo's SQL
  joins it, appended;
- ``stage.order_items`` -> ``fact.order_items``: a stream-stream ``LEFT JOIN`` of the order lines
  with ``fact.orders`` as a stream, each side with a watermark of the topic's ``delay`` (5 s in the
  demo's lineage) and the demo's SQL with one more condition, an order's ``pos`` within that delay
  of its line's (Spark needs it to drop old state). A line is written as soon as its order is in
  ``fact.orders``, one whose order never comes once the watermark passes it, with nulls: what the
  demo's SQL with Tidemark's ``depends_on: [.., fact.orders]`` and ``delay`` gives. Appended, with
  the change data feed on, for the next query. ``--join wait`` instead runs the demo's SQL in
  ``foreachBatch`` once ``fact.orders`` holds every order ``stage.orders`` held when the
  micro-batch began (the orders' newest ``pos``, from the Delta statistics), checked every 0.1 s:
  exact where a line is committed after its order, as the demo's feeder does, and without the
  join's state. ``--join naive`` joins each micro-batch to the ``fact.orders`` of that moment, as
  the demo's SQL reads: a line whose order is not there yet gets null customer attributes
  (measured: nearly every line fed during a run), so that chain is faster and wrong;
- ``fact.order_items`` -> ``mart.daily_revenue``: the change feed of ``fact.order_items``; each
  micro-batch re-derives the ``(day, country)`` groups its rows touch from the whole fact and
  MERGEs them (what a hand-written incremental view does).

Each commit's ``userMetadata`` names its base and the base version it read (``source_version``), as
a Tidemark unit's does, so ``bench/freshness.py`` measures both alike (and checks both chains'
order lines against their orders afterwards). Stops on SIGTERM or after ``--seconds``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resources.core.settings import Settings  # noqa: E402

SQL = ROOT / "demo" / "sql"
TABLES = ("stage.customers", "stage.orders", "stage.order_items", "dim.customers", "fact.orders",
          "fact.order_items", "mart.daily_revenue")


def _sql(name: str, paths: dict[str, str]) -> str:
    """A demo transform with its table names as Delta paths (no catalog needed)."""
    text = (SQL / name).read_text()
    for table, path in paths.items():
        text = text.replace(f" {table} ", f" delta.`{path}` ").replace(f" {table}\n", f" delta.`{path}`\n")
    return text


def _stream_join_sql(delay_s: float) -> str:
    """The demo's ``fact_order_items.sql`` joined to ``orders_stream`` (``fact.orders`` as a stream)
    instead of ``fact.orders``, an order's ``pos`` within ``delay_s`` of its line's."""
    watermark = f"{delay_s:g} seconds"
    sql = (SQL / "fact_order_items.sql").read_text()
    joined = sql.replace("LEFT JOIN fact.orders o ON o.order_id = i.order_id",
                         "LEFT JOIN orders_stream o ON o.order_id = i.order_id\n"
                         f"  AND o.pos BETWEEN i.pos - INTERVAL {watermark} AND i.pos + INTERVAL {watermark}")
    if joined == sql:
        raise RuntimeError("demo/sql/fact_order_items.sql no longer has the join this baseline rewrites")
    return joined


def _meta(base: str, version: int) -> str:
    return json.dumps({"base": base, "source_version": int(version)})


def _version(path: str) -> int:
    from deltalake import DeltaTable

    return int(DeltaTable(path).version())


class Chain:
    """The four queries on one session (see the module docstring)."""

    def __init__(self, spark: Any, settings: Settings, trigger_s: float, checkpoints: Path, *,
                 join: str = "stream", delay_s: float = 5.0) -> None:
        """``join``: how order lines meet their orders (``stream``, ``wait`` or ``naive``, see the
        module docstring); ``delay_s``: the watermark of ``stream``."""
        self.spark, self.checkpoints = spark, checkpoints
        self.paths = {t: settings.table_path(t) for t in TABLES}
        self.trigger = f"{trigger_s:g} seconds"
        self.join, self.delay_s = join, delay_s
        self.queries: list[Any] = []

    def _start(self, name: str, table: str, fn: Any, *, cdf: bool = False, df: Any = None) -> None:
        if df is None:
            reader = self.spark.readStream.format("delta")
            if cdf:
                reader = reader.option("readChangeFeed", "true").option("startingVersion", 0)
            df = reader.load(self.paths[table])
        self.queries.append(df.writeStream.queryName(name).trigger(processingTime=self.trigger)
                            .option("checkpointLocation", str(self.checkpoints / name)).foreachBatch(fn).start())

    def starts(self) -> list[tuple[str | None, Any]]:
        """Each query's start, after the table its SQL joins (or its change feed) exists."""
        return [
            (None, lambda: self._start("dim_customers", "stage.customers", self._dim)),
            ("dim.customers", lambda: self._start("fact_orders", "stage.orders", self._step("fact.orders", "fact_orders.sql"))),
            ("fact.orders", self._start_lines),
            ("fact.order_items", lambda: self._start("daily_revenue", "fact.order_items", self._mart, cdf=True)),
        ]

    def _start_lines(self) -> None:
        if self.join == "stream":
            self._start("fact_order_items", "stage.order_items", self._append("fact.order_items"), df=self._lines_joined())
            return
        step = self._step("fact.order_items", "fact_order_items.sql")
        self._start("fact_order_items", "stage.order_items", self._after_orders(step) if self.join == "wait" else step)

    def _after_orders(self, step: Any) -> Any:
        """``step`` once ``fact.orders`` holds the newest order ``stage.orders`` held when the
        micro-batch began (at most 60 s of waiting), read JVM-free from the Delta statistics."""
        from resources.storage.delta_meta import table_mark

        def newest(table: str) -> Any:
            mark = table_mark(self.paths[table], positions=False).max_position
            return mark.pos if mark is not None else None

        def run(batch: Any, batch_id: int) -> None:
            want, deadline = newest("stage.orders"), time.monotonic() + 60
            while want is not None and time.monotonic() < deadline:
                have = newest("fact.orders")
                if have is not None and have >= want:
                    break
                time.sleep(0.1)
            step(batch, batch_id)
        return run

    def _lines_joined(self) -> Any:
        """The demo's ``fact_order_items.sql`` over two streams: the order lines as ``block``,
        ``fact.orders`` as ``orders_stream``, both with a watermark of the delay, and the orders'
        ``pos`` within the delay of their lines' (what Spark needs to drop the join's old state)."""
        watermark = f"{self.delay_s:g} seconds"
        for view, table in (("block", "stage.order_items"), ("orders_stream", "fact.orders")):
            (self.spark.readStream.format("delta").load(self.paths[table]).withWatermark("pos", watermark)
             .createOrReplaceTempView(view))
        return self.spark.sql(_stream_join_sql(self.delay_s))

    def _append(self, dest: str) -> Any:
        def run(batch: Any, batch_id: int) -> None:
            (batch.write.format("delta").mode("append").option("txnAppId", f"stream:{dest}")
             .option("txnVersion", batch_id).save(self.paths[dest]))
        return run

    def _dim(self, batch: Any, batch_id: int) -> None:
        spark, paths = batch.sparkSession, self.paths  # the query's own session: its own temporary views
        version = _version(paths["stage.customers"])  # the snapshot read next is this one or newer
        spark.read.format("delta").load(paths["stage.customers"]).createOrReplaceTempView("block")
        (spark.sql(_sql("dim_customers.sql", paths)).write.format("delta").mode("overwrite")
         .option("userMetadata", _meta("stage.customers", version)).save(paths["dim.customers"]))

    def _step(self, dest: str, sql: str) -> Any:
        append = self._append(dest)

        def run(batch: Any, batch_id: int) -> None:
            batch.createOrReplaceTempView("block")  # in the query's own session
            append(batch.sparkSession.sql(_sql(sql, self.paths)), batch_id)
        return run

    def _mart(self, batch: Any, batch_id: int) -> None:
        from delta.tables import DeltaTable

        spark, paths = batch.sparkSession, self.paths
        rows = batch.where("_change_type = 'insert'")
        top = rows.agg({"_commit_version": "max"}).collect()[0][0]
        if top is None:
            return
        rows.selectExpr("CAST(pos AS DATE) AS day", "coalesce(country, 'unknown') AS country").distinct() \
            .createOrReplaceTempView("touched")
        spark.read.format("delta").load(paths["fact.order_items"]).createOrReplaceTempView("all_items")
        spark.sql("SELECT i.* FROM all_items i JOIN touched t ON CAST(i.pos AS DATE) = t.day "
                  "AND coalesce(i.country, 'unknown') = t.country").createOrReplaceTempView("block")
        fresh = spark.sql(_sql("daily_revenue.sql", paths))
        meta = _meta("fact.order_items", int(top))
        if not DeltaTable.isDeltaTable(spark, paths["mart.daily_revenue"]):
            fresh.write.format("delta").option("userMetadata", meta).save(paths["mart.daily_revenue"])
            return
        spark.conf.set("spark.databricks.delta.commitInfo.userMetadata", meta)
        try:
            (DeltaTable.forPath(spark, paths["mart.daily_revenue"]).alias("m")
             .merge(fresh.alias("f"), "m.day = f.day AND m.country = f.country")
             .whenMatchedUpdateAll().whenNotMatchedInsertAll().execute())
        finally:
            spark.conf.unset("spark.databricks.delta.commitInfo.userMetadata")

    def failed(self) -> str | None:
        for q in self.queries:
            if q.exception() is not None:
                return f"query {q.name} failed: {q.exception()}"
        return None

    def stop(self) -> None:
        for q in self.queries:
            try:
                q.stop()
            except Exception:  # noqa: BLE001 - stopping what may already be broken
                pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", help="state dir (default: TIDEMARK_HOME or .tidemark)")
    p.add_argument("--trigger", type=float, default=1.0, help="seconds between micro-batches (default 1)")
    p.add_argument("--seconds", type=float, default=3600.0, help="stop after this long (default 1 h)")
    p.add_argument("--join", choices=("stream", "wait", "naive"), default="stream",
                   help="how order lines meet their orders: a stream-stream join with the topic's delay as watermark "
                        "(default), the demo's SQL once fact.orders holds what stage.orders held (wait), or the "
                        "fact.orders of that moment (naive: lines whose order is not there yet get nulls)")
    args = p.parse_args()
    settings = Settings.from_env(home=args.home)
    from lineage.spec.loader import load_lineage

    delay = load_lineage(settings.lineage).topic("fact.order_items").spec.delay
    delay_s = delay.total_seconds() if delay else 5.0
    from resources.spark.session import build_spark_session

    spark = build_spark_session(settings, app_name="tidemark-streaming-baseline")
    # new tables keep a change data feed: the mart's query reads fact.order_items' (with its versions)
    spark.conf.set("spark.databricks.delta.properties.defaults.enableChangeDataFeed", "true")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    chain = Chain(spark, settings, args.trigger, settings.home / "streaming-checkpoints", join=args.join, delay_s=delay_s)
    waiting = chain.starts()
    print(f"streaming: {len(waiting)} queries, trigger {args.trigger:g} s, each started once the table it joins exists; "
          + {"stream": f"order lines joined to fact.orders as a stream, watermark {delay_s:g} s",
             "wait": "order lines joined once fact.orders holds what stage.orders held",
             "naive": "order lines joined to fact.orders of the moment"}[args.join], flush=True)
    end = time.monotonic() + args.seconds
    try:
        while not stop.is_set() and time.monotonic() < end:
            why = chain.failed()
            if why:
                raise RuntimeError(why)
            while waiting and (waiting[0][0] is None or (Path(settings.table_path(waiting[0][0])) / "_delta_log"
                                                          / f"{0:020d}.json").exists()):
                waiting.pop(0)[1]()
            stop.wait(1.0)
    finally:
        chain.stop()
        spark.stop()
    print("streaming: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
