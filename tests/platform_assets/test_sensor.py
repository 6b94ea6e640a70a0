"""The planner sensor and block-partitioned assets on a real Dagster instance (and real Spark
for the materialization)."""

from __future__ import annotations

import datetime as dt
import uuid

import dagster as dg
import pytest
from deltalake import DeltaTable

from lineage.core.partitions import partitions_name
from lineage.core.positions import Position
from lineage.spec.loader import load_lineage
from platform_assets.dagster.definitions import build_definitions
from platform_assets.dagster.sensors import PastRun, launch_decision
from resources.state.offset_sql import OwnerId, make_owner, open_offset_store
from tests.platform_assets.shop import T0, make_events, write_lineage, write_rows, write_users

S = dg.DagsterRunStatus


def test_launch_decision_retries_with_backoff_and_gives_up():
    assert launch_decision([], 1000.0, max_attempts=3, backoff_s=60) == (True, 1, "new block")
    assert launch_decision([PastRun(S.STARTED, None)], 1000.0, max_attempts=3, backoff_s=60)[0] is False
    failed = [PastRun(S.FAILURE, 1000.0)]
    launch, attempt, why = launch_decision(failed, 1030.0, max_attempts=3, backoff_s=60)
    assert (launch, attempt) == (False, 2) and "backoff" in why
    assert launch_decision(failed, 1061.0, max_attempts=3, backoff_s=60) == (True, 2, "retry")
    two = [PastRun(S.FAILURE, 1000.0), PastRun(S.FAILURE, 1100.0)]
    assert launch_decision(two, 1150.0, max_attempts=3, backoff_s=60)[0] is False  # second backoff is 120 s
    assert launch_decision(two, 1221.0, max_attempts=3, backoff_s=60) == (True, 3, "retry")
    three = [*two, PastRun(S.CANCELED, 1300.0)]
    launch, attempt, why = launch_decision(three, 9999.0, max_attempts=3, backoff_s=60)
    assert not launch and "gave up after 3 failed attempts" in why


def _tick(sensor, instance, defs):
    # As the daemon does: with an instance ref, partitions added in the same tick resolve.
    ctx = dg.build_sensor_context(instance=instance, instance_ref=instance.get_ref(), definitions=defs)
    return sensor.evaluate_tick(ctx)


def _defs(settings, tmp_path, **kw):
    s = settings.with_(lineage=write_lineage(tmp_path, **kw))
    return s, build_definitions(s)


def test_sensor_waits_with_the_planners_reason_then_adds_partition_and_requests_run(settings, tmp_path, dagster_storage):
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    s, defs = _defs(settings, tmp_path, delay="1h", maxstep=30)
    write_users(s)
    write_rows(s, "stage.events", make_events(50, start=now - dt.timedelta(minutes=30), distinct_pos=50))
    sensor = defs.get_sensor_def("tidemark_planner")
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        data = _tick(sensor, instance, defs)
        assert not data.run_requests
        assert "fact.events: delay 1h: newest eligible row at" in data.skip_message

    s, defs = _defs(settings, tmp_path / "ready", maxstep=30)
    write_users(s)
    write_rows(s, "stage.events", make_events(50, distinct_pos=50))
    sensor = defs.get_sensor_def("tidemark_planner")
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        data = _tick(sensor, instance, defs)
        (req,) = data.run_requests
        assert req.partition_key == "00000001" and req.run_key == "fact.events@1#1"
        assert req.job_name == "tidemark__fact__events"
        assert req.tags["dagster/priority"] == "0"  # no topic reads fact.events: others' runs go first
        (add,) = data.dynamic_partitions_requests
        assert add.partitions_def_name == partitions_name("fact.events") and list(add.partition_keys) == ["00000001"]
        rec = open_offset_store(s.offsets_url).get("fact.events")
        assert rec.pending and rec.seq == 1 and rec.owner == ""  # next fixed before anything is written
        # The next tick sees the same pending block: same key and run key (Dagster dedups it).
        instance.add_dynamic_partitions(add.partitions_def_name, ["00000001"])
        again = _tick(sensor, instance, defs)
        assert [r.run_key for r in again.run_requests] == ["fact.events@1#1"] and not again.dynamic_partitions_requests


