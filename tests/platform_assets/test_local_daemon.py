"""The planner sensor's loop in one process (what the demo's first command runs): real sensor
ticks, real Dagster runs of the block partitions, real Spark and Delta."""

from __future__ import annotations

import dagster as dg
import pytest

from platform_assets.dagster.definitions import build_definitions
from platform_assets.dagster.local_daemon import run_until_idle
from tests.platform_assets.shop import make_events, write_lineage, write_rows, write_users

pytestmark = pytest.mark.spark


def test_runs_every_block_through_dagster_until_every_topic_waits(spark, settings, tmp_path, dagster_storage):
    s = settings.with_(lineage=write_lineage(tmp_path, maxstep=30))
    write_users(s)
    write_rows(s, "stage.events", make_events(70, distinct_pos=70, seed=3))
    seen = []
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        runs, waiting = run_until_idle(build_definitions(s), instance, on_run=seen.append, log_level="WARNING")
        assert [r.partition for r in runs] == ["00000001", "00000002", "00000003"] and seen == runs
        assert all(r.success and r.checks == {"rows": True, "lag": True, "nulls": True, "late_rows": True} for r in runs)
        assert [r.metadata["base_rows"] for r in runs] == [30, 30, 10]
        assert waiting == "fact.events: no new rows"
        records = instance.fetch_materializations(dg.AssetKey(["fact", "events"]), limit=10).records
        assert sorted(r.partition_key for r in records) == ["00000001", "00000002", "00000003"]
        assert {r.run_id for r in records} == {r.run_id for r in runs}


@pytest.mark.fast
def test_a_failed_run_stops_the_loop_with_its_error(spark, settings, tmp_path, dagster_storage):
    s = settings.with_(lineage=write_lineage(tmp_path, maxstep=30))
    (tmp_path / "sql" / "fact_events.sql").write_text("SELECT pos, id, no_such_column FROM block")
    write_users(s)
    write_rows(s, "stage.events", make_events(40, distinct_pos=40))
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        runs, why = run_until_idle(build_definitions(s), instance, log_level="CRITICAL")
        (run,) = runs
        assert not run.success and run.partition == "00000001"
        assert "transform ../sql/fact_events.sql failed" in run.error and "no_such_column" in run.error
        assert why.startswith(f"run {run.run_id} of tidemark__fact__events failed: ")
