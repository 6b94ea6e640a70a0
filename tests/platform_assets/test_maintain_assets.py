"""Table maintenance in Dagster (no Spark): the tidemark_maintain job run in-process over a
warehouse written with deltalake, its schedule, the table_health check, the health metadata of a
unit and the retention warnings of ``tidemark lag``."""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from lineage.core.checks import HEALTH_CHECK
from lineage.core.errors import ConfigError
from lineage.core.positions import Position
from lineage.spec.loader import load_lineage
from platform_assets.dagster.definitions import build_definitions
from platform_assets.dagster.io_manager import table_health
from platform_assets.dagster.maintenance import (
    CHECKS_NAME,
    JOB_NAME,
    SCHEDULE_NAME,
    MaintainConfig,
    health_verdict,
    maintain_cron,
)
from platform_assets.engine.runner import Engine
from resources.core.settings import Settings
from resources.state.offset_sql import open_offset_store
from resources.state.offsets import LogRetention
from resources.storage import maintenance
from tests.platform_assets.shop import T0, make_events, write_lineage, write_rows

FACT = dg.AssetKey(["fact", "events"])


def _appends(path: str, n: int, *, configuration: dict[str, str] | None = None) -> None:
    """``n`` one-row appends: ``n`` small files, ``n`` commits (versions 0 .. n-1)."""
    for i in range(n):
        write_deltalake(path, pa.table({"id": pa.array([i], pa.int64())}), mode="append",
                        configuration=configuration if i == 0 else None)


def _unwritable(path: str, n: int) -> None:
    """A table deltalake reads but may not write: its protocol requires a writer feature nobody knows."""
    _appends(path, n)
    first = Path(path) / "_delta_log" / f"{0:020}.json"
    actions = [json.loads(line) for line in first.read_text().splitlines()]
    for a in actions:
        if "protocol" in a:
            a["protocol"] = {"minReaderVersion": 1, "minWriterVersion": 7, "writerFeatures": ["tidemarkTestUnknown"]}
    first.write_text("".join(json.dumps(a) + "\n" for a in actions))


def _committed_block(s: Settings, *, source_version: int, delta_version: int | None) -> None:
    """fact.events's offsets after one committed block that read stage.events at ``source_version``
    and landed as ``delta_version`` of fact.events."""
    store = open_offset_store(s.offsets_url)
    store.init("fact.events", Position.zero(), "step", who="test")
    store.acquire("fact.events", "test")
    nxt = Position(T0, 1)
    store.plan("fact.events", "test", last=Position.zero(), next=nxt, seq=1, source_version=source_version)
    store.commit("fact.events", "test", seq=1, last=Position.zero(), next=nxt, rows=1, delta_version=delta_version)
    store.release("fact.events", "test")
    store.close()


def _sections(markdown: str) -> dict[str, list[str]]:
    """The maintenance report's lines per table (``**table**: first line`` then ``- line``s)."""
    out: dict[str, list[str]] = {}
    table = ""
    for line in markdown.splitlines():
        if line.startswith("**"):
            table, _, first = line[2:].partition("**: ")
            out[table] = [first]
        elif line.startswith("- "):
            out[table].append(line[2:])
    return out


def _files(path: str) -> int:
    return len(DeltaTable(path).file_uris())


def test_health_verdict_warns_on_small_files_and_passes_after_maintenance(tmp_path: Path):
    path = str(tmp_path / "fact" / "events")
    _appends(path, 20)
    h = maintenance.health("fact.events", path)
    passed, description, meta = health_verdict(h)
    assert not passed and description == "needs maintenance: " + "; ".join(h.reasons())
    assert description.startswith("needs maintenance: 20 small files") and "commits since the last checkpoint" in description
    assert meta["small_files"] == 20 and meta["maintenance"].startswith("20 small files")
    maintenance.maintain(h)
    passed, description, meta = health_verdict(maintenance.health("fact.events", path))
    assert passed and description == "ok: 1 files (1 small), 0 commits since the last checkpoint"
    assert meta["files"] == 1 and meta["maintenance"] == "ok" and "warnings" not in meta
    # a maintenance that failed is said, the verdict stays the table's health
    passed, description, _ = health_verdict(maintenance.health("fact.events", path), "MaintenanceError: boom")
    assert passed and description.endswith("(maintenance failed: MaintenanceError: boom)")
    passed, description, _ = health_verdict(None, "OSError: gone")
    assert not passed and description == "the table's health could not be read: OSError: gone"


