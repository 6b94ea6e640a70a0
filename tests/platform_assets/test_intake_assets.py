"""The event intake in Dagster: destination and stage-table assets, the intake job run in-process
on a real instance over real files and Delta tables, the failed_share check and the sensor."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import dagster as dg
from deltalake import DeltaTable

from lineage.intake.config import load_intake
from lineage.spec.loader import load_lineage
from platform_assets.core import locks
from platform_assets.dagster.definitions import build_definitions
from platform_assets.dagster.intake import (
    CHECK_NAME,
    JOB_NAME,
    SENSOR_NAME,
    destination_key,
    processor_busy,
    produced_sources,
    template_prefix,
)
from resources.core.settings import Settings
from resources.intake import event_store as store
from tests.platform_assets.test_events import T0, write_file

INTAKE = """\
tokens:
  - {id: web, kind: browser, secret_env: T_WEB}
destinations:
  - id: main
    table_name_template: "events_{{ event_type }}"
    failed_share_threshold: 0.2
"""
LINEAGE = """\
sources:
  - table: stage.events_pv
  - table: stage.orders
topics:
  - table: fact.pv
    depends_on: [stage.events_pv]
    transforms: [pv.sql]
"""


def _setup(tmp_path: Path, monkeypatch, settings: Settings) -> tuple[Settings, dg.Definitions]:
    lineage = tmp_path / "lineage"
    lineage.mkdir()
    (lineage / "x.yaml").write_text(LINEAGE)
    (lineage / "pv.sql").write_text("SELECT pos, id, url FROM block")
    (tmp_path / "intake.yaml").write_text(INTAKE)
    monkeypatch.setenv("TIDEMARK_INTAKE", str(tmp_path / "intake.yaml"))
    s = settings.with_(lineage=lineage)
    return s, build_definitions(s)


def test_template_prefix_and_the_sources_a_destination_writes(tmp_path: Path):
    assert template_prefix("events_{{ event_type }}") == "events_"
    assert template_prefix("  Web Events {{ x }}") == "web_events_"
    assert template_prefix("{{ t }}") == ""
    (tmp_path / "x.yaml").write_text(LINEAGE)
    (tmp_path / "pv.sql").write_text("SELECT * FROM block")
    (tmp_path.parent / "i.yaml").write_text(INTAKE)
    spec = load_intake(tmp_path.parent / "i.yaml", secrets=False).spec.destinations[0]
    assert produced_sources(spec, load_lineage(tmp_path)) == ["stage.events_pv"]  # not stage.orders


def test_intake_assets_job_check_and_sensor_on_a_real_instance(tmp_path: Path, monkeypatch, settings: Settings,
                                                                dagster_storage):
    s, defs = _setup(tmp_path, monkeypatch, settings)
    graph = defs.resolve_asset_graph()
    pv = dg.AssetKey(["stage", "events_pv"])
    assert graph.get(pv).is_materializable and graph.get(destination_key("main")).is_materializable
    assert not graph.get(dg.AssetKey(["stage", "orders"])).is_materializable  # still an external source
    assert destination_key("main") in graph.get(pv).parent_keys
    assert pv in graph.get(dg.AssetKey(["fact", "pv"])).parent_keys
    assert {k.name for k in graph.asset_check_keys if k.asset_key == destination_key("main")} == {CHECK_NAME}
    dg.Definitions.validate_loadable(defs)
    sensor = defs.resolve_sensor_def(SENSOR_NAME)
    job = defs.resolve_job_def(JOB_NAME)

    with dg.instance_for_test(overrides=dagster_storage) as instance:
        def tick():
            return sensor.evaluate_tick(dg.build_sensor_context(instance=instance, definitions=defs))

        assert "no rotated files" in (tick().skip_message or "")
        write_file(s, "web", T0, [{"event_type": "pv", "url": "/a"}, {"event_type": "pv", "url": "/b", "n": 1},
                                  {"event_type": "cart", "sku": "x"}])
        write_file(s, "web", T0 + dt.timedelta(seconds=1), [{"event_type": "pv", "URL": "/d", "url": "/e"}])
        (req,) = tick().run_requests
        assert req.run_key.startswith("intake:") and tick().run_requests[0].run_key == req.run_key
        # a CLI processor runs (it holds the intake's lock in the offset store): the sensor waits for it
        with locks.holding_in(s, locks.INTAKE_BATCH, processor="intake", note="a CLI processor"):
            assert processor_busy(s) and "processor is running" in (tick().skip_message or "")
        assert not processor_busy(s)

        result = job.execute_in_process(instance=instance, tags=dict(req.tags))
        assert result.success
        mats = {e.asset_key: {k: v.value for k, v in e.step_materialization_data.materialization.metadata.items()}
                for e in result.get_asset_materialization_events()}
        main = mats[destination_key("main")]
        assert main["events_in"] == 4 and main["written"] == 4 and main["files"] == 2  # two files, one unit
        assert main["tables"] == {"stage.events_cart": 1, "stage.events_pv": 3}
        assert main["collided"] == 1 and mats[pv]["collided"] == 1  # URL and url: one column, /URL unmapped
        assert mats[pv]["written"] == 3 and mats[pv]["columns_added"] == 6
        assert sorted(mats[pv]["columns"]) == ["_timestamp", "_unmapped_data", "api_key", "event_type", "n", "url"]
        (check,) = result.get_asset_check_evaluations()
        assert check.passed and check.check_name == CHECK_NAME
        assert len(DeltaTable(s.table_path("stage.events_pv")).to_pyarrow_table()) == 3
        assert "no rotated files" in (tick().skip_message or "")

        # a second file where half the events fail their template: the check fails (threshold 20 %)
        write_file(s, "web", T0 + dt.timedelta(minutes=5), [{"event_type": "pv", "url": "/c"}, {"url": "/no-type"}])
        (req2,) = tick().run_requests
        assert req2.run_key != req.run_key
        result = job.execute_in_process(instance=instance)
        (check,) = result.get_asset_check_evaluations()
        assert not check.passed and "1 of 2 events failed" in (check.description or "")
        assert pv in {e.asset_key for e in result.get_asset_materialization_events()}
        failed = store.read_failed_events(s.table_path(store.FAILED_EVENTS))
        assert len(failed) == 1 and "table_name_template" in failed[0]["error"]
