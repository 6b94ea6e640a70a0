"""Exactly-once through Dagster runs: a `dagster asset materialize` of a block partition is
killed with SIGKILL after its Delta commit and before the offset commit; materializing the
same partition again lands the block once. The kill happens inside the offset IO manager's
``handle_output`` (the Delta write and the offset commit live there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from deltalake import DeltaTable

from lineage.core.partitions import partitions_name
from platform_assets.engine.runner import data_app_id
from resources.state.offset_sql import open_offset_store
from resources.storage.meta_tables import read_etl_log
from tests.platform_assets.shop import (
    ROOT,
    dagster_yaml,
    make_events,
    materialize_command,
    write_lineage,
    write_rows,
    write_users,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _materialize(settings, dagster_home: Path, key: str, **env: str) -> subprocess.CompletedProcess:
    cmd, full_env = materialize_command(settings, dagster_home, "fact/events", key, **env)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=400)


def test_killed_block_run_retried_through_dagster_lands_once(spark, settings, tmp_path, dagster_storage, cli_spark):
    s = settings.with_(lineage=write_lineage(tmp_path, maxstep=40))
    write_users(s)
    write_rows(s, "stage.events", make_events(100, distinct_pos=100, seed=21))
    dagster_home = tmp_path / "dagster"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text(dagster_yaml(dagster_storage))
    # Plan block 1 and add its partition, as the sensor or `tidemark plan` would.
    plan = subprocess.run([sys.executable, "-m", "platform_assets.cli", "--home", str(s.home), "--lineage", str(s.lineage),
                           "plan", "fact.events"], cwd=ROOT, env={**os.environ, "DAGSTER_HOME": str(dagster_home)},
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    key = plan.stdout.split()[-1]
    assert key == "00000001"

    killed = _materialize(s, dagster_home, key, TIDEMARK_CRASH_AT="written")
    assert killed.returncode == -9, killed.stderr[-3000:]
    dest = s.table_path("fact.events")
    store = open_offset_store(s.offsets_url)
    rec = store.get("fact.events")
    assert rec.pending and rec.seq == 1  # the offset did not move ...
    assert DeltaTable(dest).transaction_version(data_app_id("fact.events")) == 1  # ... but the data landed

    retried = _materialize(s, dagster_home, key)
    assert retried.returncode == 0, retried.stderr[-3000:]
    out = retried.stderr + retried.stdout
    assert "RUN_SUCCESS" in out
    assert 'using IO manager "tidemark_io_manager"' in out  # the offset IO manager finished the block
    with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
        mat = instance.get_latest_materialization_event(dg.AssetKey(["fact", "events"])).asset_materialization
        meta = {k: v.value for k, v in mat.metadata.items()}
        assert mat.partition == key and meta["recovered"] is True and meta["block"] == 1 and meta["base_rows"] == 40
        assert meta["rows"] == DeltaTable(dest).to_pyarrow_table().num_rows
    rec = store.get("fact.events")
    assert not rec.pending and rec.seq == 1 and rec.owner == ""
    assert DeltaTable(dest).version() == 0  # one data commit: the retry did not write again
    ids = [r.id for r in spark.read.format("delta").load(dest).select("id").collect()]
    assert len(ids) == len(set(ids))
    (log,) = read_etl_log(s, "fact.events")
    assert log["seq"] == 1 and log["base_rows"] == 40
    assert partitions_name("fact.events") == "tidemark_blocks__fact__events"
    assert any(h.action == "steal" for h in store.history("fact.events"))  # the killed run's lock was taken over
