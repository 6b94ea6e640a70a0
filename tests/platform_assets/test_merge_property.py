"""Merge topics equal their transform after every unit, as a property (issues 9 and 24).

Random interleavings of appended orders and in-place UPDATE/DELETE/INSERT of two dimensions
(``dim.customers`` and ``dim.tiers``, Delta, change data feed on), merge topics run a random
number of units in random block sizes (``maxstep``), then caught up. After EVERY processed unit
the topic's view must equal its transform computed from scratch over the base rows up to the
unit's committed ``last`` and every other input as it is now (the test changes nothing during a
unit); at the end every view is caught up and equal. Each example draws a few of the views:

* keyed join (``mart.wide``): reverse join of customer changes;
* aggregate without ``join_keys`` (``mart.by_country``): a dimension change is a full recompute
  saying so, new orders re-derive their groups incrementally;
* aggregates keyed by expressions of reference columns, declared exactly (``join_keys`` on a base
  column, ``{customer_id: id}``): the plain ``c.country`` of a LEFT JOIN (a NULL group),
  ``coalesce(c.country, '?')`` (issue 24's view), a CASE over the country with ``c.id % 3``
  (``full_above`` 0.5: a big change is a cost-based full recompute); two reference inputs (country
  and tier); a view of a view (an aggregate over ``mart.wide``, a merge output, by ``{id: id}``).
  A reference change is applied by reverse join (or ``full_above``), never silently wrong;
* additive views (``additive: {count, sums}``): a reference change adds the moved rows'
  contributions (old groups subtracted, new ones added), a null contribution re-derives its
  groups instead;
* row-wise views (``row_wise: true``): a unit re-derives only the base rows it found (new, late,
  joining a changed row), an inner join and a key holding a reference expression;
* issue 24's view declared the inexact way (``{country: country}``, a view column that is not a
  base column): every reference change must be a visible full recompute ("cannot be derived
  exactly").

A sample of cases catches up in ``tidemark run`` subprocesses killed with SIGKILL at a random point,
then resumed. Examples are not shrunk (each costs tens of seconds of Spark); a failure names the
operation, the unit and the rows that differ, and Hypothesis prints the case.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from lineage.core.positions import Position, to_naive_utc
from platform_assets.core import keyed_merge
from resources.core.settings import Settings
from tests.platform_assets.shop import reset_cli_catalog, tidemark

pytestmark = [pytest.mark.spark]

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
CUSTOMER_IDS = 8  # ids 0..7: small, so orders hit changed customers and deleted ids come back
ORDERS_SCHEMA = pa.schema([("pos", pa.timestamp("us", tz="UTC")), ("id", pa.int64()), ("customer_id", pa.int32()),
                           ("amount", pa.float64())])


@dataclass(frozen=True)
class Dim:
    """A reference input: its key column, its one value column and the values drawn for it."""

    key: str
    value: str
    values: tuple[str | None, ...]

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([(self.key, pa.int32()), (self.value, pa.string())])


DIMS = {"dim.customers": Dim("id", "country", ("DE", "FR", "IT", None)),
        "dim.tiers": Dim("customer_id", "tier", ("gold", "silver", None))}

EXACT, INEXACT, NO_JOIN_KEYS = "exact", "inexact", "no join_keys"


@dataclass(frozen=True)
class View:
    sql: str
    extra: str  # the topic's YAML beyond depends_on/processor/transforms/maxstep
    inputs: tuple[str, ...]  # depends_on after the base (stage.orders)
    kind: str  # how a reference change must be applied: EXACT, INEXACT or NO_JOIN_KEYS


_BY_COUNTRY_Q = ("SELECT coalesce(c.country, '?') AS country, count(*) AS n, sum(b.amount) AS total "
                 "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id GROUP BY coalesce(c.country, '?')")
_CUSTOMERS = ("dim.customers",)
# Amounts are whole numbers, so a sum is exact whatever order Spark adds in. Dependency order
# (mart.wide before the view over it); a unit of "*" runs them in this order.
VIEWS: dict[str, View] = {
    "mart.wide": View(
        "SELECT b.id, b.customer_id, b.amount, c.country FROM block b JOIN dim.customers c ON b.customer_id = c.id",
        "key: [id]\njoin_keys: {dim.customers: {customer_id: id}}\nfull_above: 1\n", _CUSTOMERS, EXACT),
    "mart.by_country": View(
        "SELECT c.country, sum(b.amount) AS revenue, count(*) AS n "
        "FROM block b JOIN dim.customers c ON b.customer_id = c.id GROUP BY c.country",
        "key: [country]\n", _CUSTOMERS, NO_JOIN_KEYS),
    # issue 24's view, declared through a view column: cannot be exact, so every change is a full recompute
    "mart.by_country_view": View(_BY_COUNTRY_Q, "key: [country]\njoin_keys: {dim.customers: {country: country}}\n"
                                                "late_rows: rederive\nfull_above: 1\n", _CUSTOMERS, INEXACT),
    "mart.by_country_null": View(
        "SELECT c.country, count(*) AS n, sum(b.amount) AS total "
        "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id GROUP BY c.country",
        "key: [country]\njoin_keys: {dim.customers: {customer_id: id}}\nfull_above: 1\n", _CUSTOMERS, EXACT),
    # issue 24's view, declared through the base column
    "mart.by_country_q": View(_BY_COUNTRY_Q, "key: [country]\njoin_keys: {dim.customers: {customer_id: id}}\n"
                                             "late_rows: rederive\nfull_above: 1\n", _CUSTOMERS, EXACT),
    "mart.by_region": View(
        "SELECT CASE WHEN c.country IN ('DE', 'FR') THEN 'west' WHEN c.country = 'IT' THEN 'south' ELSE 'none' END "
        "AS region, c.id % 3 AS bucket, count(*) AS n, sum(b.amount) AS total "
        "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id GROUP BY 1, 2",
        "key: [region, bucket]\njoin_keys: {dim.customers: {customer_id: id}}\nfull_above: 0.5\n", _CUSTOMERS, EXACT),
    "mart.by_tier": View(
        "SELECT coalesce(c.country, '?') AS country, coalesce(t.tier, '-') AS tier, count(*) AS n, sum(b.amount) AS total "
        "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id "
        "LEFT JOIN dim.tiers t ON b.customer_id = t.customer_id "
        "GROUP BY coalesce(c.country, '?'), coalesce(t.tier, '-')",
        "key: [country, tier]\njoin_keys: {dim.customers: {customer_id: id}, dim.tiers: {customer_id: customer_id}}\n"
        "full_above: 1\n", ("dim.customers", "dim.tiers"), EXACT),
    # a view of a view: mart.wide is a merge output (change data feed on); its rows come and go
    # with customers and with its own units
    "mart.by_wide_country": View(
        "SELECT coalesce(w.country, '?') AS country, count(*) AS n, sum(b.amount) AS total "
        "FROM block b LEFT JOIN mart.wide w ON b.id = w.id GROUP BY coalesce(w.country, '?')",
        "key: [country]\njoin_keys: {mart.wide: {id: id}}\nfull_above: 1\n", ("mart.wide",), EXACT),
    # additive views (issue 18): a reference change adds the moved rows' contributions; no full_above cap.
    # This one's SQL is of the form the driver runs by DuckDB (driver_sql), by_tier_add's is not
    "mart.by_country_add": View(
        "SELECT coalesce(c.country, '?') AS country, count(*) AS n, sum(CAST(b.amount AS DECIMAL(12, 2))) AS total "
        "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id GROUP BY coalesce(c.country, '?')",
        "key: [country]\njoin_keys: {dim.customers: {customer_id: id}}\nlate_rows: rederive\n"
        "additive: {count: n, sums: [total]}\n", _CUSTOMERS, EXACT),
    # ``big`` is null in a group without an amount above 25: such contributions re-derive their groups
    "mart.by_tier_add": View(
        "SELECT coalesce(c.country, '?') AS country, coalesce(t.tier, '-') AS tier, count(*) AS n, "
        "sum(CAST(b.amount AS DECIMAL(10, 2))) AS total, sum(CASE WHEN b.amount > 25 THEN 1 END) AS big "
        "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id "
        "LEFT JOIN dim.tiers t ON b.customer_id = t.customer_id "
        "GROUP BY coalesce(c.country, '?'), coalesce(t.tier, '-')",
        "key: [country, tier]\njoin_keys: {dim.customers: {customer_id: id}, dim.tiers: {customer_id: customer_id}}\n"
        "late_rows: rederive\nadditive: {count: n, sums: [total, big]}\n", ("dim.customers", "dim.tiers"), EXACT),
    # row-wise views (issue 18): a unit re-derives only the base rows it found, not the full base; an
    # inner join (rows come and go) and a key holding a reference expression (a moved row changes key)
    "mart.wide_rw": View(
        "SELECT b.id, b.customer_id, b.amount, c.country FROM block b JOIN dim.customers c ON b.customer_id = c.id",
        "key: [id]\njoin_keys: {dim.customers: {customer_id: id}}\nrow_wise: true\n", _CUSTOMERS, EXACT),
    "mart.tiered_rw": View(
        "SELECT b.id, coalesce(c.country, '?') AS country, t.tier, b.amount FROM block b "
        "LEFT JOIN dim.customers c ON b.customer_id = c.id LEFT JOIN dim.tiers t ON b.customer_id = t.customer_id",
        "key: [id, country]\njoin_keys: {dim.customers: {customer_id: id}, dim.tiers: {customer_id: customer_id}}\n"
        "late_rows: rederive\nrow_wise: true\n", ("dim.customers", "dim.tiers"), EXACT),
    # a row-wise view holding every base column: a unit finds the orders of a changed customer in it
    "mart.holds_rw": View(
        "SELECT b.*, coalesce(c.country, '?') AS country FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id",
        "key: [id]\njoin_keys: {dim.customers: {customer_id: id}}\nrow_wise: true\n", _CUSTOMERS, EXACT),
}


def closure(views: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``views`` with every view they read, in dependency order."""
    need = set(views)
    for v in list(need):
        need.update(i for i in VIEWS[v].inputs if i in VIEWS)
    return tuple(v for v in VIEWS if v in need)