def test_sensor_shows_a_missing_base_table_as_a_wait(settings, tmp_path, dagster_storage):
    s, defs = _defs(settings, tmp_path)
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        data = _tick(defs.get_sensor_def("tidemark_planner"), instance, defs)
    assert not data.run_requests
    assert (f"fact.events: stage.events does not exist at {s.table_path('stage.events')}; check the table name "
            "or the source's path") in data.skip_message


def test_a_pending_block_is_requested_again_without_a_write_unless_a_run_holds_it(settings, tmp_path, dagster_storage):
    s, defs = _defs(settings, tmp_path, maxstep=30)
    write_users(s)
    write_rows(s, "stage.events", make_events(50, distinct_pos=50))
    sensor = defs.get_sensor_def("tidemark_planner")
    store = open_offset_store(s.offsets_url)
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        _tick(sensor, instance, defs)
        planned = store.get("fact.events")
        # The planned block's partition was never added (e.g. the tick's result was lost).
        again = _tick(sensor, instance, defs)
        assert [r.run_key for r in again.run_requests] == ["fact.events@1#1"]
        assert [list(r.partition_keys) for r in again.dynamic_partitions_requests] == [["00000001"]]
        # The pending block is read, not locked: the record (even updated_at) is unchanged.
        assert store.get("fact.events") == planned and store.history("fact.events")[0].action == "plan"
        store.acquire("fact.events", "elsewhere:1:abcd")  # a run of the block holds the topic
        held = _tick(sensor, instance, defs)
        assert not held.run_requests and "fact.events: running (elsewhere:1:abcd)" in held.skip_message


def test_sensor_frees_the_lock_of_a_failed_or_canceled_run_but_not_of_a_live_one(settings, tmp_path, dagster_storage):
    s, defs = _defs(settings, tmp_path, maxstep=30)
    write_users(s)
    write_rows(s, "stage.events", make_events(50, distinct_pos=50))
    sensor = defs.get_sensor_def("tidemark_planner")
    store = open_offset_store(s.offsets_url)
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        _tick(sensor, instance, defs)  # plans block 1
        instance.add_dynamic_partitions(partitions_name("fact.events"), ["00000001"])

        def run_holding_the_lock(status: dg.DagsterRunStatus) -> tuple[dg.DagsterRun, str]:
            run = instance.add_run(dg.DagsterRun(job_name="tidemark__fact__events", run_id=str(uuid.uuid4()), status=status))
            owner = make_owner(run_id=run.run_id)  # as the IO manager builds it inside a run
            store.acquire("fact.events", owner)
            return run, owner

        live, owner = run_holding_the_lock(S.STARTED)
        held = _tick(sensor, instance, defs)
        assert not held.run_requests and f"fact.events: running ({owner})" in held.skip_message
        assert store.get("fact.events").owner == owner
        instance.report_run_failed(live)  # e.g. run monitoring found its container gone
        freed = _tick(sensor, instance, defs)
        assert store.get("fact.events").owner == ""
        entry = store.history("fact.events")[0]
        assert (entry.action, entry.who) == ("release-dead", "tidemark_planner")
        assert owner in entry.note and entry.note.endswith(f"Dagster run {live.run_id} ended as FAILURE")
        assert [r.partition_key for r in freed.run_requests] == ["00000001"]  # the pending block runs again
        store.unlock("fact.events", who="test")

        canceled, owner = run_holding_the_lock(S.STARTED)
        instance.report_run_canceled(canceled)
        _tick(sensor, instance, defs)
        assert store.get("fact.events").owner == ""
        assert store.history("fact.events")[0].note.endswith("ended as CANCELED")
        # A lock whose owner names no run (a `tidemark run` process) is the lease's business.
        store.acquire("fact.events", make_owner())
        _tick(sensor, instance, defs)
        assert store.get("fact.events").owner != ""


