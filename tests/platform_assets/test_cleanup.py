"""A user's own OPTIMIZE, VACUUM ... RETAIN 0 HOURS and log cleanup on the tables Tidemark reads,
between units, on real Spark + Delta: a step fact and two merge views go on exactly (each row
once, late rows still found), or the one topic that cannot stops with what to run while the
others go on; ``lag`` and ``explain`` print lines, never a traceback."""

from __future__ import annotations

import datetime as dt
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from lineage.spec.loader import load_lineage
from platform_assets.cli.main import main
from platform_assets.core import spark_io
from platform_assets.engine.runner import Engine
from resources.core.settings import Settings
from resources.storage import delta_read

pytestmark = pytest.mark.spark
T0 = dt.datetime(2026, 3, 1, 12, 0, 0)
SQL = {
    "fact": "SELECT id, pos, customer_id, amount FROM block",
    "wide": "SELECT b.id, b.customer_id, b.amount, c.country FROM block b JOIN dim.customers c ON b.customer_id = c.id",
    "daily": "SELECT customer_id, CAST(pos AS DATE) AS day, sum(amount) AS amount, count(*) AS n FROM block GROUP BY 1, 2",
    "countries": "SELECT country, count(*) AS n FROM block GROUP BY country",
}
FACT = """\
- table: fact.orders
  depends_on: [stage.orders]
  transforms: [sql/fact.sql]
"""
WIDE = """\
- table: mart.wide
  depends_on: [stage.orders, dim.customers]
  processor: merge
  transforms: [sql/wide.sql]
  key: [id]
  join_keys: {dim.customers: {customer_id: id}}
  full_above: 1
"""
DAILY = """\
- table: mart.daily
  depends_on: [stage.orders]
  processor: merge
  transforms: [sql/daily.sql]
  key: [customer_id, day]
  late_rows: rederive
"""
COUNTRIES = """\
- table: dim.countries
  depends_on: [dim.customers]
  processor: reload
  transforms: [sql/countries.sql]
"""


@pytest.fixture
def no_retention_check(spark) -> Iterator[None]:  # noqa: ANN001 - the session's SparkSession
    """What the user sets to VACUUM with ``RETAIN 0 HOURS`` (and a listing parallelism for 2 cores:
    with the default of 10,000 tasks one VACUUM of a tiny table takes minutes here)."""
    conf = {"spark.databricks.delta.retentionDurationCheck.enabled": "false",
            "spark.sql.sources.parallelPartitionDiscovery.parallelism": "2"}
    for k, v in conf.items():
        spark.conf.set(k, v)
    yield
    for k in conf:
        spark.conf.unset(k)


def make_engine(spark, settings: Settings, root: Path, topics: str) -> tuple[Engine, list[str]]:  # noqa: ANN001
    (root / "sql").mkdir(parents=True, exist_ok=True)
    for name, sql in SQL.items():
        (root / "sql" / f"{name}.sql").write_text(sql + "\n")
    lineage = root / "lineage.yaml"
    lineage.write_text("sources:\n  - table: stage.orders\n  - table: dim.customers\ntopics:\n"
                       + textwrap.indent(topics, "  "))
    s = settings.with_(lineage=lineage)
    args = ["--home", str(s.home), "--lineage", str(lineage)]
    return Engine(s, load_lineage(lineage), spark=spark), args


def orders(eng: Engine, rows: list[tuple[int, int]]) -> None:
    """Append ``(seconds after T0, id)`` orders in one commit (JVM-free, as a loader would)."""
    pos = [(T0 + dt.timedelta(seconds=s)).replace(tzinfo=dt.UTC) for s, _ in rows]
    ids = [i for _, i in rows]
    write_deltalake(eng.path("stage.orders"), pa.table({
        "pos": pa.array(pos, pa.timestamp("us", tz="UTC")), "id": pa.array(ids, pa.int64()),
        "customer_id": pa.array([i % 5 for i in ids], pa.int32()), "amount": pa.array([float(i) for i in ids])}),
        mode="append")


def customers(eng: Engine) -> None:
    write_deltalake(eng.path("dim.customers"), pa.table({"id": pa.array(range(5), pa.int32()),
                                                         "country": [f"C{i % 2}" for i in range(5)]}),
                    configuration={"delta.enableChangeDataFeed": "true"})


def optimize_and_vacuum(eng: Engine, table: str) -> None:
    """The user's maintenance, with Spark: compaction, then every unreferenced file deleted."""
    eng.spark.sql(f"OPTIMIZE delta.`{eng.path(table)}`")
    eng.spark.sql(f"VACUUM delta.`{eng.path(table)}` RETAIN 0 HOURS")


def compact_and_vacuum(eng: Engine, table: str) -> None:
    """The same maintenance JVM-free (delta-rs), where the test needs no second Spark job."""
    DeltaTable(eng.path(table)).optimize.compact()
    DeltaTable(eng.path(table)).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)


