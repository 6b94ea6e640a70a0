"""The offset IO manager on a real Dagster instance, real Spark and Delta: it writes each block
once and commits its offsets, records the block's figures as materialization metadata, and
gives downstream assets the rows of the upstream block; two concurrent runs of one topic never
both write (the pool serialises them, the offset-store lock stops them if the pool is off)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import dagster as dg
import pytest
from dagster_pyspark import LazyPySparkResource
from deltalake import DeltaTable

from lineage.core.errors import ProcessingError
from lineage.core.partitions import partitions_name
from platform_assets.dagster.definitions import build_definitions
from platform_assets.dagster.io_manager import IO_MANAGER_KEY, OffsetIOManager
from platform_assets.engine.runner import Engine
from resources.state.offset_sql import open_offset_store
from resources.storage.meta_tables import read_etl_log
from tests.platform_assets.shop import (
    ROOT,
    cli_master,
    dagster_yaml,
    make_events,
    materialize_command,
    write_lineage,
    write_rows,
    write_users,
)

EVENTS = dg.AssetKey(["fact", "events"])
RELOAD_TOPIC = """\
- table: dim.user_count
  processor: reload
  depends_on: [dim.users]
  transforms: [../sql/user_count.sql]
"""


def _setup(settings, tmp_path, **kw):
    s = settings.with_(lineage=write_lineage(tmp_path, **kw))
    write_users(s)
    return s


def _io(s) -> OffsetIOManager:
    return OffsetIOManager(home=str(s.home), warehouse=s.warehouse, offsets_url=s.offsets_url, lineage=str(s.lineage))


def _plan(s, instance) -> str:
    """Plan the next block of fact.events and add its partition, as `tidemark plan` does."""
    from lineage.spec.loader import load_lineage

    eng = Engine(s, load_lineage(s.lineage))
    try:
        planned = eng.plan_block("fact.events")
    finally:
        eng.close()
    assert planned.block is not None, planned.reason
    key = f"{planned.block.seq:08d}"
    instance.add_dynamic_partitions(partitions_name("fact.events"), [key])
    return key


def test_every_io_manager_setting_is_described_with_its_environment_fallback():
    fields = OffsetIOManager.to_config_schema().as_field().config_type.fields  # what the UI's Resources page shows
    assert set(fields) == {"home", "warehouse", "offsets_url", "lineage", "spark_master"}
    for name, field in fields.items():
        assert field.description and "Empty: TIDEMARK_" in field.description, name


def test_handle_output_refuses_what_is_not_an_opened_block(settings, tmp_path):
    s = _setup(settings, tmp_path)
    ctx = dg.build_output_context(asset_key=EVENTS)
    with pytest.raises(ProcessingError, match="asset fact/events: the Tidemark IO manager writes blocks opened by Engine.open_block, not int"):
        _io(s).handle_output(ctx, 42)


@pytest.mark.spark
@pytest.mark.fast
def test_blocks_written_through_the_io_manager_and_read_back_by_a_downstream_asset(spark, settings, tmp_path, dagster_storage):
    s = _setup(settings, tmp_path, maxstep=30)
    write_rows(s, "stage.events", make_events(70, distinct_pos=70, seed=5))
    defs = build_definitions(s)
    events = defs.resolve_assets_def(EVENTS)
    seen: dict[str, list[int]] = {}
    sessions: list[object] = []

    @dg.asset(partitions_def=dg.DynamicPartitionsDefinition(name=partitions_name("fact.events")),
              ins={"block": dg.AssetIn(key=EVENTS, input_manager_key=IO_MANAGER_KEY)})
    def block_ids(context, block, pyspark: LazyPySparkResource) -> None:  # noqa: ANN001 - Dagster inspects the signature
        seen[context.partition_key] = sorted(r.id for r in block.select("id").collect())
        sessions.append(pyspark.spark_session)  # dagster-pyspark's resource, under its documented key

    # A user's own asset downstream of a Tidemark table, in the same code location.
    with_user_asset = dg.Definitions.merge(defs, dg.Definitions(assets=[block_ids]))
    job = with_user_asset.resolve_implicit_global_asset_job_def()
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        keys = []
        for _ in range(2):
            key = _plan(s, instance)
            keys.append(key)
            result = dg.materialize([events], partition_key=key, instance=instance)
            (mat,) = result.asset_materializations_for_node(events.node_def.name)
            meta = {k: v.value for k, v in mat.metadata.items()}
            rec = open_offset_store(s.offsets_url).get("fact.events")
            # the IO manager committed the offsets: last moved to the block's next
            assert not rec.pending and rec.seq == int(key) and meta["next"] == rec.last.to_text()
            # the first block starts at the beginning, shown as "start", not as the sentinel position
            assert (meta["last"] == "start") == (key == keys[0]) and "-9223372036854775808" not in meta["last"]
            assert meta["block"] == int(key) and meta["base_rows"] == 30 and meta["delta_version"] == int(key) - 1
            assert meta["rows"] > 0 and meta["min_pos"] <= meta["max_pos"]
            assert isinstance(meta["lag_s"], float) and isinstance(meta["duration_s"], float)
            # where the block's time went, each phase once, adding up to no more than the block took
            phases = meta["phases_s"]
            assert {"lock", "transform", "write", "log", "commit"} <= set(phases)  # planned by the sensor: no "plan"
            assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= meta["duration_s"] + 1.0
            (log,) = [r for r in read_etl_log(s, "fact.events") if r["seq"] == int(key)]
            assert log["rows"] == meta["rows"] and log["delta_version"] == meta["delta_version"]

            down = job.execute_in_process(asset_selection=[block_ids.key], partition_key=key, instance=instance)
            assert down.success
            assert len(seen[key]) == meta["rows"]

    # the user's asset got the very session the units ran on (one JVM per run, not two)
    assert sessions and all(x is spark for x in sessions)
    dest = spark.read.format("delta").load(s.table_path("fact.events"))
    all_ids = sorted(r.id for r in dest.select("id").collect())
    first, second = seen[keys[0]], seen[keys[1]]
    assert not set(first) & set(second) and sorted(first + second) == all_ids  # each block's rows, no more
    assert max(first) < min(second)  # blocks follow (pos, id) order (ids rise with pos here)


@pytest.mark.spark
def test_load_input_of_a_block_not_materialized_names_it(spark, settings, tmp_path, dagster_storage):
    s = _setup(settings, tmp_path, maxstep=30)
    write_rows(s, "stage.events", make_events(40, distinct_pos=40))
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        key = _plan(s, instance)
        dg.materialize([build_definitions(s).resolve_assets_def(EVENTS)], partition_key=key, instance=instance)
        instance.add_dynamic_partitions(partitions_name("fact.events"), ["00000002"])  # a key never materialized
        io = _io(s)
        parts = dg.DynamicPartitionsDefinition(name=partitions_name("fact.events"))
        ctx = dg.build_input_context(asset_key=EVENTS, partition_key="00000002", asset_partitions_def=parts, instance=instance)
        with pytest.raises(ProcessingError, match=r"asset fact/events: block 00000002 of topic 'fact.events' has no commit in .*_delta_log"):
            io.load_input(ctx)
    ctx = dg.build_input_context(asset_key=dg.AssetKey(["fact", "nothing"]))
    with pytest.raises(ProcessingError, match=r"asset fact/nothing: no Delta table at .*fact/nothing \(not materialized yet\)"):
        io.load_input(ctx)


@pytest.mark.spark
def test_reload_asset_is_rebuilt_by_the_io_manager_and_loads_whole(spark, settings, tmp_path, dagster_storage):
    s = _setup(settings, tmp_path, extra_topic=RELOAD_TOPIC)
    (tmp_path / "sql" / "user_count.sql").write_text("SELECT country, count(*) AS users FROM block GROUP BY country")
    defs = build_definitions(s)
    reload_asset = defs.resolve_assets_def(dg.AssetKey(["dim", "user_count"]))
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        result = dg.materialize([reload_asset], instance=instance)
        (mat,) = result.asset_materializations_for_node(reload_asset.node_def.name)
        assert mat.metadata["rows"].value == 3 and mat.metadata["delta_version"].value == 0
        assert mat.metadata["files"].value >= 1 and mat.metadata["maintenance"].value == "ok"  # the table's health
        again = dg.materialize([reload_asset], instance=instance)  # nothing changed: nothing written
        (mat2,) = again.asset_materializations_for_node(reload_asset.node_def.name)
        assert "note" in mat2.metadata and DeltaTable(s.table_path("dim.user_count")).version() == 0
        assert mat2.metadata["files"].value == mat.metadata["files"].value
    df = _io(s).load_input(dg.build_input_context(asset_key=dg.AssetKey(["dim", "user_count"])))
    assert sum(r.users for r in df.collect()) == 20


# --------------------------------------------------------------------- two concurrent runs
def _materialize(s, dagster_home: Path, key: str, **env: str) -> subprocess.Popen:
    cmd, full_env = materialize_command(s, dagster_home, "fact/events", key, master=cli_master("local[1]"), **env)
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_lock(s, timeout: float = 120.0) -> str:
    store = open_offset_store(s.offsets_url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = store.get("fact.events")
        if rec is not None and rec.owner:
            return rec.owner
        time.sleep(0.2)
    raise AssertionError("the first run never took the topic's lock")


def _concurrent_runs(settings, tmp_path, dagster_yaml: str) -> tuple[str, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    s = _setup(settings, tmp_path, maxstep=40)
    write_rows(s, "stage.events", make_events(60, distinct_pos=60, seed=9))
    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text(dagster_yaml)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        key = _plan(s, instance)
    # The first run holds the lock (and its pool slot) while it sits paused before its write.
    first = _materialize(s, home, key, TIDEMARK_PAUSE_AT="transformed:20")
    _wait_for_lock(s)
    second = _materialize(s, home, key)
    out2 = second.communicate(timeout=400)[0]
    out1 = first.communicate(timeout=400)[0]
    dest = s.table_path("fact.events")
    assert DeltaTable(dest).version() == 0  # ONE data commit: the runs never both wrote
    assert [r["seq"] for r in read_etl_log(s, "fact.events")] == [1]
    rows = DeltaTable(dest).to_pyarrow_table(columns=["id"]).column("id").to_pylist()
    assert len(rows) == len(set(rows))
    return key, subprocess.CompletedProcess(first.args, first.returncode, out1), subprocess.CompletedProcess(second.args, second.returncode, out2)


@pytest.mark.spark
@pytest.mark.slow
def test_two_concurrent_runs_of_a_topic_wait_for_its_pool(settings, tmp_path, dagster_storage, cli_spark):
    """With the shipped pool limit (one per table), the second run waits for the first's slot
    and then finds the block committed: no lock error, no second write."""
    shipped = (ROOT / "dagster.yaml").read_text()
    _, first, second = _concurrent_runs(settings, tmp_path, dagster_yaml(dagster_storage, shipped))
    assert first.returncode == 0, first.stdout[-3000:]
    assert second.returncode == 0, second.stdout[-3000:]
    assert "already committed" in second.stdout
    assert "is being processed by" not in second.stdout


@pytest.mark.spark
@pytest.mark.slow
def test_without_a_pool_the_offset_lock_stops_the_second_run(settings, tmp_path, dagster_storage, cli_spark):
    _, first, second = _concurrent_runs(settings, tmp_path, dagster_yaml(dagster_storage))
    assert first.returncode == 0, first.stdout[-3000:]
    assert second.returncode != 0
    assert "TopicLockedError" in second.stdout and "is being processed by" in second.stdout
