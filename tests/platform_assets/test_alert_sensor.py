"""The alert sensor on real Dagster machinery: a temporary Dagster instance, runs that really
fail, asset checks that really do not pass, and a real local HTTP receiver for the webhook."""

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from platform_assets.dagster.alerts import (
    RESOURCE_KEY,
    SENSOR_NAME,
    AlertCursor,
    AlertNotifierResource,
    build_alert_sensor,
    scan_incidents,
)
from resources.core.alerts import DEFAULT_WEBHOOK_ENV
from tests.resources.test_alerts import Receiver

ROOT = Path(__file__).resolve().parents[2]

blocks = dg.DynamicPartitionsDefinition(name="tidemark_blocks")


@dg.asset(key=["fact", "orders"], partitions_def=blocks)
def fact_orders(context: dg.AssetExecutionContext) -> None:
    raise RuntimeError(f"block {context.partition_key} failed: disk full")


@dg.asset(key=["fact", "order_items"])
def fact_order_items() -> int:
    return 1


@dg.asset_check(asset=fact_order_items, blocking=False, description="no bad rows in the block")
def rows_ok() -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN, description="5 bad rows quarantined",
                               metadata={"bad_rows": 5, "topic": "fact.order_items", "nulls": {"pos": 2}})


@dg.asset_check(asset=fact_order_items, blocking=False)
def lag_ok() -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=True, metadata={"max_lag_s": 1.0})


@dg.asset_check(asset=fact_order_items, blocking=False)
def seq_ok() -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR, description="seq went backwards")


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[dg.DagsterInstance]:
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as inst:
        yield inst


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    r = Receiver()
    monkeypatch.setenv(DEFAULT_WEBHOOK_ENV, r.url)
    yield r
    r.stop()


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "home" / "alerts.log"


def fail_block(instance: dg.DagsterInstance, block: str) -> str:
    instance.add_dynamic_partitions("tidemark_blocks", [block])
    result = dg.materialize([fact_orders], instance=instance, partition_key=block, raise_on_error=False)
    assert not result.success
    return result.run_id


def check_items(instance: dg.DagsterInstance, *checks: dg.AssetChecksDefinition) -> str:
    result = dg.materialize([fact_order_items, *checks], instance=instance, raise_on_error=False)
    assert result.success  # non-blocking checks that fail do not fail the run
    return result.run_id


def tick(instance: dg.DagsterInstance, log_path: Path, cursor: str | None = None,
         sensor: dg.SensorDefinition | None = None) -> dg.SensorResult:
    sensor = sensor or build_alert_sensor()
    context = dg.build_sensor_context(instance=instance, cursor=cursor,
                                      resources={RESOURCE_KEY: AlertNotifierResource(log_path=str(log_path))})
    result = sensor(context)
    assert isinstance(result, dg.SensorResult) and not result.run_requests
    return result


def message(result: dg.SensorResult) -> str:
    assert result.skip_reason is not None and result.skip_reason.skip_message is not None
    return result.skip_reason.skip_message


