"""The merge processor (materialized views) on real Spark + Delta: reverse join, strict refresh,
late rows re-derived, adopt, restate, a crash between the data commit and the offset commit."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from lineage.core.checks import ChecksSpec, evaluate_unit
from lineage.core.errors import OffsetError, ProcessingError
from lineage.core.positions import Position
from lineage.spec.loader import load_lineage
from lineage.views import refresh
from lineage.views.refresh import RefreshRefused
from platform_assets.core import keyed_merge, spark_io
from platform_assets.core.merge_layout import newest_unit_commit
from platform_assets.engine.runner import Engine
from platform_assets.views import merge as merge_module
from platform_assets.views import operate as views
from platform_assets.views import reverse
from resources.core.settings import Settings
from resources.storage.meta_tables import read_etl_log

pytestmark = pytest.mark.spark
T0 = dt.datetime(2026, 3, 1, 12, 0, 0)
WIDE = "SELECT b.id, b.customer_id, b.amount, c.country FROM block b JOIN dim.customers c ON b.customer_id = c.id"
AGG = ("-- revenue per country\nWITH x AS (SELECT b.amount, c.country FROM block b JOIN dim.customers c ON b.customer_id = c.id)\n"
       "SELECT country, sum(amount) AS revenue, count(*) AS n FROM x GROUP BY country")
DAILY = "SELECT customer_id, CAST(pos AS DATE) AS day, sum(amount) AS amount, count(*) AS n FROM block GROUP BY 1, 2"


def engine(spark, settings: Settings, root: Path, topics: str) -> Engine:
    (root / "sql").mkdir(parents=True, exist_ok=True)
    for name, sql in {"wide": WIDE, "agg": AGG, "daily": DAILY}.items():
        (root / "sql" / f"{name}.sql").write_text(sql + "\n")
    lineage = root / "lineage.yaml"
    lineage.write_text("sources:\n  - table: stage.orders\n  - table: dim.customers\ntopics:\n"
                       + textwrap.indent(textwrap.dedent(topics).strip("\n"), "  ") + "\n")
    s = settings.with_(lineage=lineage)
    return Engine(s, load_lineage(lineage), spark=spark)


def wide_topic(extra: str = "") -> str:
    return ("- table: mart.wide\n  depends_on: [stage.orders, dim.customers]\n  processor: merge\n"
            "  transforms: [sql/wide.sql]\n  key: [id]\n" + extra)


def orders(eng: Engine, first: int, n: int, *, customers: int = 10, at: dt.datetime = T0) -> None:
    rows = [(at + dt.timedelta(seconds=i), i, i % customers, float(i)) for i in range(first, first + n)]
    eng.spark.createDataFrame(rows, "pos timestamp, id bigint, customer_id int, amount double") \
        .write.format("delta").mode("append").save(eng.path("stage.orders"))


def customers(eng: Engine, n: int = 10) -> None:
    (eng.spark.createDataFrame([(i, f"C{i % 3}") for i in range(n)], "id int, country string")
     .write.format("delta").option("delta.enableChangeDataFeed", "true").save(eng.path("dim.customers")))


def dim_sql(eng: Engine, statement: str) -> None:
    eng.spark.sql(statement.replace("DIM", f"delta.`{eng.path('dim.customers')}`"))


def assert_view_equals_recompute(eng: Engine, topic: str) -> int:
    """The view of ``topic`` equals its transform over its inputs as they are now, as multisets of
    rows (compared in Python: two Spark jobs, where counts and ``exceptAll`` both ways took five);
    returns its row count."""
    t = eng.lineage.topic(topic)
    eng.register_tables()
    want = eng.spark.sql(spark_io.bind_block(t.transforms[0].sql or "", t.spec.base))
    got = eng.spark.read.format("delta").load(eng.path(t.spec.destination)).select(*want.columns)
    g, w = Counter(_value(r) for r in got.collect()), Counter(_value(r) for r in want.collect())
    assert g == w, (f"{topic}: only in the view {list((g - w).elements())[:5]}, "
                    f"only in the recompute {list((w - g).elements())[:5]}")
    return g.total()


def _value(v: Any) -> Any:
    """``v`` (a collected row or value) hashable, equal where Spark's set operations take values
    as equal (NaN to NaN)."""
    if isinstance(v, float):
        return "NaN" if math.isnan(v) else v
    if isinstance(v, (bytes, bytearray)):
        return bytes(v)
    if isinstance(v, (list, tuple)):
        return tuple(_value(x) for x in v)
    if isinstance(v, dict):
        return frozenset(Counter((_value(k), _value(x)) for k, x in v.items()).items())
    return v


def processed(results) -> list:
    return [r for r in results if r.processed]


def dies_after_the_merge(eng: Engine, topic: str, monkeypatch) -> int:
    """A unit of ``topic`` whose process dies after its MERGE landed, before the offset commit; the
    view's Delta version it left (the store works again afterwards)."""
    real_commit = eng.store.commit

    def dies(*a, **kw):
        raise OSError("the process died after the MERGE landed")

    monkeypatch.setattr(eng.store, "commit", dies)
    with pytest.raises(OSError, match="died after the MERGE"):
        eng.run_topic(topic)
    monkeypatch.setattr(eng.store, "commit", real_commit)
    return DeltaTable(eng.path(topic)).version()


