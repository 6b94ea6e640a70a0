"""The Dagster code location loads from the lineage, quickly and without Spark."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from lineage.core.errors import LineageError
from platform_assets.dagster.definitions import build_definitions
from resources.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def _td(value) -> dt.timedelta:  # Dagster stores a SerializableTimeDelta
    return dt.timedelta(days=value.days, seconds=value.seconds, microseconds=value.microseconds)


def test_demo_definitions_have_sources_topics_and_dependencies(tmp_path):
    defs = build_definitions(Settings.from_env({}, home=tmp_path, lineage=ROOT / "demo" / "lineage"))
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert keys == {"stage/customers", "stage/orders", "stage/order_items", "dim/customers", "fact/orders",
                    "fact/order_items", "mart/daily_revenue", "intake/stage", "stage/events_page_view", "fact/page_views",
                    "crm/customers", "tidemark_maintenance"}
    # the intake's stage table is an asset of the intake job, the source of fact.page_views
    assert graph.get(dg.AssetKey(["stage", "events_page_view"])).is_materializable
    assert dg.AssetKey(["stage", "events_page_view"]) in graph.get(dg.AssetKey(["fact", "page_views"])).parent_keys
    crm = dg.AssetKey(["crm", "customers"])  # a CDC replica, kept by the replicator crm
    assert {k.name for k in graph.asset_check_keys if k.asset_key == crm} == {"state", "lag"}
    assert "tidemark__cdc__crm" in {j.name for j in defs.get_repository_def().get_all_jobs()}
    assert "tidemark_cdc" in {s.name for s in defs.sensors}
    items = graph.get(dg.AssetKey(["fact", "order_items"]))
    assert {p.to_user_string() for p in items.parent_keys} == {"stage/order_items", "fact/orders"}
    assert items.group_name == "fact" and items.pools == {"tidemark/fact.order_items"}
    assert not graph.get(dg.AssetKey(["stage", "orders"])).is_materializable
    # Every job and sensor target resolves (a sensor over differently partitioned tables once did not).
    dg.Definitions.validate_loadable(defs)
    jobs = {j.name for j in defs.get_repository_def().get_all_jobs()}
    assert {"tidemark__fact__orders", "tidemark__dim__customers"} <= jobs
    assert {s.name for s in defs.sensors} >= {"tidemark_planner", "tidemark_alerts", "tidemark_intake_files"}
    checks = {k.name for k in graph.asset_check_keys if k.asset_key == dg.AssetKey(["fact", "orders"])}
    assert checks == {"rows", "lag", "nulls", "late_rows", "table_health"}
    # a merge view: one unpartitioned asset, judged per unit by its own checks
    mart = dg.AssetKey(["mart", "daily_revenue"])
    assert {k.name for k in graph.asset_check_keys if k.asset_key == mart} == {"offset_age", "late_rows", "refresh",
                                                                               "table_health"}
    # every topic's table has table_health; a block's or unit's run evaluates its own checks, not that one
    assert {k.asset_key.to_user_string() for k in graph.asset_check_keys if k.name == "table_health"} == {
        "dim/customers", "fact/orders", "fact/order_items", "mart/daily_revenue", "fact/page_views"}
    for table in ("fact__orders", "mart__daily_revenue"):
        run_checks = defs.resolve_job_def(f"tidemark__{table}").asset_layer.asset_graph.asset_check_keys
        assert run_checks and "table_health" not in {k.name for k in run_checks}
    assert graph.get(dg.AssetKey("tidemark_maintenance")).group_name == "maintenance"
    assert defs.resolve_schedule_def("tidemark_maintain_schedule").job_name == "tidemark_maintain"
    assert graph.get(mart).partitions_def is None
    items_def = defs.resolve_assets_def(dg.AssetKey(["fact", "order_items"]))
    policy = items_def.specs_by_key[dg.AssetKey(["fact", "order_items"])].freshness_policy
    assert _td(policy.warn_window) == dt.timedelta(minutes=10) and _td(policy.fail_window) == dt.timedelta(minutes=20)


def test_owner_and_freshness_follow_the_spec(tmp_path):
    (tmp_path / "t.sql").write_text("SELECT * FROM block")
    (tmp_path / "x.yaml").write_text(
        "sources:\n  - table: stage.a\ntopics:\n  - table: fact.a\n    depends_on: [stage.a]\n    transforms: [t.sql]\n"
        "    delay: 1h\n    repeat: 30m\n    owner: data-eng\n")
    defs = build_definitions(Settings.from_env({}, home=tmp_path, lineage=tmp_path))
    spec = defs.resolve_assets_def(dg.AssetKey(["fact", "a"])).specs_by_key[dg.AssetKey(["fact", "a"])]
    assert spec.owners == ["team:data-eng"]
    expected = dt.timedelta(hours=1, minutes=30, seconds=150)
    assert _td(spec.freshness_policy.warn_window) == 2 * expected and _td(spec.freshness_policy.fail_window) == 4 * expected


def test_bad_lineage_fails_with_the_validators_message(tmp_path):
    (tmp_path / "x.yaml").write_text("topics:\n  - table: fact.x\n    depends_on: [stage.nope]\n    transforms: [x.sql]\n")
    with pytest.raises(LineageError, match=r"x.yaml:3: topic 'fact.x': field 'depends_on'.*'stage.nope'"):
        build_definitions(Settings.from_env({}, home=tmp_path, lineage=tmp_path))


def test_module_import_is_light():
    t0 = time.monotonic()
    # dagster-pyspark's resource module imports pyspark's Python side; no session and no JVM may start
    out = subprocess.run([sys.executable, "-c", "import sys, platform_assets.dagster.definitions as d; "
                          "from pyspark import SparkContext; from pyspark.sql import SparkSession; "
                          "print(d.defs is not None, SparkContext._active_spark_context is None, "
                          "SparkSession.getActiveSession() is None, 'py4j.java_gateway' in sys.modules and "
                          "SparkContext._gateway is not None)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "False"]  # loaded; no Spark session, no JVM gateway
    assert time.monotonic() - t0 < 60