def dims_of(views: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(d for d in DIMS if any(d in VIEWS[v].inputs for v in views))


def write_merge_lineage(root: Path, maxstep: int, views: tuple[str, ...]) -> Path:
    """The lineage dir of ``views`` over ``stage.orders`` and the dimensions."""
    lin = root / "lineage"
    lin.mkdir(parents=True, exist_ok=True)
    topics = []
    for table in views:
        view = VIEWS[table]
        (lin / f"{table}.sql").write_text(view.sql + "\n")
        topics.append(f"- table: {table}\n  depends_on: [stage.orders, {', '.join(view.inputs)}]\n  processor: merge\n"
                      f"  transforms: [{table}.sql]\n  maxstep: {maxstep}\n" + textwrap.indent(view.extra, "  "))
    (lin / "merge.yaml").write_text("sources:\n  - table: stage.orders\n" + "".join(f"  - table: {d}\n" for d in DIMS)
                                    + "topics:\n" + textwrap.indent("".join(topics), "  "))
    return lin


# ----------------------------------------------------------------- operations
# ("append", [(customer_id, amount, pos_gap), ...])   orders, ids increasing, pos never before the newest
# ("update", dim, [ids], value)                       UPDATE dim SET value WHERE key IN ids
# ("delete", dim, [ids])                              DELETE FROM dim WHERE key IN ids
# ("insert", dim, [ids], value)                       INSERT the ids not present (a deleted id comes back)
# ("run", topic or "*", units)                        that many units of one topic, or of each topic
# Customer ids of orders and of dimension rows are drawn from the same few, so orders point at
# customers that do not exist yet (then inserted), and dimension changes hit ordered customers.
_ids = st.lists(st.integers(0, CUSTOMER_IDS - 1), min_size=1, max_size=3, unique=True)
_orders = st.lists(st.tuples(st.integers(0, CUSTOMER_IDS - 1), st.integers(0, 50), st.sampled_from([0, 0, 1, 2])),
                   max_size=12)  # pos gap 0: ties on pos, also with the last row of the previous batch


def operations(views: tuple[str, ...], *, runs: bool = True) -> st.SearchStrategy[tuple[Any, ...]]:
    """One operation on the inputs ``views`` read (or, with ``runs``, units of them)."""
    choices: list[st.SearchStrategy[tuple[Any, ...]]] = [st.tuples(st.just("append"), _orders)]
    for d in dims_of(views):
        values = st.sampled_from(DIMS[d].values)
        choices += [st.tuples(st.just("update"), st.just(d), _ids, values), st.tuples(st.just("delete"), st.just(d), _ids),
                    st.tuples(st.just("insert"), st.just(d), _ids, values)]
    if runs:
        choices.append(st.tuples(st.just("run"), st.sampled_from([*views, "*"]), st.integers(1, 2)))
    return st.one_of(choices)


def _dim_rows(d: str) -> st.SearchStrategy[dict[int, str | None]]:
    return st.dictionaries(st.integers(0, CUSTOMER_IDS - 1), st.sampled_from(DIMS[d].values), max_size=6)


@dataclass(frozen=True)
class Case:
    maxstep: int
    views: tuple[str, ...]  # the merge topics of the lineage (closed under what they read)
    customers: dict[int, str | None]  # the dimensions' first versions
    tiers: dict[int, str | None]
    orders: list[tuple[int, int, int]]  # the first batch of orders
    ops: list[tuple[Any, ...]]
    after: list[tuple[Any, ...]] = field(default_factory=list)  # the SIGKILL test: input changes before the killed run


@st.composite
def cases(draw: st.DrawFn, *, views: int = 3, after: bool = False) -> Case:
    """A case on up to ``views`` drawn views (plus what they read); ``after``: draw input changes
    for the SIGKILL test's killed run too."""
    chosen = closure(draw(st.lists(st.sampled_from(list(VIEWS)), min_size=1, max_size=views, unique=True)))
    return Case(maxstep=draw(st.integers(2, 8)), views=chosen, customers=draw(_dim_rows("dim.customers")),
                tiers=draw(_dim_rows("dim.tiers")), orders=draw(_orders),
                ops=draw(st.lists(operations(chosen), max_size=6)),
                after=draw(st.lists(operations(chosen, runs=False), min_size=1, max_size=3)) if after else [])


# Explicit cases that take every path (random cases usually do too, but the test must not depend on luck).
# Issue 24: orders of customers 3, 5 and 7 have no customer ('?', NULL and 'none' groups); maxstep 8
# builds every view in one unit, so each dimension change is a unit without new orders.
ISSUE_24 = Case(
    maxstep=8, views=("mart.by_country_view", "mart.by_country_null", "mart.by_country_q", "mart.by_region"),
    customers={0: "DE", 1: "FR", 2: None, 6: "DE"}, tiers={},
    orders=[(0, 5, 0), (1, 6, 1), (2, 7, 0), (3, 8, 1), (0, 9, 0), (5, 2, 0), (6, 4, 1)],
    ops=[("run", "*", 1),  # initial builds
         ("delete", "dim.customers", [0]), ("run", "*", 1),  # a referenced customer deleted, no new orders: '?' gains
         ("insert", "dim.customers", [3], "IT"), ("run", "*", 1),  # a customer that orders already point at: '?' loses
         ("update", "dim.customers", [1], "IT"), ("run", "*", 1),  # orders move between groups
         ("update", "dim.customers", [1, 2, 3, 6], "DE"), ("run", "mart.by_region", 1),  # 4 of 4: full_above
         ("append", [(0, 1, 0), (7, 3, 1)]), ("insert", "dim.customers", [0, 7], "FR")])  # new orders + inserts: catch-up
# A second reference (tiers: customer 4 has a tier, no customer row), a view of a view, and
# mart.by_country without join_keys (customer changes: full; the last orders alone: incremental).
REFERENCES = Case(
    maxstep=8, views=("mart.wide", "mart.by_country", "mart.by_tier", "mart.by_wide_country"),
    customers={0: "DE", 1: "FR", 2: "IT", 3: None}, tiers={0: "gold", 1: "silver", 4: "gold"},
    orders=[(0, 5, 0), (1, 6, 1), (2, 7, 0), (3, 8, 1), (0, 9, 0), (4, 1, 0)],
    ops=[("run", "*", 1),  # initial builds
         ("update", "dim.tiers", [0], "silver"), ("delete", "dim.tiers", [1]), ("run", "mart.by_tier", 1),  # second reference
         ("insert", "dim.tiers", [2, 3], "gold"), ("run", "mart.by_tier", 1),  # tiers of customers with orders
         ("update", "dim.customers", [0], "FR"), ("update", "dim.tiers", [0], "gold"),  # both references of one customer
         ("run", "mart.wide", 1), ("run", "mart.by_wide_country", 1), ("run", "mart.by_tier", 1),  # propagates; (DE, silver) left
         ("delete", "dim.customers", [2]), ("insert", "dim.customers", [4], "IT"), ("run", "*", 1),  # wide loses and gains rows
         ("append", [(1, 3, 0), (5, 4, 1)])])
# Additive and row-wise views: a group emptied and deleted, one created, a null contribution (no amount above
# 25 among customer 0's orders) re-deriving its groups, both references changed in one unit, new
# orders and reference changes in one unit.
ADDITIVE = Case(
    maxstep=8, views=("mart.by_country_add", "mart.by_tier_add", "mart.wide_rw", "mart.tiered_rw", "mart.holds_rw"),
    customers={0: "DE", 1: "FR", 2: None, 6: "DE"}, tiers={0: "gold", 4: "silver"},
    orders=[(0, 5, 0), (1, 30, 1), (2, 7, 0), (3, 40, 1), (0, 9, 0), (5, 2, 0), (6, 44, 1)],
    ops=[("run", "*", 1),  # initial builds
         ("delete", "dim.customers", [0]), ("run", "*", 1),  # customer 0's orders (5, 9) move DE -> '?': big is null
         ("insert", "dim.customers", [3], "IT"), ("run", "*", 1),  # a new group: customer 3's order leaves '?'
         ("update", "dim.customers", [6], "FR"), ("run", "*", 1),  # DE loses its last order: the group goes
         ("update", "dim.tiers", [4], "gold"), ("insert", "dim.tiers", [1], "silver"), ("update", "dim.customers", [1], "IT"),
         ("run", "mart.by_tier_add", 1),  # both references of customer 1 in one unit: its order moves once
         ("update", "dim.tiers", [1], "gold"), ("update", "dim.customers", [1], "DE"),
         ("run", "mart.tiered_rw", 1),  # row-wise, both references of one customer, no new order: found once
         ("append", [(0, 1, 0), (7, 50, 1)]), ("insert", "dim.customers", [0, 7], "FR")])  # catch-up: both at once


class World:
    """One example's warehouse: the inputs, changed as the operations say, with a Python copy of
    the orders (their positions) and of the dimensions (which ids exist, so an INSERT never
    duplicates a key)."""

    def __init__(self, spark: Any, root: Path, case: Case) -> None:
        from deltalake import write_deltalake

        self.spark = spark
        self.views = case.views
        self.settings = Settings.from_env({}, home=root / "home", lineage=write_merge_lineage(root, case.maxstep, case.views),
                                          spark_master="local[2]")
        self.dims = {"dim.customers": dict(case.customers), "dim.tiers": dict(case.tiers)}
        self.orders: list[tuple[dt.datetime, int]] = []  # (pos naive UTC, id) of every order
        self.next_id, self.pos = 1, T0
        for d, rows in self.dims.items():
            dim = DIMS[d]
            write_deltalake(self.path(d), pa.Table.from_pylist([{dim.key: k, dim.value: v} for k, v in rows.items()],
                                                              schema=dim.schema),
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
            self.orders.append((to_naive_utc(self.pos), self.next_id))
            self.next_id += 1
        write_deltalake(self.path("stage.orders"), pa.Table.from_pylist(rows, schema=ORDERS_SCHEMA), mode="append")

    def apply(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "append":
            self.append(op[1])
            return
        if kind not in ("update", "delete", "insert"):
            raise ValueError(f"not an input operation: {op!r}")
        d, ids = op[1], op[2]
        dim, rows, table = DIMS[d], self.dims[d], f"delta.`{self.path(d)}`"
        if kind == "update":
            self.spark.sql(f"UPDATE {table} SET {dim.value} = {_lit(op[3])} WHERE {dim.key} IN ({', '.join(map(str, ids))})")
            rows.update({i: op[3] for i in ids if i in rows})
        elif kind == "delete":
            self.spark.sql(f"DELETE FROM {table} WHERE {dim.key} IN ({', '.join(map(str, ids))})")
            for i in ids:
                rows.pop(i, None)
        else:
            new = [i for i in ids if i not in rows]
            if new:
                values = ", ".join(f"({i}, {_lit(op[3])})" for i in new)
                self.spark.sql(f"INSERT INTO {table} ({dim.key}, {dim.value}) VALUES {values}")
                rows.update({i: op[3] for i in new})

    def covered(self, last: Position) -> list[int]:
        """Ids of the orders at or before ``last`` by ``(pos, id)`` (positions are naive UTC)."""
        return [i for p, i in self.orders if (p, i) <= (last.pos, last.id)]

    def mismatches(self, eng: Any, tables: list[str] | tuple[str, ...], *, caught_up: bool = False) -> list[str]:
        """Every view of ``tables`` against its transform computed from scratch over the base rows up
        to the topic's committed ``last`` and the other inputs as they are now, as multisets of rows
        (duplicates count), compared in Python. The tables are tiny and each Spark job on a Delta
        table costs seconds on a shared 2-core machine, so the tables are read JVM-free (delta-rs)
        and the transform's SQL runs once over local copies of its inputs. ``caught_up``: ``last``
        must also be the newest order."""
        import pyarrow.compute as pc
        from deltalake import DeltaTable

        newest = Position(*self.orders[-1]) if self.orders else Position.zero()
        out = []
        for table in tables:
            rec = eng.store.get(table)
            last = rec.last if rec is not None else Position.zero()
            if caught_up and last != newest:
                out.append(f"{table}: not caught up: last {last}, the newest order is at {newest}")
                continue
            ids = self.covered(last)
            orders = DeltaTable(self.path("stage.orders")).to_pyarrow_table()
            sql, views = VIEWS[table].sql, ["block"]
            self.spark.createDataFrame(orders.filter(pc.is_in(orders["id"], pa.array(ids, pa.int64())))) \
                .createOrReplaceTempView("block")
            try:
                for name in VIEWS[table].inputs:  # read by name in the SQL: bound to a local copy instead
                    local = "tm_check_" + name.replace(".", "_")
                    self.spark.createDataFrame(DeltaTable(self.path(name)).to_pyarrow_table()).createOrReplaceTempView(local)
                    sql, views = sql.replace(name, local), [*views, local]
                want_df = self.spark.sql(sql)
                want = Counter(tuple(r) for r in want_df.collect())
            finally:
                for v in views:
                    self.spark.catalog.dropTempView(v)
            columns = list(want_df.columns)
            got: Counter[tuple[Any, ...]] = Counter()
            if rec is not None and rec.seq:
                view = DeltaTable(self.path(table)).to_pyarrow_table()
                if sorted(view.column_names) != sorted(columns):
                    out.append(f"{table}: columns {view.column_names} != {columns}")
                    continue
                # a timestamp (a view holding pos) as Spark collects it: naive UTC
                got = Counter(tuple(to_naive_utc(r[c]) if isinstance(r[c], dt.datetime) else r[c] for c in columns)
                              for r in view.to_pylist())
            if got != want:
                out.append(f"{table} (last {last}, {len(ids)} orders): {got.total()} rows, expected {want.total()}; "
                           f"only in the view: {sorted((got - want).elements(), key=repr)}; "
                           f"missing from the view: {sorted((want - got).elements(), key=repr)}; "
                           f"{self.describe()}")
        return out

    def describe(self) -> str:
        return "inputs now: " + "; ".join(f"{d} {dict(sorted(rows.items()))}" for d, rows in self.dims.items())

    def engine(self) -> Any:
        from lineage.spec.loader import load_lineage
        from platform_assets.engine.runner import Engine

        return Engine(self.settings, load_lineage(self.settings.lineage), spark=self.spark)


def forget_tables(spark: Any) -> None:
    """Drop this test's names from the session catalog (external tables: the files stay), so a
    later test never meets a name whose warehouse was deleted."""
    from resources.storage.meta_tables import META_TABLES

    for table in ["stage.orders", *DIMS, *VIEWS, *META_TABLES]:
        spark.sql(f"DROP TABLE IF EXISTS {table}")


def _lit(value: str | None) -> str:
    return "NULL" if value is None else f"'{value}'"


def _record(seen: Counter[tuple[str, str]], r: Any) -> str:
    """Count the paths unit ``r`` took; a problem when a reference change was applied in a way its
    view's declaration does not allow (an exact view must apply it by reverse join or, over
    ``full_above``, a full recompute; an inexact one by a full recompute that says why)."""
    topic, strategy = r.topic, r.stats.get("strategy", "?")
    reason = str(r.stats.get("strategy_reason", ""))
    seen[(topic, strategy)] += 1
    for tag, text in (("reverse join", "reverse join"), ("full_above", "full_above"), ("additive", "; additive: "),
                      ("row_wise", "; row_wise: "), ("in view", "found in the view, not by a scan"),
                      ("re-derived", "groups re-derived from the full base"),
                      ("no join_keys", "declares no join_keys"), ("inexact", "cannot be derived exactly"),
                      ("driver", "run in the driver by DuckDB")):
        if text in reason:
            seen[(topic, tag)] += 1
    changed = r.stats.get("reference_rows_changed") or {}
    if not changed or "initial build" in reason:
        return ""
    seen[(topic, "reference change")] += 1
    kind = VIEWS[topic].kind
    if kind == EXACT:
        ok = (strategy == "incremental" and "reverse join" in reason) or (strategy == "full" and "full_above" in reason)
        want = "incremental by reverse join (or full over full_above)"
    elif kind == INEXACT:
        ok, want = strategy == "full" and "cannot be derived exactly" in reason, "full: 'cannot be derived exactly'"
    else:
        ok, want = strategy == "full" and "declares no join_keys" in reason, "full: 'declares no join_keys'"
    return "" if ok else (f"{topic} ({kind} join_keys) applied a change of {changed} as {strategy}: {reason!r}; "
                          f"expected {want}")


def _check_unit(world: World, eng: Any, seen: Counter[tuple[str, str]], r: Any, where: str) -> None:
    """After a processed unit: its strategy fits its view's declaration, and the view equals its
    transform over the base rows up to its ``last`` and the other inputs now."""
    if not r.processed:
        return
    problem = _record(seen, r)
    bad = world.mismatches(eng, [r.topic])
    seq = r.block.seq if r.block is not None else "?"
    assert not problem and not bad, (
        f"{where}: after unit {seq} of {r.topic} ({r.stats.get('strategy')}: {r.stats.get('strategy_reason')}):\n"
        + "\n".join(([problem] if problem else []) + bad))


def run_ops(world: World, eng: Any, ops: list[tuple[Any, ...]], seen: Counter[tuple[str, str]]) -> None:
    """Apply ``ops`` in order: input changes, and units of the views in ``eng`` (in process), each
    unit checked as it lands."""
    for i, op in enumerate(ops):
        if op[0] != "run":
            world.apply(op)
            continue
        for name in (list(world.views) if op[1] == "*" else [op[1]]):
            for _ in range(op[2]):
                try:
                    r = eng.run_topic(name)
                except Exception as exc:
                    raise AssertionError(f"op {i} {op!r}: a unit of {name} failed: {type(exc).__name__}: "
                                         f"{str(exc)[:800]}\n{world.describe()}") from exc
                _check_unit(world, eng, seen, r, f"op {i} {op!r}")
                if not r.processed:
                    break


def catch_up(world: World, eng: Any, seen: Counter[tuple[str, str]]) -> None:
    try:
        eng.run_until_caught_up(on_result=lambda r: _check_unit(world, eng, seen, r, "catch-up"))
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"catch-up: a unit failed: {type(exc).__name__}: {str(exc)[:800]}\n{world.describe()}") from exc


def _examples(default: int) -> dict[str, Any]:
    """How many random cases: ``TIDEMARK_MERGE_EXAMPLES`` overrides (more: a soak run; 0: only
    the explicit ``@example`` cases). No shrinking: each example costs tens of seconds."""
    n = int(os.environ.get("TIDEMARK_MERGE_EXAMPLES", default))
    if n <= 0:
        return {"max_examples": 1, "phases": [Phase.explicit]}
    return {"max_examples": n, "phases": [Phase.explicit, Phase.generate]}


# Sizes keep a case at a few units per view: an incremental unit costs ~3-6 s here (MERGE jobs).
# The limit is generous: the per-unit checks make a case cost minutes on a loaded 2-core machine.
@pytest.mark.timeout(1800)
def test_every_merge_view_equals_its_transform_after_every_unit(spark: Any) -> None:
    """In process: random input changes and units in random block sizes, then caught up; after
    every unit its view equals its transform over the inputs it covers, every reference change took
    the path its declaration allows, and every path ran."""
    seen: Counter[tuple[str, str]] = Counter()
    base = Path(tempfile.mkdtemp(prefix="tm-merge-prop-"))

    @settings(**_examples(1), deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(case=cases())
    @example(case=ISSUE_24)
    @example(case=REFERENCES)
    @example(case=ADDITIVE)
    def check(case: Case) -> None:
        # A fresh warehouse per example; kept until the end (the session catalog still names its tables).
        world = World(spark, Path(tempfile.mkdtemp(dir=base)), case)
        eng = world.engine()
        small_view, filtered = keyed_merge.SMALL_VIEW_ROWS, keyed_merge.FILTERED_VIEW_ROWS
        if case in (REFERENCES, ADDITIVE):  # these with Spark's MERGE; the others' small views MERGE from the driver
            keyed_merge.SMALL_VIEW_ROWS = keyed_merge.FILTERED_VIEW_ROWS = -1
        try:
            run_ops(world, eng, case.ops, seen)
            catch_up(world, eng, seen)
            bad = world.mismatches(eng, case.views, caught_up=True)
        finally:
            keyed_merge.SMALL_VIEW_ROWS, keyed_merge.FILTERED_VIEW_ROWS = small_view, filtered
            eng.close()
        assert not bad, "caught up, views differ from their transform over the final inputs:\n" + "\n".join(bad)

    try:
        check()
    finally:
        forget_tables(spark)
        shutil.rmtree(base, ignore_errors=True)
    # The property must not pass by always taking the full path: every path ran at least once.
    assert seen[("mart.by_country", "incremental")] > 0 and seen[("mart.by_country", "no join_keys")] > 0, seen
    assert seen[("mart.by_region", "full_above")] > 0, seen
    assert seen[("mart.by_country_view", "inexact")] > 0, seen
    for view in (v for v, spec in VIEWS.items() if spec.kind == EXACT):
        assert seen[(view, "reverse join")] > 0, (view, seen)
    assert seen[("mart.by_country_add", "additive")] > 0 and seen[("mart.by_tier_add", "re-derived")] > 0, seen
    assert seen[("mart.wide_rw", "row_wise")] > 0 and seen[("mart.tiered_rw", "row_wise")] > 0, seen
    assert seen[("mart.holds_rw", "in view")] > 0, seen
    # units in the driver (DuckDB) and in Spark, both: the form's views and the others
    assert seen[("mart.by_country_add", "driver")] > 0 and seen[("mart.wide_rw", "driver")] > 0, seen
    assert seen[("mart.by_tier_add", "driver")] == 0 and seen[("mart.holds_rw", "driver")] == 0, seen


CRASH_POINTS = ["planned", "transformed", "written", "logged", "committed"]
# The killed run's first unit is mart.wide's (new orders, and customer changes by reverse join); the
# resumed run carries customer and tier changes into the aggregates and, through mart.wide, into the
# view of a view.
KILLED = Case(
    maxstep=3, views=("mart.wide", "mart.by_country_q", "mart.by_tier", "mart.by_wide_country"),
    customers={0: "DE", 1: "FR", 2: None}, tiers={0: "gold", 3: "silver"},
    orders=[(0, 5, 0), (1, 6, 1), (2, 7, 0), (3, 8, 1), (4, 1, 0)],
    ops=[("run", "*", 2), ("delete", "dim.customers", [1]), ("run", "mart.by_country_q", 1)],
    after=[("insert", "dim.customers", [3, 4], "IT"), ("update", "dim.tiers", [0], "silver"),
           ("delete", "dim.customers", [0]), ("append", [(0, 1, 0), (4, 3, 1)])])


# Row-wise views whose killed unit appends new orders (no reference change): the append landed, its
# offsets did not; the resumed run must find it by its txn id and not append it again.
KILLED_ROW_WISE = Case(
    maxstep=4, views=("mart.wide_rw", "mart.tiered_rw"), customers={0: "DE", 1: "FR"}, tiers={0: "gold"},
    orders=[(0, 5, 0), (1, 6, 1), (2, 7, 0)], ops=[("run", "*", 1)], after=[("append", [(0, 3, 0), (1, 4, 1)])])


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_merge_views_converge_after_a_sigkill_at_a_random_point(spark: Any, cli_spark) -> None:
    """A sample of cases: after the in-process operations, more input changes, then the catch-up
    runs as ``tidemark run --until-caught-up`` killed with SIGKILL at a random point of its first
    unit, and a second ``tidemark run`` resumes it; every view is caught up and equals its transform
    over the final inputs (a unit whose data landed before the kill is not applied twice)."""
    seen: Counter[tuple[str, str]] = Counter()
    points: Counter[str] = Counter()
    base = Path(tempfile.mkdtemp(prefix="tm-merge-crash-"))

    @settings(**_examples(1), deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(case=cases(views=2, after=True), crash_at=st.sampled_from(CRASH_POINTS))
    @example(case=KILLED, crash_at="written")
    @example(case=KILLED_ROW_WISE, crash_at="written")
    def check(case: Case, crash_at: str) -> None:
        world = World(spark, Path(tempfile.mkdtemp(dir=base)), case)
        eng = world.engine()
        try:
            run_ops(world, eng, case.ops, seen)
        finally:
            eng.close()
        for op in case.after:
            world.apply(op)
        world.append([(0, 1, 0)])  # something for the killed run to do, whatever the operations did
        try:
            crashed = tidemark(world.settings, "run", "--until-caught-up", env={"TIDEMARK_CRASH_AT": crash_at})
            resumed = tidemark(world.settings, "run", "--until-caught-up")
        finally:
            reset_cli_catalog()  # the next case's tables have the same names at other paths
        assert crashed.returncode == -9, f"expected SIGKILL at {crash_at}: rc={crashed.returncode}\n{crashed.stderr[-3000:]}"
        points[crash_at] += 1
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        eng = world.engine()
        try:
            bad = world.mismatches(eng, case.views, caught_up=True)
        finally:
            eng.close()
        assert not bad, (f"after a SIGKILL at {crash_at!r} and a resume, views differ from their transform over the "
                         f"final inputs:\n" + "\n".join(bad) + f"\nresume output:\n{resumed.stdout[-3000:]}")

    try:
        check()
    finally:
        forget_tables(spark)
        shutil.rmtree(base, ignore_errors=True)
    assert points["written"] > 0, points  # data landed, offsets not: the retry must not apply it twice
