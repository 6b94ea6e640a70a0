"""Row-wise views (issue 18): ``row_wise: true`` on a view whose every row comes from one base row,
so a unit re-derives only the base rows it found (new, late, joining a changed reference row)
instead of the full base narrowed to the affected keys. Every unit is checked against a
recompute; declarations that cannot hold are refused with the reason; a crash between the MERGE
and the offset commit never applies twice. (Random interleavings: test_merge_property.py.)"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from deltalake import DeltaTable

from lineage.core.errors import ProcessingError
from lineage.core.positions import Position
from platform_assets.core import keyed_merge, spark_io, table_reads
from platform_assets.views import driver_unit, in_hand, reverse
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
from tests.platform_assets.test_merge_additive import lineage_refusal, write_sql

# key [id, country]: a row whose customer changes country gets a new key (the old one is deleted)
WIDE = ("SELECT b.id, coalesce(c.country, '?') AS country, b.customer_id, b.amount "
        "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id")
INNER = "SELECT b.id, b.customer_id, b.amount, c.country FROM block b JOIN dim.customers c ON b.customer_id = c.id"
OUTER = ("SELECT b.id, c.id AS cid, c.country FROM block b FULL OUTER JOIN dim.customers c ON b.customer_id = c.id")
SUMS = ("SELECT coalesce(c.country, '?') AS country, sum(b.amount) AS revenue "
        "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id GROUP BY 1")


def row_wise_topic(name: str, key: str, extra: str = "") -> str:
    return (f"- table: {name}\n  depends_on: [stage.orders, dim.customers]\n  processor: merge\n"
            f"  transforms: [sql/{name.split('.')[1]}.sql]\n  key: [{key}]\n"
            f"  join_keys: {{dim.customers: {{customer_id: id}}}}\n  maxstep: 15\n  row_wise: true\n" + extra)


@pytest.mark.spark
@pytest.mark.parametrize("driver", [True, False], ids=["rows-in-driver", "rows-in-spark"])
def test_a_row_wise_view_re_derives_only_the_rows_found_and_equals_a_recompute(spark, settings, tmp_path, monkeypatch,
                                                                                driver):
    if not driver:  # the unit's checks, keys and MERGE source computed by Spark, not from its rows in the driver,
        monkeypatch.setattr(in_hand, "IN_HAND_ROWS", -1)
        monkeypatch.setenv("TIDEMARK_DRIVER_SQL", "off")  # and the appended rows' transform run by Spark
    write_sql(tmp_path, wide_rw=WIDE, inner_rw=INNER)
    eng = engine(spark, settings, tmp_path, row_wise_topic("mart.wide_rw", "id, country", "  late_rows: rederive\n")
                 + row_wise_topic("mart.inner_rw", "id"))
    customers(eng, 8)  # ids 0..7 in C0, C1, C2; orders point at 0..11: 8..11 have no customer
    orders(eng, 1, 36, customers=12)
    # the full base is never narrowed to the affected keys once the views are built
    narrowed: list[int] = []
    real_semi = spark_io.semi_join
    monkeypatch.setattr(spark_io, "semi_join", lambda *a, **kw: narrowed.append(1) or real_semi(*a, **kw))
    for topic in ("mart.wide_rw", "mart.inner_rw"):
        units = processed(eng.run_until_caught_up([topic]))
        assert [u.stats["strategy"] for u in units] == ["full", "incremental", "incremental"], topic
        for u in units[1:]:  # new base rows into a view that holds none of them: appended, not MERGEd
            assert "; appended: the view holds no row of base rows after its last" in u.stats["strategy_reason"], \
                u.stats["strategy_reason"]
            assert ("run in the driver by DuckDB" in u.stats["strategy_reason"]) == driver, u.stats["strategy_reason"]
        if topic == "mart.wide_rw":  # a LEFT JOIN: a row per new base row (15, then 6)
            for u, n in zip(units[1:], (15, 6), strict=True):
                assert f"row_wise: {n} rows re-derived from the base rows found" in u.stats["strategy_reason"], \
                    u.stats["strategy_reason"]
                assert (u.stats["rows_inserted"], u.stats["rows_updated"]) == (n, 0), u.stats
    assert assert_view_equals_recompute(eng, "mart.wide_rw") == 36
    assert assert_view_equals_recompute(eng, "mart.inner_rw") == 24

    # customer 5 deleted, 9 appears, 1 changes country, 2 changes id to 10: rows move, go and come
    dim_sql(eng, "DELETE FROM DIM WHERE id = 5")
    dim_sql(eng, "INSERT INTO DIM VALUES (9, 'C9')")
    dim_sql(eng, "UPDATE DIM SET country = 'C7' WHERE id = 1")
    dim_sql(eng, "UPDATE DIM SET id = 10 WHERE id = 2")
    orders(eng, 37, 5, customers=12)  # and new orders in the same unit (ids 37..41: one joins customer 1)
    text = "\n".join(views.explain(eng, eng.lineage.topic("mart.wide_rw"), keys=50))
    assert "(re-derived alone: row_wise)" in text, text
    for topic, rows in (("mart.wide_rw", 41), ("mart.inner_rw", 27)):
        [unit] = processed(eng.run_until_caught_up([topic]))
        assert unit.stats["strategy"] == "incremental" and "reverse join" in unit.stats["strategy_reason"], unit.stats
        assert "row_wise: " in unit.stats["strategy_reason"] and "appended" not in unit.stats["strategy_reason"], \
            unit.stats["strategy_reason"]
        assert ("run in the driver by DuckDB" in unit.stats["strategy_reason"]) == driver, unit.stats["strategy_reason"]
        # new rows and moved ones: the view's clustering values of the affected keys are read by Spark, and it says so
        assert ("; one Spark job read the view's customer_id of the " in unit.stats["strategy_reason"]) == driver
        assert "no Spark job" not in unit.stats["strategy_reason"], unit.stats["strategy_reason"]
        assert assert_view_equals_recompute(eng, topic) == rows
    assert not narrowed, "a row-wise unit narrowed the full base to its keys"

    if driver:  # once is enough: the retry's recovery by txn id and the restated range's MERGE-not-append
        # decision do not depend on where the unit's rows are computed
        # a crash after the MERGE, before the offset commit: the retry never applies twice
        dim_sql(eng, "UPDATE DIM SET country = 'C8' WHERE id IN (0, 3)")
        merged = dies_after_the_merge(eng, "mart.wide_rw", monkeypatch)
        [retry] = processed(eng.run_until_caught_up(["mart.wide_rw"]))
        assert retry.recovered, retry
        assert DeltaTable(eng.path("mart.wide_rw")).version() == merged  # the retry wrote nothing
        assert assert_view_equals_recompute(eng, "mart.wide_rw") == 41

        # a range restated by offsets reset: the view holds its rows, so they are MERGEd, never appended twice
        eng.spark.sql(f"UPDATE delta.`{eng.path('mart.inner_rw')}` SET amount = -1 WHERE id BETWEEN 30 AND 33")
        eng.reset_offsets(eng.lineage.topic("mart.inner_rw"), Position(T0 + dt.timedelta(seconds=29), 29), "restate 30..")
        units = processed(eng.run_until_caught_up(["mart.inner_rw"]))
        assert units and all("appended" not in u.stats["strategy_reason"] for u in units), [u.stats for u in units]
        assert assert_view_equals_recompute(eng, "mart.inner_rw") == 27
    eng.close()


# every base column (pos, id, customer_id, amount) under its own name: the view stands in for the base
HOLDS = "SELECT b.*, c.country FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id"
# the same columns, but amount computed: not a copy of the base's (Spark's analysis shows it)
DOUBLED = ("SELECT b.pos, b.id, b.customer_id, b.amount * 2 AS amount, c.country "
           "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id")
# every base column, but an inner join: orders without a customer have no view row
HOLDS_INNER = "SELECT b.*, c.country FROM block b JOIN dim.customers c ON b.customer_id = c.id"
# every base row once, but a UNION whose second branch computes customer_id (its first branch's column marks win)
UNIONED = ("SELECT b.*, c.country FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id WHERE b.amount < 15 "
           "UNION ALL SELECT b.pos, b.id, -b.customer_id AS customer_id, b.amount, c.country "
           "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id WHERE b.amount >= 15")
IN_VIEW = "the base rows joining a changed row found in the view, not by a scan of the base"


def later_units(eng, topic: str, unit, reads: list[str]) -> None:
    """Two more units of ``topic`` (30 orders, a view that stands in for the base; ``unit`` runs one
    and gives its reason, ``reads`` what it read): new orders and a changed customer in one unit
    (the new orders re-derived with the rows found in the view), then a unit after another writer
    changed the view (what it holds is unknown, so the base is read)."""
    orders(eng, 31, 6, customers=12)
    dim_sql(eng, "UPDATE DIM SET country = 'C6' WHERE id IN (0, 3)")
    assert IN_VIEW in unit(topic)
    assert assert_view_equals_recompute(eng, topic) == 36
    eng.spark.sql(f"UPDATE delta.`{eng.path(topic)}` SET amount = -1 WHERE id = 3")
    dim_sql(eng, "UPDATE DIM SET country = 'C5' WHERE id = 3")
    why = unit(topic)
    assert IN_VIEW not in why and reads == ["base"], (why, reads)
    assert assert_view_equals_recompute(eng, topic) == 36


@pytest.mark.spark
def test_a_row_wise_view_holding_the_base_columns_finds_the_rows_of_a_changed_row_in_itself(
        spark, settings, tmp_path, monkeypatch):
    """Δ(A⋈B) with A's side read from the view: a unit whose reference rows changed looks up the
    orders joining them in the view, not in the base, only when the view can stand in for the base,
    and the view equals a recompute either way."""
    write_sql(tmp_path, holds=HOLDS, doubled=DOUBLED, holds_inner=HOLDS_INNER, unioned=UNIONED)
    eng = engine(spark, settings, tmp_path, row_wise_topic("mart.holds", "id") + row_wise_topic("mart.doubled", "id")
                 + row_wise_topic("mart.holds_inner", "id") + row_wise_topic("mart.unioned", "id"))
    customers(eng, 8)
    orders(eng, 1, 30, customers=12)  # customers 8..11 do not exist: the inner join drops their orders
    topics = ("mart.holds", "mart.doubled", "mart.holds_inner", "mart.unioned")
    for topic in topics:
        processed(eng.run_until_caught_up([topic]))
    base_reads: list[str] = []
    real_matching, real_scanned = reverse._matching, reverse._scanned
    monkeypatch.setattr(reverse, "_matching", lambda view, *a: base_reads.append(
        "view" if "country" in view.columns else "base") or real_matching(view, *a))

    def scanned(*a, **kw):  # the base read JVM-free, by a filtered scan (else Spark's, _matching)
        got = real_scanned(*a, **kw)
        if got is not None:
            base_reads.append("base")
        return got

    monkeypatch.setattr(reverse, "_scanned", scanned)

    def unit(topic: str) -> str:
        base_reads.clear()
        [u] = processed(eng.run_until_caught_up([topic]))
        assert u.stats["strategy"] == "incremental" and "reverse join" in u.stats["strategy_reason"], u.stats
        return str(u.stats["strategy_reason"])

    # a deleted customer, one that appears (orders already point at it), a moved one, a changed id
    dim_sql(eng, "DELETE FROM DIM WHERE id = 5")
    dim_sql(eng, "INSERT INTO DIM VALUES (9, 'C9')")
    dim_sql(eng, "UPDATE DIM SET country = 'C7' WHERE id = 1")
    dim_sql(eng, "UPDATE DIM SET id = 10 WHERE id = 2")
    merges: list[bool] = []
    real_merge = spark_io.run_merge
    small_view, filtered = keyed_merge.SMALL_VIEW_ROWS, keyed_merge.FILTERED_VIEW_ROWS
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", -1)  # Spark's MERGE, whose source copy this checks
    monkeypatch.setattr(keyed_merge, "FILTERED_VIEW_ROWS", -1)
    monkeypatch.setattr(spark_io, "run_merge", lambda *a, **k: merges.append(k.get("in_hand", False)) or real_merge(*a, **k))
    why = unit("mart.holds")
    assert IN_VIEW in why and base_reads == ["view"], (why, base_reads)
    assert assert_view_equals_recompute(eng, "mart.holds") == 30
    assert merges == [True], "the unit's rows are in hand: Delta need not copy the MERGE's source"
    monkeypatch.setattr(spark_io, "run_merge", real_merge)
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", small_view)
    monkeypatch.setattr(keyed_merge, "FILTERED_VIEW_ROWS", filtered)
    for topic in ("mart.doubled", "mart.unioned"):  # a column not the base's: never looked up in the view
        why = unit(topic)
        assert IN_VIEW not in why and base_reads == ["base"], (topic, why, base_reads)
        assert assert_view_equals_recompute(eng, topic) == 30
    why = unit("mart.holds_inner")  # fewer view rows than base rows: never looked up in the view
    assert IN_VIEW not in why and base_reads == ["base"], (why, base_reads)
    assert assert_view_equals_recompute(eng, "mart.holds_inner") > 0

    later_units(eng, "mart.holds", unit, base_reads)

    # a crash after the MERGE of a unit that found its rows in the view: the retry never applies twice
    dim_sql(eng, "UPDATE DIM SET country = 'C4' WHERE id = 4")
    merged = dies_after_the_merge(eng, "mart.holds", monkeypatch)
    [retry] = processed(eng.run_until_caught_up(["mart.holds"]))
    assert retry.recovered, retry
    assert DeltaTable(eng.path("mart.holds")).version() == merged
    assert assert_view_equals_recompute(eng, "mart.holds") == 36
    eng.close()

    # the transform edited since the view's rows were written (country now lower case): the rows
    # found in the view are not what it gives over their base columns, so the unit reads the base
    write_sql(tmp_path, holds=HOLDS.replace("c.country", "lower(c.country) AS country"))
    eng = engine(spark, settings, tmp_path, row_wise_topic("mart.holds", "id"))
    dim_sql(eng, "UPDATE DIM SET country = 'C3' WHERE id = 6")
    why = unit("mart.holds")
    assert "does not give those rows back" in why and IN_VIEW not in why and base_reads == ["view", "base"], \
        (why, base_reads)
    eng.close()


# the driver's form (no `*`, no function): every base column copied by name, as the driver runs it
COPIES = ("SELECT b.pos, b.id, b.customer_id, b.amount, c.country "
          "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id")


@pytest.mark.spark
def test_a_unit_in_the_driver_finds_the_rows_of_a_changed_row_in_the_view(spark, settings, tmp_path, monkeypatch):
    """The lookup in the view by a unit that runs in the driver: only where the view stands in for
    the base (the translated SQL copies every base column it reads, the log's counts agree, the
    view's newest commit is the topic's), and only when the transform gives the rows found back;
    else the base is read. The view equals a recompute either way."""
    write_sql(tmp_path, copies=COPIES, computed=COPIES.replace("b.customer_id,", "coalesce(b.customer_id, 0) AS customer_id,"),
              copies_inner=COPIES.replace("LEFT JOIN", "JOIN"))
    topics = ("mart.copies", "mart.computed", "mart.copies_inner")
    eng = engine(spark, settings, tmp_path, "".join(row_wise_topic(t, "id") for t in topics))
    customers(eng, 8)
    orders(eng, 1, 30, customers=12)  # customers 8..11 do not exist: the inner join drops their orders
    for topic in topics:
        processed(eng.run_until_caught_up([topic]))
    reads: list[str] = []
    real = table_reads.matching_rows
    monkeypatch.setattr(table_reads, "matching_rows", lambda snap, *a, **kw: reads.append(
        "base" if snap.path == eng.path("stage.orders") else "view") or real(snap, *a, **kw))

    def unit(topic: str) -> str:
        reads.clear()
        [u] = processed(eng.run_until_caught_up([topic]))
        why = str(u.stats["strategy_reason"])
        assert u.stats["strategy"] == "incremental" and "reverse join" in why and "in the driver by DuckDB" in why, why
        return why

    dim_sql(eng, "DELETE FROM DIM WHERE id = 5")
    dim_sql(eng, "INSERT INTO DIM VALUES (9, 'C9')")
    dim_sql(eng, "UPDATE DIM SET country = 'C7' WHERE id = 1")
    dim_sql(eng, "UPDATE DIM SET id = 10 WHERE id = 2")
    why = unit("mart.copies")
    assert IN_VIEW in why and reads == ["view"], (why, reads)
    assert assert_view_equals_recompute(eng, "mart.copies") == 30
    # from here on the checks below decide, not the files' sizes (that rule: its own test)
    monkeypatch.setattr(driver_unit, "_cheaper_in_view", lambda *a: True)
    for topic in ("mart.computed", "mart.copies_inner"):  # a join column computed; fewer view rows than base rows
        why = unit(topic)
        assert IN_VIEW not in why and reads == ["base"], (topic, why, reads)
        assert assert_view_equals_recompute(eng, topic) > 0

    later_units(eng, "mart.copies", unit, reads)
    eng.close()

    # the transform edited since the view's rows were written (a customer-less order's country now
    # '?', where the view holds null): the rows found in the view are not what it gives over their
    # base columns, so the unit reads the base
    write_sql(tmp_path, copies=COPIES.replace("c.country", "coalesce(c.country, '?') AS country"))
    eng = engine(spark, settings, tmp_path, row_wise_topic("mart.copies", "id"))
    dim_sql(eng, "INSERT INTO DIM VALUES (11, 'C2')")  # orders of 11 had no customer: country null in the view
    why = unit("mart.copies")
    assert IN_VIEW not in why and reads == ["view", "base"], (why, reads)
    got = eng.spark.read.format("delta").load(eng.path("mart.copies")).where("customer_id = 11").collect()
    assert sorted((r.id, r.country) for r in got) == [(11, "C2"), (23, "C2"), (35, "C2")]  # re-derived from the base
    eng.close()


@pytest.mark.spark
def test_a_row_wise_declaration_that_cannot_hold_is_refused_with_the_reason(spark, settings, tmp_path):
    write_sql(tmp_path, outer=OUTER, sums=SUMS)
    eng = engine(spark, settings, tmp_path, row_wise_topic("mart.outer", "id, cid") + row_wise_topic("mart.sums", "country"))
    customers(eng, 4)
    orders(eng, 1, 10, customers=6)
    for topic in ("mart.outer", "mart.sums"):
        eng.run_topic(topic)  # the initial build is a recompute; the first unit that re-derives shows the problem
    orders(eng, 11, 6, customers=6)
    with pytest.raises(ProcessingError, match=r"topic 'mart.outer' \(.*\): row_wise, but its transform makes rows from "
                                              r"dim.customers without any base row"):
        eng.run_topic("mart.outer")
    with pytest.raises(ProcessingError, match=r"topic 'mart.sums' \(.*\): row_wise, but over the unit's base rows taken in "
                                              r"two parts the transform gives key \('[^']+'\) of country to 2 rows"):
        eng.run_topic("mart.sums")
    eng.close()


@pytest.mark.spark
def test_a_row_wise_units_checks_count_what_they_say(spark):
    """The checks of a row-wise unit (rows made from no base row, a key given twice, the rows found
    in the view against their re-derivation) and its row count, which one Spark action computes."""
    from pyspark.sql.types import LongType

    from platform_assets.views.row_wise import _checks
    from platform_assets.views.work import PART

    every = spark.createDataFrame(
        [(1, "a", "even"), (2, "b", "odd"), (3, "c", "even"), (3, "c", "odd"), (3, "c", "odd"), (9, "z", "old"),
         (8, "y", "old"), (None, "n", "alone")], f"id long, v string, {PART} string")
    found = spark.createDataFrame([(9, "z"), (8, "x")], "id long, v string")
    types = {"id": LongType(), "v": every.schema["v"].dataType}
    got = _checks(every, ["id"], found=found, view_types=types)
    assert (got["rows"], got["alone"], got["twice"], got["most"]["id"], got["most_n"], got["differ"]) == \
        (5, 1, 1, 3, 3, 2)
    clean = _checks(every.where(f"{PART} <> 'alone' AND id <> 3"), ["id"], found=None, view_types=types)
    assert (clean["rows"], clean["alone"], clean["twice"], clean["most_n"]) == (2, 0, 0, 1)
    assert "differ" not in clean.asDict()
    empty = _checks(every.where("false"), ["id"], found=found.where("false"), view_types=types)
    assert (empty["rows"], empty["alone"], empty["twice"], empty["differ"]) == (0, 0, 0, 0)
    # the same checks of the same rows in the driver (in_hand, from Arrow) say the same
    local = in_hand.checks(every.toArrow(), ["id"], PART, found.toArrow())
    assert (local["rows"], local["alone"], local["twice"], local["most"], local["most_n"], local["differ"]) == \
        (5, 1, 1, {"id": 3}, 3, 2)
    assert in_hand.comparable(every.toArrow(), found.toArrow())


def test_the_lineage_refuses_row_wise_with_additive_or_off_a_merge_topic(tmp_path: Path) -> None:
    topic = ("- table: mart.x\n  depends_on: [stage.orders]\n  processor: merge\n  transforms: [x.sql]\n"
             "  key: [day]\n  late_rows: rederive\n  additive: {count: n}\n  row_wise: true\n"
             "- table: fact.y\n  depends_on: [stage.orders]\n  processor: step\n  transforms: [x.sql]\n"
             "  row_wise: true\n")
    text = lineage_refusal(tmp_path, topic)
    assert "topic 'mart.x'" in text and "an additive view sums several base rows into a row, so it cannot be row_wise" in text
    assert "only merge topics take 'row_wise' (this is a step topic)" in text


def test_a_unit_in_the_driver_looks_in_the_view_only_where_it_reads_fewer_bytes_than_the_base(tmp_path: Path) -> None:
    """The view's files that may hold the values (by their statistics) against the base's columns
    the filtered scan reads in every base file, both from the Delta logs."""
    import hashlib

    import pyarrow as pa
    from deltalake import write_deltalake

    from platform_assets.views.driver_unit import _cheaper_in_view
    from resources.storage.delta_meta import TableSnapshot

    base, view = str(tmp_path / "base"), str(tmp_path / "view")
    n = 20_000
    write_deltalake(base, pa.table({"pos": pa.array(range(n), pa.int64()), "id": pa.array(range(n), pa.int64()),
                                    "customer_id": pa.array([i % 500 for i in range(n)], pa.int64()),
                                    "amount": pa.array([i * 0.5 for i in range(n)])}))
    for first in range(0, 500, 100):  # clustered: a file per 100 customers
        rows = [i for i in range(n) if first <= i % 500 < first + 100]
        write_deltalake(view, pa.table({"id": pa.array(rows, pa.int64()),
                                        "customer_id": pa.array([i % 500 for i in rows], pa.int64()),
                                        "note": pa.array([hashlib.sha256(str(i).encode()).hexdigest() for i in rows])}),
                        mode="append")  # a wide column that does not compress: the view is the larger table
    b, v = TableSnapshot.open(base), TableSnapshot.open(view)
    cols = ["amount", "customer_id", "id", "pos"]
    assert _cheaper_in_view(v, b, {"customer_id": [7]}, cols)  # one of five view files
    assert not _cheaper_in_view(v, b, {"customer_id": [7, 107, 207, 307, 407]}, cols)  # every view file
    assert not _cheaper_in_view(v, b, {"customer_id": ["x"]}, cols)  # values the statistics cannot compare
