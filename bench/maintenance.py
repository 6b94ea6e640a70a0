"""Maintenance of a many-block fact: a day-style aggregate query and Tidemark's JVM-free planning
before and after ``tidemark maintain``, against the same rows written once, in the same run.

    .venv/bin/python bench/maintenance.py                    # 2,000 blocks of 100 rows (planning also at 100)
    .venv/bin/python bench/maintenance.py --quick            # 200 blocks of 50 rows (planning also at 20)

How the blocks are written: **not** through step units (a unit costs ~1 s of Spark on 2 cores,
2,000 of them too long for a benchmark). Each block is one ``deltalake`` append of one small Parquet
file, as a step unit lands it: rows ``(pos TIMESTAMP, id BIGINT, customer_id, category, amount
DECIMAL(12,2), qty)`` in ``(pos, id)`` order, two rows per ``pos`` (a tie may straddle two blocks),
positions spread over 30 days; each commit carries a ``txn`` (app id ``bench.maintenance``, version =
block number) as a unit's commit does, and the table has ``delta.checkpointInterval = 10``, the
property Tidemark's Spark sessions give the tables they create. The fact is a *source* of the
generated lineage (no topic writes it). The "written once" copy holds exactly the same rows in one
``deltalake`` write. Data writing is untimed for the figures (its time is printed).

Lineage (temp home): ``fact.events`` (the many-block fact); ``mart.events_next``, a step topic whose
base is the fact (``SELECT * FROM block``, maxstep = one block); and, unless ``--no-view``,
``mart.daily``, a merge topic (materialized view) on the fact with the query's aggregate (key
``day, category``).

Measured, at the full size (``--blocks``), in one run:

* **query**: ``SELECT CAST(pos AS DATE) AS day, category, count(*), sum(amount), sum(qty) ... GROUP
  BY 1, 2`` in Spark SQL (``local[2]``, 4 shuffle partitions, UI off) on the many-block fact before
  maintenance, after it, and on the written-once copy; best of ``--repeat`` (the two tables of a
  phase interleaved, the order alternating; an untimed warm-up query first). The results of the
  three must be equal (else exit 1). Target: after maintenance <= 1.2 x written once.
* **planning** (no JVM): ``Engine.plan_block`` of the step topic, what the planner sensor (and
  ``tidemark plan``) runs for a step topic: the base's snapshot and mark, the decision, the
  quarantine checks (null positions, late rows in the commits since the topic's last block), the
  block's end, the offset store's plan; and the topic's row of ``tidemark lag`` / ``explain``
  (``Engine._lag_row``). The topic's offset is at the end of block N-1, so the planned block is
  block N (its rows are checked). Best of ``--plan-repeat`` (after an untimed warm-up round) at
  ``--small-blocks`` and at ``--blocks``, each in three states (the maintained ones at both sizes with
  their rounds interleaved, beside the Spark JVM, so that both sizes are planned in the same
  conditions). Each timed plan first forgets what the process kept of the tables (the newest
  snapshots, Parquet footers: every plan of a new block opens a version not seen before); the
  ``warm`` column is the same plan again with the snapshot kept, as a resident process plans a base
  that did not change since its last look. States: ``no maintenance`` (the topic's last
  block planned on version N-1); ``maintained`` (the same offsets after maintenance: the first plan
  after it, whose late-row check reads the compaction's commit); ``maintained, steady`` (the topic's
  last block planned on the compacted version, as every later plan is; no commit follows it here, so
  its late-row check reads none, where ``no maintenance`` reads one). Target: the 2,000-block plan
  <= 1.2 x the 100-block plan, for both maintained states (the ratio without maintenance is printed
  too). Then, after the queries and the view, ``maintained, resident``: block N+1 appended after
  the compaction (a commit that is no checkpoint), the topic's last block planned on the compacted
  version, and the process keeping what it read in its plan on that version (the snapshot, which
  the plan moves forward by the one new commit, and the footers), as the follower or the planner
  sensor's code server plans every new block; each round checks that the kept snapshot was the one
  moved forward. Same target, printed beside the others. Also printed, with no target: ``steady,
  no tombstones``, the steady state on copies of both homes whose fact has
  ``delta.deletedFileRetentionDuration`` 0 and a new checkpoint, which then leaves out the
  compaction's remove actions (tombstones, kept in every checkpoint for 7 days by default): what
  they cost a plan that opens the table anew. (A compaction by ``tidemark maintain`` carries a mark
  in its ``commitInfo`` by which the first plan after it tells it a rewrite without counting its
  lines.)
* **maintenance**: ``platform_assets.maintenance.tables.run`` on the fact, as ``tidemark maintain fact.events
  --retain-hours 0 --writers-idle`` (nothing else writes the temp tables): compaction
  (``deltalake`` optimize.compact), checkpoint, VACUUM keeping the versions the topics still need,
  log cleanup; what it did and the files before and after are printed.
* **view** (unless ``--no-view``): one unit of ``mart.daily`` (one new block) before maintenance and
  one after (single runs, not best-of), with the strategy ``etl.log`` records for it.

A miss is printed as MISS and the script still exits 0. ``--keep`` keeps the temp dir.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.shared import BenchError  # noqa: E402
from lineage.core.positions import Position  # noqa: E402
from resources.core.settings import Settings  # noqa: E402
from resources.spark.session import cached_delta_jars  # noqa: E402

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

    from platform_assets.engine.runner import Engine

FACT, ONCE = "fact.events", "fact.events_once"
NEXT, VIEW = "mart.events_next", "mart.daily"
APP_ID = "bench.maintenance"
SPAN = dt.timedelta(days=30)
CATEGORIES = [f"cat-{i}" for i in range(8)]
QUERY = ("SELECT CAST(pos AS DATE) AS day, category, count(*) AS n, sum(amount) AS amount, sum(qty) AS qty "
         "FROM {table} GROUP BY 1, 2")
QUERY_TARGET = PLAN_TARGET = 1.2
OPTIONS = "--retain-hours 0 --writers-idle"  # what maintain.Options below stands for on the command line


# ------------------------------------------------------------------ data


@dataclass(frozen=True)
class Shape:
    """The rows of a fact of ``blocks`` blocks of ``rows`` rows: ids 1..blocks*rows, two per ``pos``."""

    blocks: int
    rows: int
    t0: dt.datetime  # naive UTC

    @property
    def step(self) -> dt.timedelta:
        return SPAN / max(1, self.blocks * self.rows // 2)

    def pos(self, row_id: int) -> dt.datetime:
        return self.t0 + self.step * (row_id // 2)

    def block_end(self, block: int) -> Position:
        """The position of the last row of block ``block`` (1-based)."""
        last_id = block * self.rows
        return Position(self.pos(last_id), last_id)

    def block(self, block: int) -> pa.Table:
        """Block ``block`` (1-based), in (pos, id) order."""
        import numpy as np
        import pyarrow as pa

        first = (block - 1) * self.rows + 1
        ids = np.arange(first, first + self.rows, dtype=np.int64)
        base = np.datetime64(self.t0, "us")
        step_us = int(self.step / dt.timedelta(microseconds=1))
        pos = base + (ids // 2) * np.timedelta64(step_us, "us")
        rng = np.random.default_rng(block)
        cents = rng.integers(100, 50_000, self.rows)
        return pa.table({
            "pos": pa.array(pos).cast(pa.timestamp("us", tz="UTC")),
            "id": ids,
            "customer_id": rng.integers(1, 10_000, self.rows, dtype=np.int64),
            "category": pa.array([CATEGORIES[i] for i in rng.integers(0, len(CATEGORIES), self.rows)]),
            "amount": pa.array([Decimal(int(c)).scaleb(-2) for c in cents], pa.decimal128(12, 2)),
            "qty": pa.array(rng.integers(1, 10, self.rows), pa.int32()),
        })


def append_blocks(path: str, shape: Shape, first: int, last: int) -> float:
    """Blocks ``first..last`` (1-based) into ``path``, one ``deltalake`` append (one file) each: seconds."""
    from deltalake import CommitProperties, Transaction, write_deltalake

    t = time.perf_counter()
    for b in range(first, last + 1):
        write_deltalake(path, shape.block(b), mode="append",
                        configuration={"delta.checkpointInterval": "10"} if b == 1 else None,
                        commit_properties=CommitProperties(app_transactions=[Transaction(APP_ID, b)]))
    return time.perf_counter() - t


def write_once(path: str, shape: Shape) -> float:
    """The same rows as ``shape``'s blocks, in one write: seconds."""
    import pyarrow as pa
    from deltalake import write_deltalake

    t = time.perf_counter()
    rows = pa.concat_tables([shape.block(b) for b in range(1, shape.blocks + 1)])
    write_deltalake(path, rows, mode="overwrite", configuration={"delta.checkpointInterval": "10"})
    return time.perf_counter() - t


