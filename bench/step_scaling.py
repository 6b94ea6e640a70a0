"""Step scaling benchmark: is the cost of one block flat in the size of the history?

The same ``--block``-row block is processed by ``Engine.run_topic`` on top of a base table
(``bench.events``) that holds 1M, 5M and 10M rows of history (by default), and compared with a
raw Delta append of exactly the same transformed rows (same position filter, same SQL, plain
``df.write.format("delta").mode("append").save(...)``) measured in the same run, interleaved
with the steps so machine noise hits both.

Targets (from the issue): step time flat in history (largest/smallest size <= 1.2) and
step <= 1.3x the raw append at the largest size. Misses are printed, never turned into a
non-zero exit code.

Run::

    .venv/bin/python bench/step_scaling.py                      # 1M, 5M, 10M; 100k block; 3 repeats
    .venv/bin/python bench/step_scaling.py --sizes 100000,500000 --block 20000 --repeat 2

Everything lives in a fresh temporary home (warehouse, SQLite offset store, Spark scratch)
that is removed at the end unless ``--keep`` (or ``--home DIR`` to choose it; an existing
``--home`` is never removed).

Setup per size: the missing history rows are appended to the base table with Spark in
(pos, id) order (``--rows-per-pos`` rows share each timestamp; files of ``--file-rows``
rows), and their transformed rows are appended to both destinations, so the step's
destination (``fact.events``) and the raw append's destination hold the same history too.
The topic's offset is then moved to the end of history (``init`` the first time, then a
logged ``reset``) and ``--settle`` untimed blocks run (the first writes after a bulk history
commit refresh the destinations' snapshots, which a table written only by its steps never
pays), so the first measured block sits on exactly N rows. Each repeat appends one fresh
block and measures the step, the raw append and (unless ``--no-txn-variant``) the raw append
with the step's ``txnAppId``/``txnVersion`` options into a table of its own, in an order that
rotates between repeats. Before them, Spark's snapshot of the base table is refreshed by a
query that skips every file (timed and printed on its own: in production the step pays it,
and so would a raw append; here whichever ran first would pay it alone; ``--no-prime`` turns
this off). ``--warmup`` untimed blocks run first, on a small history, to load classes and JIT
the JVM.

Where the step's time goes is measured by wrapping (in this process only, no library code is
changed) the engine's calls into the offset store, the ``deltalake`` metadata reads
(``table_mark`` through ``Engine.decide``, ``find_block_end``, ``bad_position_rows``,
``find_txn_commit``), table registration, the Spark write (``DataFrameWriter.save``) and the
``etl.log`` write.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import os
import shutil
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lineage.core.positions import Position  # noqa: E402
from lineage.spec.loader import load_lineage  # noqa: E402
from resources.core.settings import Settings  # noqa: E402
from resources.storage import delta_log, delta_meta, positions  # noqa: E402

TOPIC = "fact.events"
BASE = "bench.events"
RAW_TABLE = "bench.raw_events"
RAW_TXN_TABLE = "bench.raw_txn_events"

#: Positions: row ``i`` (its id) has ``pos = EPOCH0 + i // rows_per_pos`` seconds.
EPOCH0 = dt.datetime(2024, 1, 1)

TRANSFORM_SQL = """\
-- A realistic per-row transform of one block of events: computed columns, CASEs, casts.
SELECT pos, id, user_id,
       CAST(pos AS DATE) AS day,
       hour(pos) AS hour,
       upper(kind) AS kind,
       kind = 'refund' AS is_refund,
       CASE WHEN kind = 'refund' THEN -amount ELSE amount END AS signed_amount,
       CAST(round(amount * 100) AS BIGINT) AS amount_cents,
       CAST(amount AS DECIMAL(12, 2)) AS amount_dec,
       CASE WHEN amount >= 500 THEN 'large' WHEN amount >= 50 THEN 'medium' ELSE 'small' END AS size_band,
       CAST(user_id % 16 AS INT) AS user_bucket,
       concat('u', CAST(user_id AS STRING), '-', date_format(pos, 'yyyyMMdd')) AS user_day