@pytest.mark.spark
def test_materializing_a_block_partition_writes_exactly_that_block(spark, settings, tmp_path, dagster_storage):
    s, defs = _defs(settings, tmp_path, maxstep=30)
    write_users(s)
    write_rows(s, "stage.events", make_events(50, distinct_pos=50))
    sensor = defs.get_sensor_def("tidemark_planner")
    asset = defs.resolve_assets_def(dg.AssetKey(["fact", "events"]))
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        data = _tick(sensor, instance, defs)
        instance.add_dynamic_partitions(partitions_name("fact.events"), ["00000001"])
        result = dg.materialize([asset], partition_key="00000001", instance=instance)
        assert result.success
        (mat,) = result.asset_materializations_for_node(asset.node_def.name)
        meta = {k: v.value for k, v in mat.metadata.items()}
        assert meta["block"] == 1 and meta["base_rows"] == 30 and meta["delta_version"] == 0
        assert meta["last"] == "start" and data.run_requests[0].partition_key == "00000001"
        rec = open_offset_store(s.offsets_url).get("fact.events")
        assert not rec.pending and rec.seq == 1
        assert meta["next"] == rec.last.to_text()
        # the table's health after the block, read from its Delta log
        assert meta["files"] >= 1 and meta["small_files"] == meta["files"] and meta["maintenance"] == "ok"
        assert meta["versions_since_checkpoint"] == 1 and meta["oldest_version_needed"].startswith("v0 for fact.events")
        commit = open_offset_store(s.offsets_url).history("fact.events")[0]
        assert commit.action == "commit" and OwnerId.parse(commit.who).run_id == result.run_id  # the lock names the run
        # Materializing the committed block again changes nothing.
        again = dg.materialize([asset], partition_key="00000001", instance=instance)
        (mat2,) = again.asset_materializations_for_node(asset.node_def.name)
        meta2 = {k: v.value for k, v in mat2.metadata.items()}
        assert meta2["note"] == "block 1 was already committed (nothing written)"
        assert meta2["rows_written"] == 0 and meta2["already_committed"] is True and "rows" not in meta2
        assert meta2["files"] == meta["files"] and meta2["maintenance"] == "ok"
        logs = [e.user_message for e in instance.all_logs(again.run_id)]
        assert any("fact.events: block 1 was already committed (nothing written)" in m for m in logs)
        checks = again.get_asset_check_evaluations()
        assert checks and all(c.description.startswith("block 1 as committed earlier (") for c in checks)
        assert all("nothing written now: " in c.description for c in checks)
        assert DeltaTable(s.table_path("fact.events")).version() == 0
        assert spark.active() is not None  # the test's shared session was not stopped by the run


@pytest.mark.spark
def test_block_checks_record_etl_log_figures_and_fail_with_the_spec_severity(spark, settings, tmp_path, dagster_storage):
    s = settings.with_(lineage=write_lineage(tmp_path, maxstep=100))
    yaml_path = s.lineage / "events.yaml"
    yaml_path.write_text(yaml_path.read_text() + "    checks: {max_null_share: {country: 0.05}, max_lag: 1d, severity: error}\n")
    defs = build_definitions(s)
    write_users(s, n=10)  # users 10..25 have no country: far more than 5% nulls
    write_rows(s, "stage.events", make_events(60, distinct_pos=60))
    asset = defs.resolve_assets_def(dg.AssetKey(["fact", "events"]))
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        _tick(defs.get_sensor_def("tidemark_planner"), instance, defs)
        instance.add_dynamic_partitions(partitions_name("fact.events"), ["00000001"])
        result = dg.materialize([asset], partition_key="00000001", instance=instance, raise_on_error=False)
        evals = {e.check_name: e for e in result.get_asset_check_evaluations()}
        assert set(evals) == {"rows", "lag", "nulls", "late_rows"}
        assert evals["rows"].passed and not evals["nulls"].passed and not evals["lag"].passed
        assert evals["nulls"].severity == dg.AssetCheckSeverity.ERROR
        assert evals["nulls"].description.startswith("too many nulls: country")
        meta = {k: v.value for k, v in evals["rows"].metadata.items()}
        assert meta["rows"] > 0 and meta["base_rows"] == 60 and meta["max_id"] == 60 and meta["nulls"]["country"] > 0
        # Re-materializing the committed block reports the same logged figures again.
        again = dg.materialize([asset], partition_key="00000001", instance=instance, raise_on_error=False)
        evals2 = {e.check_name: e for e in again.get_asset_check_evaluations()}
        assert evals2["nulls"].passed is False and evals2["rows"].metadata["rows"].value == meta["rows"]