def test_bind_block_binds_the_view_in_the_statement_itself() -> None:
    assert spark_io.bind_block("SELECT 1 FROM block", "v") == "WITH block AS (SELECT * FROM v)\nSELECT 1 FROM block"
    merged = spark_io.bind_block("-- c\n/* d */ with a AS (SELECT 1) SELECT * FROM a, block", "v")
    assert merged == "-- c\n/* d */ WITH block AS (SELECT * FROM v), a AS (SELECT 1) SELECT * FROM a, block"


@pytest.mark.parametrize("narrowed,driver", [(True, False), (False, False), (True, True)],
                         ids=["keys-narrowed", "keys-not-narrowed", "driver-pruned"])
def test_reverse_join_rederives_only_the_affected_keys(spark, settings, tmp_path, monkeypatch, narrowed, driver):
    # Spark's MERGE, whose file pruning this checks; or deltalake's into a view "larger" than the driver
    # MERGEs whole (30 rows), in files of 10 rows clustered by customer_id, of which the filter leaves few
    monkeypatch.setattr(keyed_merge, "SMALL_VIEW_ROWS", 30 if driver else -1)
    monkeypatch.setattr(keyed_merge, "FILTERED_VIEW_ROWS", 30 if driver else -1)
    monkeypatch.setattr(merge_module, "CLUSTER_ROWS", 10 if driver else merge_module.CLUSTER_ROWS)
    if not narrowed:  # the re-derivation not narrowed by a literal list of keys, the MERGE not pruned, and the
        monkeypatch.setattr(reverse, "NARROW_VALUES", 0)  # base rows joining a changed row found by Spark's semi join
        monkeypatch.setattr(reverse, "IN_LIST", 0)  # (not a literal list, so not by deltalake's filtered scan)
    eng = engine(spark, settings, tmp_path, wide_topic("  join_keys: {dim.customers: {customer_id: id}}\n  full_above: 0.5\n"))
    customers(eng)
    orders(eng, 1, 50)
    [first] = processed(eng.run_until_caught_up())
    assert (first.stats["strategy"], first.stats["strategy_reason"]) == (
        "full", "initial build: mart.wide holds no commit of topic 'mart.wide'")
    # customer 3 moves country, customer 4 is deleted, customer 10 appears with 5 new orders
    dim_sql(eng, "UPDATE DIM SET country = 'XX' WHERE id = 3")
    dim_sql(eng, "DELETE FROM DIM WHERE id = 4")
    dim_sql(eng, "INSERT INTO DIM VALUES (10, 'C9')")
    orders(eng, 51, 10, customers=11)
    [unit] = processed(eng.run_until_caught_up())
    s = unit.stats
    assert s["strategy"] == "incremental", s["strategy_reason"]
    assert s["strategy_reason"].startswith("incremental: 10 new base rows; reverse join of 3 changed rows of "
                                           "dim.customers (versions 1..3) on customer_id=id (estimated ")
    # far below the cost floor: incremental although a recompute of so small a view moves fewer bytes
    assert 0 < s["estimate_full_bytes"] < refresh.COST_FLOOR
    assert s["estimate_incremental_bytes"] > refresh.FULL_MARGIN * s["estimate_full_bytes"]
    # new orders 51..60 (customer 4's order 59 has no customer now), customer 3's 5 old rows, customer 4's 5 old rows
    assert (s["rows_inserted"], s["rows_updated"], s["rows_deleted"]) == (9, 5, 5)
    assert s["keys_rederived"] == 10 + 5 + 5 - 1  # order 53 is new and customer 3's: counted once
    assert assert_view_equals_recompute(eng, "mart.wide") == 54
    logged = read_etl_log(eng.settings, "mart.wide", limit=1)[0]
    assert (logged["strategy"], logged["detail"]) == ("incremental", s["strategy_reason"])
    assert dict(logged["changes"])["rows_deleted"] == 5
    assert dict(logged["changes"])["estimate_full_bytes"] == s["estimate_full_bytes"]
    commit = newest_unit_commit(DeltaTable(eng.path("mart.wide")))  # (a re-sort of the files it packed may follow)
    meta = json.loads(commit["userMetadata"])
    assert commit["operation"] == "MERGE"
    # keys narrowed: the MERGE reads only the view files holding the affected customers' rows
    predicate = commit["operationParameters"]["predicate"]  # (deltalake says its scan's filter its own way)
    pruned = re.search(r"customer_id#\d+ IN \((4,3|3,4)\)", predicate) or sorted(predicate.split(" OR ")) == [
        "customer_id = 3", "customer_id = 4"]
    assert bool(pruned) is narrowed, commit["operationParameters"]
    assert ("delta-rs" in str(commit.get("engineInfo"))) is driver, commit
    if driver:  # of the view's 5 files, only those holding customers 3 and 4 rewritten
        assert 1 <= int(commit["operationMetrics"]["num_target_files_removed"]) <= 3, commit["operationMetrics"]
    assert (meta["seq"], meta["strategy"], meta["inputs"]) == (2, "incremental", {"dim.customers": 3, "stage.orders": 1})
    assert eng.store.get("mart.wide").inputs == {"dim.customers": 3, "stage.orders": 1}
    # Nothing changed: nothing to do (and no commit)
    assert not processed(eng.run_until_caught_up())
    # Above the floor, the estimate decides: here a recompute is cheaper, and the unit says so
    monkeypatch.setattr(refresh, "COST_FLOOR", 0)
    dim_sql(eng, "UPDATE DIM SET country = 'YY' WHERE id = 5")
    topic = eng.lineage.topic("mart.wide")
    assert any(line.startswith("  strategy: full: full recompute because it is cheaper: estimated ")
               for line in views.explain(eng, topic)), views.explain(eng, topic)
    [unit] = processed(eng.run_until_caught_up())
    assert (unit.stats["strategy"], unit.stats["fallback"]) == ("full", True)
    assert unit.stats["strategy_reason"].startswith("full recompute because it is cheaper: estimated ")
    assert assert_view_equals_recompute(eng, "mart.wide") == 54