def test_health_verdict_warns_when_the_retention_would_remove_what_a_consumer_needs(tmp_path: Path):
    path = str(tmp_path / "stage" / "events")
    _appends(path, 3, configuration={"delta.deletedFileRetentionDuration": "interval 1 hours"})
    h = maintenance.health("stage.events", path, [maintenance.Need(0, "fact.events", "late-row check")])
    passed, description, meta = health_verdict(h)
    assert h.warnings and not h.reasons()
    assert not passed and description == "needs maintenance: " + h.warnings[0]
    assert "v0 for fact.events" in meta["warnings"].value and "late-row check" in meta["warnings"].value


def test_the_maintenance_job_compacts_reports_each_table_and_evaluates_table_health(
        settings: Settings, tmp_path: Path, dagster_storage, monkeypatch):
    monkeypatch.delenv("TIDEMARK_MAINTAIN_CRON", raising=False)
    s = settings.with_(lineage=write_lineage(tmp_path))
    for i in range(20):  # the base: 20 small files
        write_rows(s, "stage.events", make_events(1, start_id=i + 1, seed=i))
    _appends(s.table_path("fact.events"), 18)  # the destination, as 18 blocks would leave it
    _unwritable(s.table_path("stage.broken"), 16)
    _committed_block(s, source_version=5, delta_version=16)
    store = open_offset_store(s.offsets_url)  # a quiet topic's history from 40 days ago: three entries may go
    store.clock = lambda: dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(days=40)
    store.init("old.topic", Position.zero(), "step", who="test")
    for _ in range(3):
        store.unlock("old.topic", who="test")
    store.close()
    monkeypatch.setenv("TIDEMARK_OFFSET_LOG_KEEP", "1")
    monkeypatch.delenv("TIDEMARK_OFFSET_LOG_RETENTION", raising=False)
    defs = build_definitions(s)
    job = defs.resolve_job_def(JOB_NAME)

    def check_of(result: dg.ExecuteInProcessResult) -> dg.AssetCheckEvaluation:
        (evaluation,) = [e for e in result.get_asset_check_evaluations() if e.asset_key == FACT]
        assert evaluation.check_name == HEALTH_CHECK and evaluation.severity == dg.AssetCheckSeverity.WARN
        return evaluation

    with dg.instance_for_test(overrides=dagster_storage) as instance:
        # A dry run changes nothing: the check warns with what the table needs.
        dry = job.execute_in_process(instance=instance, raise_on_error=False, run_config=dg.RunConfig(
            {"tidemark_maintenance": MaintainConfig(dry_run=True)}))
        assert dry.success
        warned = check_of(dry)
        assert not warned.passed
        assert warned.description.startswith("needs maintenance: 18 small files (compaction from 16)")
        (mat,) = dry.asset_materializations_for_node("tidemark_maintenance")
        meta = {k: v.value for k, v in mat.metadata.items()}
        assert meta["dry_run"] is True and meta["failed"] == 0 and meta["small_files_compacted"] == 18 + 20 + 16
        assert meta["offset_log_entries_removed"] == 3
        report = _sections(meta["report"])
        assert report["fact.events"][0] == "v17: 18 files, 18 small" and "would compact: 18 files" in report["fact.events"][1]
        assert set(report) >= {"fact.events", "stage.events", "stage.broken"}
        assert _files(s.table_path("fact.events")) == 18 and _files(s.table_path("stage.events")) == 20

        # The real run: stage.broken fails, every other table is maintained, the run fails naming it.
        real = job.execute_in_process(instance=instance, raise_on_error=False)
        assert not real.success
        (failure,) = real.get_step_failure_events()
        user = failure.step_failure_data.user_failure_data
        assert user.description == "1 table(s) failed: stage.broken (the others were maintained)"
        assert "stage.broken" in user.metadata["errors"].value
        assert user.metadata["small_files_compacted"].value == 18 + 20
        assert user.metadata["offset_log_entries_removed"].value == 3  # pruned although a table failed
        report = _sections(user.metadata["report"].value)
        assert report["stage.broken"] == ["FAILED: " + user.metadata["errors"].value["stage.broken"]]
        # what was compacted, and what was kept for whom (the base from the version fact.events's block read)
        assert report["stage.events"][1].startswith("compacted: 20 files -> 1 file(s)")
        (kept,) = [line for line in report["stage.events"] if line.startswith("kept versions from v")]
        assert "for fact.events" in kept and int(kept.split("kept versions from v")[1].split()[0]) in (5, 6)
        assert report["fact.events"][1].startswith("compacted: 18 files -> 1 file(s)")
        assert any(line.startswith("kept versions from v16 on: v16 for fact.events") for line in report["fact.events"])
        assert _files(s.table_path("fact.events")) == 1 and _files(s.table_path("stage.events")) == 1
        passed = check_of(real)
        assert passed.passed and passed.description == "ok: 1 files (1 small), 0 commits since the last checkpoint"
        logs = "\n".join(e.user_message for e in instance.all_logs(real.run_id))
        assert "stage.events v19: 20 files, 20 small" in logs and "compacted: 20 files -> 1 file(s)" in logs
        assert "fact.events v17: 18 files, 18 small" in logs and "compacted: 18 files -> 1 file(s)" in logs
        assert "stage.broken: FAILED: MaintenanceError" in logs
        assert "offset log: 3 entries removed (entries older than 30d, each topic's newest 1 kept)" in logs
        assert [e.action for e in open_offset_store(s.offsets_url).history("old.topic")] == ["unlock"]
        latest = instance.event_log_storage.get_latest_asset_check_execution_by_key([dg.AssetCheckKey(FACT, HEALTH_CHECK)])
        assert latest[dg.AssetCheckKey(FACT, HEALTH_CHECK)].run_id == real.run_id

        # A pruning that fails is said and fails the run; the tables' report stays.
        def locked(self, store, *, dry_run=False):  # noqa: ANN001, ANN202
            raise OSError("store unreachable")

        monkeypatch.setattr(LogRetention, "prune", locked)
        again = job.execute_in_process(instance=instance, raise_on_error=False)
        (failure,) = again.get_step_failure_events()
        user = failure.step_failure_data.user_failure_data
        assert user.description == ("1 table(s) failed: stage.broken (the others were maintained); "
                                    "offset log: FAILED: OSError: store unreachable")
        assert set(user.metadata["errors"].value) == {"stage.broken", "offset log"}
        assert "fact.events" in _sections(user.metadata["report"].value)

        # The check on its own, from the table's log now (as the UI's "Execute" runs it).
        checks = dg.materialize([_checks_def(defs)], instance=instance, resources=dict(defs.resources or {}),
                                selection=dg.AssetSelection.checks(dg.AssetCheckKey(FACT, HEALTH_CHECK)))
        (alone,) = checks.get_asset_check_evaluations()
        assert alone.passed and alone.asset_key == FACT and alone.metadata["files"].value == 1

        # The schedule: hourly, running by default, skipped while a maintenance run is active.
        schedule = defs.resolve_schedule_def(SCHEDULE_NAME)
        assert schedule.cron_schedule == "0 * * * *" and schedule.default_status == dg.DefaultScheduleStatus.RUNNING
        assert schedule.job_name == JOB_NAME
        (request,) = schedule.evaluate_tick(dg.build_schedule_context(instance=instance)).run_requests
        assert request.job_name in (None, JOB_NAME)
        run = instance.add_run(dg.DagsterRun(job_name=JOB_NAME, run_id=str(uuid.uuid4()), status=dg.DagsterRunStatus.STARTED))
        data = schedule.evaluate_tick(dg.build_schedule_context(instance=instance))
        assert not data.run_requests and data.skip_message == f"maintenance run {run.run_id} is still started"