def drop_old_log(eng: Engine, table: str) -> int:
    """Log cleanup: a checkpoint at the newest version, every older commit file removed."""
    path = Path(eng.path(table))
    dt_ = DeltaTable(str(path))
    dt_.create_checkpoint()
    for f in (path / "_delta_log").glob("*.json"):
        if int(f.stem) < dt_.version():
            f.unlink()
    return dt_.version()


def assert_equals_recompute(eng: Engine, topic: str, *, without: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """The destination equals its transform over the whole base (less the base rows ``without``,
    quarantined as late), every row exactly once. The destination is read JVM-free; the recompute
    is one Spark job."""
    from pyspark.sql import functions as F

    t = eng.lineage.topic(topic)
    eng.register_tables()
    base = eng.spark.read.format("delta").load(eng.path("stage.orders")).where(F.col("id").isNotNull())
    if without:
        base = base.where(~F.col("id").isin(list(without)))
    base.createOrReplaceTempView("tm_test_base")
    want_df = eng.spark.sql(spark_io.bind_block(t.transforms[0].sql or "", "tm_test_base"))
    want = sorted((tuple(map(_naive, r)) for r in want_df.collect()), key=repr)
    got_table = delta_read.read_rows(DeltaTable(eng.path(t.spec.destination)), want_df.columns)  # deletion vectors too
    got = sorted((tuple(_naive(r[c]) for c in want_df.columns) for r in got_table.to_pylist()), key=repr)
    assert got == want
    return len(got)


def _naive(value: object) -> object:
    """A timestamp as naive UTC (Spark gives naive local time, delta-rs aware UTC; the tests run in UTC)."""
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.UTC).replace(tzinfo=None)
    return value


def quarantined(eng: Engine, topic: str) -> list[int]:
    """Ids of ``topic``'s rows in ``etl.quarantine`` (read JVM-free)."""
    rows = DeltaTable(eng.path("etl.quarantine")).to_pyarrow_table(columns=["topic", "row"]).to_pylist()
    return sorted(json.loads(r["row"])["id"] for r in rows if r["topic"] == topic)


def cli(args: list[str], capsys, *command: str) -> tuple[int, str]:  # noqa: ANN001
    code = main([*args, *command])
    out = capsys.readouterr()
    return code, out.out + out.err


def processed(results) -> dict:  # noqa: ANN001
    return {r.topic: r for r in results if r.processed}


def test_a_step_fact_and_a_view_go_on_exactly_after_optimize_and_vacuum_of_their_base(
        spark, settings, tmp_path, no_retention_check, capsys):
    eng, args = make_engine(spark, settings, tmp_path, FACT + DAILY)
    for k in range(3):
        orders(eng, [(s, s) for s in range(1 + 10 * k, 11 + 10 * k)])
    assert set(processed(eng.run_until_caught_up())) == {"fact.orders", "mart.daily"}
    # New orders arrive, two of them late (positions long processed; ids new).
    orders(eng, [(31, 31), (5, 32), (32, 33)])
    orders(eng, [(12, 34), (33, 35)])
    planned = eng.plan_block("fact.orders")  # the planner sensor fixed fact.orders' next block; it has not run yet
    assert planned.block is not None and planned.base_rows == 3 and planned.bad_rows == 2
    optimize_and_vacuum(eng, "stage.orders")
    assert pa.table(DeltaTable(eng.path("stage.orders")).get_add_actions()).num_rows == 1  # every order in one file

    units = processed(eng.run_until_caught_up())
    fact = units["fact.orders"]  # the planned block, read by id from the compacted file
    assert fact.block is not None and fact.block.seq == planned.block.seq and fact.base_rows == 3 and fact.rows == 3
    assert quarantined(eng, "fact.orders") == [32, 34]  # found again after the VACUUM: stored once
    assert assert_equals_recompute(eng, "fact.orders", without={32, 34}) == 33
    daily = units["mart.daily"].stats
    assert daily["strategy"] == "incremental" and daily["late_rows"] == 2
    assert assert_equals_recompute(eng, "mart.daily") == 5

    code, out = cli(args, capsys, "lag")
    assert code == 0 and "Traceback" not in out and "error" not in out and "WARNING" not in out
    assert "fact.orders" in out and "mart.daily" in out
    for t in ("fact.orders", "mart.daily"):
        code, out = cli(args, capsys, "explain", t)
        assert code == 0 and out.startswith(f"topic {t} ") and "Traceback" not in out
    assert not processed(eng.run_until_caught_up())  # nothing new, nothing found twice
    assert quarantined(eng, "fact.orders") == [32, 34]