# ------------------------------------------------------------------ a home: lineage, engine, consumer


def make_lineage(base: Path, rows: int, view: bool) -> Path:
    (base / "sql").mkdir(parents=True)
    (base / "sql" / "events_next.sql").write_text("SELECT * FROM block\n")
    (base / "sql" / "daily.sql").write_text(QUERY.format(table="block") + "\n")
    lin = base / "lineage"
    lin.mkdir()
    text = textwrap.dedent(f"""\
        sources:
          - table: {FACT}
            comment: the many-block fact (written by bench/maintenance.py, one deltalake append per block)
        topics:
          - table: {NEXT}
            depends_on: [{FACT}]
            processor: step
            transforms: [../sql/events_next.sql]
            maxstep: {rows}
            delay: 0
            repeat: 0
            comment: a step topic whose base is the many-block fact (its planning is measured)
        """)
    if view:
        text += textwrap.indent(textwrap.dedent(f"""\
            - table: {VIEW}
              depends_on: [{FACT}]
              processor: merge
              transforms: [../sql/daily.sql]
              key: [day, category]
              maxstep: 10000000
              delay: 0
              repeat: 0
              comment: the query's aggregate as a materialized view on the fact
            """), "  ")
    (lin / "bench.yaml").write_text(text)
    return lin


