"""The Dagster code location built from the lineage (``workspace.yaml`` loads it).

* every source table is an external asset, so the graph shows where data comes from;
* every destination table is an asset (key ``[schema, table]``, group per schema, kinds
  spark/delta). A table built by step topics is partitioned by block, with dynamic partitions
  whose keys name the block (``00000012``). A materialization processes exactly the planned
  ``(last, next]`` of that block, and redoing a committed block is a no-op. Tables built by
  reload topics are unpartitioned;
* an asset's compute takes its topic's lock and prepares the block's output; the offset IO
  manager (``platform_assets/dagster/io_manager.py``) writes it exactly once, commits the offsets and records
  the block's figures; the compute then reports the block's checks;
* the ``tidemark_planner`` sensor plans blocks and requests their runs; ``tidemark_alerts``
  sends one alert per failed run or failed check (webhook + log file);
* a concurrency pool per table (``tidemark/<table>``; ``dagster.yaml`` limits each to 1);
* table maintenance (``platform_assets/dagster/maintenance.py``): the ``tidemark_maintenance`` asset,
  its ``tidemark_maintain`` job and hourly schedule, and the ``table_health`` check of every table
  above (evaluated by that job, not with each block).

Nothing heavy happens at import: the lineage loader is pure Python, and Spark starts only
inside a materialization.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import dagster as dg

from lineage.core.checks import CHECK_NAMES, evaluate_unit, merge_check_names
from lineage.core.errors import ProcessingError
from lineage.core.partitions import partitions_name
from lineage.spec.loader import load_lineage
from lineage.spec.model import Lineage, Processor
from platform_assets.dagster.alerts import RESOURCE_KEY, AlertNotifierResource, build_alert_sensor
from platform_assets.dagster.intake import build_intake_definitions
from platform_assets.dagster.io_manager import IO_MANAGER_KEY, OffsetIOManager, already_committed
from platform_assets.dagster.maintenance import build_maintenance
from platform_assets.dagster.reports import asset_key, check_results
from platform_assets.dagster.sensors import build_planner_sensor
from resources.core.settings import Settings
from resources.spark.session import PYSPARK_KEY, pyspark_resource


def _step_compute(lineage: Lineage, table: str) -> Any:
    key = asset_key(table)

    def compute(context):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202 - Dagster inspects the signature
        from platform_assets.core.protocol import StepResult
        from resources.storage.meta_tables import read_etl_log

        topic, seq = lineage.block_of(table, context.partition_key)
        spec = lineage.topic(topic).spec
        io: OffsetIOManager = getattr(context.resources, IO_MANAGER_KEY)
        # Take the lock and build the block's output; the IO manager writes it exactly once and
        # commits the offsets (handle_output runs when the Output is yielded).
        opened = io.engine().open_block(topic, seq)
        yield dg.Output(opened)
        if isinstance(opened, StepResult):  # committed earlier: report that block's logged figures again
            context.log.info(f"{topic}: {already_committed(seq)}; the checks repeat the figures of that commit")
            logged = next((row for row in read_etl_log(io.engine().settings, topic, limit=100_000) if row["seq"] == seq), None)
            if logged:
                when = logged["ts"].isoformat(sep=" ", timespec="seconds") if isinstance(logged["ts"], dt.datetime) else logged["ts"]
                yield from check_results(key, spec.checks, {**logged, "nulls": dict(logged["nulls"] or [])},
                                          prefix=f"block {seq} as committed earlier ({when}), nothing written now: ")
            return
        if opened.result is None:
            raise ProcessingError(f"{topic}: block {seq} was not finished by the IO manager")
        yield from check_results(key, spec.checks, {**opened.result.stats, "base_rows": opened.result.base_rows})

    return compute


def _reload_compute(topic: str) -> Any:
    def compute(context):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202 - Dagster inspects the signature
        io: OffsetIOManager = getattr(context.resources, IO_MANAGER_KEY)
        return io.engine().open_block(topic)  # the IO manager rebuilds the table from it

    return compute


def _repeated_checks(instance: dg.DagsterInstance, key: dg.AssetKey, names: Sequence[str], why: str) -> list[dg.AssetCheckResult]:
    """Results for a run that judged nothing: each check repeats its last finished evaluation
    (verdict and severity), saying so; a check never evaluated before passes with ``why``."""
    from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus as Status

    out = []
    for name in names:
        history = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(key, name), limit=1, status={Status.SUCCEEDED, Status.FAILED})
        last = history[0].evaluation if history else None
        if last is None:
            out.append(dg.AssetCheckResult(asset_key=key, check_name=name, passed=True, description=f"{why}; never evaluated before"))
            continue
        # The verdict stands as it was judged; a failure is repeated as a warning, since an ERROR
        # would fail this run, which did nothing (a blocking check still holds back the topics
        # downstream: they wait on any failed evaluation).
        judged = (last.description or "").rpartition(REPEATS)[2]  # not "repeats ... repeats ..."
        was = "" if last.passed or last.severity is dg.AssetCheckSeverity.WARN else " (an ERROR)"
        first_run = (last.metadata or {}).get("repeated_from_run")
        out.append(dg.AssetCheckResult(asset_key=key, check_name=name, passed=last.passed, severity=dg.AssetCheckSeverity.WARN,
                                       description=f"{why}{REPEATS}{judged}{was}",
                                       metadata={"repeated_from_run": first_run.value if isinstance(first_run, dg.TextMetadataValue)
                                                 else str(first_run or history[0].run_id)}))
    return out


REPEATS = "; repeats the last evaluation: "


def _merge_compute(lineage: Lineage, table: str, topic: str) -> Any:
    key = asset_key(table)
    spec = lineage.topic(topic).spec

    def compute(context):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202 - Dagster inspects the signature
        io: OffsetIOManager = getattr(context.resources, IO_MANAGER_KEY)
        from platform_assets.core.protocol import StepResult

        opened = io.engine().open_block(topic)  # the IO manager MERGEs (or rebuilds) from it
        yield dg.Output(opened)
        if isinstance(opened, StepResult):  # nothing to do (an earlier run did the unit): no new figures
            yield from _repeated_checks(context.instance, key, merge_check_names(spec.checks),
                                        f"no unit ran ({opened.reason}), nothing written")
            return
        result = getattr(opened, "result", None)
        if result is not None:
            yield from check_results(key, spec.checks, result.stats, outcomes=evaluate_unit(spec.checks, result.stats))

    return compute


def _owner(owner: str) -> str:
    """Dagster owners are e-mail addresses or ``team:name``."""
    return owner if "@" in owner or owner.startswith("team:") else f"team:{owner}"


def _freshness(specs: list[Any]) -> dg.FreshnessPolicy:
    warn, fail = max(sp.freshness_windows() for sp in specs)
    return dg.FreshnessPolicy.time_window(fail_window=fail, warn_window=warn)


def build_definitions(settings: Settings | None = None) -> dg.Definitions:
    settings = settings or Settings.from_env()
    lineage = load_lineage(settings.lineage)
    intake = build_intake_definitions(settings, lineage)  # the event intake's assets, job and sensor
    sources = [
        dg.AssetSpec(asset_key(s.name), group_name=s.name.split(".")[0], kinds={"delta"},
                     description=s.spec.comment or f"source table {s.name}")
        for s in lineage.sources.values() if s.name not in intake.tables
    ]
    assets = []
    for table, topics in lineage.destinations().items():
        specs = [lineage.topic(n).spec for n in topics]
        step = specs[0].processor is Processor.STEP
        merge = specs[0].processor is Processor.MERGE
        checks = CHECK_NAMES if step else merge_check_names(specs[0].checks) if merge else ()
        deps = sorted({d for sp in specs for d in sp.depends_on})
        assets.append(dg.asset(
            key=asset_key(table),
            deps=[asset_key(d) for d in deps],
            group_name=table.split(".")[0],
            kinds={"spark", "delta"},
            description="; ".join(sp.comment for sp in specs if sp.comment) or f"built by {', '.join(topics)}",
            metadata={"topics": ", ".join(topics), "processor": specs[0].processor.value,
                      "location": settings.table_path(table)},
            partitions_def=dg.DynamicPartitionsDefinition(name=partitions_name(table)) if step else None,
            io_manager_key=IO_MANAGER_KEY,
            required_resource_keys={IO_MANAGER_KEY},
            pool=f"tidemark/{table}",
            owners=sorted({_owner(sp.owner) for sp in specs if sp.owner}) or None,
            freshness_policy=_freshness(specs) if step else None,
            check_specs=[
                dg.AssetCheckSpec(name, asset=asset_key(table), blocking=specs[0].checks.blocking,
                                  description=f"{'block' if step else 'unit'} {name}: the etl.log figures of each "
                                              f"{'block' if step else 'unit'} against the spec's thresholds")
                for name in checks
            ] or None,
        )(_step_compute(lineage, table) if step else _merge_compute(lineage, table, topics[0]) if merge
          else _reload_compute(topics[0])))
    from platform_assets.dagster.cdc import build_cdc

    cdc_assets, cdc_jobs, cdc_sensors = build_cdc(settings, lineage)
    maint_assets, maint_jobs, maint_schedules = build_maintenance(settings, lineage)
    from platform_assets.dagster.follow import build_follow_job, build_follow_sensor
    from platform_assets.dagster.followed import mode_setting

    mode_setting()  # a bad TIDEMARK_MODE fails the code location's load, before anything runs
    follow_job = build_follow_job(settings, lineage)
    pyspark = pyspark_resource(settings)
    return dg.Definitions(
        assets=[*sources, *assets, *cdc_assets, *intake.assets, *maint_assets],
        jobs=[*cdc_jobs, *intake.jobs, *maint_jobs, follow_job],
        schedules=maint_schedules,
        sensors=[build_planner_sensor(settings, lineage), build_alert_sensor(), *cdc_sensors, *intake.sensors,
                 build_follow_sensor(follow_job)],
        resources={
            RESOURCE_KEY: AlertNotifierResource(log_path=str(settings.home / "alerts.log")),
            # dagster-pyspark's lazy session from Tidemark's settings: the units run on it, and a
            # user's own assets get the same session under the key they expect (pyspark).
            PYSPARK_KEY: pyspark,
            IO_MANAGER_KEY: OffsetIOManager(home=str(settings.home), warehouse=settings.warehouse,
                                            offsets_url=settings.offsets_url, lineage=str(settings.lineage),
                                            spark_master=settings.spark_master, pyspark=pyspark),
        },
        # A block run is one step: run it in the run's own process, with one SparkSession that
        # is stopped when the run ends (no step subprocesses each starting a JVM).
        executor=dg.in_process_executor,
    )


defs = build_definitions()
