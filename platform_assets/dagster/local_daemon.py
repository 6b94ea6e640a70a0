"""The planner sensor's loop in one process, without the Dagster daemon: what ``dagster dev``
does by itself, for the demo's first command (no UI) and for batch catch-up.

Each tick evaluates the ``tidemark_planner`` sensor exactly as the daemon would, applies its
partition requests, and executes every requested run in this process: the assets' own code, the
offset IO manager, the asset checks. Runs, materializations and check results are recorded in
the Dagster instance, so ``dagster dev`` on the same ``DAGSTER_HOME`` shows them afterwards. The
loop ends when a tick requests nothing (every topic waits) or a run fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

PLANNER = "tidemark_planner"


@dataclass(frozen=True)
class RunSummary:
    """One executed run: its asset's materialization metadata and check outcomes."""

    run_id: str
    job: str
    partition: str | None
    success: bool
    metadata: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)  # check name -> passed (for every asset of the run)
    error: str = ""


def _summary(job: str, partition: str | None, result: dg.ExecuteInProcessResult) -> RunSummary:
    metadata: dict[str, Any] = {}
    for event in result.get_asset_materialization_events():
        mat = event.step_materialization_data.materialization
        metadata = {k: v.value for k, v in mat.metadata.items()}
    checks: dict[str, bool] = {}
    for e in result.get_asset_check_evaluations():  # a check of several assets (a replicator's): passed by all
        checks[e.check_name] = checks.get(e.check_name, True) and e.passed
    error = ""
    if not result.success:
        failure = next((e for e in result.all_events if e.is_step_failure), None)
        err = failure.step_failure_data.error if failure is not None else None
        while err is not None and err.cause is not None and (err.cls_name or "").startswith("Dagster"):
            err = err.cause  # the error raised in the asset, not Dagster's wrapper around it
        error = err.message.strip().splitlines()[0] if err is not None and err.message.strip() else "run failed"
    return RunSummary(result.run_id, job, partition, result.success, metadata, checks, error)


def apply_partition_requests(instance: dg.DagsterInstance, requests: Any) -> None:
    """Add and delete the dynamic partitions a sensor tick asked for, as the daemon does."""
    for req in requests:
        if isinstance(req, dg.AddDynamicPartitionsRequest):
            instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        elif isinstance(req, dg.DeleteDynamicPartitionsRequest):
            for key in req.partition_keys:
                instance.delete_dynamic_partition(req.partitions_def_name, key)


def run_until_idle(defs: dg.Definitions, instance: dg.DagsterInstance, *, max_runs: int = 10_000,
                   on_run: Callable[[RunSummary], None] | None = None,
                   log_level: str = "INFO", sensor_name: str = PLANNER) -> tuple[list[RunSummary], str]:
    """Tick the planner sensor and execute what it requests until it requests nothing or a run
    fails. Returns the runs and the last tick's skip reason (why the topics wait).
    ``log_level``: the runs' console log level (their full logs are in the instance anyway).
    ``sensor_name``: the sensor to tick (default the planner; ``tidemark_cdc`` for replicators)."""
    sensor = defs.resolve_sensor_def(sensor_name)
    run_config = {"loggers": {"console": {"config": {"log_level": log_level}}}}
    runs: list[RunSummary] = []
    cursor: str | None = None  # carried from tick to tick, as the daemon does
    while len(runs) < max_runs:
        ctx = dg.build_sensor_context(instance=instance, instance_ref=instance.get_ref(), definitions=defs, cursor=cursor)
        tick = sensor.evaluate_tick(ctx)
        cursor = tick.cursor if tick.cursor is not None else cursor
        apply_partition_requests(instance, tick.dynamic_partitions_requests or [])
        if not tick.run_requests:
            return runs, tick.skip_message or ""
        for req in tick.run_requests:
            job = defs.resolve_job_def(req.job_name or "")
            result = job.execute_in_process(run_config=run_config, instance=instance, partition_key=req.partition_key,
                                            tags=dict(req.tags), raise_on_error=False)
            summary = _summary(job.name, req.partition_key, result)
            runs.append(summary)
            if on_run:
                on_run(summary)
            if not summary.success:
                return runs, f"run {summary.run_id} of {job.name} failed: {summary.error}"
    return runs, f"stopped after {max_runs} runs"