def place_consumer(eng: Engine, at: Position, version: int) -> None:
    """``mart.events_next``'s offset at ``at``, its last block planned on ``version`` of the fact (so
    its late-row check reads the commits after it): a fresh record each time, never pending."""
    topic = eng.lineage.topic(NEXT)
    eng.store.forget(NEXT, who="bench", reason="bench: place the consumer again")
    eng.store.init(NEXT, at, topic.spec.processor.value, who="bench", note="bench: placed at the end of block N-1")
    eng.store.reset(NEXT, at, who="bench", reason="bench: last block planned on the fact's version", late_from={FACT: version})


@dataclass
class PlanTimes:
    plan: list[float] = field(default_factory=list)  # cold: the base's newest snapshot opened anew
    lag: list[float] = field(default_factory=list)  # cold
    warm: list[float] = field(default_factory=list)  # plan_block again, the snapshot kept from the plan before
    reason: str = ""


def _forget_snapshots() -> None:
    """What a process keeps of the tables it planned on (the newest snapshot of each, Parquet
    footers): forgotten, so that the next plan opens the base as it does on a version it has not
    seen, the case of every plan of a new block."""
    from resources.storage import delta_read, snapshot

    snapshot._NEWEST.clear()
    delta_read._FOOTERS.clear()


@dataclass(frozen=True)
class PlanCase:
    """Planning block N of ``mart.events_next`` on one home: its consumer at ``at``, its last block
    planned on ``version`` of the fact."""

    eng: Engine
    shape: Shape
    at: Position
    version: int


def _plan_round(case: PlanCase, out: PlanTimes) -> None:
    eng, shape = case.eng, case.shape
    topic = eng.lineage.topic(NEXT)
    want = shape.block_end(shape.blocks)
    place_consumer(eng, case.at, case.version)
    rec = eng.store.get(NEXT)
    assert rec is not None
    _forget_snapshots()
    t = time.perf_counter()
    row = eng._lag_row(topic, rec, eng.clock())  # what `tidemark lag` / `explain` compute for the topic
    out.lag.append(time.perf_counter() - t)
    _forget_snapshots()
    t = time.perf_counter()
    planned = eng.plan_block(NEXT)
    out.plan.append(time.perf_counter() - t)
    place_consumer(eng, case.at, case.version)
    t = time.perf_counter()
    again = eng.plan_block(NEXT)  # the same plan in a process that planned on this version already
    out.warm.append(time.perf_counter() - t)
    if (again.block, again.base_rows) != (planned.block, planned.base_rows):
        raise BenchError(f"planning {NEXT} again with the snapshot kept found {again.block} ({again.base_rows} rows); "
                         f"opened anew: {planned.block} ({planned.base_rows} rows)")
    if planned.block is None or planned.block.next != want or planned.base_rows != shape.rows:
        raise BenchError(f"planning block {shape.blocks} of {NEXT} found {planned.block} ({planned.base_rows} rows, "
                         f"{planned.reason}); expected {shape.rows} rows up to {want}")
    if planned.warnings:
        raise BenchError(f"planning {NEXT} warned: {'; '.join(planned.warnings)}")
    out.reason = row.reason