def test_sensor_deletes_block_partitions_beyond_retention(settings, tmp_path, dagster_storage):
    from platform_assets.dagster.sensors import build_planner_sensor

    s = settings.with_(lineage=write_lineage(tmp_path, maxstep=30))
    write_users(s)
    write_rows(s, "stage.events", make_events(50, distinct_pos=50))
    defs = build_definitions(s)
    sensor = build_planner_sensor(s, load_lineage(s.lineage), retention=2)
    name = partitions_name("fact.events")
    store = open_offset_store(s.offsets_url)
    store.init("fact.events", Position.zero(), "step", who="test")
    store.acquire("fact.events", "test")
    last = Position.zero()
    for seq in (1, 2, 3):  # three committed blocks before the data's first row
        nxt = Position(T0 - dt.timedelta(seconds=4 - seq), seq)
        store.plan("fact.events", "test", last=last, next=nxt, seq=seq, source_version=None)
        store.commit("fact.events", "test", seq=seq, last=last, next=nxt, rows=0)
        last = nxt
    store.release("fact.events", "test")
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        instance.add_dynamic_partitions(name, ["00000001", "00000002", "00000003"])
        data = _tick(sensor, instance, defs)
        assert [r.partition_key for r in data.run_requests] == ["00000004"]
        deletes = [r for r in data.dynamic_partitions_requests if isinstance(r, dg.DeleteDynamicPartitionsRequest)]
        assert [list(d.partition_keys) for d in deletes] == [["00000001", "00000002"]]  # keeps 3 and the new 4


@pytest.mark.spark
def test_a_failed_blocking_check_holds_back_downstream_topics(spark, settings, tmp_path, dagster_storage):
    down = """
      - table: fact.down
        depends_on: [fact.events]
        transforms: [../sql/down.sql]
    """
    (tmp_path / "sql").mkdir(exist_ok=True)
    (tmp_path / "sql" / "down.sql").write_text("SELECT pos, id, country FROM block")
    s = settings.with_(lineage=write_lineage(tmp_path, maxstep=100, extra_topic=down))
    yaml_path = s.lineage / "events.yaml"
    text = yaml_path.read_text().replace(
        "    after: ''\n", "    after: ''\n    checks: {max_null_share: {country: 0.05}, blocking: true}\n", 1)
    yaml_path.write_text(text)
    defs = build_definitions(s)
    write_users(s, n=10)  # most users have no country: the blocking nulls check fails
    write_rows(s, "stage.events", make_events(60, distinct_pos=60))
    sensor = defs.get_sensor_def("tidemark_planner")
    asset = defs.resolve_assets_def(dg.AssetKey(["fact", "events"]))
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        first = _tick(sensor, instance, defs)
        assert [r.job_name for r in first.run_requests] == ["tidemark__fact__events"]
        instance.add_dynamic_partitions(partitions_name("fact.events"), ["00000001"])
        result = dg.materialize([asset], partition_key="00000001", instance=instance, raise_on_error=False)
        assert any(not e.passed for e in result.get_asset_check_evaluations())
        data = _tick(sensor, instance, defs)
        assert not [r for r in data.run_requests if r.job_name == "tidemark__fact__down"]
        assert "fact.down: blocked by a failed blocking check of fact.events (check 'nulls' failed)" in data.skip_message