def _checks_def(defs: dg.Definitions) -> dg.AssetChecksDefinition:
    (found,) = [a for a in defs.assets or [] if isinstance(a, dg.AssetChecksDefinition) and a.node_def.name == CHECKS_NAME]
    return found


def test_the_schedules_cron_comes_from_the_environment(settings: Settings, tmp_path: Path, monkeypatch):
    s = settings.with_(lineage=write_lineage(tmp_path))
    monkeypatch.setenv("TIDEMARK_MAINTAIN_CRON", "*/15 * * * *")
    assert build_definitions(s).resolve_schedule_def(SCHEDULE_NAME).cron_schedule == "*/15 * * * *"
    assert maintain_cron({}) == "0 * * * *" and maintain_cron({"TIDEMARK_MAINTAIN_CRON": " "}) == "0 * * * *"
    monkeypatch.setenv("TIDEMARK_MAINTAIN_CRON", "hourly please")
    with pytest.raises(ConfigError, match=r"TIDEMARK_MAINTAIN_CRON='hourly please' is not a cron schedule"):
        build_definitions(s)
    monkeypatch.delenv("TIDEMARK_MAINTAIN_CRON")
    monkeypatch.setenv("TIDEMARK_OFFSET_LOG_KEEP", "-3")  # the offset log's retention is checked at load too
    with pytest.raises(ConfigError, match=r"TIDEMARK_OFFSET_LOG_KEEP='-3': give how many"):
        build_definitions(s)