def logged(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []


def test_one_alert_per_incident_across_ticks_and_a_restart(instance, receiver, log_path):
    failed_run = fail_block(instance, "fact.orders#3")
    checked_run = check_items(instance, rows_ok, lag_ok)

    first = tick(instance, log_path)
    by_kind = {b["kind"]: b for b in receiver.bodies()}
    assert len(receiver.posts) == 2 and set(by_kind) == {"run_failure", "check_failure"}

    run = by_kind["run_failure"]
    assert run["key"] == f"run:{failed_run}"
    assert run["title"] == "Run failed: fact/orders [fact.orders#3]: RuntimeError: block fact.orders#3 failed: disk full"
    d = run["details"]
    assert (d["run_id"], d["assets"], d["partition"], d["failure_reason"], d["failed_step"]) == (
        failed_run, ["fact/orders"], "fact.orders#3", "STEP_FAILURE", "fact__orders")
    assert d["error"] == "RuntimeError: block fact.orders#3 failed: disk full"

    check = by_kind["check_failure"]
    assert check["key"] == f"check:fact/order_items:rows_ok:-:{checked_run}"
    assert check["title"] == "Check rows_ok failed (WARN) on fact/order_items: 5 bad rows quarantined"
    assert check["details"] == {
        "asset": "fact/order_items", "check": "rows_ok", "severity": "WARN", "passed": False, "blocking": False,
        "partition": None, "description": "5 bad rows quarantined", "run_id": checked_run,
        "job": "__ephemeral_asset_job__", "url": None,
        "metadata": {"bad_rows": 5, "topic": "fact.order_items", "nulls": {"pos": 2}},
    }
    assert logged(log_path) == receiver.bodies()  # the log file has the same alerts, one per line

    # later ticks carry the cursor on and send nothing again
    second = tick(instance, log_path, first.cursor)
    third = tick(instance, log_path, second.cursor)
    assert len(receiver.posts) == 2 and third.cursor == first.cursor
    assert "0 new alert(s)" in message(third)

    # a new incident is sent once
    another = fail_block(instance, "fact.orders#4")
    fourth = tick(instance, log_path, third.cursor)
    assert [b["key"] for b in receiver.bodies()[2:]] == [f"run:{another}"]
    assert "1 new alert(s)" in message(fourth)
    tick(instance, log_path, fourth.cursor)
    assert len(receiver.posts) == 3

    # a restart: a new sensor with no cursor sees the same incidents, but the alert log remembers them
    restarted = tick(instance, log_path, None, sensor=build_alert_sensor())
    assert "0 new alert(s), 3 duplicate(s) skipped" in message(restarted)
    assert len(receiver.posts) == 3
    assert [x["key"] for x in logged(log_path)] == [b["key"] for b in receiver.bodies()]
    assert len({x["key"] for x in logged(log_path)}) == 3


def test_webhook_down_the_log_file_still_gets_the_alert_and_the_failure_is_reported(
        instance, receiver, log_path, monkeypatch, caplog):
    receiver.stop()
    run_id = fail_block(instance, "fact.orders#7")
    with caplog.at_level(logging.ERROR, logger="tidemark.alerts"):
        result = tick(instance, log_path)
    assert receiver.posts == []
    assert [(x["kind"], x["key"]) for x in logged(log_path)] == [("run_failure", f"run:{run_id}")]
    said = message(result)
    assert "1 new alert(s)" in said and "webhook delivery(ies) not done: cannot connect" in said
    assert f"alert webhook failed: 'run:{run_id}' was not delivered" in caplog.text

    # the webhook comes back: the pending alert is delivered once, the log file is not repeated
    back = Receiver()
    monkeypatch.setenv(DEFAULT_WEBHOOK_ENV, back.url)
    try:
        again = tick(instance, log_path, result.cursor)
        tick(instance, log_path, again.cursor)
        tick(instance, log_path, None)
        assert [b["key"] for b in back.bodies()] == [f"run:{run_id}"]
    finally:
        back.stop()
    assert len(logged(log_path)) == 1


def test_ticks_are_bounded_and_the_cursor_moves_in_order(instance, receiver, log_path):
    runs = [fail_block(instance, f"fact.orders#{i}") for i in range(3)]
    sensor = build_alert_sensor(max_runs_per_tick=1)
    cursor = None
    posts_after_tick = []
    for _ in range(4):
        cursor = tick(instance, log_path, cursor, sensor=sensor).cursor
        posts_after_tick.append(len(receiver.posts))
    assert posts_after_tick == [1, 2, 3, 3]  # one run per tick, in the order the runs ended
    assert [b["key"] for b in receiver.bodies()] == [f"run:{r}" for r in runs]
    assert json.loads(cursor or "")["runs"].keys() == {"RUN_FAILURE"}


def test_minimum_check_severity(instance, receiver, log_path):
    run_id = check_items(instance, rows_ok, seq_ok, lag_ok)
    tick(instance, log_path, sensor=build_alert_sensor(min_check_severity="ERROR"))
    [body] = receiver.bodies()
    assert body["key"] == f"check:fact/order_items:seq_ok:-:{run_id}"
    assert (body["details"]["severity"], body["details"]["description"]) == ("ERROR", "seq went backwards")
    with pytest.raises(ValueError):
        build_alert_sensor(min_check_severity="FATAL")


def test_check_results_reported_outside_a_run_are_alerted(instance, receiver, log_path):
    instance.report_runless_asset_event(dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey(["fact", "orders"]), check_name="freshness", passed=False,
        severity=dg.AssetCheckSeverity.WARN, partition=None, metadata={"lag_s": 7200}))
    first = tick(instance, log_path)
    [body] = receiver.bodies()
    assert body["key"].startswith("check:fact/orders:freshness:-:runless#")
    assert body["details"]["metadata"] == {"lag_s": 7200} and body["details"]["run_id"] is None
    tick(instance, log_path, first.cursor)
    assert len(receiver.posts) == 1


def test_the_first_tick_looks_back_only_lookback_seconds(instance):
    fail_block(instance, "fact.orders#1")
    now = time.time()
    assert scan_incidents(instance, AlertCursor.parse(None, now=now + 3600, lookback_s=60)).alerts == []
    [found] = scan_incidents(instance, AlertCursor.parse(None, now=now, lookback_s=60)).alerts
    assert found.kind == "run_failure"
    # an unreadable cursor is replaced by a fresh one instead of breaking every tick
    assert AlertCursor.parse("not json", now=now, lookback_s=60).since == now - 60


def test_an_unwritable_alert_log_fails_the_tick(instance, receiver, tmp_path):
    fail_block(instance, "fact.orders#9")
    (tmp_path / "dir.log").mkdir()
    with pytest.raises(Exception, match="directory"):
        tick(instance, tmp_path / "dir.log")
    assert receiver.posts == []


def test_definitions_wiring_and_resource_descriptions(instance, receiver, log_path):
    defs = dg.Definitions(sensors=[build_alert_sensor(dagster_ui_url="http://dagster:3000/")],
                          resources={RESOURCE_KEY: AlertNotifierResource(log_path=str(log_path))})
    dg.Definitions.validate_loadable(defs)
    sensor = defs.resolve_sensor_def(SENSOR_NAME)
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
    assert sensor.minimum_interval_seconds == 30
    assert sensor.required_resource_keys == {RESOURCE_KEY}
    run_id = fail_block(instance, "fact.orders#5")
    # as the code server does: the sensor gets the top-level resources it requires
    top_level = defs.get_repository_def().get_top_level_resources()
    result = sensor(dg.build_sensor_context(instance=instance, definitions=defs,
                                            resources={k: top_level[k] for k in sensor.required_resource_keys}))
    assert isinstance(result, dg.SensorResult)
    assert "1 new alert(s)" in message(result)
    assert receiver.bodies()[0]["details"]["url"] == f"http://dagster:3000/runs/{run_id}"
    for name, info in AlertNotifierResource.model_fields.items():
        assert info.description and len(info.description) > 20, name


def test_module_import_is_light():
    out = subprocess.run([sys.executable, "-c", "import sys, platform_assets.dagster.alerts as a; "
                          "print(a.build_alert_sensor().name, 'pyspark' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["tidemark_alerts", "False"]