def time_planning(cases: list[PlanCase], repeat: int,
                  one_round: Callable[[PlanCase, PlanTimes], None] | None = None) -> list[PlanTimes]:
    """Best-of timings of planning block N of ``mart.events_next`` (see the module docstring) in each
    case (``one_round``: :func:`_plan_round` unless given), the cases' rounds interleaved so that
    what else the machine does weighs on each alike."""
    one_round = one_round or _plan_round
    outs = [PlanTimes() for _ in cases]
    for i in range(repeat + 1):  # the first round is an untimed warm-up
        for case, out in zip(cases, outs, strict=True):
            one_round(case, out)
            if i == 0:
                out.plan.clear()
                out.lag.clear()
                out.warm.clear()
    for case in cases:
        place_consumer(case.eng, case.at, case.version)  # not pending: maintenance sees the topic's needs as they were
    return outs


def resident_case(eng: Engine, shape: Shape) -> PlanCase:
    """Block N+1 appended after the compaction; the topic at the end of block N, its last block
    planned on the compacted version (the newest before this append)."""
    compacted = fact_version(eng)
    append_blocks(eng.path(FACT), shape, shape.blocks + 1, shape.blocks + 1)
    return PlanCase(eng, shape, shape.block_end(shape.blocks), compacted)


def _resident_round(case: PlanCase, out: PlanTimes) -> None:
    """Planning block N+1 in a process that kept the snapshot of the compacted version from its
    plan on it (and the footers it read then): the plan moves that snapshot forward by the commit
    of block N+1."""
    import weakref

    from deltalake import DeltaTable

    from resources.storage import snapshot

    eng, shape = case.eng, case.shape
    path = eng.path(FACT)
    place_consumer(eng, case.at, case.version)
    kept = snapshot.TableSnapshot(path, DeltaTable(path, version=case.version))
    kept_table = weakref.ref(kept.table)  # (no reference of ours: one would keep the snapshot from moving)
    snapshot._NEWEST.clear()
    snapshot._NEWEST.put(kept)
    del kept
    t = time.perf_counter()
    planned = eng.plan_block(NEXT)
    out.plan.append(time.perf_counter() - t)
    want = shape.block_end(shape.blocks + 1)
    if planned.block is None or planned.block.next != want or planned.base_rows != shape.rows:
        raise BenchError(f"planning block {shape.blocks + 1} of {NEXT} found {planned.block} ({planned.base_rows} "
                         f"rows, {planned.reason}); expected {shape.rows} rows up to {want}")
    now = snapshot._NEWEST.get(path, None)
    if now is None or now.version != case.version + 1 or now.table is not kept_table():
        raise BenchError(f"planning {NEXT} in a resident process opened {FACT} anew instead of moving the kept "
                         f"snapshot of version {case.version} forward")
    out.reason = planned.reason


def without_tombstones(eng: Engine, into: Path) -> Engine:
    """A copy of ``eng``'s home (tables, offsets) whose fact keeps no tombstone: its
    ``delta.deletedFileRetentionDuration`` set to 0 on the copy, then a checkpoint, which leaves
    out the removes that retention let expire. What a plan after maintenance would cost once the
    compaction's tombstones expire (7 days by default; the Delta protocol keeps them in every
    checkpoint until then)."""
    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    from lineage.spec.loader import load_lineage
    from platform_assets.engine.runner import Engine

    src = Path(eng.settings.home).parent
    shutil.copytree(src, into)
    settings = Settings.from_env({}, home=into / "home", lineage=into / "tidemark" / "lineage",
                                 spark_master=eng.settings.spark_master)
    copy = Engine(settings, load_lineage(settings.lineage), owner="bench-maintenance")
    DeltaTable(copy.path(FACT)).alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 0 hours"})
    table = DeltaTable(copy.path(FACT))
    table.create_checkpoint()
    checkpoint = Path(copy.path(FACT)) / "_delta_log" / f"{table.version():020d}.checkpoint.parquet"
    removes = pq.read_table(checkpoint, columns=["remove"])["remove"]
    if table.get_add_actions().num_rows == 0 or removes.null_count != len(removes):
        raise BenchError(f"the copy of {FACT} without tombstones holds no file, or its checkpoint still holds "
                         f"{len(removes) - removes.null_count} tombstone(s)")
    return copy


