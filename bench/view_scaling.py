"""View scaling: does a materialized view's refresh cost follow the change, or the view's size?

    .venv/bin/python bench/view_scaling.py              # 1M, 10M and 50M orders (hours on 2 cores)
    .venv/bin/python bench/view_scaling.py --quick      # 1M and 5M orders
    .venv/bin/python bench/view_scaling.py --sizes 200000 --changes 10,100   # a smoke run

Two views over one orders fact ``stage.orders (pos, id, customer_id, amount)`` and one reference
table ``dim.customers (id, name, segment, country)`` (Change Data Feed on), both ``merge`` topics
of one lineage (issue 18):

* ``mart.orders_wide`` (keyed join): every order left-joined to its customer, key ``id``,
  declared ``row_wise`` (a unit re-derives only the orders it found and appends new ones);
* ``mart.revenue`` (aggregating): orders and revenue per day and customer country
  (``'??'`` for an order without a customer), key ``(day, country)``, declared ``additive``
  (a unit adds the moved orders' contributions) with a ``join_index`` on ``customer_id``: after
  the initial build the index is written as ``tidemark maintain`` writes it (untimed; its time
  printed), and a unit reads the orders of changed customers from it and the base after it.

``--plain`` leaves the three declarations out: the units re-derive the affected keys from the full base.
``--strategy full`` gives both views ``refresh: full``, so that every unit takes the full path and
issue 56's full-path target (Tidemark's full unit against the plain rebuild of the same SQL) is
measured at every event, e.g. ``--sizes 1000000 --changes 10,10,10,10,10,10 --strategy full``.

The reference table has ``--customers`` rows (200,000) at every size, so only the base grows.
Orders span a year and draw their customer from 1.25x the customer ids, so ~20 % have none at
first. At each size the views are built once, then these events, each followed by a timed
refresh of each view:

* N changed reference rows, for N in ``--changes`` (10, 1,000, 100,000), all in one Delta MERGE
  of ``dim.customers``: 40 % updated in place (name, segment, country), 20 % deleted, 20 %
  inserted (customers that orders already reference: the left join's nulls get a value) and
  20 % whose join value (``id``) changes (a delete and an insert);
* 10,000 base rows appended (``--append``).

Each event runs ``--rounds`` times (3; each round changes other customers, or appends again) and
is timed against a rebuild each time. The table shows every round; the targets are judged on the
medians of the rounds (of Tidemark's seconds, of the rebuild's), so that one unit that ran into
the machine's noise, or one rebuild that ran fast, does not decide a ratio.

Per event and view: Tidemark's refresh (``Engine.run_until_caught_up`` of the topic in this
process's warm ``local[2]`` session; its strategy and why, and its phases) against a full
rebuild (the view's SQL from scratch over every order, one Delta overwrite, same session; the
two alternate which goes first), and, with ``--sdp``, a fresh ``spark-pipelines run`` of the
view as a ``@dp.materialized_view`` (JVM start included), given ``--sdp-limit`` seconds per
run: a run over the limit is killed, reported as such, and SDP is left out of larger sizes.
Before the first size an untimed warm-up size (``--warmup`` orders, 200,000; its lines printed,
its results left out) runs the same events, so that the first measured units do not alone pay
the process's first calls (imports of DuckDB and sqlglot, first reads: ~0.3 s measured at 1M).
Every result is checked equal to the full rebuild (row counts and ``exceptAll`` both ways,
untimed); a difference exits 1. The targets of issues 18 and 56 are printed PASS, MISS or "not
measured" (a size the run did not include); a miss still exits 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.reverse_join import compare as compare_tables  # noqa: E402
from bench.reverse_join import full_rebuild, merge_metrics, tidemark_refresh, write_customers  # noqa: E402
from bench.shared import BenchError, append_orders, make_sdp_project, sdp_table_path, sdp_update  # noqa: E402
from resources.core.settings import Settings  # noqa: E402
from resources.spark.session import cached_delta_jars  # noqa: E402

if TYPE_CHECKING:
    import numpy as np
    from pyspark.sql import SparkSession

ORDERS, CUSTOMERS = "stage.orders", "dim.customers"
SPAN = 1.25  # orders draw customer ids from [0, customers * SPAN]
YEAR_US = 365 * 86_400 * 1_000_000


@dataclass(frozen=True)
class View:
    topic: str
    sql: str
    key: tuple[str, ...]
    columns: tuple[str, ...]
    sdp: str  # the @dp.materialized_view body: a DataFrame expression over b (orders) and c (customers)
    extra: str = ""  # the topic's YAML beyond what every view gets (unless --plain)


KEYED = View(
    "mart.orders_wide",
    """SELECT b.pos, b.id, b.customer_id, b.amount, c.name, c.segment, c.country
FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id
""",
    ("id",), ("pos", "id", "customer_id", "amount", "name", "segment", "country"),
    'b.join(c, F.col("b.customer_id") == F.col("c.id"), "left").select('
    '"b.pos", "b.id", "b.customer_id", "b.amount", "c.name", "c.segment", "c.country")',
    "row_wise: true\n")
AGGREGATE = View(
    "mart.revenue",
    """SELECT CAST(b.pos AS DATE) AS day, coalesce(c.country, '??') AS country, count(*) AS orders,
       sum(CAST(b.amount AS DECIMAL(12, 2))) AS revenue
FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id
GROUP BY CAST(b.pos AS DATE), coalesce(c.country, '??')
""",
    ("day", "country"), ("day", "country", "orders", "revenue"),
    'b.join(c, F.col("b.customer_id") == F.col("c.id"), "left").groupBy('
    'F.col("b.pos").cast("date").alias("day"), F.coalesce(F.col("c.country"), F.lit("??")).alias("country")).agg('
    'F.count(F.lit(1)).alias("orders"), F.sum(F.col("b.amount").cast("decimal(12,2)")).alias("revenue"))',
    "late_rows: rederive\nadditive: {count: orders, sums: [revenue]}\njoin_index: true\n")
VIEWS = (KEYED, AGGREGATE)

#: issue 18's targets
SMALL_GROWTH = 1.5  # 10 changed rows: refresh time at the largest size / at the smallest, at most
SMALL_SHARE = {10_000_000: 0.10, 50_000_000: 0.05}  # 10 changed rows: Tidemark / full rebuild, at most
MEDIUM_SHARE = 0.25  # 1,000 changed rows at 10M and 50M: incremental, and Tidemark / full at most
LARGE_WITHIN = 1.10  # 100,000 changed rows: Tidemark / the faster of (Tidemark, full) at most
APPEND_SHARE = 0.10  # 10,000 appended rows into the aggregating view at 10M: Tidemark / full at most
#: issue 56's targets
SMALL_SHARE_56 = {1_000_000: 1.0, 10_000_000: 0.15, 50_000_000: 0.10}  # 10 changed rows: Tidemark / full at most
FULL_WITHIN = 1.10  # a unit on the full path: Tidemark / the plain rebuild of the same SQL at most
APPEND_SHARE_56 = 0.05  # 10,000 appended orders at 10M and 50M, both views: Tidemark / full at most


@dataclass
class Result:
    size: int
    event: str
    changed: int  # reference rows changed (0: an append)
    view: str
    tm_s: float
    full_s: float
    strategy: str
    detail: str
    sdp_s: float | None = None
    sdp_note: str = ""
    rounds: int = 1  # of a median (:func:`medians`): how many rounds it is the median of

    @property
    def ratio(self) -> float:
        return self.tm_s / self.full_s


@dataclass
class Customers:
    """Which customer ids exist (the reference table's state, to draw changes from)."""

    present: np.ndarray
    rng: Any
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, customers: int) -> Customers:
        import numpy as np

        present = np.zeros(int(customers * SPAN) + 1, dtype=bool)
        present[:customers] = True
        return cls(present, np.random.default_rng(18))

    def draw(self, n: int) -> tuple[list[int], list[int], list[int], list[tuple[int, int]]]:
        """``n`` changes: (updated, deleted, inserted, moved old->new) ids; the state follows."""
        import numpy as np

        upd, dele, ins = int(n * 0.4), int(n * 0.2), int(n * 0.2)
        mov = n - upd - dele - ins
        have, free = np.flatnonzero(self.present), np.flatnonzero(~self.present)
        if upd + dele + mov > len(have) or ins + mov > len(free):
            raise BenchError(f"{n} changes need more customer ids than the reference table has; use fewer --changes")
        old = self.rng.choice(have, size=upd + dele + mov, replace=False)
        new = self.rng.choice(free, size=ins + mov, replace=False)
        updated, deleted, moved_from = old[:upd], old[upd:upd + dele], old[upd + dele:]
        inserted, moved_to = new[:ins], new[ins:]
        self.present[deleted] = self.present[moved_from] = False
        self.present[inserted] = self.present[moved_to] = True
        return ([int(i) for i in updated], [int(i) for i in deleted], [int(i) for i in inserted],
                list(zip((int(i) for i in moved_from), (int(i) for i in moved_to), strict=True)))


