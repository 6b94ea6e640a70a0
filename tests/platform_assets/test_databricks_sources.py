"""Sources as Spark and Databricks write them: deletion vectors and column mapping on, rows
deleted and updated in place, appends, a column renamed and one dropped, an OPTIMIZE between
runs. Step facts, a view, a reload and the late-row check stay exact; a transform reading the
renamed column fails its topic alone, naming the column."""

from __future__ import annotations

from pathlib import Path

import pytest
from deltalake import DeltaTable

from lineage.core.errors import TidemarkError
from lineage.spec.loader import load_lineage
from platform_assets.engine.runner import Engine
from platform_assets.maintenance.tables import jvm_free_reads
from resources.core.settings import Settings
from resources.storage import delta_log, delta_meta
from tests.platform_assets.test_merge import assert_view_equals_recompute

pytestmark = pytest.mark.spark

LINEAGE = """\
sources:
  - table: stage.orders
  - table: stage.payments
  - table: dim.customers
topics:
  - table: fact.orders
    depends_on: [stage.orders]
    transforms: [sql/orders.sql]
    maxstep: 1000
  - table: fact.notes
    depends_on: [stage.orders]
    transforms: [sql/notes.sql]
    maxstep: 1000
  - table: fact.payments
    depends_on: [stage.payments]
    transforms: [sql/payments.sql]
    maxstep: 1000
  - table: mart.wide
    depends_on: [stage.orders, dim.customers]
    processor: merge
    transforms: [sql/wide.sql]
    key: [id]
    join_keys: {dim.customers: {customer_id: id}}
  - table: dim.countries
    depends_on: [dim.customers]
    processor: reload
    transforms: [sql/countries.sql]
"""
SQL = {
    "orders": "SELECT pos, id, customer_id, amount FROM block",
    "notes": "SELECT pos, id, note FROM block",
    "payments": "SELECT pos, id, amount FROM block",
    "wide": "SELECT b.id, b.customer_id, b.amount, c.country FROM block b JOIN dim.customers c ON b.customer_id = c.id",
    "countries": "SELECT country, count(*) AS n FROM block GROUP BY country",
}
FEATURES = ("'delta.enableDeletionVectors' = 'true', 'delta.columnMapping.mode' = '{mode}', "
            "'delta.minReaderVersion' = '3', 'delta.minWriterVersion' = '7'")


def _engine(spark, settings: Settings, root: Path) -> Engine:  # noqa: ANN001 - a SparkSession
    (root / "sql").mkdir(parents=True, exist_ok=True)
    for name, sql in SQL.items():
        (root / "sql" / f"{name}.sql").write_text(sql + "\n")
    (root / "lineage.yaml").write_text(LINEAGE)
    return Engine(settings.with_(lineage=root / "lineage.yaml"), load_lineage(root / "lineage.yaml"), spark=spark)


def _rows(first: int, n: int, customers: int = 10) -> str:
    """``n`` rows from id ``first``, one second apart, as a VALUES-free SELECT."""
    return (f"SELECT timestamp_seconds(unix_seconds(timestamp'2026-01-01 00:00:00') + id) AS pos, id, "
            f"CAST(id % {customers} AS INT) AS customer_id, CAST(id AS DOUBLE) AS amount, concat('n', id) AS note, "
            f"'x' AS extra FROM range({first}, {first + n})")


def _sql(eng: Engine, statement: str) -> None:
    for table in ("stage.orders", "stage.payments", "dim.customers"):
        statement = statement.replace(table.upper().replace(".", "_"), f"delta.`{eng.path(table)}`")
    eng.spark.sql(statement)


def _spark_count(eng: Engine, table: str) -> int:
    return eng.spark.read.format("delta").load(eng.path(table)).count()


def _quarantined(eng: Engine, topic: str) -> list[int]:
    import json

    path = eng.path("etl.quarantine")
    if delta_log.open_table(path) is None:
        return []
    rows = DeltaTable(path).to_pyarrow_table(columns=["topic", "row"]).to_pylist()
    return sorted(json.loads(r["row"])["id"] for r in rows if r["topic"] == topic)