def fact_version(eng: Engine) -> int:
    from resources.storage import maintenance

    version = maintenance.health(FACT, eng.path(FACT)).version
    assert version is not None
    return version


def fact_state(eng: Engine) -> str:
    from resources.storage import maintenance

    h = maintenance.health(FACT, eng.path(FACT))
    log = len(os.listdir(Path(eng.path(FACT)) / "_delta_log"))
    data = sum(1 for p in Path(eng.path(FACT)).glob("*.parquet"))
    return (f"v{h.version}, {h.files} files in the snapshot ({h.small_files} small, {h.bytes / 1e6:.1f} MB), "
            f"{h.since_checkpoint} commits since the last checkpoint, {log} files in _delta_log, {data} data files on disk")


def run_maintenance(eng: Engine) -> list[str]:
    """``tidemark maintain fact.events --retain-hours 0 --writers-idle``: what it printed."""
    from platform_assets.maintenance import tables as maintain

    lines: list[str] = []

    def show(h: Any, report: Any, exc: Exception | None) -> None:
        if exc is not None:
            raise BenchError(f"tidemark maintain {FACT} failed: {type(exc).__name__}: {exc}") from exc
        lines.append(f"{h.table} v{h.version}: {h.files} files, {h.small_files} small ({report.seconds:.2f}s)")
        lines.extend(f"  {line}" for line in maintain.describe(h, report))

    maintain.run(eng, [FACT], maintain.Options(retain_hours=0, writers_idle=True), on_report=show)
    return lines


# ------------------------------------------------------------------ Spark side


def run_query(spark: SparkSession, path: str) -> tuple[float, list[tuple[Any, ...]]]:
    t = time.perf_counter()
    rows = spark.sql(QUERY.format(table=f"delta.`{path}`")).collect()
    took = time.perf_counter() - t
    return took, sorted(tuple(r) for r in rows)


def time_queries(spark: SparkSession, tables: dict[str, str], repeat: int,
                 results: dict[str, list[tuple[Any, ...]]]) -> dict[str, list[float]]:
    """Each table's query ``repeat`` times, the tables interleaved and their order alternating."""
    times: dict[str, list[float]] = {k: [] for k in tables}
    names = list(tables)
    for i in range(repeat):
        for name in (names if i % 2 == 0 else names[::-1]):
            took, rows = run_query(spark, tables[name])
            times[name].append(took)
            results[name] = rows
    return times


def view_unit(eng: Engine) -> str:
    """One unit of the view: its time, strategy and figures."""
    t = time.perf_counter()
    r = eng.run_topic(VIEW)
    took = time.perf_counter() - t
    if not r.processed:
        raise BenchError(f"{VIEW} processed nothing: {r.reason}")
    s = r.stats
    figures = ", ".join(f"{k} {s[k]}" for k in ("keys_rederived", "rows_inserted", "rows_updated", "rows_deleted")
                        if s.get(k) is not None)
    return (f"{took:.2f} s, base rows {r.base_rows}, strategy {s.get('strategy', '?')} "
            f"({s.get('strategy_reason', r.reason)}); {figures}; phases {s.get('phases_s', {})}")


def view_check(spark: SparkSession, eng: Engine, expected: list[tuple[Any, ...]]) -> str:
    """The view against the query over the fact (both at the fact's current rows)."""
    got = sorted(tuple(r) for r in spark.read.format("delta").load(eng.path(VIEW))
                 .select("day", "category", "n", "amount", "qty").collect())
    if got != expected:
        raise BenchError(f"{VIEW} differs from the query over {FACT}: {len(got)} rows vs {len(expected)}")
    return f"{VIEW} equals the query over {FACT} ({len(got)} rows)"


# ------------------------------------------------------------------ main


def best(xs: list[float]) -> float:
    return min(xs)


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "MISS"


def _ms(xs: list[float]) -> str:
    return f"{1000 * best(xs):9.1f}"


