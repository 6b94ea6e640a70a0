"""The driver's transform (platform_assets.views.driver_sql): the SQL it accepts gives, run by
DuckDB, exactly the rows Spark gives (real Spark, the same Arrow rows); everything else is declined."""

from __future__ import annotations

import datetime as dt
import decimal
import random

import pyarrow as pa
import pytest

from platform_assets.views import driver_sql

UTC = dt.UTC


def tables(n: int = 240, seed: int = 56) -> dict[str, pa.Table]:
    """A block and a reference table with what tells engines apart: nulls, instants before 1970 and
    at midnight, strings that differ in case and accents, duplicate join values, decimals."""
    rng = random.Random(seed)
    base = dt.datetime(1969, 12, 30, 22, 0, tzinfo=UTC)
    names = ["a", "A", "é", "e", "Zoë", "", None, "b b"]
    block = pa.table({
        "pos": pa.array([base + dt.timedelta(hours=rng.choice([0, 1, 2, 26, 50, 3, 24 * 400])) for _ in range(n)],
                        pa.timestamp("us", tz="UTC")),
        "id": pa.array(range(1, n + 1), pa.int64()),
        "customer_id": pa.array([rng.choice([None, *range(12)]) for _ in range(n)], pa.int64()),
        "amount": pa.array([rng.choice([None, round(rng.uniform(-500, 500), 2), 0.0, -0.0, 1.1, -0.05, 1e3])
                            for _ in range(n)], pa.float64()),
        "qty": pa.array([rng.choice([None, *range(-3, 9)]) for _ in range(n)], pa.int32()),
        "price": pa.array([rng.choice([None, decimal.Decimal(rng.randint(-99999, 99999)) / 100]) for _ in range(n)],
                          pa.decimal128(10, 2)),
        "note": pa.array([rng.choice(names) for _ in range(n)], pa.string()),
        "local": pa.array([dt.datetime(1969, 12, 31, 23, 30) + dt.timedelta(minutes=rng.randint(0, 120)) for _ in range(n)],
                          pa.timestamp("us")),
    })
    refs = pa.table({
        "id": pa.array([0, 1, 2, 3, 3, 4, 5, 6, 7, None, 9], pa.int64()),
        "country": pa.array(["DE", "FR", None, "NL", "PL", "é", "e", "DE", "", "XX", "JP"], pa.string()),
        "segment": pa.array(["r", "s", "r", None, "e", "s", "r", "e", "s", "r", None], pa.string()),
        "since": pa.array([dt.date(2020, 1, d + 1) for d in range(11)], pa.date32()),
    })
    return {"block": block, "refs": refs}