def test_a_reference_that_was_only_compacted_runs_no_unit(spark, settings, tmp_path):
    """OPTIMIZE of a reference input (``dataChange: false``) is a new version with the same rows:
    no unit is due, nothing is written; a real change after it is applied over both versions."""
    eng = engine(spark, settings, tmp_path, wide_topic("  join_keys: {dim.customers: {customer_id: id}}\n  full_above: 0.5\n"))
    customers(eng)
    for i in (10, 11, 12):  # small files for the compaction to join
        dim_sql(eng, f"INSERT INTO DIM VALUES ({i}, 'C{i % 3}')")
    orders(eng, 1, 30, customers=13)
    processed(eng.run_until_caught_up())
    view_version = DeltaTable(eng.path("mart.wide")).version()
    dim_sql(eng, "OPTIMIZE DIM")
    assert DeltaTable(eng.path("dim.customers")).history(1)[0]["operation"] == "OPTIMIZE"
    text = "\n".join(views.explain(eng, eng.lineage.topic("mart.wide")))
    assert "input dim.customers: only compacted (version 4: the same rows, no unit due)" in text, text
    assert "nothing to do" in text, text
    assert not processed(eng.run_until_caught_up())
    assert DeltaTable(eng.path("mart.wide")).version() == view_version
    dim_sql(eng, "UPDATE DIM SET country = 'XX' WHERE id = 11")
    [unit] = processed(eng.run_until_caught_up())
    assert unit.stats["strategy"] == "incremental" and "reverse join of 1 changed rows of dim.customers (versions 4..5)" \
        in unit.stats["strategy_reason"], unit.stats["strategy_reason"]
    assert assert_view_equals_recompute(eng, "mart.wide") == 30
    eng.close()


