"""Eventual consistency of merge topics, as a property (issue 9, "Proof").

Random interleavings of appended orders and in-place UPDATE/DELETE/INSERT of a customer
dimension (Delta, change data feed on), merge topics run a random number of units in random
block sizes (``maxstep``), then caught up: every view equals its transform computed from scratch
over the final inputs, duplicates included. Three views cover the three paths: a keyed join
(reverse join), an aggregation without ``join_keys`` (a dimension change falls back to a full
recompute) and a left join whose ``full_above`` is small (cost-based fallback). A sample of cases
catches up in ``tidemark run`` subprocesses killed with SIGKILL at a random point, then resumed.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from resources.settings import Settings
from tests.platform_assets.shop import tidemark

pytestmark = [pytest.mark.spark]

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
CUSTOMER_IDS = 8  # ids 0..7: small, so orders hit changed customers and deleted ids come back
COUNTRIES = ["DE", "FR", "IT", None]
ORDERS_SCHEMA = pa.schema([("pos", pa.timestamp("us", tz="UTC")), ("id", pa.int64()), ("customer_id", pa.int32()),
                           ("amount", pa.float64())])
CUSTOMERS_SCHEMA = pa.schema([("id", pa.int32()), ("country", pa.string())])

# Amounts are whole numbers, so a sum is exact whatever order Spark adds in.
VIEWS: dict[str, tuple[str, str]] = {
    # keyed join, every dimension change by reverse join (full_above 1: never cost-based)
    "mart.wide": ("SELECT b.id, b.customer_id, b.amount, c.country FROM block b JOIN dim.customers c ON b.customer_id = c.id",
                  "key: [id]\njoin_keys: {dim.customers: {customer_id: id}}\nfull_above: 1\n"),
    # aggregation, no join_keys: a dimension change is a full recompute, new orders re-derive their groups
    "mart.by_country": ("SELECT c.country, sum(b.amount) AS revenue, count(*) AS n "
                        "FROM block b JOIN dim.customers c ON b.customer_id = c.id GROUP BY c.country",
                        "key: [country]\n"),
    # left join, refresh default, full_above small: a few changed customers already cost a full recompute
    "mart.wide_left": ("SELECT b.id, b.customer_id, b.amount, c.country FROM block b LEFT JOIN dim.customers c "
                       "ON b.customer_id = c.id",
                       "key: [id]\njoin_keys: {dim.customers: {customer_id: id}}\nfull_above: 0.3\n"),
}


def write_merge_lineage(root: Path, maxstep: int) -> Path:
    """The lineage dir of the three merge views over ``stage.orders`` and ``dim.customers``."""
    lin = root / "lineage"
    lin.mkdir(parents=True, exist_ok=True)
    topics = []
    for table, (sql, extra) in VIEWS.items():
        (lin / f"{table}.sql").write_text(sql + "\n")
        topics.append(f"- table: {table}\n  depends_on: [stage.orders, dim.customers]\n  processor: merge\n"
                      f"  transforms: [{table}.sql]\n  maxstep: {maxstep}\n" + textwrap.indent(extra, "  "))
    (lin / "merge.yaml").write_text("sources:\n  - table: stage.orders\n  - table: dim.customers\ntopics:\n"
                                    + textwrap.indent("".join(topics), "  "))
    return lin


# ----------------------------------------------------------------- operations
# ("append", [(customer_id, amount, pos_gap), ...])   orders, ids increasing, pos never before the newest
# ("update", [ids], country)                          UPDATE dim.customers SET country WHERE id IN ids
# ("delete", [ids])                                   DELETE FROM dim.customers WHERE id IN ids
# ("insert", [ids], country)                          INSERT the ids not present (a deleted id comes back)
# ("run", topic or "*", units)                        that many units of one topic, or of each topic
_ids = st.lists(st.integers(0, CUSTOMER_IDS - 1), min_size=1, max_size=3, unique=True)
_orders = st.lists(st.tuples(st.integers(0, CUSTOMER_IDS - 1), st.integers(0, 50), st.sampled_from([0, 0, 1, 2])),
                   max_size=15)  # pos gap 0: ties on pos, also with the last row of the previous batch
OPERATION = st.one_of(
    st.tuples(st.just("append"), _orders),
    st.tuples(st.just("update"), _ids, st.sampled_from(COUNTRIES)),
    st.tuples(st.just("delete"), _ids),
    st.tuples(st.just("insert"), _ids, st.sampled_from(COUNTRIES)),
    st.tuples(st.just("run"), st.sampled_from([*VIEWS, "*"]), st.integers(1, 2)),
)


@dataclass(frozen=True)
class Case:
    maxstep: int
    customers: dict[int, str | None]  # the dimension's first version
    orders: list[tuple[int, int, int]]  # the first batch of orders
    ops: list[tuple[Any, ...]]


CASE = st.builds(Case, maxstep=st.integers(2, 8),
                 customers=st.dictionaries(st.integers(0, CUSTOMER_IDS - 1), st.sampled_from(COUNTRIES), min_size=1, max_size=6),
                 orders=_orders, ops=st.lists(OPERATION, max_size=6))


# A case that takes every path (random cases usually do too, but the test must not depend on luck).
EVERY_PATH = Case(maxstep=3, customers={0: "DE", 1: "FR", 2: "IT", 3: None},
                  orders=[(0, 5, 0), (1, 6, 1), (2, 7, 0), (3, 8, 1), (0, 9, 0), (4, 1, 0)],
                  ops=[("run", "*", 3), ("update", [0], "FR"), ("run", "*", 1),  # reverse join
                       ("append", [(1, 3, 0), (2, 4, 1)]), ("run", "*", 2),  # new orders only: incremental everywhere
                       ("update", [1, 2, 3], "DE"), ("run", "*", 1),  # 3 of 4 customers: full_above, no join_keys
                       ("delete", [3]), ("insert", [3, 4], "IT"), ("append", [(3, 2, 0), (4, 2, 0)])])


class World:
    """One example's warehouse: the inputs, changed as the operations say, with a Python copy of
    the dimension (which ids exist) so an INSERT never duplicates a customer id."""

    def __init__(self, spark: Any, root: Path, case: Case) -> None:
        from deltalake import write_deltalake

        self.spark = spark
        self.settings = Settings.from_env({}, home=root / "home", lineage=write_merge_lineage(root, case.maxstep),
                                          spark_master="local[2]")
        self.customers = dict(case.customers)
        self.next_id, self.pos = 1, T0
        write_deltalake(self.path("dim.customers"),
                        pa.Table.from_pylist([{"id": i, "country": c} for i, c in self.customers.items()], schema=CUSTOMERS_SCHEMA),
                        configuration={"delta.enableChangeDataFeed": "true"})
        self.append(case.orders)

    def path(self, table: str) -> str:
        return self.settings.table_path(table)

    def append(self, orders: list[tuple[int, int, int]]) -> None:
        from deltalake import write_deltalake

        rows = []
        for customer, amount, gap in orders:
            self.pos += dt.timedelta(seconds=gap)
            rows.append({"pos": self.pos, "id": self.next_id, "customer_id": customer, "amount": float(amount)})
            self.next_id += 1
        write_deltalake(self.path("stage.orders"), pa.Table.from_pylist(rows, schema=ORDERS_SCHEMA), mode="append")

    def apply(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        dim = f"delta.`{self.path('dim.customers')}`"
        if kind == "append":
            self.append(op[1])
        elif kind == "update":
            ids, country = op[1], op[2]
            self.spark.sql(f"UPDATE {dim} SET country = {_lit(country)} WHERE id IN ({', '.join(map(str, ids))})")
            self.customers.update({i: country for i in ids if i in self.customers})
        elif kind == "delete":
            self.spark.sql(f"DELETE FROM {dim} WHERE id IN ({', '.join(map(str, op[1]))})")
            for i in op[1]:
                self.customers.pop(i, None)
        elif kind == "insert":
            new = [i for i in op[1] if i not in self.customers]
            if new:
                values = ", ".join(f"({i}, {_lit(op[2])})" for i in new)
                self.spark.sql(f"INSERT INTO {dim} (id, country) VALUES {values}")
                self.customers.update({i: op[2] for i in new})
        else:
            raise ValueError(f"not an input operation: {op!r}")

    def mismatches(self) -> list[str]:
        """Every view against its transform over the full final inputs, as multisets of rows (what
        ``exceptAll`` both ways plus row counts check: duplicates count), compared in Python: the
        tables are tiny and each Spark job costs seconds on a shared 2-core machine."""
        from lineage.loader import load_lineage
        from platform_assets.engine import Engine

        eng = Engine(self.settings, load_lineage(self.settings.lineage), spark=self.spark)
        try:
            eng.register_tables()
            self.spark.read.format("delta").load(self.path("stage.orders")).createOrReplaceTempView("block")
            out = []
            for table, (sql, _) in VIEWS.items():
                want_df = self.spark.sql(sql)
                got_df = self.spark.read.format("delta").load(self.path(table))
                if sorted(got_df.columns) != sorted(want_df.columns):
                    out.append(f"{table}: columns {got_df.columns} != {want_df.columns}")
                    continue
                got = Counter(tuple(r) for r in got_df.select(*want_df.columns).collect())
                want = Counter(tuple(r) for r in want_df.collect())
                if got != want:
                    out.append(f"{table}: {got.total()} rows, expected {want.total()}; only in the view: "
                               f"{sorted((got - want).elements(), key=repr)}; missing from the view: "
                               f"{sorted((want - got).elements(), key=repr)}")
            return out
        finally:
            self.spark.catalog.dropTempView("block")
            eng.close()


def forget_tables(spark: Any) -> None:
    """Drop this test's names from the session catalog (external tables: the files stay), so a
    later test never meets a name whose warehouse was deleted."""
    from resources.meta_tables import META_TABLES

    for table in ["stage.orders", "dim.customers", *VIEWS, *META_TABLES]:
        spark.sql(f"DROP TABLE IF EXISTS {table}")


def _lit(country: str | None) -> str:
    return "NULL" if country is None else f"'{country}'"


def _record(seen: Counter[tuple[str, str]], results: list[Any]) -> None:
    for r in results:
        if r.processed:
            seen[(r.topic, r.stats.get("strategy", "?"))] += 1
            reason = str(r.stats.get("strategy_reason", ""))
            if "reverse join" in reason:
                seen[(r.topic, "reverse join")] += 1
            if "full_above" in reason:
                seen[(r.topic, "full_above")] += 1
            if "declares no join_keys" in reason:
                seen[(r.topic, "no join_keys")] += 1


def run_ops(world: World, eng: Any, ops: list[tuple[Any, ...]], seen: Counter[tuple[str, str]]) -> None:
    """Apply ``ops`` in order: input changes, and units of the views in ``eng`` (in process)."""
    for op in ops:
        if op[0] != "run":
            world.apply(op)
            continue
        for name in (list(VIEWS) if op[1] == "*" else [op[1]]):
            for _ in range(op[2]):
                r = eng.run_topic(name)
                _record(seen, [r])
                if not r.processed:
                    break


def _examples(default: int) -> dict[str, Any]:
    """How many random cases: ``TIDEMARK_MERGE_EXAMPLES`` overrides (more: a soak run; 0: only
    the explicit ``@example`` cases)."""
    n = int(os.environ.get("TIDEMARK_MERGE_EXAMPLES", default))
    return {"max_examples": n} if n > 0 else {"max_examples": 1, "phases": [Phase.explicit]}


# Sizes keep a case at a few units per view: an incremental unit costs ~3-6 s here (MERGE jobs).
@pytest.mark.timeout(900)
def test_every_merge_view_equals_its_transform_over_the_final_inputs(spark: Any) -> None:
    """In process: random inputs changes and units in random block sizes, then caught up; every
    view equals its transform over the final inputs, and every strategy path ran."""
    from lineage.loader import load_lineage
    from platform_assets.engine import Engine

    seen: Counter[tuple[str, str]] = Counter()
    base = Path(tempfile.mkdtemp(prefix="tm-merge-prop-"))

    @settings(**_examples(4), deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(case=CASE)
    @example(case=EVERY_PATH)
    def check(case: Case) -> None:
        # A fresh warehouse per example; kept until the end (the session catalog still names its tables).
        world = World(spark, Path(tempfile.mkdtemp(dir=base)), case)
        eng = Engine(world.settings, load_lineage(world.settings.lineage), spark=spark)
        try:
            run_ops(world, eng, case.ops, seen)
            _record(seen, eng.run_until_caught_up())
        finally:
            eng.close()
        bad = world.mismatches()
        assert not bad, "views differ from their transform over the final inputs:\n" + "\n".join(bad)

    try:
        check()
    finally:
        forget_tables(spark)
        shutil.rmtree(base, ignore_errors=True)
    # The property must not pass by always taking the full path: every path ran at least once.
    assert seen[("mart.wide", "reverse join")] > 0, seen
    assert seen[("mart.by_country", "incremental")] > 0 and seen[("mart.by_country", "no join_keys")] > 0, seen
    assert seen[("mart.wide_left", "full_above")] > 0, seen


CRASH_POINTS = ["planned", "transformed", "written", "logged", "committed"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_merge_views_converge_after_a_sigkill_at_a_random_point(spark: Any) -> None:
    """A sample of cases: after the in-process operations, more input changes, then the catch-up
    runs as ``tidemark run --until-caught-up`` killed with SIGKILL at a random point of its first
    unit, and a second ``tidemark run`` resumes it; every view equals its transform over the
    final inputs (a unit whose data landed before the kill is not applied twice)."""
    from lineage.loader import load_lineage
    from platform_assets.engine import Engine

    seen: Counter[tuple[str, str]] = Counter()
    points: Counter[str] = Counter()
    base = Path(tempfile.mkdtemp(prefix="tm-merge-crash-"))

    @settings(**_examples(1), deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(case=CASE, after=st.lists(OPERATION.filter(lambda op: op[0] != "run"), min_size=1, max_size=3),
           crash_at=st.sampled_from(CRASH_POINTS))
    @example(case=EVERY_PATH, after=[("update", [0, 4], "IT"), ("append", [(0, 1, 0), (4, 3, 1)])], crash_at="written")
    def check(case: Case, after: list[tuple[Any, ...]], crash_at: str) -> None:
        world = World(spark, Path(tempfile.mkdtemp(dir=base)), case)
        eng = Engine(world.settings, load_lineage(world.settings.lineage), spark=spark)
        try:
            run_ops(world, eng, case.ops, seen)
        finally:
            eng.close()
        for op in after:
            world.apply(op)
        world.append([(0, 1, 0)])  # something for the killed run to do, whatever the operations did
        crashed = tidemark(world.settings, "run", "--until-caught-up", env={"TIDEMARK_CRASH_AT": crash_at})
        assert crashed.returncode == -9, f"expected SIGKILL at {crash_at}: rc={crashed.returncode}\n{crashed.stderr[-3000:]}"
        points[crash_at] += 1
        resumed = tidemark(world.settings, "run", "--until-caught-up")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        bad = world.mismatches()
        assert not bad, (f"after a SIGKILL at {crash_at!r} and a resume, views differ from their transform over the "
                         f"final inputs:\n" + "\n".join(bad) + f"\nresume output:\n{resumed.stdout[-3000:]}")

    try:
        check()
    finally:
        forget_tables(spark)
        shutil.rmtree(base, ignore_errors=True)
    assert points["written"] > 0, points  # data landed, offsets not: the retry must not apply it twice