AGREEING = [
    # an aggregate over a left join: day, country with a default, count and a decimal sum of doubles
    """SELECT CAST(b.pos AS DATE) AS day, coalesce(c.country, '??') AS country, count(*) AS orders,
       sum(CAST(b.amount AS DECIMAL(12, 2))) AS revenue
       FROM block b LEFT JOIN refs c ON b.customer_id = c.id
       GROUP BY CAST(b.pos AS DATE), coalesce(c.country, '??')""",
    # rows passed through, a double among them, duplicate join values giving two rows
    "SELECT b.pos, b.id, b.amount, b.note, c.country, c.segment FROM block b LEFT JOIN refs c ON b.customer_id = c.id",
    # an inner join, conditions on strings, integers, nulls, IN, NOT, OR
    """SELECT b.id, c.country, b.note FROM block b JOIN refs c ON b.customer_id = c.id AND c.segment <> 'e'
       WHERE (b.note IN ('a', 'é', '', 'it\\'s') OR b.note IS NULL) AND NOT (b.qty > 5) AND b.qty IS NOT NULL""",
    # CASE, min/max of strings, dates and decimals, count of a column, integer sums and casts
    """SELECT CASE WHEN c.segment = 'r' THEN 'retail' WHEN c.segment IS NULL THEN NULL ELSE c.segment END AS seg,
       min(b.note) AS first_note, max(b.note) AS last_note, min(c.since) AS since, max(b.price) AS top,
       count(b.qty) AS with_qty, sum(b.qty) AS qty, sum(CAST(b.qty AS BIGINT)) AS qty64,
       sum(CAST(b.qty AS DECIMAL(12, 1))) AS qty_dec, sum(CAST(b.price AS DECIMAL(20, 4))) AS total
       FROM block b LEFT OUTER JOIN refs c ON b.customer_id = c.id
       GROUP BY CASE WHEN c.segment = 'r' THEN 'retail' WHEN c.segment IS NULL THEN NULL ELSE c.segment END""",
    # local date-times to dates; unqualified columns
    "SELECT CAST(local AS DATE) AS d, count(*) AS n, max(price) AS p FROM block GROUP BY CAST(local AS DATE)",
    # GROUP BY positions and an output alias, as Spark resolves them
    """SELECT CAST(b.pos AS DATE) AS day, c.segment AS seg, count(*) AS n FROM block b LEFT JOIN refs c
       ON b.customer_id = c.id GROUP BY 1, seg""",
    # an aggregate without GROUP BY over no rows: one row
    "SELECT count(*) AS n, sum(qty) AS s, max(note) AS m FROM block WHERE id < 0",
    # dates compared, a decimal against a decimal of another scale
    """SELECT b.id, c.since FROM block b JOIN refs c ON b.customer_id = c.id
       WHERE c.since >= DATE '2020-01-05' AND b.price > CAST(b.price AS DECIMAL(12, 3))
       OR b.price = CAST(b.price AS DECIMAL(14, 4))""",
]


@pytest.mark.spark
@pytest.mark.parametrize("sql", AGREEING, ids=[f"q{i}" for i in range(len(AGREEING))])
def test_accepted_sql_gives_in_duckdb_exactly_the_rows_spark_gives(spark, sql):
    data = tables()
    tr = driver_sql.translate(sql, {name: t.schema for name, t in data.items()})
    for name, t in data.items():
        spark.createDataFrame(t).createOrReplaceTempView(name)
    want = spark.sql(sql).toArrow()
    got = driver_sql.cast_to(driver_sql.run(tr, data), want.schema)
    assert got.column_names == want.column_names == tr.output

    def rows(t: pa.Table) -> list[tuple[object, ...]]:
        return sorted((tuple(r.values()) for r in t.to_pylist()), key=repr)

    assert rows(got) == rows(want)
    assert got.num_rows == want.num_rows > 0