def test_a_change_beyond_full_above_or_without_join_keys_recomputes_and_says_why(spark, settings, tmp_path):
    eng = engine(spark, settings, tmp_path, wide_topic("  join_keys: {dim.customers: {customer_id: id}}\n")
                 + "- table: mart.by_country\n  depends_on: [stage.orders, dim.customers]\n  processor: merge\n"
                   "  transforms: [sql/agg.sql]\n  key: [country]\n")
    customers(eng)
    orders(eng, 1, 30)
    eng.run_until_caught_up()
    dim_sql(eng, "UPDATE DIM SET country = 'XX' WHERE id IN (1, 2, 3)")
    units = {r.topic: r.stats for r in processed(eng.run_until_caught_up())}
    assert units["mart.wide"]["strategy_reason"] == ("full recompute because 3 rows of dim.customers changed, more than "
                                                     "full_above 0.5% of its 10 rows (a full recompute is cheaper)")
    assert units["mart.by_country"]["strategy_reason"] == (
        "full recompute because dim.customers changed (version 1) and the spec declares no join_keys for it")
    assert units["mart.by_country"]["fallback"] is True
    refresh = next(o for o in evaluate_unit(ChecksSpec(), units["mart.by_country"]) if o.name == "refresh")
    assert not refresh.passed and "no join_keys" in refresh.description
    assert assert_view_equals_recompute(eng, "mart.wide") == 30
    assert assert_view_equals_recompute(eng, "mart.by_country") == 4
    # a small view's recompute is one overwrite from the driver (deltalake), the table's settings kept
    for view in ("mart.wide", "mart.by_country"):
        last = DeltaTable(eng.path(view)).history(1)[0]
        assert last["operation"] == "WRITE" and "delta-rs" in str(last.get("clientVersion")), last
        assert DeltaTable(eng.path(view)).metadata().configuration.get("delta.enableChangeDataFeed") == "true"


def test_strict_refresh_fails_instead_of_a_full_recompute(spark, settings, tmp_path):
    eng = engine(spark, settings, tmp_path, "- table: mart.by_country\n  depends_on: [stage.orders, dim.customers]\n"
                 "  processor: merge\n  transforms: [sql/agg.sql]\n  key: [country]\n  refresh: incremental_strict\n")
    customers(eng)
    orders(eng, 1, 20)
    eng.run_until_caught_up()  # the initial build is allowed
    before = DeltaTable(eng.path("mart.by_country")).version()
    dim_sql(eng, "UPDATE DIM SET country = 'XX' WHERE id = 1")
    topic = eng.lineage.topic("mart.by_country")
    assert views.explain(eng, topic)[-1].startswith(
        "  strategy: REFUSED: topic 'mart.by_country': refresh: incremental_strict refuses a full recompute because "
        "dim.customers changed (version 1) and the spec declares no join_keys for it")
    for _ in range(2):  # refused every time, nothing written
        with pytest.raises(RefreshRefused, match="declare join_keys on the base.s join column, enable delta.enableChangeDataFeed"):
            eng.run_topic("mart.by_country")
    assert DeltaTable(eng.path("mart.by_country")).version() == before
    rec = eng.store.get("mart.by_country")
    assert rec.state.startswith("failed: RefreshRefused") and rec.inputs["dim.customers"] == 0


def test_late_rows_are_rederived_into_the_view_and_counted(spark, settings, tmp_path):
    eng = engine(spark, settings, tmp_path, "- table: mart.daily\n  depends_on: [stage.orders]\n  processor: merge\n"
                 "  transforms: [sql/daily.sql]\n  key: [customer_id, day]\n  late_rows: rederive\n  maxstep: 15\n")
    orders(eng, 1, 40, at=T0)
    assert len(processed(eng.run_until_caught_up())) == 3
    # two rows land at or before last (pos in the past), after their blocks committed
    orders(eng, 100, 2, at=T0 - dt.timedelta(days=1))
    orders(eng, 200, 1, at=T0 + dt.timedelta(hours=1))
    [unit] = processed(eng.run_until_caught_up())
    assert unit.stats["late_rows"] == 2 and unit.stats["strategy"] == "incremental"
    assert "2 late base rows re-derived" in unit.stats["strategy_reason"]
    late = next(o for o in evaluate_unit(ChecksSpec(), unit.stats) if o.name == "late_rows")
    assert not late.passed and late.description.startswith("2 late base rows")
    assert_view_equals_recompute(eng, "mart.daily")
    assert not processed(eng.run_until_caught_up())  # re-derived once, not again