def test_sources_with_deletion_vectors_and_column_mapping(spark, settings, tmp_path):
    # Both column mapping modes in one run (each case costs minutes of Spark here): the orders in
    # 'name' mode (a column renamed, one dropped), the payments and the customers in 'id' mode (a
    # column dropped, one renamed).
    eng = _engine(spark, settings, tmp_path)
    for table, mode, cols in [
            ("STAGE_ORDERS", "name", "pos TIMESTAMP, id BIGINT, customer_id INT, amount DOUBLE, note STRING, extra STRING"),
            ("STAGE_PAYMENTS", "id", "pos TIMESTAMP, id BIGINT, customer_id INT, amount DOUBLE, note STRING, extra STRING"),
            ("DIM_CUSTOMERS", "id", "id INT, country STRING, tier STRING")]:
        cdf = ", 'delta.enableChangeDataFeed' = 'true'" if table == "DIM_CUSTOMERS" else ""
        _sql(eng, f"CREATE TABLE {table} ({cols}) USING delta TBLPROPERTIES ({FEATURES.format(mode=mode)}{cdf})")
    _sql(eng, f"INSERT INTO STAGE_ORDERS {_rows(0, 200)}")
    _sql(eng, f"INSERT INTO STAGE_PAYMENTS {_rows(0, 100)}")
    _sql(eng, "INSERT INTO DIM_CUSTOMERS SELECT CAST(id AS INT), concat('C', id % 3), 'gold' FROM range(10)")
    _sql(eng, "DELETE FROM DIM_CUSTOMERS WHERE id = 9")  # a deletion vector before the first run
    assert delta_meta.deletion_vectors(delta_meta.TableSnapshot.open(eng.path("dim.customers"))).feature

    failures: dict[str, TidemarkError] = {}
    eng.run_until_caught_up(on_error=failures.__setitem__)
    assert not failures, failures
    assert _spark_count(eng, "fact.orders") == _spark_count(eng, "fact.notes") == 200
    assert _spark_count(eng, "fact.payments") == 100
    assert assert_view_equals_recompute(eng, "mart.wide") == 180  # customer 9 is gone
    assert assert_view_equals_recompute(eng, "dim.countries") == 3

    # between runs, as Databricks jobs would: in-place DML (deletion vectors), appends, a column
    # renamed and one dropped (column mapping), an OPTIMIZE
    _sql(eng, f"INSERT INTO STAGE_ORDERS {_rows(200, 100, customers=11)}")
    _sql(eng, "ALTER TABLE STAGE_ORDERS RENAME COLUMN note TO memo")
    _sql(eng, "ALTER TABLE STAGE_ORDERS DROP COLUMN extra")
    _sql(eng, "OPTIMIZE STAGE_ORDERS")
    _sql(eng, "DELETE FROM STAGE_PAYMENTS WHERE id % 10 = 0")  # rows the fact took stay in it
    _sql(eng, "UPDATE STAGE_PAYMENTS SET amount = -1 WHERE id < 20")  # in place: same positions, not late
    _sql(eng, "INSERT INTO STAGE_PAYMENTS SELECT timestamp'2026-01-01 00:00:05', 5000, 1, 5.0, 'late', 'x'")
    _sql(eng, f"INSERT INTO STAGE_PAYMENTS {_rows(100, 50)}")
    _sql(eng, "ALTER TABLE STAGE_PAYMENTS DROP COLUMN extra")
    _sql(eng, "UPDATE DIM_CUSTOMERS SET country = 'XX' WHERE id = 3")
    _sql(eng, "DELETE FROM DIM_CUSTOMERS WHERE id = 4")
    _sql(eng, "INSERT INTO DIM_CUSTOMERS VALUES (10, 'C9', 'new')")
    _sql(eng, "ALTER TABLE DIM_CUSTOMERS RENAME COLUMN tier TO level")

    eng.run_until_caught_up(on_error=failures.__setitem__)
    # the transform that reads the renamed column fails its topic alone, and says which column and where
    assert list(failures) == ["fact.notes"], failures
    message = str(failures["fact.notes"])
    assert "`note` cannot be resolved" in message and "(stage.orders renamed note to memo at version " in message, message
    assert _spark_count(eng, "fact.notes") == 200
    assert _spark_count(eng, "fact.orders") == 300
    assert _spark_count(eng, "fact.payments") == 150  # 100 taken before (deleted ones too) + 50 appended
    assert _quarantined(eng, "fact.payments") == [5000]  # the one row inserted at an old position
    kept = {0, 1, 2, 3, 5, 6, 7, 8, 10}  # customers 4 and 9 are gone
    assert assert_view_equals_recompute(eng, "mart.wide") == sum(1 for i in range(300) if i % (10 if i < 200 else 11) in kept)
    assert assert_view_equals_recompute(eng, "dim.countries") == 5  # C0, C1, C2, XX, C9
    # every JVM-free reader sees what Spark sees, and lag plans without Spark
    for table, jvm_free, by_spark in jvm_free_reads(eng):
        assert jvm_free == by_spark, (table, jvm_free)
    lag = {row.topic: row for row in eng.lag()}
    assert set(lag) >= {"fact.orders", "fact.payments", "mart.wide", "dim.countries"}
    eng.close()
