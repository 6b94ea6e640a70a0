"""What a small block's write costs on a warm Spark Connect server, and what each of the step
processor's write options adds (issue 20, part 2: "the write path of a small block in under a
second").

    .venv/bin/python bench/write_floor.py [--rounds 8] [--rows 100]

One local Spark Connect server (``resources/spark/server.py``, ``local[2]``, Tidemark's settings),
started by the bench and stopped at the end, also on failure. A source table (100,000 rows
written in 21 commits, as blocks land) and a 1,000-row dimension. Per round, in turn, one
append of ``--rows`` rows to each of four destination tables, each a way of writing:

- ``literal``: rows made from literals, plain append: Delta's floor for a commit over Connect;
- ``block``: the block as a step unit reads it (the source at a Delta version, a ``(pos, id)``
  range) left-joined to the dimension, plain append;
- ``block+txn``: the same with ``txnAppId``/``txnVersion``, the options that make a unit's
  commit idempotent and fence a writer whose lease was taken over;
- ``tidemark``: what the step processor writes (``platform_assets/facts/step.py``): ``txn``,
  ``mergeSchema``, ``userMetadata`` and the observation of row and null counts.

The time of each append is from building the DataFrame to the return of ``save``. One untimed
round first (it creates the tables and loads Delta's classes). Prints median/min/max per way
and the differences between neighbours: what the join and the version read add, what the
``txn`` options add (Delta 4.4 looks the application's last version up in the table's full
state, a Spark job over the log, on every such write), what the rest adds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from resources.spark import server as spark_server  # noqa: E402

WAYS = ("literal", "block", "block+txn", "tidemark")
SOURCE_ROWS = 100_000
SOURCE_COMMITS = 20  # appends after the first write: a log of 21 commits (checkpoints every 10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (one append per way each)")
    p.add_argument("--rows", type=int, default=100, help="rows per append")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = p.parse_args()

    base = Path(tempfile.mkdtemp(prefix="tidemark-write-floor-"))
    t0 = time.monotonic()
    server = spark_server.start(base / "server", port=spark_server.free_port(), master="local[2]")
    print(f"Connect server up in {time.monotonic() - t0:.1f} s", flush=True)
    spark = None
    try:
        from pyspark.sql import SparkSession

        spark = SparkSession.builder.remote(server.url).getOrCreate()
        times = measure(spark, base, args.rounds, args.rows)
    finally:
        if spark is not None:
            try:
                spark.stop()
            except Exception:  # noqa: BLE001 - the server is stopped next either way
                pass
        spark_server.stop(base / "server")
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    report(times, args.rows, args.rounds)
    return 0


def measure(spark, base: Path, rounds: int, rows: int) -> dict[str, list[float]]:  # noqa: ANN001 - a SparkSession
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    src, users = str(base / "src"), str(base / "users")

    def source_rows(lo: int, hi: int):  # noqa: ANN202
        return spark.range(lo, hi).select(F.col("id"), (F.col("id") % 1000).alias("user_id"),
                                          F.timestamp_seconds(F.col("id")).alias("pos"), (F.col("id") * 1.5).alias("amount"))

    step = SOURCE_ROWS // 2 // SOURCE_COMMITS
    source_rows(0, SOURCE_ROWS // 2).write.format("delta").save(src)
    for i in range(SOURCE_COMMITS):
        lo = SOURCE_ROWS // 2 + i * step
        source_rows(lo, lo + step).write.format("delta").mode("append").save(src)
    spark.range(0, 1000).select(F.col("id").alias("user_id"), F.lit("DE").alias("country")).write.format("delta").save(users)
    spark.read.format("delta").load(users).createOrReplaceTempView("users")
    version = SOURCE_COMMITS
    seq = {way: 0 for way in WAYS}
    blocks = [0]

    def block():  # noqa: ANN202 - the next block of the source, as a step unit reads it, joined
        lo = blocks[0] * rows % SOURCE_ROWS
        blocks[0] += 1
        part = (spark.read.format("delta").option("versionAsOf", version).load(src)
                .where((F.col("id") >= lo) & (F.col("id") < lo + rows)))
        part.createOrReplaceTempView("block")
        return spark.sql("SELECT b.*, u.country FROM block b LEFT JOIN users u ON u.user_id = b.user_id")

    def append(way: str) -> float:
        dest = str(base / way.replace("+", "_"))
        seq[way] += 1
        started = time.monotonic()
        df = spark.range(rows).select(F.col("id"), F.lit("x").alias("c")) if way == "literal" else block()
        obs = None
        if way == "tidemark":
            obs = Observation(f"bench_{seq[way]}")
            df = df.observe(obs, F.count(F.lit(1)).alias("rows"),
                            *[F.count_if(F.col(c).isNull()).alias(f"n{i}") for i, c in enumerate(df.columns)])
        writer = df.write.format("delta").mode("append")
        if way in ("block+txn", "tidemark"):
            writer = writer.option("txnAppId", f"bench-{way}").option("txnVersion", seq[way])
        if way == "tidemark":
            writer = writer.option("mergeSchema", "true").option("userMetadata", f'{{"seq": {seq[way]}}}')
        writer.save(dest)
        took = time.monotonic() - started
        if obs is not None and obs.get["rows"] != rows:
            raise SystemExit(f"the observation counted {obs.get['rows']} rows, {rows} were written")
        return took

    for way in WAYS:  # untimed: creates the tables, loads the classes
        append(way)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(rounds):
        for way in WAYS:
            times[way].append(append(way))
        print(f"  round {r + 1}: " + ", ".join(f"{w} {times[w][-1]:.2f} s" for w in WAYS), flush=True)
    return times


def report(times: dict[str, list[float]], rows: int, rounds: int) -> None:
    med = {w: statistics.median(t) for w, t in times.items()}
    print(f"\n{rows}-row append on a warm Spark Connect server, start to return of save (median of {rounds})")
    print(f"{'way':12} {'median s':>9} {'min s':>7} {'max s':>7}")
    for w in WAYS:
        print(f"{w:12} {med[w]:9.2f} {min(times[w]):7.2f} {max(times[w]):7.2f}")
    print("\nwhat each step adds (difference of medians)")
    print(f"  a versioned block read and a join: {med['block'] - med['literal']:+.2f} s")
    print(f"  txnAppId/txnVersion:               {med['block+txn'] - med['block']:+.2f} s")
    print(f"  mergeSchema, userMetadata, observe: {med['tidemark'] - med['block+txn']:+.2f} s")
    verdict = "PASS" if med["tidemark"] < 1.0 else "MISS"
    print(f"\nTidemark's write of a {rows}-row block: {med['tidemark']:.2f} s vs target < 1 s: {verdict}")


if __name__ == "__main__":
    raise SystemExit(main())