def test_adopt_takes_over_an_existing_view_then_applies_only_changes(spark, settings, tmp_path):
    eng = engine(spark, settings, tmp_path, wide_topic("  join_keys: {dim.customers: {customer_id: id}}\n  full_above: 1\n"))
    customers(eng)
    orders(eng, 1, 30)
    topic = eng.lineage.topic("mart.wide")
    with pytest.raises(ProcessingError, match="nothing to adopt: no Delta table"):
        views.adopt(eng, topic, dry_run=True)
    eng.register_tables()
    built_elsewhere = eng.spark.sql(spark_io.bind_block(WIDE, "stage.orders"))
    built_elsewhere.write.format("delta").option("delta.enableChangeDataFeed", "true").save(eng.path("mart.wide"))
    with pytest.raises(OffsetError, match="tidemark offsets adopt mart.wide --dry-run"):
        eng.run_topic("mart.wide")  # rows no unit of this topic wrote: refuses to guess
    lines = views.adopt(eng, topic, dry_run=True)
    assert lines[1] == f"  last = {Position(T0 + dt.timedelta(seconds=30), 30).to_text()} (the newest (pos, id) in stage.orders now)"
    assert "  input stage.orders: offset = version 0" in lines and "  input dim.customers: offset = version 0" in lines
    assert lines[-1].startswith("dry run: nothing was set") and eng.store.get("mart.wide") is None
    assert views.adopt(eng, topic, dry_run=False)[-1].startswith("adopted")
    rec = eng.store.get("mart.wide")
    assert rec.last == Position(T0 + dt.timedelta(seconds=30), 30) and rec.inputs == {"stage.orders": 0, "dim.customers": 0}
    with pytest.raises(ProcessingError, match="has offsets already"):
        views.adopt(eng, topic, dry_run=True)
    dim_sql(eng, "UPDATE DIM SET country = 'XX' WHERE id = 3")
    orders(eng, 31, 5)
    [unit] = processed(eng.run_until_caught_up())
    assert unit.stats["strategy"] == "incremental" and unit.stats["rows_inserted"] == 5
    assert assert_view_equals_recompute(eng, "mart.wide") == 35


@pytest.mark.fast
def test_adopt_refuses_a_view_whose_key_is_not_unique(spark, settings, tmp_path):
    eng = engine(spark, settings, tmp_path, wide_topic())
    customers(eng)
    orders(eng, 1, 5)
    eng.spark.createDataFrame([(1, 1, 1.0, "C1"), (1, 1, 2.0, "C1")], "id bigint, customer_id int, amount double, country string") \
        .write.format("delta").save(eng.path("mart.wide"))
    with pytest.raises(ProcessingError, match=r"1 duplicate keys -- fix the table before adopting"):
        views.adopt(eng, eng.lineage.topic("mart.wide"), dry_run=True)


def test_restating_a_range_rederives_it_without_duplicates(spark, settings, tmp_path):
    eng = engine(spark, settings, tmp_path, wide_topic("  maxstep: 10\n"))
    customers(eng)
    orders(eng, 1, 30)
    eng.run_until_caught_up()
    # the view was damaged by hand: restate the range that holds the damage
    eng.spark.sql(f"UPDATE delta.`{eng.path('mart.wide')}` SET amount = -1 WHERE id BETWEEN 12 AND 14")
    eng.spark.sql(f"DELETE FROM delta.`{eng.path('mart.wide')}` WHERE id = 15")
    eng.reset_offsets(eng.lineage.topic("mart.wide"), Position(T0 + dt.timedelta(seconds=10), 10), "restate 11..")
    units = processed(eng.run_until_caught_up())
    assert [u.stats["strategy"] for u in units] == ["incremental", "incremental"]
    assert sum(u.stats["rows_updated"] for u in units) == 3 and sum(u.stats["rows_inserted"] for u in units) == 1
    assert assert_view_equals_recompute(eng, "mart.wide") == 30


def test_a_crash_between_the_merge_and_the_offset_commit_never_applies_twice(spark, settings, tmp_path, monkeypatch):
    eng = engine(spark, settings, tmp_path, wide_topic("  join_keys: {dim.customers: {customer_id: id}}\n  full_above: 1\n"))
    customers(eng)
    orders(eng, 1, 20)
    eng.run_until_caught_up()
    dim_sql(eng, "UPDATE DIM SET country = 'XX' WHERE id = 3")
    orders(eng, 21, 5)
    merged = dies_after_the_merge(eng, "mart.wide", monkeypatch)
    dim_sql(eng, "UPDATE DIM SET country = 'YY' WHERE id = 5")  # changes after the plan wait for the next unit
    [retry, nxt] = processed(eng.run_until_caught_up())
    assert retry.recovered and retry.reason.startswith("unit 2")
    assert DeltaTable(eng.path("mart.wide")).history(2)[1]["version"] == merged  # the retry wrote nothing
    assert nxt.stats["strategy"] == "incremental" and nxt.stats["rows_updated"] == 3  # orders 5, 15, 25
    assert assert_view_equals_recompute(eng, "mart.wide") == 25