@pytest.mark.parametrize("sql, why", [
    ("SELECT * FROM block", "without a name"),
    ("SELECT b.id + 1 AS x FROM block b", "add"),
    ("SELECT count(*) FROM block", "without a name"),
    ("SELECT id FROM block b RIGHT JOIN refs c ON b.customer_id = c.id", "join"),
    ("SELECT id FROM block b FULL OUTER JOIN refs c ON b.customer_id = c.id", "join"),
    ("SELECT b.id FROM block b LEFT SEMI JOIN refs c ON b.customer_id = c.id", "join"),
    ("SELECT b.id FROM block b, refs c", "join"),
    ("SELECT count(DISTINCT id) AS n FROM block", "DISTINCT"),
    ("SELECT DISTINCT id FROM block", "DISTINCT"),
    ("SELECT amount FROM block WHERE amount > 1", "float"),
    ("SELECT sum(amount) AS s FROM block", "float"),
    ("SELECT note, count(*) AS n FROM block GROUP BY note HAVING count(*) > 1", "HAVING"),
    ("SELECT id FROM block ORDER BY id", "ORDER"),
    ("SELECT id FROM block LIMIT 3", "LIMIT"),
    ("SELECT id FROM block UNION ALL SELECT id FROM block", "SELECT"),
    ("WITH x AS (SELECT id FROM block) SELECT id FROM x", "WITH"),
    ("SELECT id FROM block WHERE id IN (SELECT id FROM refs)", "subquery"),
    ("SELECT id, row_number() OVER (ORDER BY id) AS r FROM block", "window"),
    ("SELECT CAST(id + 1 AS DECIMAL(10, 2)) AS x FROM block", "expression"),
    ("SELECT CAST(price AS DECIMAL(10, 1)) AS x FROM block", "CAST"),
    ("SELECT CAST(note AS DATE) AS x FROM block", "CAST"),
    ("SELECT id FROM block WHERE CAST(local AS DATE) = DATE '2024-1-5'", "literal"),
    ("SELECT id FROM block WHERE CAST(local AS DATE) = DATE '2024-02-30'", "literal"),
    ("SELECT CAST(id AS DECIMAL) AS x FROM block", "CAST"),
    ("SELECT id FROM other.table", "block"),
    ("SELECT b.id FROM block b JOIN other c ON b.id = c.id", "reads other"),
    ("SELECT id FROM block WHERE note = 1", "comparison"),
    ("SELECT id FROM block WHERE price = 1", "comparison"),
    ("SELECT id FROM block WHERE price > 1.5", "literal"),
    ("SELECT upper(note) AS u FROM block", "upper"),
    (r"SELECT id FROM block WHERE note = 'a\\b'", "escape"),
    (r"SELECT id FROM block WHERE note = 'a\tb'", "escape"),
    ("SELECT id FROM block b JOIN refs c ON b.customer_id = c.id", "not one column"),
    ("SELECT note, count(*) AS n FROM block GROUP BY 3", "position"),
    ("SELECT note, count(*) AS n FROM block GROUP BY 2", "count"),
    ("SELECT id AS a, qty AS a FROM block", "two output columns"),
    ("SELECT id FROM block; SELECT id FROM block", "SELECT"),
])
def test_sql_outside_the_form_is_declined_with_its_reason(sql, why):
    data = tables(8)
    with pytest.raises(driver_sql.Declined, match=why):
        driver_sql.translate(sql, {name: t.schema for name, t in data.items()})


def test_lineage_names_and_aliases_resolve_as_spark_resolves_them():
    data = tables(8)
    schemas = {"block": data["block"].schema, "dim.Customers": data["refs"].schema}
    tr = driver_sql.translate("SELECT block.id, X.country FROM block JOIN `dim`.`customers` x ON customer_id = x.ID "
                              "WHERE X.segment = 'r'", schemas)
    assert tr.output == ["id", "country"]
    assert tr.columns == {"block": {"id", "customer_id"}, "dim.Customers": {"id", "country", "segment"}}


def test_copied_names_the_output_columns_that_are_a_column_of_the_from_table_as_it_is():
    """What a row-wise unit in the driver trusts to look base rows up in the view: only bare columns of
    ``block`` as the ``FROM`` table (not of a joined ``block``, not computed, not the other tables')."""
    data = tables(8)
    tr = driver_sql.translate(
        "SELECT b.pos, b.ID, b.customer_id AS cid, coalesce(b.qty, 0) AS qty, CAST(b.price AS DECIMAL(12, 2)) AS price, "
        "b2.note AS note, c.id AS customer_id, c.country FROM block b LEFT JOIN block b2 ON b.id = b2.id "
        "LEFT JOIN refs c ON b.customer_id = c.id", {name: t.schema for name, t in data.items()})
    assert tr.copied == {"pos": "pos", "id": "id", "cid": "customer_id"}


def test_an_ambiguous_column_is_declined():
    data = tables(8)
    with pytest.raises(driver_sql.Declined, match="not one column"):
        driver_sql.translate("SELECT id FROM block JOIN refs c ON customer_id = c.id",
                             {name: t.schema for name, t in data.items()})
    tr = driver_sql.translate("SELECT block.id, c.Country FROM block JOIN refs c ON customer_id = c.id",
                              {name: t.schema for name, t in data.items()})
    assert tr.output == ["id", "country"]  # a bare column's output name is the table's own
    assert tr.columns == {"block": {"id", "customer_id"}, "refs": {"id", "country"}}


