"""Continuous mode in Dagster (issue 55): the ``tidemark_follow`` job runs the follower in one run and
reports every unit as its run would (the block's partition, metadata, check evaluations); the
planner sensor leaves the lineage to a live follow run and takes it back when the run ends; the
``tidemark_follow`` sensor keeps one run alive in follow mode; the alert sensor alerts on a followed
unit's failed check while the run still runs."""

from __future__ import annotations

import datetime as dt

import dagster as dg
import pytest
from deltalake import DeltaTable

from lineage.core.checks import CHECK_NAMES
from lineage.core.errors import ConfigError
from lineage.core.partitions import partitions_name
from platform_assets.dagster.alerts import AlertCursor, scan_incidents
from platform_assets.dagster.definitions import build_definitions
from platform_assets.dagster.follow import restart_wait
from platform_assets.dagster.followed import FOLLOW_JOB, follow_run, mode_setting
from tests.platform_assets.shop import make_events, write_lineage, write_rows, write_users

S = dg.DagsterRunStatus
EVENTS = dg.AssetKey(["fact", "events"])


def test_the_mode_is_runs_unless_follow_is_chosen_and_a_typo_is_refused() -> None:
    assert mode_setting({}) == "runs"
    assert mode_setting({"TIDEMARK_MODE": " Follow "}) == "follow"
    with pytest.raises(ConfigError, match="TIDEMARK_MODE='folow': use runs .* or follow"):
        mode_setting({"TIDEMARK_MODE": "folow"})


def test_a_dead_follow_run_is_replaced_at_once_and_runs_that_keep_failing_back_off() -> None:
    assert restart_wait([], 1000.0) == (0.0, "")
    assert restart_wait([(S.SUCCESS, 990.0), (S.FAILURE, 900.0)], 1000.0)[0] == 0.0  # stopped by hand: again
    wait, why = restart_wait([(S.FAILURE, 995.0)], 1000.0)
    assert wait == 5.0 and "last 1 follow run(s) failed" in why  # 10 s after the end
    assert restart_wait([(S.FAILURE, 995.0), (S.CANCELED, 900.0), (S.FAILURE, 800.0)], 1000.0)[0] == 35.0  # 40 s
    assert restart_wait([(S.FAILURE, 1000.0)] * 12, 1000.0)[0] == 300.0  # at most 5 min


def _tick(sensor, instance, defs):  # noqa: ANN001, ANN202
    ctx = dg.build_sensor_context(instance=instance, instance_ref=instance.get_ref(), definitions=defs)
    return sensor.evaluate_tick(ctx)


@pytest.mark.spark
@pytest.mark.fast
def test_a_followed_block_is_its_partitions_materialization_with_its_checks_and_the_planner_waits_for_the_run(
        spark, settings, tmp_path, dagster_storage, monkeypatch) -> None:  # noqa: ANN001
    # max_lag 4h fails the lag check of the first block (rows of 2024) and passes the second's
    s = settings.with_(lineage=write_lineage(tmp_path, maxstep=30))
    spec = tmp_path / "lineage" / "events.yaml"
    spec.write_text(spec.read_text().replace("maxstep: 30", "maxstep: 30\n    checks: {max_lag: 4h}"))
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    write_users(s)
    write_rows(s, "stage.events", make_events(30, distinct_pos=30))
    write_rows(s, "stage.events", make_events(20, start_id=31, start=now - dt.timedelta(hours=3), distinct_pos=20, seed=2))
    defs = build_definitions(s)
    job = defs.get_job_def(FOLLOW_JOB)
    # The run's follower on the test's session (its own would stop the session every test of this worker shares).
    import platform_assets.follow.loop as loop

    real = loop.Follower
    monkeypatch.setattr(loop, "Follower", lambda *a, **kw: real(*a, spark=spark, **kw))
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        result = job.execute_in_process(instance=instance, run_config={
            "ops": {"follow": {"config": {"until_idle_s": 2.0, "max_seconds": 240.0}}}})
        assert result.success
        mats = instance.fetch_materializations(EVENTS, limit=10).records
        blocks = sorted((m.partition_key, m.asset_materialization.metadata["base_rows"].value) for m in mats)
        assert blocks == [("00000001", 30), ("00000002", 20)]
        written = sum(m.asset_materialization.metadata["rows"].value for m in mats)
        assert all(m.run_id == result.run_id for m in mats)
        assert sorted(instance.get_dynamic_partitions(partitions_name("fact.events"))) == ["00000001", "00000002"]
        meta = mats[0].asset_materialization.metadata
        assert {"topic", "block", "last", "next", "delta_version", "duration_s"} <= set(meta)
        assert "lag" in CHECK_NAMES
        history = instance.event_log_storage.get_asset_check_execution_history(dg.AssetCheckKey(EVENTS, "lag"), limit=5)
        verdicts = sorted((h.evaluation.partition, h.evaluation.passed) for h in history)
        assert verdicts == [("00000001", False), ("00000002", True)]
        assert DeltaTable(s.table_path("fact.events")).to_pyarrow_table().num_rows == written > 0

        # While a follow run lives, the planner leaves the lineage to it; once it ends, it plans again.
        write_rows(s, "stage.events", make_events(5, start_id=1000, start=now - dt.timedelta(minutes=119), distinct_pos=5,
                                                  seed=7))
        live = instance.create_run_for_job(job_def=job, run_config={"ops": {"follow": {"config": {}}}})
        instance.handle_run_event(live.run_id, dg.DagsterEvent(event_type_value="PIPELINE_START", job_name=FOLLOW_JOB))
        assert follow_run(instance).run_id == live.run_id
        planner = defs.get_sensor_def("tidemark_planner")
        held = _tick(planner, instance, defs)
        assert not held.run_requests and f"run {live.run_id} of tidemark_follow runs every unit" in held.skip_message
        keeper = defs.get_sensor_def("tidemark_follow")
        monkeypatch.setenv("TIDEMARK_MODE", "follow")
        assert f"run {live.run_id} follows the lineage" in _tick(keeper, instance, defs).skip_message
        # the alert sensor reads a live follow run's failed checks (the execute_in_process run ended:
        # its failed lag check is alerted as an ended run's, once, with the block's partition)
        scan = scan_incidents(instance, AlertCursor(since=0.0))
        failed = [a for a in scan.alerts if a.kind == "check_failure"]
        assert [(a.details["check"], a.details["partition"]) for a in failed] == [("lag", "00000001")]
        instance.report_run_failed(live)
        planned = _tick(planner, instance, defs)
        assert [r.partition_key for r in planned.run_requests] == ["00000003"]
        restart = _tick(keeper, instance, defs)  # the dead run is replaced after its backoff
        assert not restart.run_requests and "the last 1 follow run(s) failed" in restart.skip_message
        monkeypatch.setenv("TIDEMARK_MODE", "runs")
        assert "TIDEMARK_MODE=runs" in _tick(keeper, instance, defs).skip_message
    assert spark.range(3).count() == 3  # the shared session outlives the follow run