def test_offset_age_is_judged_by_the_planner_sensor_and_alerted_once(spark, settings, tmp_path):
    import dagster as dg

    from platform_assets.dagster.alerts import AlertCursor, scan_incidents
    from platform_assets.dagster.sensors import offset_age_checks

    eng = engine(spark, settings, tmp_path, wide_topic("  join_keys: {dim.customers: {customer_id: id}}\n"
                                                       "  checks: {max_offset_age: 1h}\n"))
    customers(eng)
    orders(eng, 1, 10)
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    eng.clock = lambda: T0 + dt.timedelta(seconds=40)  # the data is 30 s old
    [unit] = processed(eng.run_until_caught_up())
    ages = unit.stats["offset_age_s"]
    assert ages["stage.orders"] == 30.0  # the base: since its last position
    # another input: since the commit of the version applied (made just now, on the real clock)
    assert abs((T0 + dt.timedelta(seconds=40) - now).total_seconds() - ages["dim.customers"]) < 600
    lag = next(r for r in eng.lag() if r.topic == "mart.wide")
    assert lag.offset_ages["stage.orders"] == 30.0
    evaluations, states = offset_age_checks(eng, eng.lineage, {})
    assert [e.passed for e in evaluations] == [True] and states == {"mart.wide": "pass"}
    assert offset_age_checks(eng, eng.lineage, states) == ([], states)  # unchanged verdict: nothing reported
    eng.clock = lambda: T0 + dt.timedelta(hours=2)
    [failed], states = offset_age_checks(eng, eng.lineage, states)
    assert not failed.passed and failed.check_name == "offset_age" and states == {"mart.wide": "fail"}
    assert failed.description.startswith("oldest input offset stage.orders 7190 s old > 3600 s")
    with dg.DagsterInstance.ephemeral() as instance:
        instance.report_runless_asset_event(failed)
        scan = scan_incidents(instance, AlertCursor(since=0.0, runs={}, runless=None))
        [alert] = [a for a in scan.alerts if "offset_age" in a.key]
        assert "mart" in alert.key


def test_a_merge_view_through_dagster_records_its_strategy_and_checks(spark, settings, tmp_path, dagster_storage):
    import dagster as dg

    from platform_assets.dagster.definitions import build_definitions
    from platform_assets.dagster.local_daemon import run_until_idle

    eng = engine(spark, settings, tmp_path, wide_topic("  join_keys: {dim.customers: {customer_id: id}}\n  full_above: 1\n"))
    customers(eng)
    orders(eng, 1, 20)
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        defs = build_definitions(eng.settings)
        [first], waiting = run_until_idle(defs, instance, log_level="WARNING")
        assert first.success and first.metadata["strategy"] == "full" and waiting == "mart.wide: no new rows"
        dim_sql(eng, "UPDATE DIM SET country = 'XX' WHERE id = 3")
        [second], _ = run_until_idle(defs, instance, log_level="WARNING")
        meta = second.metadata
        assert (meta["strategy"], meta["rows_updated"], meta["rows_inserted"]) == ("incremental", 2, 0)
        assert "reverse join of 1 changed rows of dim.customers" in meta["strategy_reason"]
        assert second.checks == {"offset_age": True, "late_rows": True, "refresh": True}
        assert set(meta["offset_age_s"]) == {"stage.orders", "dim.customers"}
        # A run with nothing left to do (e.g. queued behind the run that did the unit) succeeds,
        # writes nothing and repeats each check's last verdict, saying so.
        version = DeltaTable(eng.path("mart.wide")).version()
        idle = defs.resolve_job_def("tidemark__mart__wide").execute_in_process(instance=instance, raise_on_error=False)
        assert idle.success
        repeated = {e.check_name: e for e in idle.get_asset_check_evaluations()}
        assert set(repeated) == {"offset_age", "late_rows", "refresh"} and all(e.passed for e in repeated.values())
        assert repeated["refresh"].description.startswith("no unit ran (")
        assert "repeats the last evaluation: incremental: reverse join" in repeated["refresh"].description
        assert DeltaTable(eng.path("mart.wide")).version() == version
        # New changes while a run of the topic is under way: no second run is requested
        # (it would find the first one's work done); once the queue is clear, one is.
        import uuid

        from platform_assets.dagster.sensors import TOPIC_TAG

        dim_sql(eng, "UPDATE DIM SET country = 'YY' WHERE id = 4")
        queued = instance.add_run(dg.DagsterRun(job_name="tidemark__mart__wide", run_id=str(uuid.uuid4()),
                                                status=dg.DagsterRunStatus.STARTED, tags={TOPIC_TAG: "mart.wide"}))
        planner = defs.get_sensor_def("tidemark_planner")
        held = planner.evaluate_tick(dg.build_sensor_context(instance=instance, instance_ref=instance.get_ref(), definitions=defs))
        assert not held.run_requests and f"run {queued.run_id[:8]} of the topic is queued or running" in held.skip_message
        instance.delete_run(queued.run_id)
        [third], _ = run_until_idle(defs, instance, log_level="WARNING")
        assert third.success and third.metadata["strategy"] == "incremental"
    assert assert_view_equals_recompute(eng, "mart.wide") == 20