def _git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "?"
    except OSError:
        return "?"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=2000, help="blocks written into the fact (the full size)")
    p.add_argument("--small-blocks", type=int, default=100, help="the smaller size planning is also measured at")
    p.add_argument("--rows-per-block", type=int, default=100, help="rows per block")
    p.add_argument("--repeat", type=int, default=7, help="query repetitions per table and phase (best is reported)")
    p.add_argument("--plan-repeat", type=int, default=25, help="planning repetitions per size and state (best)")
    p.add_argument("--quick", action="store_true", help="--blocks 200 --small-blocks 20 --rows-per-block 50 --repeat 3")
    p.add_argument("--no-view", action="store_true", help="leave out the materialized view on the fact")
    p.add_argument("--master", default="local[2]", help="Spark master")
    p.add_argument("--driver-memory", default="2g", help="Spark driver memory")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (tables, offsets)")
    args = p.parse_args()
    if args.quick:
        args.blocks, args.small_blocks, args.rows_per_block, args.repeat = 200, 20, 50, 3
    if not 2 <= args.small_blocks < args.blocks:
        p.error(f"need 2 <= --small-blocks < --blocks (got {args.small_blocks}, {args.blocks})")
    if args.rows_per_block < 2 or args.repeat < 1 or args.plan_repeat < 1:
        p.error("--rows-per-block must be >= 2, --repeat and --plan-repeat >= 1")
    if not args.no_view and args.blocks < 3:
        p.error("the view needs --blocks >= 3")
    if not cached_delta_jars():
        print("error: no cached Delta jars; start Spark once first (e.g. ./scripts/setup.sh or `tidemark spark up`)",
              file=sys.stderr)
        return 1

    base = Path(tempfile.mkdtemp(prefix="tidemark-bench-maintenance-"))
    os.environ["TIDEMARK_DRIVER_MEMORY"] = args.driver_memory
    view = not args.no_view
    print(f"bench/maintenance.py at {_git_head()}: {args.blocks:,} blocks of {args.rows_per_block} rows "
          f"(planning also at {args.small_blocks:,}); work dir {base}; master {args.master}", flush=True)
    print("blocks written with deltalake, one append (one Parquet file, one txn) per block as a step unit lands it, "
          "not through step units; checkpointInterval 10", flush=True)
    engines: list[Engine] = []
    spark: SparkSession | None = None
    t_day = dt.datetime.now(dt.UTC).replace(tzinfo=None, hour=0, minute=0, second=0, microsecond=0)
    t0 = t_day - SPAN - SPAN / args.small_blocks - dt.timedelta(days=1)  # (block N+1 of either size before today)
    plans: dict[tuple[int, str], PlanTimes] = {}
    loads = [os.getloadavg()[0]]  # the machine's 1-minute load average at points of the run
    try:
        from lineage.spec.loader import load_lineage
        from platform_assets.engine.runner import Engine

        def home(n: int, with_view: bool) -> tuple[Engine, Settings]:
            d = base / f"b{n}"
            settings = Settings.from_env({}, home=d / "home", lineage=make_lineage(d / "tidemark", args.rows_per_block,
                                                                                 with_view), spark_master=args.master)
            eng = Engine(settings, load_lineage(settings.lineage), owner="bench-maintenance")
            engines.append(eng)
            return eng, settings

        def measure_plans(state: str, *cases: PlanCase) -> None:
            for case, t in zip(cases, time_planning(list(cases), args.plan_repeat), strict=True):
                plans[(case.shape.blocks, state)] = t
                print(f"  planning at {case.shape.blocks:,} blocks, {state}: plan_block best {1000 * best(t.plan):.1f} "
                      f"ms, lag row best {1000 * best(t.lag):.1f} ms; {NEXT}: {t.reason}", flush=True)

        # -- the smaller size: planning only, no JVM
        small = Shape(args.small_blocks, args.rows_per_block, t0)
        eng_s, _ = home(small.blocks, False)
        took = append_blocks(eng_s.path(FACT), small, 1, small.blocks - 1)
        at_s, v_s = small.block_end(small.blocks - 1), small.blocks - 2  # block b is version b - 1
        place_consumer(eng_s, at_s, v_s)
        took += append_blocks(eng_s.path(FACT), small, small.blocks, small.blocks)
        print(f"\n[{small.blocks:,} blocks] written in {took:.1f} s; {FACT}: {fact_state(eng_s)}", flush=True)
        measure_plans("no maintenance", PlanCase(eng_s, small, at_s, v_s))
        print("\n".join(f"  maintain: {line}" for line in run_maintenance(eng_s)))
        print(f"  after: {FACT}: {fact_state(eng_s)}", flush=True)
        # (measured again beside the full size, in its conditions: see below)
        small_cases = {"maintained": PlanCase(eng_s, small, at_s, v_s),
                       "maintained, steady": PlanCase(eng_s, small, at_s, fact_version(eng_s))}

        # -- the full size
        full = Shape(args.blocks, args.rows_per_block, t0)
        eng, settings = home(full.blocks, view)
        fact, once = eng.path(FACT), settings.table_path(ONCE)
        lead = full.blocks - (2 if view else 1)
        took = append_blocks(fact, full, 1, lead)
        print(f"\n[{full.blocks:,} blocks] {lead:,} blocks written in {took:.1f} s "
              f"({1000 * took / lead:.0f} ms per block append)", flush=True)
        took = write_once(once, full)
        print(f"  {ONCE}: the same {full.blocks * full.rows:,} rows in one write in {took:.1f} s", flush=True)
        from resources.spark.session import build_spark_session

        t = time.perf_counter()
        spark = build_spark_session(settings, app_name="tidemark-bench-maintenance")
        run_query(spark, once)  # warm-up (class loading, JIT), untimed
        print(f"  Spark session and a warm-up query: {time.perf_counter() - t:.1f} s (untimed)", flush=True)
        view_lines: list[str] = []
        if view:
            t = time.perf_counter()
            built = [r for r in eng.run_until_caught_up([VIEW]) if r.processed]
            print(f"  {VIEW}: initial build over {lead:,} blocks in {time.perf_counter() - t:.1f} s "
                  f"({len(built)} unit(s), strategy {built[0].stats.get('strategy') if built else '-'}; untimed)",
                  flush=True)
            append_blocks(fact, full, lead + 1, lead + 1)
            view_lines.append(f"unit before maintenance ({FACT} at {lead + 1:,} blocks, one new): {view_unit(eng)}")
        at, v_at = full.block_end(full.blocks - 1), full.blocks - 2
        place_consumer(eng, at, v_at)
        append_blocks(fact, full, full.blocks, full.blocks)
        print(f"  {FACT}: {fact_state(eng)}", flush=True)
        measure_plans("no maintenance", PlanCase(eng, full, at, v_at))

        results: dict[str, list[tuple[Any, ...]]] = {}
        loads.append(os.getloadavg()[0])
        before = time_queries(spark, {"many blocks": fact, "written once": once}, args.repeat, results)
        loads.append(os.getloadavg()[0])
        maintain_lines = run_maintenance(eng)
        print("\n".join(f"  maintain: {line}" for line in maintain_lines))
        print(f"  after: {FACT}: {fact_state(eng)}", flush=True)
        # Each maintained state at both sizes, rounds interleaved: the same machine and the same
        # Spark JVM beside them (the 100-block home was planned before the JVM started).
        measure_plans("maintained", small_cases["maintained"], PlanCase(eng, full, at, v_at))
        measure_plans("maintained, steady", small_cases["maintained, steady"], PlanCase(eng, full, at, fact_version(eng)))
        loads.append(os.getloadavg()[0])
        after = time_queries(spark, {"many blocks, maintained": fact, "written once (again)": once}, args.repeat,
                             results)
        loads.append(os.getloadavg()[0])
        expected = results["written once"]
        for name, rows in results.items():
            if rows != expected:
                raise BenchError(f"the query's result on '{name}' differs from the written-once table's "
                                 f"({len(rows)} rows vs {len(expected)})")
        if view:
            view_lines.append(f"unit after maintenance ({FACT} at {full.blocks:,} blocks, one new): {view_unit(eng)}")
            view_lines.append(view_check(spark, eng, expected))
        print(f"  query results equal on all {len(results)} (tables, phase): {len(expected)} rows (day, category)",
              flush=True)
        # Diagnostic: the same states on copies whose compaction's tombstones expired.
        bare = [without_tombstones(e, base / f"{e.settings.home.parent.name}-no-tombstones") for e in (eng_s, eng)]
        engines.extend(bare)
        measure_plans("steady, no tombstones", *(PlanCase(e, shape, a, fact_version(e))
                                                 for e, shape, a in zip(bare, (small, full), (at_s, at), strict=True)))
        resident = [resident_case(eng_s, small), resident_case(eng, full)]
        for case, kept in zip(resident, time_planning(resident, args.plan_repeat, _resident_round), strict=True):
            plans[(case.shape.blocks, "maintained, resident")] = kept
            print(f"  planning at {case.shape.blocks:,} blocks, maintained, resident: plan_block best "
                  f"{1000 * best(kept.plan):.1f} ms; {NEXT}: {kept.reason}", flush=True)
    except BenchError as exc:
        print(f"\nFAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        for e in engines:
            e.close()
        if spark is not None:
            spark.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    print_report(args, before, after, plans, view_lines, loads)
    return 0


def print_report(args: argparse.Namespace, before: dict[str, list[float]], after: dict[str, list[float]],
                 plans: dict[tuple[int, str], PlanTimes], view_lines: list[str], loads: list[float]) -> None:
    n, small = args.blocks, args.small_blocks
    print(f"\nmachine: {os.cpu_count()} cores, 1-minute load average during the run {min(loads):.1f}-{max(loads):.1f} "
          f"(other processes share the cores: single runs vary; read the best-of figures)")
    print(f"\nquery: {QUERY.format(table='<table>')}\n"
          f"Spark {args.master}, best of {args.repeat} (all runs in seconds, in order)")
    print(f"{'table':<28} {'best s':>8}  runs")
    for times in (before, after):
        for name, xs in times.items():
            print(f"{name:<28} {best(xs):8.3f}  {' '.join(f'{x:.3f}' for x in xs)}")
    r_before = best(before["many blocks"]) / best(before["written once"])
    r_after = best(after["many blocks, maintained"]) / best(after["written once (again)"])
    print(f"many blocks / written once, before maintenance: {r_before:.2f}")
    print(f"target: after maintenance <= {QUERY_TARGET} x written once: {r_after:.2f} -> {verdict(r_after, QUERY_TARGET)}")

    print(f"\nJVM-free planning of the next block of {NEXT} (base {FACT}), best of {args.plan_repeat}, ms")
    print("(plan_block and lag row open the base anew, as every plan of a new block does; warm: plan_block in a "
          "process that kept the base's snapshot from a plan on the same version)")
    print(f"{'blocks':>7}  {'state':<22} {'plan_block':>10} {'lag row':>9} {'warm':>7}")
    for (blocks, state), t in sorted(plans.items(), key=lambda kv: kv[0][0]):
        if not t.lag:  # (resident: the plan alone)
            print(f"{blocks:>7,}  {state:<22} {_ms(t.plan):>10} {'-':>9} {'-':>7}")
            continue
        print(f"{blocks:>7,}  {state:<22} {_ms(t.plan):>10} {_ms(t.lag):>9} {_ms(t.warm):>7}")
    for state in ("no maintenance", "maintained", "maintained, steady", "steady, no tombstones", "maintained, resident"):
        a, b = plans[(small, state)], plans[(n, state)]
        if not b.lag:
            r_plan = best(b.plan) / best(a.plan)
            print(f"target: plan_block {n:,}/{small:,} blocks, {state} (block N+1 since the process's last look, its "
                  f"snapshot moved forward), <= {PLAN_TARGET}: {r_plan:.2f} -> {verdict(r_plan, PLAN_TARGET)}")
            continue
        r_plan, r_lag, r_warm = best(b.plan) / best(a.plan), best(b.lag) / best(a.lag), best(b.warm) / best(a.warm)
        if state == "steady, no tombstones":
            print(f"plan_block {n:,}/{small:,} blocks, {state}: {r_plan:.2f} (lag row {r_lag:.2f}, warm {r_warm:.2f}; "
                  "no target: copies whose compaction's tombstones expired, delta.deletedFileRetentionDuration 0, "
                  "what the checkpoint's tombstones cost the cold states)")
        elif state != "no maintenance":
            print(f"target: plan_block {n:,}/{small:,} blocks, {state}, <= {PLAN_TARGET}: {r_plan:.2f} -> "
                  f"{verdict(r_plan, PLAN_TARGET)} (lag row {r_lag:.2f} -> {verdict(r_lag, PLAN_TARGET)}; warm {r_warm:.2f})")
        else:
            print(f"plan_block {n:,}/{small:,} blocks, no maintenance: {r_plan:.2f} (lag row {r_lag:.2f}, warm "
                  f"{r_warm:.2f}; no target)")
    if view_lines:
        print(f"\n{VIEW} (merge topic on the fact; single runs):")
        print("\n".join(f"  {line}" for line in view_lines))
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    print(f"\nto reproduce: PYTHONPATH=. .venv/bin/python bench/maintenance.py {argv}".rstrip())
    print(f"(maintenance as `tidemark maintain {FACT} {OPTIONS}`)")


if __name__ == "__main__":
    raise SystemExit(main())