def change_customers(spark: SparkSession, path: str, state: Customers, n: int, round_no: int) -> str:
    """``n`` changes of the reference table in one Delta MERGE; what was done."""
    from delta.tables import DeltaTable

    updated, deleted, inserted, moved = state.draw(n)
    rows = ([(i, "U") for i in updated] + [(i, "D") for i in deleted] + [(i, "I") for i in inserted]
            + [(a, "D") for a, _ in moved] + [(b, "I") for _, b in moved])
    src = spark.createDataFrame(rows, "id BIGINT, op STRING").selectExpr(
        "id", "op", f"concat('customer-', id, '-r{round_no}') AS name",
        f"element_at(array('retail', 'smb', 'enterprise', 'public'), CAST((id + {round_no}) % 4 + 1 AS INT)) AS segment",
        f"element_at(array('DE', 'FR', 'NL', 'PL', 'SE', 'US', 'BR', 'JP'), CAST((id + {round_no}) % 8 + 1 AS INT))"
        " AS country")
    attrs: dict[str, Any] = {c: f"s.{c}" for c in ("name", "segment", "country")}
    (DeltaTable.forPath(spark, path).alias("t").merge(src.alias("s"), "t.id = s.id")
     .whenMatchedDelete(condition="s.op = 'D'")
     .whenMatchedUpdate(condition="s.op = 'U'", set=attrs)
     .whenNotMatchedInsert(condition="s.op = 'I'", values={"id": "s.id", **attrs}).execute())
    return (f"{len(updated)} updated, {len(deleted)} deleted, {len(inserted)} inserted, "
            f"{len(moved)} with a changed id")