BY_COUNTRY = ("SELECT coalesce(c.country, '?') AS country, count(*) AS n, sum(b.amount) AS total\n"
              "FROM block b LEFT JOIN dim.customers c ON b.customer_id = c.id\nGROUP BY coalesce(c.country, '?')")


def test_a_vanished_or_appearing_reference_moves_rows_to_and_from_the_unknown_group(spark, settings, tmp_path):
    """Issue 24's example: a view keyed by an expression of a reference column, declared by the
    base's join column. A deleted customer's orders leave its country for '?', an inserted
    customer's orders leave '?': both groups are re-derived by the delta rule, with no new orders,
    and ``explain --keys`` shows where each key comes from. The same view declared by its view
    column cannot be exact: it recomputes, says why, and ``lineage validate`` warns."""
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "by_country.sql").write_text(BY_COUNTRY + "\n")
    eng = engine(spark, settings, tmp_path,
                 "- table: mart.by_country\n  depends_on: [stage.orders, dim.customers]\n  processor: merge\n"
                 "  transforms: [sql/by_country.sql]\n  key: [country]\n  join_keys: {dim.customers: {customer_id: id}}\n"
                 "  full_above: 1\n  late_rows: rederive\n  checks: {verify_sample: 3}\n"
                 "- table: mart.by_country_view_col\n  depends_on: [stage.orders, dim.customers]\n  processor: merge\n"
                 "  transforms: [sql/by_country.sql]\n  key: [country]\n  join_keys: {dim.customers: {country: country}}\n"
                 "  full_above: 1\n")
    customers(eng, 8)  # ids 0..7; orders point at 0..11: 8..11 have no customer yet
    orders(eng, 1, 48, customers=12)
    eng.run_until_caught_up()
    assert assert_view_equals_recompute(eng, "mart.by_country") == 4  # C0, C1, C2, ?

    dim_sql(eng, "DELETE FROM DIM WHERE id = 5")  # C2 loses customer 5's 4 orders to '?'
    shown = views.explain(eng, eng.lineage.topic("mart.by_country"), keys=20)
    text = "\n".join(shown)
    assert "strategy: incremental: reverse join of 1 changed rows of dim.customers (version 1) on customer_id=id" in text
    assert "from base rows joining a changed row, before (dim.customers version 0): 1 key(s)\n      country='C2'" in text
    assert "from base rows joining a changed row, after (dim.customers version 1): 1 key(s)\n      country='?'" in text
    units = {r.topic: r.stats for r in processed(eng.run_until_caught_up())}
    assert units["mart.by_country"]["strategy"] == "incremental"
    assert units["mart.by_country"]["keys_rederived"] == 2
    assert units["mart.by_country"]["verify"] == {"keys": 3, "differing": 0, "duplicates": 0, "example": None}
    assert assert_view_equals_recompute(eng, "mart.by_country") == 4
    view_col = units["mart.by_country_view_col"]
    assert (view_col["strategy"], view_col["fallback"]) == ("full", True)
    assert "its join_keys name country, which the base stage.orders does not have, so the affected keys cannot be " \
           "derived exactly" in view_col["strategy_reason"]
    assert assert_view_equals_recompute(eng, "mart.by_country_view_col") == 4

    dim_sql(eng, "INSERT INTO DIM VALUES (9, 'C7')")  # 4 orders that pointed at nobody gain a new country
    text = "\n".join(views.explain(eng, eng.lineage.topic("mart.by_country"), keys=20))
    assert "before (dim.customers version 1): 1 key(s)\n      country='?'" in text
    assert "after (dim.customers version 2): 1 key(s)\n      country='C7'" in text
    [unit, _] = processed(eng.run_until_caught_up())
    assert (unit.stats["rows_inserted"], unit.stats["rows_updated"]) == (1, 1)
    assert assert_view_equals_recompute(eng, "mart.by_country") == 5

    from platform_assets.cli.main import _exactness_warnings

    [warning] = _exactness_warnings(eng.settings, eng.lineage)
    assert "topic 'mart.by_country_view_col': join_keys of dim.customers: its join_keys name country" in warning

    # tidemark verify: equal now, whole and sampled; then a view changed behind Tidemark's back
    from platform_assets.views.verify import verify

    topic = eng.lineage.topic("mart.by_country")
    whole = verify(eng, topic)
    assert whole.ok and (whole.keys_compared, whole.view_rows, whole.sampled) == (5, 5, False), whole.lines()
    assert "OK: the view equals its transform recomputed from scratch" in "\n".join(whole.lines())
    assert verify(eng, topic, sample=2, seed=1).keys_compared == 2
    dim_sql(eng, "UPDATE DIM SET country = 'ZZ' WHERE id = 0")  # an input change not applied yet is no difference
    assert verify(eng, topic).ok
    view = f"delta.`{eng.path('mart.by_country')}`"
    eng.spark.sql(f"UPDATE {view} SET n = n + 1 WHERE country = 'C1'")
    eng.spark.sql(f"DELETE FROM {view} WHERE country = '?'")
    bad = verify(eng, topic)
    assert (bad.ok, bad.differing) == (False, 2)
    text = "\n".join(bad.lines())
    assert "DIFFERS: 2 key(s), the first 2:" in text
    assert "    country='?'\n      view:      (no row)\n      recompute: country='?', n=" in text
    assert "    country='C1'\n      view:      country='C1', n=" in text
    eng.close()