def test_a_followed_replicator_and_intake_unit_are_reported_as_their_runs_report_them(settings) -> None:  # noqa: ANN001
    """The reporter's other two kinds, without Spark: a replicator's unit is a materialization of each
    replica it touched with its state and lag checks; the intake's units are the destination's figures
    with its failed_share check, then each stage table that got rows."""
    from pathlib import Path

    from lineage.intake.config import load_intake
    from lineage.spec.loader import load_lineage
    from platform_assets.cdc.units import CdcResult
    from platform_assets.dagster.follow import FollowReporter
    from platform_assets.follow.loop import Event, IntakeUnits
    from platform_assets.intake.batch import UnitResult

    root = Path(__file__).resolve().parents[2] / "demo"
    lineage = load_lineage(root / "lineage")
    intake = load_intake(root / "intake.yaml", secrets=False)

    class Store:
        def get(self, topic: str) -> None:
            return None

    lines: list[str] = []

    class Log:
        def info(self, text: str) -> None:
            lines.append(text)

    with dg.instance_for_test() as instance:
        reporter = FollowReporter(settings, lineage, instance, Log(), intake)
        reporter._store = Store()
        cdc = reporter.events(Event("cdc:crm", result=CdcResult(replicator="crm", unit=3, reason="unit 3: 2 changes",
                                                                tables={"crm.customers": {"inserts": 2}}, lag_s=1.5)))
        assert [type(e).__name__ for e in cdc] == ["AssetMaterialization", "AssetCheckEvaluation", "AssetCheckEvaluation"]
        assert cdc[0].asset_key == dg.AssetKey(["crm", "customers"]) and cdc[0].metadata["inserts"].value == 2
        assert [(e.check_name, e.passed) for e in cdc[1:]] == [("state", True), ("lag", True)]
        unit = UnitResult(unit="u1", events_in=4, written=3, failed=1, failed_by_dest={"stage": 1},
                          tables={"stage:stage.events_page_view": {"rows": 3}})
        for _ in range(2):  # the destinations' tables are found once, then kept
            got = reporter.events(Event("events", result=IntakeUnits([unit])))
            keys = [e.asset_key.to_user_string() for e in got if isinstance(e, dg.AssetMaterialization)]
            assert keys == ["intake/stage", "stage/events_page_view"]
            (check,) = [e for e in got if isinstance(e, dg.AssetCheckEvaluation)]
            assert check.check_name == "failed_share" and check.metadata["failed_share"].value == 0.25
        assert "events: 1 unit(s), 1 file(s): 4 events in, 3 rows written, 1 failed" in lines