def test_a_view_whose_input_change_data_was_vacuumed_recomputes_visibly(spark, settings, tmp_path, no_retention_check,
                                                                        capsys):
    eng, args = make_engine(spark, settings, tmp_path, WIDE)
    customers(eng)
    orders(eng, [(s, s) for s in range(1, 11)])
    orders(eng, [(s, s) for s in range(11, 21)])
    assert set(processed(eng.run_until_caught_up())) == {"mart.wide"}
    orders(eng, [(21, 21), (5, 22)])  # one new order, one late
    DeltaTable(eng.path("dim.customers")).update(predicate="id = 2", updates={"country": "'XX'"})  # writes change data
    compact_and_vacuum(eng, "stage.orders")
    eng.spark.sql(f"VACUUM delta.`{eng.path('dim.customers')}` RETAIN 0 HOURS")  # deletes the change data too
    code, out = cli(args, capsys, "explain", "mart.wide")
    assert code == 0 and "change feed: the change data of version 1 is gone: _change_data/" in out
    assert "strategy: full: full recompute because dim.customers changed" in out

    [unit] = processed(eng.run_until_caught_up()).values()
    wide = unit.stats  # its reverse join cannot read the vacuumed change data: a visible full recompute
    assert wide["strategy"] == "full" and wide["fallback"]
    assert "the change data of version 1 is gone: _change_data/" in wide["strategy_reason"]
    assert quarantined(eng, "mart.wide") == [22]  # the late order, found by id in the compacted file
    assert assert_equals_recompute(eng, "mart.wide") == 22  # a full recompute takes the late row in too
    code, out = cli(args, capsys, "lag")
    assert code == 0 and "mart.wide" in out and "no new rows" in out


def test_after_log_cleanup_late_rows_are_still_found_and_where_ids_cannot_tell_one_topic_stops(
        spark, settings, tmp_path, capsys):
    eng, args = make_engine(spark, settings, tmp_path, FACT + DAILY + COUNTRIES)
    customers(eng)
    orders(eng, [(s, s) for s in range(1, 11)])
    orders(eng, [(s, s) for s in range(11, 21)])
    assert set(processed(eng.run_until_caught_up())) == {"fact.orders", "mart.daily", "dim.countries"}
    # Log cleanup on the base (a checkpoint, older commits removed), then a late order, compacted and vacuumed.
    drop_old_log(eng, "stage.orders")
    orders(eng, [(21, 21), (3, 22)])
    compact_and_vacuum(eng, "stage.orders")
    units = processed(eng.run_until_caught_up())
    assert quarantined(eng, "fact.orders") == [22] and units["fact.orders"].base_rows == 1
    assert units["mart.daily"].stats["late_rows"] == 1
    assert assert_equals_recompute(eng, "mart.daily") == 5

    # An order replayed with an id from the range already there (0), then compacted and vacuumed: ids cannot
    # tell it from the rows that were there, so the topics that read stage.orders stop; dim.countries goes on.
    orders(eng, [(4, 0), (23, 23)])
    compact_and_vacuum(eng, "stage.orders")
    DeltaTable(eng.path("dim.customers")).update(predicate="id = 2", updates={"country": "'XX'"})
    code, out = cli(args, capsys, "run", "--until-caught-up")
    assert code == 1 and "Traceback" not in out
    last = eng.store.get("fact.orders").last.to_text()
    assert (f"fact.orders            FAILED: topic 'fact.orders': {eng.path('stage.orders')}: late rows added since version"
            in out)
    assert "is gone (compacted by OPTIMIZE at version" in out and "then deleted by VACUUM), and its ids (from 0) are " \
        "not above the greatest id at version" in out
    assert (f"run: tidemark offsets reset fact.orders --to {last} --late-from-now --reason '...'" in out)
    assert "mart.daily             FAILED: topic 'mart.daily'" in out
    assert "dim.countries          reload 2" in out and "error: 2 topic(s) failed: fact.orders, mart.daily" in out
    code, out = cli(args, capsys, "lag")
    assert code == 0 and "Traceback" not in out
    assert "failed: ProcessingError: topic 'fact.orders'" in out  # fact.orders' state says why it stopped
    assert "error: ProcessingError: topic 'mart.daily'" in out  # a merge topic's look cannot be taken
    code, out = cli(args, capsys, "explain", "mart.daily")
    assert code == 0 and "  cannot plan the next unit: topic 'mart.daily'" in out
    code, out = cli(args, capsys, "explain", "fact.orders")
    assert code == 0 and out.startswith("topic fact.orders (step into fact.orders)")

    # The user accepts that the replayed order is not looked for, and both go on.
    for topic in ("fact.orders", "mart.daily"):
        code, out = cli(args, capsys, "offsets", "reset", topic, "--to", eng.store.get(topic).last.to_text(),
                        "--late-from-now", "--reason", "order 0 replayed after a VACUUM")
        assert code == 0 and "late rows of stage.orders looked for from version" in out
    units = processed(eng.run_until_caught_up())
    assert set(units) == {"fact.orders", "mart.daily"} and units["fact.orders"].base_rows == 1
    assert quarantined(eng, "fact.orders") == [22]
    assert assert_equals_recompute(eng, "fact.orders", without={0, 22}) == 22  # order 0 neither written nor quarantined
    assert assert_equals_recompute(eng, "mart.daily", without={0}) == 5
    assert any(e.action == "reset" and e.note.startswith("order 0 replayed after a VACUUM (late rows of stage.orders "
                                                         "looked for from version")
               for e in eng.store.history("fact.orders", limit=10))