def test_the_planner_plans_when_a_table_or_a_delay_says_so_and_otherwise_only_looks(settings, tmp_path, dagster_storage):
    import time

    s, defs = _defs(settings, tmp_path, maxstep=30, delay="3s")
    write_users(s)
    sensor = defs.get_sensor_def("tidemark_planner")
    assert sensor.minimum_interval_seconds == 5
    cursor: list[str | None] = [None]

    def tick():
        ctx = dg.build_sensor_context(instance=instance, instance_ref=instance.get_ref(), definitions=defs, cursor=cursor[0])
        data = sensor.evaluate_tick(ctx)
        cursor[0] = data.cursor or cursor[0]
        for req in data.dynamic_partitions_requests or []:
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        return data

    with dg.instance_for_test(overrides=dagster_storage) as instance:
        first = tick()
        assert not first.run_requests and "fact.events: stage.events does not exist" in first.skip_message
        settle = tick()  # plans once more: the first planning wrote to the offset log (the topic's init)
        assert "fact.events: stage.events does not exist" in settle.skip_message
        quiet = tick()  # nothing changed: a look, no planning, and the last planning's reasons
        assert not quiet.run_requests
        assert quiet.skip_message.startswith("nothing changed since the planning at ")
        assert "it found: fact.events: stage.events does not exist" in quiet.skip_message

        # Rows land in the base (as a user's job or a replica would write them), all too fresh for the delay.
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
        rows = make_events(10, start=now - dt.timedelta(hours=2), distinct_pos=10)
        write_rows(s, "stage.events", [{**r, "pos": now} for r in rows])
        changed = tick()
        assert not changed.run_requests and "fact.events: delay 3s: newest eligible row at" in changed.skip_message
        assert tick().skip_message.startswith("nothing changed since")
        time.sleep(max(0.0, 4.5 - (dt.datetime.now(dt.UTC).replace(tzinfo=None) - now).total_seconds()))
        due = tick()  # the delay the change started has passed: planned without waiting for the full interval
        (req,) = due.run_requests
        assert req.run_key == "fact.events@1#1"


def test_a_table_the_planner_cannot_look_at_holds_back_only_its_own_topics(settings, tmp_path, dagster_storage):
    s, _ = _defs(settings, tmp_path, maxstep=30)
    (tmp_path / "lineage" / "remote.yaml").write_text(
        "sources:\n  - table: stage.remote\n    path: zz://bucket/remote\n"
        "topics:\n  - table: fact.remote\n    depends_on: [stage.remote]\n    transforms: [../sql/fact_events.sql]\n")
    defs = build_definitions(s)
    write_users(s)
    write_rows(s, "stage.events", make_events(50, distinct_pos=50))
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        data = _tick(defs.get_sensor_def("tidemark_planner"), instance, defs)
    assert [r.run_key for r in data.run_requests] == ["fact.events@1#1"]  # the rest of the lineage goes on


def test_a_failed_reload_is_retried_with_a_new_run_key(settings, tmp_path, dagster_storage):
    from platform_assets.dagster.sensors import BLOCK_TAG

    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "users_copy.sql").write_text("SELECT * FROM block\n")
    s, defs = _defs(settings, tmp_path, extra_topic="""
        - table: dim.users_copy
          depends_on: [dim.users]
          processor: reload
          transforms: [../sql/users_copy.sql]
        """)
    write_users(s)
    sensor = defs.get_sensor_def("tidemark_planner")
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        first = _tick(sensor, instance, defs)
        [req] = [r for r in first.run_requests if r.tags["tidemark/topic"] == "dim.users_copy"]
        assert req.run_key == "dim.users_copy@1:reload#1" and req.tags["dagster/priority"] == "0"
        instance.add_run(dg.DagsterRun(job_name=req.job_name, run_id=str(uuid.uuid4()), status=S.FAILURE,
                                       tags=dict(req.tags)))
        # (A run added this way has no end time, so no backoff applies.) The retry gets a run key
        # of its own: the daemon never launches a run key it has seen, so the old key never ran again.
        again = _tick(sensor, instance, defs)
        [retry] = [r for r in again.run_requests if r.tags["tidemark/topic"] == "dim.users_copy"]
        assert retry.run_key == "dim.users_copy@1:reload#2" and retry.tags[BLOCK_TAG] == "dim.users_copy@1:reload"