FROM block
"""

LINEAGE_YAML = """\
# Lineage of bench/step_scaling.py: one source, one step topic.
sources:
  - table: {base}
    comment: synthetic events (pos TIMESTAMP, id BIGINT, user_id BIGINT, amount DOUBLE, kind STRING)
topics:
  - table: {topic}
    depends_on: [{base}]
    processor: step
    transforms: [../sql/fact_events.sql]
    maxstep: {maxstep}
    comment: per-row transform of bench events
"""


# ----------------------------------------------------------------------------- helpers
def human(n: int) -> str:
    """1000000 -> '1M', 1100000 -> '1.1M', 20000 -> '20k'."""
    if n >= 1_000_000:
        return f"{n / 1_000_000:.3g}M"
    if n >= 1_000:
        return f"{n / 1_000:.3g}k"
    return str(n)


def pos_of(i: int, rows_per_pos: int) -> dt.datetime:
    return EPOCH0 + dt.timedelta(seconds=i // rows_per_pos)


def position_of(i: int, rows_per_pos: int) -> Position:
    return Position(pos_of(i, rows_per_pos), i)


@dataclass
class Profile:
    """Accumulates wall time per label while active (``acc`` is not None)."""

    acc: dict[str, float] | None = None
    calls: dict[str, int] | None = None

    def start(self) -> None:
        self.acc, self.calls = {}, {}

    def stop(self) -> tuple[dict[str, float], dict[str, int]]:
        acc, calls = self.acc or {}, self.calls or {}
        self.acc, self.calls = None, None
        return acc, calls

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.acc is None:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.acc is not None and self.calls is not None:
                    self.acc[label] = self.acc.get(label, 0.0) + time.perf_counter() - t0
                    self.calls[label] = self.calls.get(label, 0) + 1

        return timed


#: Step phases, in the order they are printed. They do not nest, so "other" is the remainder.
PHASES = [
    ("offset store", "offset store (get/acquire/plan/commit/release, SQLite)"),
    ("decide", "Engine.decide: table_mark(base) + planner"),
    ("find_block_end", "positions.find_block_end (pyarrow scan of pos/id)"),
    ("quarantine check", "positions.bad_position_rows (null pos/id check)"),
    ("register tables", "Engine.register (deltalake open / CREATE TABLE)"),
    ("block+transform", "blocks.block_df + transform + before/after SQL (lazy plans)"),
    ("spark write", "DataFrameWriter.save: the Delta append job itself"),
    ("find_txn_commit", "delta_log.find_txn_commit (read dest _delta_log)"),
    ("etl.log write", "write_etl_log (deltalake append to etl.log)"),
]
#: Nested counters (inside the phases above), shown for information only.
NESTED = [("deltalake opens", "deltalake DeltaTable opens")]


def instrument(engine: Any, profile: Profile) -> None:
    """Wrap the engine's collaborators with timers (this process only)."""
    from pyspark.sql.readwriter import DataFrameWriter

    import platform_assets.core.blocks as blocks_mod
    import platform_assets.core.spark_io as spark_io
    import platform_assets.facts.reload as reload_mod
    import platform_assets.facts.step as step_mod
    import resources.storage.meta_tables as meta_tables

    store = engine.store
    for name in ("get", "init", "acquire", "release", "plan", "commit", "set_state"):
        setattr(store, name, profile.wrap("offset store", getattr(store, name)))
    engine.decide = profile.wrap("decide", engine.decide)
    engine.register = profile.wrap("register tables", engine.register)
    blocks_mod.block_df = profile.wrap("block+transform", blocks_mod.block_df)  # the step processor calls it by module
    for name in ("transform", "run_statements"):
        setattr(spark_io, name, profile.wrap("block+transform", getattr(spark_io, name)))
    # (both where callers find them, delta_meta, and where resources.storage.positions calls its own)
    for module, name, label in ((delta_meta, "find_block_end", "find_block_end"),
                                (delta_meta, "bad_position_rows", "quarantine check"),
                                (positions, "find_block_end", "find_block_end"),
                                (positions, "bad_position_rows", "quarantine check"),
                                (delta_log, "find_txn_commit", "find_txn_commit")):
        setattr(module, name, profile.wrap(label, getattr(module, name)))
    for mod in (step_mod, reload_mod):
        mod.write_etl_log = profile.wrap("etl.log write", mod.write_etl_log)
    DataFrameWriter.save = profile.wrap("spark write", DataFrameWriter.save)  # type: ignore[method-assign]
    opener = delta_log.open_table
    counted = profile.wrap("deltalake opens", opener)
    delta_log.open_table = counted
    meta_tables.open_table = counted


