"""The prod profile end to end on a real PostgreSQL: the shipped ``dagster.prod.yaml`` picked by
``Settings`` from ``TIDEMARK_DAGSTER_PG_URL``, a block planned by the sensor and materialized
through Dagster, and every piece of state (runs, event log, block partitions, concurrency pools,
offsets) read back from the one database over psycopg, none in a file under the instance."""

from __future__ import annotations

import dagster as dg
import psycopg
import pytest
import yaml

from lineage.core.partitions import partitions_name
from platform_assets.dagster.definitions import build_definitions
from resources.core.settings import Settings
from resources.state.local_pg import dagster_url
from tests.platform_assets.shop import ROOT, make_events, write_lineage, write_rows, write_users

pytestmark = [pytest.mark.spark, pytest.mark.postgres]


@pytest.fixture
def prod_db(pg_url: str) -> str:
    """A fresh database on the session's PostgreSQL (the prod profile's one database)."""
    base = pg_url.rsplit("/", 1)[0]
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS prod_profile")
        conn.execute("CREATE DATABASE prod_profile")
    return f"{base}/prod_profile"


def test_prod_profile_keeps_runs_events_partitions_and_offsets_in_one_postgres_database(
        spark, tmp_path, prod_db, monkeypatch):
    monkeypatch.setenv("TIDEMARK_DAGSTER_PG_URL", dagster_url(prod_db))  # dagster.prod.yaml reads it
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("TIDEMARK_OFFSETS_URL", raising=False)
    monkeypatch.delenv("TIDEMARK_PROFILE", raising=False)
    s = Settings.from_env(home=tmp_path / "home", lineage=write_lineage(tmp_path, maxstep=30), spark_master="local[2]")
    assert s.profile == "prod" and s.offsets_url == prod_db  # the offsets default to the same database
    home = s.dagster_home()
    assert home == s.home / "dagster-prod"
    assert yaml.safe_load((home / "dagster.yaml").read_text()) == yaml.safe_load((ROOT / "dagster.prod.yaml").read_text())
    write_users(s)
    write_rows(s, "stage.events", make_events(50, distinct_pos=50))
    defs = build_definitions(s)
    asset = defs.resolve_assets_def(dg.AssetKey(["fact", "events"]))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        ctx = dg.build_sensor_context(instance=instance, instance_ref=instance.get_ref(), definitions=defs)
        tick = defs.get_sensor_def("tidemark_planner").evaluate_tick(ctx)
        (request,) = tick.run_requests
        assert request.partition_key == "00000001"
        instance.add_dynamic_partitions(partitions_name("fact.events"), [request.partition_key])
        result = dg.materialize([asset], partition_key=request.partition_key, instance=instance)
        assert result.success

    with psycopg.connect(prod_db) as conn:
        runs = conn.execute("SELECT run_id, status FROM runs").fetchall()
        assert runs == [(result.run_id, "SUCCESS")]
        events = {r[0] for r in conn.execute("SELECT dagster_event_type FROM event_logs WHERE run_id = %s",
                                             (result.run_id,)).fetchall()}
        assert {"STEP_SUCCESS", "ASSET_MATERIALIZATION", "ASSET_CHECK_EVALUATION"} <= events
        assert conn.execute("SELECT partitions_def_name, partition FROM dynamic_partitions").fetchall() == [
            (partitions_name("fact.events"), "00000001")]
        assert conn.execute("SELECT concurrency_key FROM concurrency_limits").fetchall() == [("tidemark/fact.events",)]
        assert conn.execute("SELECT seq, state, owner FROM tidemark_offsets WHERE topic = 'fact.events'").fetchone() == (
            1, "committed", "")
    assert not [p for p in home.rglob("*") if p.suffix == ".db"]  # no SQLite storage beside it