@pytest.mark.parametrize("value, target, expected", [
    (12.34, pa.decimal128(12, 2), decimal.Decimal("12.34")),
    (-0.5, pa.decimal128(4, 1), decimal.Decimal("-0.5")),
    (2.675, pa.decimal128(12, 3), decimal.Decimal("2.675")),  # (2.67499999... in binary; its text has 3 decimals)
    (1e3, pa.decimal128(6, 2), decimal.Decimal("1000.00")),
    (None, pa.decimal128(6, 2), None),
])
def test_a_double_becomes_the_decimal_of_its_text(value, target, expected):
    assert driver_sql.cast_column(pa.array([value], pa.float64()), target).to_pylist() == [expected]


@pytest.mark.parametrize("value, target", [
    (2.675, pa.decimal128(12, 2)),  # rounding: Spark's rule applies to the binary value, declined
    (0.1 + 0.2, pa.decimal128(12, 2)),  # 0.30000000000000004
    (1e20, pa.decimal128(38, 2)),  # text with an exponent
    (123456.0, pa.decimal128(6, 2)),  # out of range
    (float("nan"), pa.decimal128(6, 2)),
    (float("inf"), pa.decimal128(6, 2)),
    (2.0 ** 60, pa.decimal128(38, 2)),  # its last binary place is not below a cent
])
def test_a_double_that_would_round_is_declined(value, target):
    with pytest.raises(driver_sql.Declined):
        driver_sql.cast_column(pa.array([value], pa.float64()), target)


def test_instants_become_utc_dates_before_1970_too_and_overflows_decline():
    instants = pa.array([dt.datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), dt.datetime(1970, 1, 1, tzinfo=UTC),
                         None, dt.datetime(1900, 3, 1, 0, 0, 1, tzinfo=UTC)], pa.timestamp("us", tz="UTC"))
    assert driver_sql.cast_column(instants, pa.date32()).to_pylist() == [
        dt.date(1969, 12, 31), dt.date(1970, 1, 1), None, dt.date(1900, 3, 1)]
    with pytest.raises(driver_sql.Declined):
        driver_sql.cast_column(pa.array([10 ** 12], pa.int64()), pa.int32())
    with pytest.raises(driver_sql.Declined):
        driver_sql.cast_column(pa.array([123456], pa.int64()), pa.decimal128(6, 2))
    with pytest.raises(driver_sql.Declined, match="does not fit"):
        driver_sql.cast_to(pa.table({"n": pa.array([10 ** 30], pa.decimal128(38, 0))}), pa.schema([("n", pa.int64())]))
    assert driver_sql.keys_unique(pa.table({"k": [1, None, 2]}), ["k"])
    assert not driver_sql.keys_unique(pa.table({"k": [1, None, None]}), ["k"])


def test_signed_parts_sum_per_group_with_the_groups_rows_leave():
    schema = pa.schema([("k", pa.string()), ("n", pa.int64()), ("s", pa.decimal128(22, 2))])
    plus = pa.table({"k": ["a", "b", None], "n": [2, 1, 1], "s": [decimal.Decimal("1.50"), decimal.Decimal("2"), 0]},
                    schema=schema)
    minus = pa.table({"k": ["a", "c"], "n": [1, 3], "s": [decimal.Decimal("0.25"), decimal.Decimal("-1")]}, schema=schema)
    got = driver_sql.signed_sum([(1, plus), (-1, minus)], ["k"], ["n", "s"], schema)
    assert got.schema.field("s").type == pa.decimal128(22, 2) and got.schema.field("n").type == pa.int64()
    assert sorted(got.to_pylist(), key=repr) == sorted([
        {"k": "a", "n": 1, "s": decimal.Decimal("1.25"), "_tm_minus": True},
        {"k": "b", "n": 1, "s": decimal.Decimal("2.00"), "_tm_minus": False},
        {"k": None, "n": 1, "s": decimal.Decimal("0.00"), "_tm_minus": False},
        {"k": "c", "n": -3, "s": decimal.Decimal("1.00"), "_tm_minus": True}], key=repr)
    big = pa.table({"k": ["a", "a"], "n": [2 ** 62, 2 ** 62], "s": [0, 0]}, schema=schema)
    with pytest.raises(driver_sql.Declined, match="does not fit"):  # no silent wrap-around
        driver_sql.signed_sum([(1, big)], ["k"], ["n", "s"], schema)