# ----------------------------------------------------------------------------- the benchmark
@dataclass
class Sample:
    step_s: float
    raw_s: float
    raw_save_s: float
    txn_s: float | None  # raw append + txnAppId/txnVersion (None when --no-txn-variant)
    prime_s: float  # untimed-in-the-others refresh of the base table's Spark snapshot
    phases: dict[str, float]
    calls: dict[str, int]


@dataclass
class SizeResult:
    history: int
    samples: list[Sample] = field(default_factory=list)

    def med(self, key: str) -> float:
        values = [getattr(s, key) for s in self.samples]
        return float("nan") if any(v is None for v in values) else statistics.median(values)

    def med_phase(self, label: str) -> float:
        return statistics.median(s.phases.get(label, 0.0) for s in self.samples)

    def med_calls(self, label: str) -> float:
        return statistics.median(s.calls.get(label, 0) for s in self.samples)


class Bench:
    def __init__(self, args: argparse.Namespace, home: Path) -> None:
        from platform_assets.engine.runner import Engine
        from resources.spark.session import build_spark_session

        self.args = args
        self.rpp = args.rows_per_pos
        self.block = args.block
        (home / "lineage").mkdir(parents=True, exist_ok=True)
        (home / "sql").mkdir(parents=True, exist_ok=True)
        (home / "sql" / "fact_events.sql").write_text(TRANSFORM_SQL, encoding="utf-8")
        (home / "lineage" / "bench.yaml").write_text(
            LINEAGE_YAML.format(base=BASE, topic=TOPIC, maxstep=max(200_000, 2 * args.block)), encoding="utf-8")
        os.environ.setdefault("TIDEMARK_DRIVER_MEMORY", args.driver_memory)
        self.settings = Settings.from_env({}, home=home, lineage=home / "lineage", spark_master=args.master)
        self.lineage = load_lineage(self.settings.lineage)
        sql = self.lineage.topic(TOPIC).transforms[0].sql
        assert sql is not None
        self.sql: str = sql
        t0 = time.perf_counter()
        self.spark = build_spark_session(self.settings, app_name="tidemark-bench")
        print(f"spark session ({args.master}) up in {time.perf_counter() - t0:.1f}s", flush=True)
        self.engine = Engine(self.settings, self.lineage, spark=self.spark, owner="bench-step-scaling")
        self.base_path = self.settings.table_path(BASE)
        self.dest_path = self.settings.table_path(TOPIC)
        self.raw_path = self.settings.table_path(RAW_TABLE)
        self.txn_path = self.settings.table_path(RAW_TXN_TABLE)
        self.txn_seq = 0
        self.next_id = 0  # id (and row index) of the next row to append to the base table
        self.profile = Profile()
        instrument(self.engine, self.profile)

    # ------------------------------------------------------------- data
    def _rows(self, start: int, end: int, partitions: int) -> Any:
        """Rows ``[start, end)`` of the synthetic events, in (pos, id) order, each partition a
        contiguous range (so every file covers its own pos range, as an ordered loader writes)."""
        from pyspark.sql import functions as F

        kinds = F.array(*(F.lit(k) for k in ("purchase", "purchase", "purchase", "view", "view", "view",
                                              "view", "click", "click", "refund")))
        return (self.spark.range(start, end, 1, numPartitions=max(1, partitions))
                .select(F.timestamp_seconds(F.lit(int((EPOCH0 - dt.datetime(1970, 1, 1)).total_seconds()))
                                            + F.floor(F.col("id") / self.rpp)).alias("pos"),
                        F.col("id"),
                        ((F.col("id") * 7919) % 100_000).alias("user_id"),
                        (((F.col("id") * 104_729) % 100_000) / 100.0).alias("amount"),
                        F.element_at(kinds, ((F.col("id") * 31) % 10 + 1).cast("int")).alias("kind")))

    def append_history(self, rows: int) -> float:
        """Append ``rows`` history rows to the base table and their transformed rows to both
        destinations. Returns the seconds it took."""
        if rows <= 0:
            return 0.0
        t0 = time.perf_counter()
        start, end = self.next_id, self.next_id + rows
        parts = -(-rows // self.args.file_rows)
        df = self._rows(start, end, parts)
        df.write.format("delta").mode("append").save(self.base_path)
        df.createOrReplaceTempView("block")
        out = self.spark.sql(self.sql)
        for path in self.dest_paths():
            out.write.format("delta").mode("append").save(path)
        self.next_id = end
        return time.perf_counter() - t0

    def dest_paths(self) -> list[str]:
        return [self.dest_path, self.raw_path, *([self.txn_path] if self.args.txn_variant else [])]

    def append_block(self) -> tuple[Position, Position]:
        """Append one fresh block (one file, as one loader commit); return its (last, next]."""
        start, end = self.next_id, self.next_id + self.block
        self._rows(start, end, 1).write.format("delta").mode("append").save(self.base_path)
        self.next_id = end
        return position_of(start - 1, self.rpp), position_of(end - 1, self.rpp)

    def place_offset(self, last: Position, why: str) -> None:
        topic = self.lineage.topic(TOPIC)
        rec = self.engine.store.get(TOPIC)
        if rec is None:
            self.engine.ensure_offsets(topic, start=last)
        elif rec.last != last or rec.pending:
            self.engine.store.reset(TOPIC, last, who=self.engine.owner, reason=why)

    # ------------------------------------------------------------- measurements
    def run_step(self, last: Position, nxt: Position) -> tuple[float, dict[str, float], dict[str, int]]:
        self.profile.start()
        t0 = time.perf_counter()
        try:
            res = self.engine.run_topic(TOPIC)
        finally:
            elapsed = time.perf_counter() - t0
            phases, calls = self.profile.stop()
        if not res.processed or res.rows != self.block or res.block is None:
            raise SystemExit(f"step did not process the block: processed={res.processed} rows={res.rows} "
                             f"reason={res.reason!r} (expected {self.block} rows)")
        if (res.block.last, res.block.next) != (last, nxt):
            raise SystemExit(f"step processed ({res.block.last}, {res.block.next}], expected ({last}, {nxt}]")
        return elapsed, phases, calls

    def run_raw(self, last: Position, nxt: Position, *, txn: bool = False) -> tuple[float, float]:
        """The same SQL over exactly the block's rows, appended with a plain Delta write (with
        ``txn``: plus the step's idempotency options ``txnAppId``/``txnVersion``, into a table
        of its own). Returns (total seconds, seconds inside ``DataFrameWriter.save``)."""
        from pyspark.sql import functions as F

        path = self.txn_path if txn else self.raw_path
        self.profile.start()
        t0 = time.perf_counter()
        try:
            lp, li = F.lit(last.pos).cast("timestamp"), F.lit(last.id).cast("bigint")
            np_, ni = F.lit(nxt.pos).cast("timestamp"), F.lit(nxt.id).cast("bigint")
            pos, id_ = F.col("pos"), F.col("id")
            block = (self.spark.read.format("delta").load(self.base_path)
                     .where((pos >= lp) & (pos <= np_))
                     .where(((pos > lp) | (id_ > li)) & ((pos < np_) | (id_ <= ni))))
            block.createOrReplaceTempView("block")
            writer = self.spark.sql(self.sql).write.format("delta").mode("append")
            if txn:
                self.txn_seq += 1
                writer = writer.option("txnAppId", "bench:raw").option("txnVersion", self.txn_seq)
            writer.save(path)
        finally:
            elapsed = time.perf_counter() - t0
            phases, _ = self.profile.stop()
        rows = delta_log.last_commit_stats(path).rows
        if rows != self.block:
            raise SystemExit(f"raw append into {path} wrote {rows} rows, expected {self.block}")
        return elapsed, phases.get("spark write", 0.0)

    def prime_base(self) -> float:
        """Bring Spark's cached snapshot of the base table up to date after an append (list the
        log, rebuild the file list with statistics for data skipping) with a query that skips
        every file. Whichever of the measured writes ran first would otherwise pay it alone;
        it is reported on its own line. Returns the seconds it took."""
        from pyspark.sql import functions as F

        t0 = time.perf_counter()
        (self.spark.read.format("delta").load(self.base_path)
         .where(F.col("pos") > F.lit(dt.datetime(9000, 1, 1)).cast("timestamp")).count())
        return time.perf_counter() - t0

    def one_block(self, rotation: int) -> Sample:
        """Append a block, then measure the step, the raw append (and the raw append with txn
        options) of it, in an order rotated by ``rotation``."""
        last, nxt = self.append_block()
        prime = self.prime_base() if self.args.prime else 0.0
        out: dict[str, Any] = {}
        jobs: list[tuple[str, Callable[[], Any]]] = [
            ("step", lambda: self.run_step(last, nxt)),
            ("raw", lambda: self.run_raw(last, nxt)),
        ]
        if self.args.txn_variant:
            jobs.append(("txn", lambda: self.run_raw(last, nxt, txn=True)))
        k = rotation % len(jobs)
        for name, job in jobs[k:] + jobs[:k]:
            out[name] = job()
        step_s, phases, calls = out["step"]
        raw_s, raw_save = out["raw"]
        txn_s = out["txn"][0] if "txn" in out else None
        return Sample(step_s, raw_s, raw_save, txn_s, prime, phases, calls)

    @staticmethod
    def order(rotation: int, n: int) -> str:
        names = ["step", "raw", "raw+txn"][:n]
        k = rotation % n
        return " > ".join(names[k:] + names[:k])

    def quiesce(self) -> None:
        """After a bulk history write: flush the OS's dirty pages and ask the JVM for a full GC,
        so neither lands inside the next measurements."""
        os.sync()
        self.spark.sparkContext._jvm.System.gc()  # type: ignore[union-attr]

    def history_end(self) -> Position:
        return position_of(self.next_id - 1, self.rpp)

    def run(self) -> list[SizeResult]:
        args = self.args
        # Warm-up: a small history, untimed blocks through every path (class loading, JIT).
        warm_hist = min(args.sizes[0], max(self.block, 10_000))
        for w in range(args.warmup):
            self.append_history(warm_hist if self.next_id == 0 else 0)
            self.place_offset(self.history_end(), "bench: warm-up")
            s = self.one_block(w)
            print(f"warm-up block {w + 1}/{args.warmup}: step {s.step_s:.2f}s, raw append {s.raw_s:.2f}s (not counted)",
                  flush=True)
        results = []
        for n in args.sizes:
            missing = n - args.settle * self.block - self.next_id  # the settle blocks complete it to n
            took = self.append_history(missing)
            history = self.next_id
            self.quiesce()
            if missing > 0:
                print(f"history grown to {history:,} rows (+{missing:,} in {took:.1f}s)", flush=True)
            else:
                print(f"history already {history:,} rows (warm-up and earlier blocks included), nothing to append",
                      flush=True)
            self.place_offset(self.history_end(), f"bench: history grown to {history} rows")
            for _ in range(args.settle):
                # The bulk history commits were made outside the engine's write path; the first
                # write after them refreshes the destinations' snapshots, which a production
                # table (written only by its steps) never has to. Untimed, and the history
                # counted from after it.
                self.one_block(0)
                self.place_offset(self.history_end(), "bench: after settle block")
            history = self.next_id
            res = SizeResult(history)
            for r in range(args.repeat):
                s = self.one_block(r)
                res.samples.append(s)
                txn = f"  raw+txn {s.txn_s:.3f}s" if s.txn_s is not None else ""
                print(f"  {human(history)} repeat {r + 1}/{args.repeat}: step {s.step_s:.3f}s  raw append {s.raw_s:.3f}s"
                      f"{txn}  (base snapshot refresh {s.prime_s:.3f}s; order {self.order(r, 3 if txn else 2)})",
                      flush=True)
            results.append(res)
        return results


# ----------------------------------------------------------------------------- report
W = 72  # width of the label column of the breakdown


def report(results: list[SizeResult], args: argparse.Namespace) -> None:
    print()
    print(f"Step scaling: {human(args.block)}-row block, {args.repeat} repeat(s) per size, master {args.master}, "
          f"{args.rows_per_pos} rows per pos, history files of {human(args.file_rows)} rows")
    print("(history rows: rows before the first measured block; each further repeat adds one block)")
    print()
    header = f"{'history rows':>14} | {'block rows':>10} | {'step s (median)':>15} | {'raw append s (median)':>21} | {'step/raw':>8}"
    print(header)
    print("-" * len(header))
    for r in results:
        step, raw = r.med("step_s"), r.med("raw_s")
        print(f"{r.history:>14,} | {args.block:>10,} | {step:>15.3f} | {raw:>21.3f} | {step / raw:>8.2f}")
    print("spread (min-max over repeats): " + "; ".join(
        f"{human(r.history)}: step {min(x.step_s for x in r.samples):.2f}-{max(x.step_s for x in r.samples):.2f}, "
        f"raw {min(x.raw_s for x in r.samples):.2f}-{max(x.raw_s for x in r.samples):.2f}" for r in results))
    print()
    first, last = results[0], results[-1]
    if len(results) > 1:
        ratio = last.med("step_s") / first.med("step_s")
        verdict = "PASS" if ratio <= 1.2 else "MISS"
        print(f"ratio step time {human(last.history)}/{human(first.history)} = {ratio:.2f} (target <= 1.2)  {verdict}")
    overhead = last.med("step_s") / last.med("raw_s")
    verdict = "PASS" if overhead <= 1.3 else "MISS"
    print(f"step / raw append at {human(last.history)} = {overhead:.2f} (target <= 1.3)  {verdict}")

    print()
    print("Where one step's time goes (median seconds per phase, measured inside run_topic):")
    cols = "".join(f" | {human(r.history):>7}" for r in results)
    print(f"{'phase':<{W}}{cols}")
    print("-" * (W + 10 * len(results)))
    for key, label in PHASES:
        print(f"{label:<{W}}" + "".join(f" | {r.med_phase(key):>7.3f}" for r in results))
    others = []
    for r in results:
        others.append(statistics.median(
            s.step_s - sum(s.phases.get(k, 0.0) for k, _ in PHASES) for s in r.samples))
    print(f"{'other (lock context, Python glue, stats dict)':<{W}}" + "".join(f" | {o:>7.3f}" for o in others))
    print(f"{'= step total':<{W}}" + "".join(f" | {r.med('step_s'):>7.3f}" for r in results))
    print(f"{'raw append total':<{W}}" + "".join(f" | {r.med('raw_s'):>7.3f}" for r in results))
    print(f"{'  of which DataFrameWriter.save':<{W}}" + "".join(f" | {r.med('raw_save_s'):>7.3f}" for r in results))
    overhead_cols = "".join(f" | {r.med('step_s') - r.med('raw_s'):>7.3f}" for r in results)
    print(f"{'step - raw append':<{W}}{overhead_cols}")
    if args.txn_variant:
        print(f"{'raw append + txnAppId/txnVersion options (own table) total':<{W}}"
              + "".join(f" | {r.med('txn_s'):>7.3f}" for r in results))
        print(f"{'  cost of the txn options (raw+txn - raw)':<{W}}"
              + "".join(f" | {r.med('txn_s') - r.med('raw_s'):>7.3f}" for r in results))
        print(f"{'  step - raw+txn (what Tidemark adds beyond an idempotent append)':<{W}}"
              + "".join(f" | {r.med('step_s') - r.med('txn_s'):>7.3f}" for r in results))
    if args.prime:
        print(f"{'base snapshot refresh after block append (primed; in none of the above)':<{W}}"
              + "".join(f" | {r.med('prime_s'):>7.3f}" for r in results))
    for key, label in NESTED:
        print(f"{label + ' per step (count)':<{W}}" + "".join(f" | {r.med_calls(key):>7.0f}" for r in results))
        print(f"{label + ' per step (s, inside the phases)':<{W}}" + "".join(f" | {r.med_phase(key):>7.3f}" for r in results))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=textwrap.dedent(__doc__.split("\n\n", 1)[1]))
    p.add_argument("--sizes", default="1000000,5000000,10000000",
                   help="history sizes in rows, ascending, comma-separated (default 1M,5M,10M)")
    p.add_argument("--block", type=int, default=100_000, help="rows per block (default 100000)")
    p.add_argument("--repeat", type=int, default=3, help="blocks measured per size; the median is reported (default 3)")
    p.add_argument("--warmup", type=int, default=8,
                   help="untimed warm-up blocks (on a small history) before measuring, for JIT (default 8)")
    p.add_argument("--settle", type=int, default=1,
                   help="untimed blocks right after each history growth (default 1)")
    p.add_argument("--no-prime", dest="prime", action="store_false",
                   help="do not refresh Spark's snapshot of the base table before the measured writes "
                        "(then whichever runs first pays it)")
    p.add_argument("--no-txn-variant", dest="txn_variant", action="store_false",
                   help="skip the third measurement: the raw append with txnAppId/txnVersion options")
    p.add_argument("--home", type=Path, help="Tidemark home for the run (default: a fresh temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp home at the end")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--driver-memory", default="4g", help="spark.driver.memory if TIDEMARK_DRIVER_MEMORY is unset")
    p.add_argument("--rows-per-pos", type=int, default=8, help="rows sharing each pos timestamp (default 8)")
    p.add_argument("--file-rows", type=int, default=1_000_000, help="rows per history file (default 1000000)")
    args = p.parse_args(argv)
    try:
        args.sizes = [int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes: {args.sizes!r} is not a comma-separated list of row counts")
    if not args.sizes or any(s <= 0 for s in args.sizes) or args.sizes != sorted(args.sizes):
        p.error("--sizes must be positive and ascending")
    if args.block <= 0 or args.repeat <= 0 or args.warmup < 0 or args.settle < 0 or args.rows_per_pos <= 0 or args.file_rows <= 0:
        p.error("--block, --repeat, --rows-per-pos and --file-rows must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    temporary = args.home is None
    home = (args.home or Path(tempfile.mkdtemp(prefix="tidemark-bench-"))).absolute()
    home.mkdir(parents=True, exist_ok=True)
    if args.home is not None and any((home / d).exists() for d in ("warehouse", "offsets.db")):
        print(f"--home {home} already holds a warehouse or offset store; use an empty directory", file=sys.stderr)
        return 2
    print(f"home: {home}", flush=True)
    started = time.perf_counter()
    bench = None
    try:
        bench = Bench(args, home)
        results = bench.run()
        report(results, args)
        print(f"\ntotal benchmark time {time.perf_counter() - started:.0f}s")
    finally:
        if bench is not None:
            bench.engine.store.close()
            bench.spark.stop()
        if temporary and not args.keep:
            shutil.rmtree(home, ignore_errors=True)
        else:
            print(f"kept {home}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