def test_a_units_metadata_carries_the_tables_health_and_a_failed_read_only_warns(settings: Settings, tmp_path: Path,
                                                                                 monkeypatch):
    s = settings.with_(lineage=write_lineage(tmp_path))
    _appends(s.table_path("fact.events"), 17)
    _committed_block(s, source_version=0, delta_version=16)
    eng = Engine(s, load_lineage(s.lineage))
    warnings: list[str] = []

    class Log:
        def warning(self, msg: str) -> None:
            warnings.append(msg)

    meta = table_health(eng, "fact.events", Log())
    assert meta["files"] == 17 and meta["small_files"] == 17 and meta["versions_since_checkpoint"] == 17
    assert meta["maintenance"] == "17 small files (compaction from 16)"
    assert meta["oldest_version_needed"].startswith("v16 for fact.events")
    assert table_health(eng, "fact.nothing", Log()) == {} and not warnings  # no table yet: nothing to say

    def broken(*args, **kwargs):
        raise OSError("the object store is down")

    monkeypatch.setattr(maintenance, "health", broken)
    assert table_health(eng, "fact.events", Log()) == {}
    assert warnings == ["fact.events: the table's health could not be read for the metadata: OSError: the object "
                        "store is down"]
    eng.close()


def test_lag_warns_where_a_tables_own_retention_would_remove_what_a_topic_needs(settings: Settings, tmp_path: Path,
                                                                                capsys):
    from platform_assets.cli.main import main

    s = settings.with_(lineage=write_lineage(tmp_path))
    write_rows(s, "stage.events", make_events(5, distinct_pos=5))
    DeltaTable(s.table_path("stage.events")).alter.set_table_properties(
        {"delta.deletedFileRetentionDuration": "interval 1 hours"})
    write_rows(s, "stage.events", make_events(5, start_id=6, start=T0 + dt.timedelta(hours=2), distinct_pos=5))
    args = ["--home", str(s.home), "--lineage", str(s.lineage), "lag"]
    assert main(args) == 0
    assert "WARNING" not in capsys.readouterr().out  # no topic needs anything yet
    _committed_block(s, source_version=0, delta_version=None)
    assert main(args) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("WARNING ")]
    assert re.match(r"WARNING stage\.events: v[01] for fact\.events\b.* — files removed after it were removed at ", line)
    assert re.search(r"the table's file retention \(1 hours?\) lets a VACUUM delete them", line)