def write_sources(spark: SparkSession, orders: str, refs: str, rows: int, customers: int,
                  appended: int = 0) -> tuple[dt.datetime, int]:
    """``rows`` orders over a year (ids from 1, in chunks of 1M) and ``customers`` customers, the
    latter registered by name (the full rebuild's SQL reads it so); the orders' first time and step,
    for orders appended later. The year ends far enough in the past for ``appended`` more orders at
    the same step, plus a day: a block never takes rows whose position is still to come, so an
    append into the future would be left for later (and the bench would find the view short)."""
    from platform_assets.core import spark_io

    step_us = max(1, YEAR_US // max(1, rows // 2))
    ahead = dt.timedelta(microseconds=(appended // 2 + 1) * step_us)
    t0 = dt.datetime.now(dt.UTC) - dt.timedelta(days=366) - ahead
    for start in range(0, rows, 1_000_000):
        append_orders(orders, start + 1, min(1_000_000, rows - start), customers, t0, span=SPAN, step_us=step_us)
    write_customers(spark, refs, customers)
    spark_io.register_table(spark, CUSTOMERS, refs)
    return t0, step_us


def make_lineage(base: Path, maxstep: int) -> Path:
    sql, lin = base / "sql", base / "lineage"
    sql.mkdir(parents=True)
    lin.mkdir()
    topics = []
    for v in VIEWS:
        name = v.topic.split(".")[1]
        (sql / f"{name}.sql").write_text(v.sql)
        topics.append(textwrap.dedent(f"""\
              - table: {v.topic}
                depends_on: [{ORDERS}, {CUSTOMERS}]
                processor: merge
                transforms: [../sql/{name}.sql]
                key: [{', '.join(v.key)}]
                join_keys:
                  {CUSTOMERS}: {{customer_id: id}}
                maxstep: {maxstep}
                delay: 0
                repeat: 0
            """) + "".join(f"  {line}\n" for line in (v.extra if ADDITIVE else "").splitlines() + FORCED))
    (lin / "views.yaml").write_text(f"sources:\n  - table: {ORDERS}\n  - table: {CUSTOMERS}\ntopics:\n"
                                    + "".join(textwrap.indent(t, "  ") for t in topics))
    return lin


def sdp_code(view: View, orders: str, customers: str) -> str:
    name = view.topic.split(".")[1]
    return textwrap.dedent(f'''\
        from pyspark import pipelines as dp
        from pyspark.sql import functions as F


        @dp.materialized_view(name="{name}")
        def {name}():
            b = spark.read.format("delta").load("{orders}").alias("b")  # noqa: F821 - set by the CLI
            c = spark.read.format("delta").load("{customers}").alias("c")  # noqa: F821
            return {view.sdp}
        ''')


class Sdp:
    """One pipeline project per view, run by a fresh ``spark-pipelines run`` after every event."""

    def __init__(self, base: Path, orders: str, customers: str, driver_memory: str, master: str, limit: float) -> None:
        self.master, self.limit, self.runs = master, limit, 0
        self.projects = {}
        for v in VIEWS:
            where = base / v.topic.split(".")[1]
            self.projects[v.topic] = (where, *make_sdp_project(where, v.topic.split(".")[1], sdp_code(v, orders, customers),
                                                               driver_memory))
        self.over = False  # a run went over the limit: SDP is left out from then on

    def update(self, view: View) -> tuple[float | None, str]:
        if self.over:
            return None, "left out (an earlier run went over the limit)"
        where, project, conf = self.projects[view.topic]
        self.runs += 1
        try:
            took, phases = sdp_update(where, project, conf, self.master, self.runs, timeout=self.limit)
        except subprocess.TimeoutExpired:
            self.over = True
            return None, f"over the {self.limit:.0f} s limit (killed)"
        return took, ", ".join(f"{k} {v:.0f}" for k, v in phases.items())

    def table(self, view: View) -> str:
        return str(sdp_table_path(self.projects[view.topic][0], view.topic.split(".")[1]))


#: Whether views keep their ``extra`` settings (``--plain``: neither ``additive`` nor ``row_wise``, both
#: views re-derive their affected keys from the full base)
ADDITIVE = True
#: Settings every view gets (``--strategy incremental``: ``full_above: 1``; ``--deletion-vectors``)
FORCED: list[str] = []


def run_size(spark: SparkSession, root: Path, rows: int, customers: int, changes: list[int], append: int, maxstep: int,
             sdp: Sdp | None, sdp_args: tuple[str, str, float] | None, rounds: int = 1) -> tuple[list[Result], Sdp | None]:
    from lineage.spec.loader import load_lineage
    from platform_assets.engine.runner import Engine
    from platform_assets.views import indexes

    base = root / f"size-{rows}"
    settings = Settings.from_env({}, home=base / "home", lineage=make_lineage(base / "tidemark", maxstep),
                                 spark_master="local[2]")
    orders, refs = settings.table_path(ORDERS), settings.table_path(CUSTOMERS)
    t = time.monotonic()
    t0, step_us = write_sources(spark, orders, refs, rows, customers, appended=append * rounds)
    print(f"\n== {rows:,} orders, {customers:,} customers: sources written in {time.monotonic() - t:.1f} s (untimed)",
          flush=True)
    full_paths = {v.topic: str(base / "full" / v.topic) for v in VIEWS}
    engine = Engine(settings, load_lineage(settings.lineage), spark=spark, owner="bench-view-scaling")
    results: list[Result] = []
    try:
        init = []
        for v in VIEWS:
            init.append(f"{v.topic}: full rebuild {full_rebuild(spark, orders, full_paths[v.topic], v.sql):.1f} s")
            t = time.monotonic()
            blocks = [r for r in engine.run_until_caught_up([v.topic]) if r.processed]
            init.append(f"Tidemark {time.monotonic() - t:.1f} s ({len(blocks)} units)")
        t = time.monotonic()
        for r in indexes.refresh(engine):  # what `tidemark maintain` does after the initial build
            init.append(f"{r.line()} ({time.monotonic() - t:.1f} s)")
            if r.failed:
                raise BenchError(r.line())
        if sdp is None and sdp_args is not None:
            sdp = Sdp(base / "sdp", orders, refs, *sdp_args)
        if sdp is not None and not sdp.over:
            for v in VIEWS:
                took, note = sdp.update(v)
                init.append(f"SDP {v.topic} " + (f"{took:.1f} s" if took is not None else note))
        print("initial build (untimed for the table): " + "; ".join(init), flush=True)
        state = Customers.start(customers)
        events: list[tuple[str, int]] = [(f"{n:,} changed customers", n) for n in changes for _ in range(rounds)]
        events += [(f"{append:,} appended orders", 0)] * rounds
        next_id = rows + 1
        for i, (name, n) in enumerate(events, 1):
            if n:
                what = change_customers(spark, refs, state, n, i)
            else:
                append_orders(orders, next_id, append, customers, t0, span=SPAN, step_us=step_us)
                next_id += append
                what = f"ids {next_id - append}..{next_id - 1}, at the end of the year"
            print(f"  event {i}: {name} ({what})", flush=True)
            total = rows + (next_id - rows - 1)
            for j, v in enumerate(VIEWS):
                if (i + j) % 2 == 0:  # the two in-session sides alternate which goes first
                    full_s = full_rebuild(spark, orders, full_paths[v.topic], v.sql)
                tm_s, strategy, detail = tidemark_refresh(engine, v.topic)
                detail += merge_metrics(settings.table_path(v.topic))
                if (i + j) % 2 == 1:
                    full_s = full_rebuild(spark, orders, full_paths[v.topic], v.sql)
                r = Result(rows, name, n, v.topic, tm_s, full_s, strategy, detail)
                tables = {"Tidemark": settings.table_path(v.topic), "full rebuild": full_paths[v.topic]}
                if sdp is not None:
                    r.sdp_s, r.sdp_note = sdp.update(v)
                    if r.sdp_s is not None:
                        tables["SDP"] = sdp.table(v)
                check = compare_tables(spark, tables, total if v is KEYED else None, list(v.columns))
                results.append(r)
                sdp_text = "" if sdp is None else f"; SDP {_fmt(r.sdp_s)} s ({r.sdp_note or '-'})"
                print(f"    {v.topic}: Tidemark {tm_s:.2f} s {strategy} [{detail}]; full rebuild {full_s:.1f} s "
                      f"({r.ratio:.3f}){sdp_text}\n      equal: {check}", flush=True)
    finally:
        engine.close()
        for table in (ORDERS, CUSTOMERS, *(v.topic for v in VIEWS)):  # before the size's files go
            if spark.catalog.tableExists(table):
                spark.sql(f"DROP TABLE {table}")  # external: the files stay
    return results, sdp


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def verdict(value: float | None, target: float) -> str:
    return "not measured" if value is None else ("PASS" if value <= target else "MISS")


def print_table(results: list[Result], customers: int) -> None:
    print(f"\nwall time to bring each view up to date ({customers:,} customers at every size; Tidemark: merge topic in a "
          "warm local[2] session; full: the SQL from scratch + one overwrite, same session; SDP: a fresh "
          "`spark-pipelines run`, JVM start included)")
    print(f"{'orders':>11} {'view':<17} {'event':<24} {'Tidemark s':>10} {'full s':>7} {'TM/full':>8} {'SDP s':>7}  "
          "strategy: why")
    for r in results:
        why = r.detail.split(" (")[0][:110]
        print(f"{_figures(r)} {_fmt(r.sdp_s):>7}  {why if why.startswith(r.strategy) else r.strategy + ': ' + why}")
    summary = medians(results)
    if len(summary) < len(results):
        print("\nmedians of the rounds (--rounds): the targets below are judged on these")
        for r in summary:
            print(f"{_figures(r)}  {r.strategy}, {r.rounds} round(s)")
    print_targets(summary)


def _figures(r: Result) -> str:
    """A result's columns of the table up to its ratio: size, view, event, seconds."""
    return f"{r.size:>11,} {r.view:<17} {r.event:<24} {r.tm_s:>10.2f} {r.full_s:>7.1f} {r.ratio:>8.3f}"


def medians(results: list[Result]) -> list[Result]:
    """One result per size, event, view and strategy taken: the median of its rounds' Tidemark seconds
    and of their plain rebuilds' (``--rounds``; one round: the result itself), in the order first seen.
    A unit of half a second, or a rebuild that ran fast once, moves a ratio of one round by tens of
    per cent on this machine; the medians of three do not follow one outlier."""
    groups: dict[tuple[int, int, str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.size, r.changed, r.view, r.strategy), []).append(r)
    out = []
    for rs in groups.values():
        first = rs[0]
        detail = first.detail if len(rs) == 1 else f"median of {len(rs)} rounds"
        out.append(Result(first.size, first.event, first.changed, first.view, statistics.median(r.tm_s for r in rs),
                          statistics.median(r.full_s for r in rs), first.strategy, detail, rounds=len(rs)))
    return out


def _find(results: list[Result], size: int, changed: int, view: str) -> Result | None:
    """The result of ``view`` at ``size`` orders for the event of ``changed`` reference rows (0: the append);
    of medians, the strategy that most rounds took."""
    found = [r for r in results if r.size == size and r.changed == changed and r.view == view]
    return max(found, key=lambda r: r.rounds, default=None)


def print_targets(results: list[Result]) -> None:
    sizes = sorted({r.size for r in results})
    changes = sorted({r.changed for r in results if r.changed})

    print("\ntargets (issue 18):")
    small = changes[0] if changes else None
    for v in VIEWS:
        if small is None:
            break
        lo, hi = _find(results, sizes[0], small, v.topic), _find(results, sizes[-1], small, v.topic)
        growth = hi.tm_s / lo.tm_s if lo and hi and len(sizes) > 1 else None
        exact = sizes[0] == 1_000_000 and sizes[-1] == 50_000_000
        print(f"  {v.topic}: {small:,} changed rows, refresh time {sizes[-1]:,} / {sizes[0]:,} orders "
              f"<= {SMALL_GROWTH}x: {_fmt(growth, '.2f')} -> {verdict(growth, SMALL_GROWTH)}"
              + ("" if exact or growth is None else " at these sizes (the target: 1,000,000 -> 50,000,000)"))
        for size, share in SMALL_SHARE.items():
            r = _find(results, size, small, v.topic)
            print(f"  {v.topic}: {small:,} changed rows at {size:,} orders <= {share:.0%} of the full rebuild: "
                  f"{_fmt(r.ratio if r else None, '.3f')} -> {verdict(r.ratio if r else None, share)}")
        for size in (10_000_000, 50_000_000):
            r = _find(results, size, 1_000, v.topic)
            ok = None if r is None else (r.ratio if r.strategy == "incremental" else float("inf"))
            print(f"  {v.topic}: 1,000 changed rows at {size:,} orders, incremental and <= {MEDIUM_SHARE:.0%} of the full "
                  f"rebuild: {r.strategy + ' ' + format(r.ratio, '.3f') if r else '-'} -> {verdict(ok, MEDIUM_SHARE)}")
        for size in sizes:
            r = _find(results, size, 100_000, v.topic)
            within = None if r is None else r.tm_s / min(r.tm_s, r.full_s)
            print(f"  {v.topic}: 100,000 changed rows at {size:,} orders, within {LARGE_WITHIN}x of the faster of "
                  f"Tidemark's choice ({r.strategy if r else '-'}) and the full rebuild: {_fmt(within, '.2f')} -> "
                  f"{verdict(within, LARGE_WITHIN)}")
    r = _find(results, 10_000_000, 0, AGGREGATE.topic)
    print(f"  {AGGREGATE.topic}: appended orders at 10,000,000 orders <= {APPEND_SHARE:.0%} of the full rebuild: "
          f"{_fmt(r.ratio if r else None, '.3f')} -> {verdict(r.ratio if r else None, APPEND_SHARE)}")
    print_targets_56(results)


def print_targets_56(results: list[Result]) -> None:
    """Issue 56's targets, from the same results: 10 changed rows against the rebuild per size and
    their growth from 1M to 50M, every unit on the full path against the plain rebuild, and appended
    orders into both views at 10M and 50M."""
    print("\ntargets (issue 56):")
    for v in VIEWS:
        for size, share in SMALL_SHARE_56.items():
            r = _find(results, size, 10, v.topic)
            print(f"  {v.topic}: 10 changed rows at {size:,} orders <= {share:.2f} x the full rebuild: "
                  f"{_fmt(r.ratio if r else None, '.3f')} -> {verdict(r.ratio if r else None, share)}")
        lo, hi = _find(results, 1_000_000, 10, v.topic), _find(results, 50_000_000, 10, v.topic)
        growth = hi.tm_s / lo.tm_s if lo and hi else None
        print(f"  {v.topic}: 10 changed rows, refresh time 50,000,000 / 1,000,000 orders <= {SMALL_GROWTH}x: "
              f"{_fmt(growth, '.2f')} -> {verdict(growth, SMALL_GROWTH)}")
        full = [r for r in results if r.view == v.topic and r.strategy == "full"]
        worst = max(full, key=lambda r: r.ratio, default=None)
        units = sum(r.rounds for r in full)
        of = f", the median of {worst.rounds}" if worst and worst.rounds > 1 else ""
        print(f"  {v.topic}: every unit on the full path <= {FULL_WITHIN}x the plain rebuild ({units} unit(s)): "
              + (f"worst {worst.ratio:.3f} ({worst.size:,} orders, {worst.event}{of})" if worst else "-")
              + f" -> {verdict(worst.ratio if worst else None, FULL_WITHIN)}")
        for size in (10_000_000, 50_000_000):
            r = _find(results, size, 0, v.topic)
            print(f"  {v.topic}: appended orders at {size:,} orders <= {APPEND_SHARE_56:.0%} of the full rebuild: "
                  f"{_fmt(r.ratio if r else None, '.3f')} -> {verdict(r.ratio if r else None, APPEND_SHARE_56)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1000000,10000000,50000000", help="orders per size, comma-separated")
    p.add_argument("--quick", action="store_true", help="sizes 1M and 5M")
    p.add_argument("--customers", type=int, default=200_000, help="rows of the reference table at every size")
    p.add_argument("--changes", default="10,1000,100000", help="changed reference rows per event, comma-separated")
    p.add_argument("--append", type=int, default=10_000, help="orders appended in the last event")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of each event (each a change of other customers, or another append), each timed "
                        "against a rebuild; the targets are judged on the medians (1: one round, as before stop 87)")
    p.add_argument("--maxstep", type=int, default=100_000_000, help="Tidemark's base rows per unit")
    p.add_argument("--sdp", action="store_true", help="also run Spark Declarative Pipelines on every event")
    p.add_argument("--sdp-limit", type=float, default=600, help="seconds an SDP run may take before it is killed")
    p.add_argument("--driver-memory", default="6g", help="driver memory of the Spark drivers")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (data, logs)")
    p.add_argument("--warmup", type=int, default=200_000,
                   help="orders of an untimed first size, left out of the results, so that the first measured "
                        "size does not pay the process's first calls alone (0: none)")
    p.add_argument("--strategy", choices=["auto", "incremental", "full"], default="auto",
                   help="auto: Tidemark chooses; incremental: every unit of a built view incremental (full_above 1, "
                        "no estimate decides), to measure that path where it is not chosen; full: every unit a full "
                        "recompute (`refresh: full`), to measure the full path against the plain rebuild")
    p.add_argument("--deletion-vectors", action="store_true",
                   help="the views with `deletion_vectors: true` (an opt-in: the deltalake reader cannot read them)")
    p.add_argument("--plain", "--no-additive", action="store_true", dest="plain",
                   help="the views without their declarations (mart.revenue's `additive`, mart.orders_wide's "
                        "`row_wise`): their units re-derive the affected keys from the full base")
    args = p.parse_args(argv)
    global ADDITIVE
    ADDITIVE = not args.plain
    if args.deletion_vectors:
        FORCED.append("deletion_vectors: true")
    if args.strategy == "incremental":
        from lineage.views import refresh

        FORCED.append("full_above: 1")
        refresh.COST_FLOOR = sys.maxsize
    elif args.strategy == "full":
        FORCED.append("refresh: full")
    sizes = [1_000_000, 5_000_000] if args.quick else [int(x) for x in args.sizes.split(",") if x.strip()]
    changes = [int(x) for x in args.changes.split(",") if x.strip()]
    if not sizes or any(s <= 0 for s in sizes) or any(n <= 0 for n in changes) or args.rounds <= 0:
        p.error("--sizes, --changes and --rounds must be positive integers")
    if not cached_delta_jars():
        print("error: no cached Delta jars; start Spark once first (e.g. ./scripts/setup.sh or `tidemark spark up`)",
              file=sys.stderr)
        return 1
    root = Path(tempfile.mkdtemp(prefix="tidemark-view-scaling-"))
    print(f"work dir {root}; sizes {sizes}; {args.customers:,} customers; changes {changes}; append {args.append:,}",
          flush=True)
    os.environ["TIDEMARK_DRIVER_MEMORY"] = args.driver_memory
    results: list[Result] = []
    spark = None
    try:
        from resources.spark.session import build_spark_session

        settings = Settings.from_env({}, home=root / "session", spark_master="local[2]")
        spark = build_spark_session(settings, app_name="tidemark-bench-view-scaling")
        sdp_args = (args.driver_memory, "local[2]", args.sdp_limit) if args.sdp else None
        sdp = None
        if args.warmup > 0:  # the process's first units pay its imports and first calls (DuckDB, sqlglot, ...)
            print(f"\nwarm-up: {args.warmup:,} orders, 10 changed customers, {args.append:,} appended orders "
                  f"(not in the results below)", flush=True)
            run_size(spark, root, args.warmup, args.customers, [10], args.append, args.maxstep, None, None)
            shutil.rmtree(root / f"size-{args.warmup}", ignore_errors=True)
        for rows in sorted(sizes):
            got, sdp = run_size(spark, root, rows, args.customers, changes, args.append, args.maxstep, sdp, sdp_args,
                                args.rounds)
            results.extend(got)
            sdp = None if sdp is None or not sdp.over else sdp  # a fresh project per size, unless SDP went over
            if not args.keep:
                shutil.rmtree(root / f"size-{rows}", ignore_errors=True)
    except BenchError as exc:
        print(f"\nFAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if spark is not None:
            spark.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_table(results, args.customers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