def test_a_view_with_deletion_vectors_marks_rows_and_drops_them_when_opted_out(spark, settings, tmp_path):
    """``deletion_vectors: true``: the reverse join's MERGE marks the rows it replaces instead of
    rewriting their files, and the view stays equal to its recompute; set back to false, the next
    unit drops the table feature and the ``deltalake`` reader reads the view again."""
    from deltalake import DeltaTable

    topic = wide_topic("  join_keys: {dim.customers: {customer_id: id}}\n  full_above: 1\n")
    eng = engine(spark, settings, tmp_path, topic + "  deletion_vectors: true\n")
    customers(eng)
    orders(eng, 1, 60)
    eng.run_until_caught_up()
    path = eng.path("mart.wide")
    dim_sql(eng, "UPDATE DIM SET country = 'XX' WHERE id = 3")
    [unit] = processed(eng.run_until_caught_up())
    assert unit.stats["strategy"] == "incremental"
    metrics = spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").collect()[0]["operationMetrics"]
    assert int(metrics["numTargetDeletionVectorsAdded"]) > 0, metrics
    assert "deletionVectors" in (DeltaTable(path).protocol().reader_features or [])
    assert assert_view_equals_recompute(eng, "mart.wide") == 60
    with pytest.raises(Exception, match="deletionVectors"):
        DeltaTable(path).to_pyarrow_table()
    eng.close()
    eng = engine(spark, settings, tmp_path, topic)
    dim_sql(eng, "UPDATE DIM SET country = 'YY' WHERE id = 4")
    [unit] = processed(eng.run_until_caught_up())
    assert unit.stats["strategy"] == "incremental"
    assert "deletionVectors" not in (DeltaTable(path).protocol().reader_features or [])
    assert DeltaTable(path).to_pyarrow_table().num_rows == assert_view_equals_recompute(eng, "mart.wide") == 60


def test_adopt_reads_a_view_with_deletion_vectors_through_spark(spark, settings, tmp_path):
    from deltalake import DeltaTable

    eng = engine(spark, settings, tmp_path, wide_topic("  deletion_vectors: true\n"))
    customers(eng)
    orders(eng, 1, 30)
    eng.register_tables()
    path = eng.path("mart.wide")
    (eng.spark.sql(spark_io.bind_block(WIDE.replace("b.id,", "b.pos, b.id,"), "stage.orders")).write.format("delta")
     .option("delta.enableChangeDataFeed", "true").option("delta.enableDeletionVectors", "true").save(path))
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id IN (29, 30)")  # the newest rows gone
    assert "deletionVectors" in (DeltaTable(path).protocol().reader_features or [])
    lines = views.adopt(eng, eng.lineage.topic("mart.wide"), dry_run=True)
    assert lines[1] == f"  last = {Position(T0 + dt.timedelta(seconds=28), 28).to_text()} (the newest (pos, id) in mart.wide)"
    assert lines[-2].endswith("): unique"), lines
