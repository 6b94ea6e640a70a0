"""Additive views (issue 18): a ``GROUP BY`` view whose columns are a count and sums over base
rows, maintained by adding the moved rows' contributions instead of re-deriving whole groups.
Every unit is checked against a recompute; a null in a sum falls back to re-deriving its groups;
declarations that cannot hold are refused with the column and the reason; a crash between the
MERGE and the offset commit never adds twice. (Random interleavings: test_merge_property.py.)"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from deltalake import DeltaTable

from lineage.core.errors import LineageError, ProcessingError
from lineage.core.positions import Position
from lineage.spec.loader import load_lineage
from lineage.views import refresh
from platform_assets.views import additive as additive_module
from platform_assets.views import operate as views
from tests.platform_assets.test_merge import (
    T0,
    assert_view_equals_recompute,
    customers,
    dies_after_the_merge,
    dim_sql,
    engine,
    orders,
    processed,
)

BY_COUNTRY = ("SELECT coalesce(c.country, '?') AS country, count(*) AS n, "
              "sum(CAST(b.amount AS DECIMAL(12, 2))) AS revenue, sum(CAST(b.amount > 30 AS INT)) AS big "
              "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id GROUP BY coalesce(c.country, '?')")
# ``high`` is null in a group whose rows all have amounts up to 40: such a contribution cannot be
# subtracted exactly (SQL's sum skips nulls), so its groups are re-derived from the full base
NULLABLE = ("SELECT coalesce(c.country, '?') AS country, count(*) AS n, "
            "sum(CASE WHEN b.amount > 40 THEN CAST(b.amount AS BIGINT) END) AS high "
            "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id GROUP BY coalesce(c.country, '?')")


def additive_topic(name: str, sql: str, additive: str, extra: str = "") -> str:
    return (f"- table: {name}\n  depends_on: [stage.orders, dim.customers]\n  processor: merge\n"
            f"  transforms: [sql/{name.split('.')[1]}.sql]\n  key: [country]\n"
            f"  join_keys: {{dim.customers: {{customer_id: id}}}}\n  late_rows: rederive\n  maxstep: 15\n"
            f"  additive: {additive}\n" + extra)


def write_sql(root: Path, **sql: str) -> None:
    (root / "sql").mkdir(parents=True, exist_ok=True)
    for name, text in sql.items():
        (root / "sql" / f"{name}.sql").write_text(text + "\n")


# the same groups in the form the driver runs (driver_sql): sums of columns cast, no expression cast
IN_DRIVER = ("SELECT coalesce(c.country, '?') AS country, count(*) AS n, "
             "sum(CAST(b.amount AS DECIMAL(12, 2))) AS revenue, sum(CAST(b.customer_id AS INT)) AS big "
             "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id GROUP BY 1")
DRIVER = "(the transform run in the driver by DuckDB: no Spark job)"


@pytest.mark.spark
@pytest.mark.parametrize("sql", [BY_COUNTRY, IN_DRIVER], ids=["in-spark", "in-driver"])
def test_an_additive_view_adds_contributions_and_equals_a_recompute_after_every_unit(spark, settings, tmp_path, sql,
                                                                                     monkeypatch):
    write_sql(tmp_path, by_country=sql)
    eng = engine(spark, settings, tmp_path, additive_topic("mart.by_country", sql, "{count: n, sums: [revenue, big]}",
                                                           "  checks: {verify_sample: 5}\n"))
    in_driver = sql == IN_DRIVER  # (BY_COUNTRY casts an expression: Spark runs every unit)
    customers(eng, 8)  # ids 0..7 in C0, C1, C2; orders point at 0..11: 8..11 have no customer ('?')
    orders(eng, 1, 48, customers=12)
    units = processed(eng.run_until_caught_up())
    assert [u.stats["strategy"] for u in units] == ["full", "incremental", "incremental", "incremental"]
    for u in units[1:]:  # new base rows: added to their groups, nothing re-derived
        assert "additive: " in u.stats["strategy_reason"] and "groups changed by the moved rows' contributions" \
            in u.stats["strategy_reason"], u.stats["strategy_reason"]
        assert (DRIVER in u.stats["strategy_reason"]) == in_driver, u.stats["strategy_reason"]
    assert assert_view_equals_recompute(eng, "mart.by_country") == 4

    dim_sql(eng, "DELETE FROM DIM WHERE id = 5")  # C2 loses customer 5's 4 orders to '?'
    text = "\n".join(views.explain(eng, eng.lineage.topic("mart.by_country"), keys=5))
    assert "affected groups by the delta rule (country), with their contributions:" in text
    assert ("subtracted: base rows joining a changed row, before (dim.customers version 0): 1 group(s)\n"
            "      country='C2', n=4, revenue=Decimal('") in text
    assert "added: base rows joining a changed row, after (dim.customers version 1): 1 group(s)\n      country='?', n=4" in text
    # where the transform would run: in the driver where its SQL translates, else in Spark and why
    assert ("  transform: in the driver by DuckDB, no Spark job; " in text) == in_driver, text
    assert ("  transform: in Spark (" in text) != in_driver, text
    [unit] = processed(eng.run_until_caught_up())
    assert unit.stats["strategy"] == "incremental" and "additive: 2 groups changed" in unit.stats["strategy_reason"]
    assert (DRIVER in unit.stats["strategy_reason"]) == in_driver, unit.stats["strategy_reason"]  # a reverse join too
    assert (unit.stats["rows_updated"], unit.stats["rows_inserted"], unit.stats["rows_deleted"]) == (2, 0, 0)
    assert unit.stats["verify"]["differing"] == 0
    assert assert_view_equals_recompute(eng, "mart.by_country") == 4

    dim_sql(eng, "UPDATE DIM SET country = 'C0' WHERE id = 3")  # a change that moves nothing between groups
    [unit] = processed(eng.run_until_caught_up())
    assert unit.stats["rows_updated"] + unit.stats["rows_inserted"] + unit.stats["rows_deleted"] == 0
    assert (DRIVER in unit.stats["strategy_reason"]) == in_driver, unit.stats["strategy_reason"]
    assert assert_view_equals_recompute(eng, "mart.by_country") == 4

    if in_driver:  # late rows and a restated range run Spark's unit in either case: once is enough
        dim_sql(eng, "UPDATE DIM SET country = 'C9' WHERE id = 0")  # a new group; C0 loses customer 0
        dim_sql(eng, "DELETE FROM DIM WHERE country = 'C1'")  # C1's every order moves to '?': the group goes
        orders(eng, 100, 2, at=T0 - dt.timedelta(days=1))  # late rows, added whole (not subtracted from anything)
        orders(eng, 200, 3, at=T0 + dt.timedelta(hours=1), customers=12)  # and new ones
        [unit] = processed(eng.run_until_caught_up())
        assert unit.stats["late_rows"] == 2 and "additive: " in unit.stats["strategy_reason"], unit.stats
        assert DRIVER not in unit.stats["strategy_reason"]  # late rows: Spark's unit
        assert (unit.stats["rows_inserted"], unit.stats["rows_deleted"]) == (1, 1), unit.stats
        assert assert_view_equals_recompute(eng, "mart.by_country") == 4  # C0, C2, C9, ?

        # a restated range: adding its rows again would count them twice, so the unit recomputes
        eng.reset_offsets(eng.lineage.topic("mart.by_country"), Position(T0 + dt.timedelta(seconds=10), 10), "restate 11..")
        orders(eng, 300, 2, at=T0 + dt.timedelta(hours=2))
        [unit, *_] = processed(eng.run_until_caught_up())
        assert unit.stats["strategy"] == "full" and "(a restated range: adding would count rows twice)" \
            in unit.stats["strategy_reason"], unit.stats["strategy_reason"]
        assert assert_view_equals_recompute(eng, "mart.by_country") == 4
        orders(eng, 400, 2, at=T0 + dt.timedelta(hours=3))
        [unit] = processed(eng.run_until_caught_up())  # and adds again from there
        assert "additive: " in unit.stats["strategy_reason"], unit.stats["strategy_reason"]
        assert assert_view_equals_recompute(eng, "mart.by_country") == 4

    # the estimate prices Spark's unit and chooses a recompute of this small view (no cost floor); a
    # unit in the driver costs far less, so it stays incremental and says so
    monkeypatch.setattr(refresh, "COST_FLOOR", 0)
    dim_sql(eng, "UPDATE DIM SET country = 'C1' WHERE id = 6")
    [unit] = processed(eng.run_until_caught_up())
    s = unit.stats
    assert s["estimate_incremental_bytes"] > refresh.FULL_MARGIN * s["estimate_full_bytes"], s
    if in_driver:
        assert s["strategy"] == "incremental" and DRIVER in s["strategy_reason"] and \
            "not the full recompute the estimate chose: the unit runs in the driver" in s["strategy_reason"], s
    else:
        assert s["strategy_reason"].startswith("full recompute because it is cheaper"), s["strategy_reason"]
    # C1 again (customer 6) where it went above, else customer 6 moves from C0 to C1
    assert assert_view_equals_recompute(eng, "mart.by_country") == (5 if in_driver else 4)
    eng.close()


@pytest.mark.spark
def test_a_null_in_a_sum_re_derives_its_groups_and_a_crash_never_adds_twice(spark, settings, tmp_path, monkeypatch):
    write_sql(tmp_path, high=NULLABLE)
    eng = engine(spark, settings, tmp_path, additive_topic("mart.high", NULLABLE, "{count: n, sums: [high]}"))
    customers(eng, 8)
    orders(eng, 1, 30, customers=12)
    eng.run_until_caught_up()
    dim_sql(eng, "DELETE FROM DIM WHERE id = 1")  # orders 1, 13, 25: no amount above 40, a null contribution
    [unit] = processed(eng.run_until_caught_up())
    assert "its groups re-derived from the full base (a null in a sum column in the moved rows' contributions)" \
        in unit.stats["strategy_reason"], unit.stats["strategy_reason"]
    assert assert_view_equals_recompute(eng, "mart.high") == 4

    orders(eng, 31, 20, customers=12)  # amounts 31..50: some above 40
    dim_sql(eng, "DELETE FROM DIM WHERE id = 7")
    merged = dies_after_the_merge(eng, "mart.high", monkeypatch)
    [retry, *rest] = processed(eng.run_until_caught_up())
    assert retry.recovered
    assert DeltaTable(eng.path("mart.high")).version() == merged + len(rest)  # the retry wrote nothing
    assert assert_view_equals_recompute(eng, "mart.high") == 4
    eng.close()


@pytest.mark.spark
def test_an_additive_declaration_that_cannot_hold_is_refused_with_the_column(spark, settings, tmp_path):
    double = BY_COUNTRY.replace("CAST(b.amount AS DECIMAL(12, 2))", "b.amount")
    extra = BY_COUNTRY.replace("AS big ", "AS big, max(b.amount) AS top ")
    kept = ("SELECT c.country, count(*) AS n FROM block b RIGHT JOIN dim.customers c ON b.customer_id = c.id "
            "GROUP BY c.country")
    write_sql(tmp_path, double=double, extra=extra, kept=kept)
    eng = engine(spark, settings, tmp_path,
                 additive_topic("mart.double", double, "{count: n, sums: [revenue, big]}")
                 + additive_topic("mart.extra", extra, "{count: n, sums: [revenue, big]}")
                 + additive_topic("mart.kept", kept, "{count: n}"))
    customers(eng, 4)
    orders(eng, 1, 10, customers=6)
    with pytest.raises(ProcessingError, match=r"topic 'mart.double' \(.*\), additive: revenue \(double\) must be an integer "
                                              r"\(count\) or an integer or decimal \(sums\): a floating-point sum"):
        eng.run_topic("mart.double")
    assert DeltaTable.is_deltatable(eng.path("mart.double")) is False  # nothing written
    with pytest.raises(ProcessingError, match=r"the transform's column\(s\) top are neither key nor count nor sums"):
        eng.run_topic("mart.extra")
    eng.run_topic("mart.kept")  # the initial build is a recompute; the first unit that adds shows the problem
    orders(eng, 11, 3, customers=6)
    with pytest.raises(ProcessingError, match=r"additive, but its transform makes rows from dim.customers without any "
                                              r"base row"):
        eng.run_topic("mart.kept")
    eng.close()


def test_the_lineage_refuses_an_additive_view_that_cannot_be_kept_by_adding(tmp_path: Path) -> None:
    topic = ("- table: mart.x\n  depends_on: [stage.orders]\n  processor: merge\n  transforms: [x.sql]\n"
             "  key: [day]\n  additive: {count: day, sums: [n, n]}\n  delete_missing: false\n"
             "- table: fact.y\n  depends_on: [stage.orders]\n  processor: step\n  transforms: [x.sql]\n"
             "  additive: {count: n}\n")
    text = lineage_refusal(tmp_path, topic)
    assert "topic 'mart.x'" in text and "day cannot be both a key column and an additive column" in text
    assert "a column is named twice in count and sums (day, n, n)" in text
    assert "an additive view needs late_rows: rederive" in text
    assert "delete_missing: false cannot be kept with it" in text
    assert "only merge topics take 'additive' (this is a step topic)" in text


def lineage_refusal(root: Path, topics: str) -> str:
    """The loader's refusal of a lineage of ``topics`` (YAML, one topic per ``- table:``) over
    ``stage.orders``, each reading ``x.sql`` (a count per day)."""
    (root / "x.sql").write_text("SELECT CAST(pos AS DATE) AS day, count(*) AS n FROM block GROUP BY 1\n")
    (root / "l.yaml").write_text("sources:\n  - table: stage.orders\ntopics:\n" + "".join(
        "  " + line + "\n" for line in topics.splitlines()))
    with pytest.raises(LineageError) as err:
        load_lineage(root)
    return str(err.value)


@pytest.mark.spark
@pytest.mark.parametrize("driver", [True, False], ids=["view-read-by-deltalake", "view-read-by-spark"])
def test_a_sum_that_adding_would_make_0_where_sql_gives_null_re_derives_its_group(spark, settings, tmp_path, monkeypatch,
                                                                                  driver):
    if not driver:  # the view's groups read by Spark (a view of more groups than the driver reads)
        monkeypatch.setattr(additive_module, "DRIVER_GROUPS", -1)
    write_sql(tmp_path, high=NULLABLE)
    eng = engine(spark, settings, tmp_path, additive_topic("mart.high", NULLABLE, "{count: n, sums: [high]}"))
    customers(eng, 8)
    orders(eng, 1, 30, customers=12)  # amounts 1..30: every high null
    orders(eng, 41, 1, customers=12)  # order 41, customer 5 (C2): C2's high is 41, its other orders' null
    eng.run_until_caught_up()
    dim_sql(eng, "DELETE FROM DIM WHERE id = 5")  # C2 keeps customer 2's orders, whose high is null: null, not 0
    [unit] = processed(eng.run_until_caught_up())
    assert "(1 group(s) whose sum reaches 0 as rows leave" in unit.stats["strategy_reason"], unit.stats["strategy_reason"]
    assert assert_view_equals_recompute(eng, "mart.high") == 4
    eng.close()


@pytest.mark.spark
def test_a_join_index_serves_a_unit_in_the_driver_while_it_covers_the_base(spark, settings, tmp_path, capsys):
    from platform_assets.views import driver_unit, indexes
    from tests.platform_assets.test_cleanup import cli

    write_sql(tmp_path, by_country=IN_DRIVER)
    eng = engine(spark, settings, tmp_path, additive_topic("mart.by_country", IN_DRIVER, "{count: n, sums: [revenue, big]}",
                                                           "  join_index: true\n"))
    read = driver_unit.JOIN_INDEX_READ.format(column="customer_id")
    customers(eng, 8)
    orders(eng, 1, 48, customers=12)
    processed(eng.run_until_caught_up())

    def changed(statement: str, *, indexed: bool) -> None:
        dim_sql(eng, statement)
        [unit] = processed(eng.run_until_caught_up())
        reason = unit.stats["strategy_reason"]
        assert DRIVER in reason and (read in reason) == indexed, reason
        assert assert_view_equals_recompute(eng, "mart.by_country") >= 3

    def explained() -> str:
        return "\n".join(line for line in views.explain(eng, eng.lineage.topic("mart.by_country"))
                         if "join index" in line)

    assert explained() == "  join index on customer_id: none (tidemark maintain writes it); a unit scans the base"
    changed("DELETE FROM DIM WHERE id = 5", indexed=False)  # no index yet: the base is scanned
    [r] = indexes.refresh(eng)
    assert explained().startswith("  join index on customer_id: 48 rows up to ") and explained().endswith(
        "(base version 0, 0 appended part(s)); a unit reads it, and the base after it"), explained()
    assert r.line().startswith("mart.by_country: join index on customer_id: written anew (none yet): 48 rows"), r.line()
    changed("UPDATE DIM SET country = 'C9' WHERE id IN (0, 3)", indexed=True)
    orders(eng, 200, 6, at=T0 + dt.timedelta(hours=1), customers=12)  # after the index's upto: read from the base
    processed(eng.run_until_caught_up())
    changed("UPDATE DIM SET country = 'C7' WHERE id IN (0, 1, 2, 3)", indexed=True)
    orders(eng, 100, 2, at=T0 - dt.timedelta(days=1), customers=4)  # late rows: the index no longer covers the base
    processed(eng.run_until_caught_up())
    assert "; not read: the base's files or columns it covers changed" in explained(), explained()
    changed("UPDATE DIM SET country = 'C1' WHERE id IN (0, 1)", indexed=False)
    code, out = cli(["--home", str(eng.settings.home), "--lineage", str(eng.settings.lineage)], capsys, "maintain",
                    "mart.by_country", "stage.orders")  # the CLI: the tables, then the views' indexes among them
    assert code == 0 and "stage.orders v" in out, out
    assert "mart.by_country: join index on customer_id: written anew (no longer matches the base): 56 rows" in out, out
    changed("DELETE FROM DIM WHERE id IN (1, 2)", indexed=True)
    assert "up to date" in indexes.refresh(eng)[0].line()
    eng.close()
