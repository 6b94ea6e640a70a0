"""Table maintenance in Dagster (issue 25): the ``tidemark_maintenance`` asset, the
``tidemark_maintain`` job and its schedule, and the ``table_health`` check of every topic's table.

* ``tidemark_maintenance`` (group ``maintenance``, no Spark: ``deltalake`` only) runs
  :func:`platform_assets.maintenance.tables.run` over every table (the lineage's, the meta tables and every
  other table in the warehouse), as ``tidemark maintain`` does: compaction of small files, a
  checkpoint, and cleanup that keeps every version, file and commit a topic still needs; then the views'
  join indexes (``join_index: true``, :func:`platform_assets.views.indexes.refresh`). Options
  come from the run config (default: each table's own retention). Each table's lines
  (:func:`~platform_assets.maintenance.tables.describe`: what was compacted, removed, kept and for whom) go to
  the run's log and to the materialization's ``report``; the figures are numbers Dagster plots. A
  table that fails does not stop the others: the run fails at the end, naming them.
  The run also prunes the offset store's log to ``TIDEMARK_OFFSET_LOG_RETENTION`` (figure
  ``offset_log_entries_removed``; not with ``cleanup: false``).
* ``table_health``, on every topic's destination asset (step, reload, merge), warns when the table
  needs maintenance (:meth:`~resources.storage.maintenance.Health.reasons`) or when its own retention would
  let a plain VACUUM or log cleanup remove what a consumer needs (``Health.warnings``). The
  maintenance run evaluates it for each such table after maintaining it, so it shows what
  maintenance left (a failed compaction, a consumer about to lose its version), and it can be run
  on its own from the UI (``tidemark_table_health``, a read of each Delta log). It is not evaluated
  with each block or unit: between two maintenance runs a busy table gathers small files by design,
  and a warning per block would be an alert per block (``tidemark_alerts`` alerts on every failed
  check). Each unit's materialization carries the table's health as metadata instead
  (``platform_assets/dagster/io_manager.py``).
* the schedule ``tidemark_maintain_schedule`` runs the job every hour (cron ``0 * * * *``, UTC;
  ``TIDEMARK_MAINTAIN_CRON`` changes it) and is **running by default**: maintenance is safe beside
  running work. With the default options nothing younger than the table's own retention (7 days
  unless the table says otherwise) is removed and nothing a topic still needs is removed at all;
  a retention below one hour is refused while a writer of the table runs; a compaction whose
  commit conflicts with a concurrent writer is planned again and retried. It costs no JVM and
  rewrites only tables with enough small files. A compaction is a new table version that changes
  no row: a reload topic over a compacted table does not rebuild, a view whose input was only
  compacted runs a unit that changes nothing. A tick is skipped while a maintenance run is still queued or running. Stop the
  schedule in the UI (that choice is kept by the instance) to maintain by hand only.
"""

# No ``from __future__ import annotations``: Dagster reads the asset's ``config`` annotation as a class.
import os
from collections.abc import Iterator
from typing import Any

import dagster as dg
from pydantic import Field

from lineage.core.checks import HEALTH_CHECK
from lineage.core.errors import ConfigError
from lineage.spec.model import Lineage
from platform_assets.dagster.followed import ACTIVE_RUNS
from platform_assets.maintenance import tables as maintain
from platform_assets.views import indexes
from resources.core.settings import Settings
from resources.state.offsets import log_retention_from_env
from resources.storage import maintenance
from resources.storage.maintenance import Health, Need

MAINTENANCE_KEY = dg.AssetKey(["tidemark_maintenance"])
JOB_NAME = "tidemark_maintain"
SCHEDULE_NAME = "tidemark_maintain_schedule"
CHECKS_NAME = "tidemark_table_health"
CRON_ENV = "TIDEMARK_MAINTAIN_CRON"
DEFAULT_CRON = "0 * * * *"  # hourly, on the hour (UTC)


class MaintainConfig(dg.Config):
    """The options of ``tidemark maintain`` (the defaults are the schedule's)."""

    retain_hours: float | None = Field(
        default=None, description="remove what no consumer needs once older than this many hours (default: each "
                                  "table's delta.deletedFileRetentionDuration / delta.logRetentionDuration, else 7 / "
                                  "30 days); below 1 only for tables whose writers are idle")
    dry_run: bool = Field(default=False, description="say what would be compacted and removed; change nothing")
    compact: bool = Field(default=True, description="compact tables with small files")
    cleanup: bool = Field(default=True, description="VACUUM and log cleanup (never what a consumer needs)")
    cluster: bool = Field(default=False, description="views (merge topics): Z-order the compacted files by the key")

    def options(self) -> maintain.Options:
        return maintain.Options(retain_hours=self.retain_hours, dry_run=self.dry_run, compact=self.compact,
                                cleanup=self.cleanup, cluster=self.cluster)


def table_key(table: str) -> dg.AssetKey:
    return dg.AssetKey(table.split(".", 1))


def health_verdict(h: Health | None, error: str | None = None) -> tuple[bool, str, dict[str, Any]]:
    """``table_health`` of one table: passed, description, metadata. It fails (warns) when the table
    needs maintenance or its own retention would remove what a consumer needs. ``h`` None: the
    health could not be read (``error`` says why). ``error`` with ``h``: maintenance of the table
    failed (said in the description; the verdict is the table's health). Pure."""
    if h is None:
        return False, f"the table's health could not be read: {error}", {}
    meta: dict[str, Any] = {"version": h.version if h.version is not None else -1, **maintain.health_metadata(h)}
    if h.warnings:
        meta["warnings"] = dg.MetadataValue.text("\n".join(h.warnings))
    if not h.exists:
        return True, "no table yet", meta
    problems = [*h.reasons(), *h.warnings]
    failed = f" (maintenance failed: {error})" if error else ""
    if problems:
        return False, "needs maintenance: " + "; ".join(problems) + failed, meta
    since = h.since_checkpoint if h.since_checkpoint is not None else 0
    return True, f"ok: {h.files} files ({h.small_files} small), {since} commits since the last checkpoint" + failed, meta


def _evaluation(table: str, h: Health | None, error: str | None = None) -> dg.AssetCheckEvaluation:
    passed, description, meta = health_verdict(h, error)
    return dg.AssetCheckEvaluation(asset_key=table_key(table), check_name=HEALTH_CHECK, passed=passed,
                                   severity=dg.AssetCheckSeverity.WARN, description=description, metadata=meta)


def _read_health(eng: Any, table: str, needs: dict[str, list[Need]]) -> tuple[Health | None, str | None]:
    try:
        return maintain.health_of(eng, table, needs), None
    except Exception as exc:  # noqa: BLE001 - the check says it could not read the table
        return None, f"{type(exc).__name__}: {exc}"


def _markdown(lines: dict[str, list[str]]) -> str:
    out = []
    for table, text in lines.items():
        out.append(f"**{table}**: {text[0]}")
        out += [f"- {line}" for line in text[1:]]
        out.append("")
    return "\n".join(out) or "no tables"


def build_maintenance(settings: Settings, lineage: Lineage) -> tuple[list[Any], list[Any], list[Any]]:
    """The maintenance asset, the ``table_health`` checks, the job and its schedule:
    ``(assets and checks, jobs, schedules)``."""
    from platform_assets.dagster.io_manager import IO_MANAGER_KEY

    checked = sorted(lineage.destinations())
    retention = log_retention_from_env()  # a bad setting is refused when the definitions load

    @dg.asset(key=MAINTENANCE_KEY, group_name="maintenance", kinds={"delta"}, required_resource_keys={IO_MANAGER_KEY},
              pool="tidemark/maintenance",
              description="Compacts small files, checkpoints and cleans up every table (JVM-free, deltalake), keeping "
                          "every version, file and commit a topic still needs; tidemark maintain in Dagster")
    def tidemark_maintenance(context: dg.AssetExecutionContext, config: MaintainConfig) -> Iterator[Any]:
        eng = getattr(context.resources, IO_MANAGER_KEY).engine()
        opts = config.options()
        needs = maintain.consumer_needs(eng)  # the after-maintenance health of the checked tables
        lines: dict[str, list[str]] = {}
        failed: dict[str, str] = {}
        evaluations: list[dg.AssetCheckEvaluation] = []

        def on_report(h: Health, report: maintenance.Report | None, exc: Exception | None) -> None:
            error = None
            if exc is not None or report is None:
                error = failed[h.table] = f"{type(exc).__name__}: {exc}"
                lines[h.table] = [f"FAILED: {error}"]
                context.log.error(f"{h.table}: FAILED: {error}")
            else:
                lines[h.table] = [maintain.heading(h, report), *maintain.describe(h, report)]
                context.log.info(f"{h.table} " + "\n  ".join(lines[h.table]))
            if h.table in checked:  # what maintenance left (a dry run changed nothing: the health read before)
                after, read_error = (h, None) if opts.dry_run and h.exists else _read_health(eng, h.table, needs)
                evaluations.append(_evaluation(h.table, after, error or read_error))

        reports = maintain.run(eng, None, opts, on_report=on_report)
        yield from evaluations  # yielded (not raised past) also when tables failed
        for r in indexes.refresh(eng, dry_run=opts.dry_run):
            (context.log.error if r.failed else context.log.info)(r.line())
            lines.setdefault(r.view, []).append(r.line())
            if r.failed:
                failed[f"{r.view} join index on {r.column}"] = r.text
        pruned: int | None = 0
        line = ""
        if opts.cleanup:
            pruned, line = maintain.prune_offset_log(eng.store, retention, dry_run=opts.dry_run)
            (context.log.info if pruned is not None else context.log.error)(line)
        meta: dict[str, Any] = {
            "tables": len(lines), "failed": len(failed), "dry_run": opts.dry_run, **maintain.totals(reports),
            "offset_log_entries_removed": pruned or 0, "report": dg.MetadataValue.md(_markdown(lines)),
        }
        if failed or pruned is None:
            problems = [f"{len(failed)} table(s) failed: {', '.join(failed)} (the others were maintained)"] if failed else []
            problems += [line] if pruned is None else []
            raise dg.Failure(description="; ".join(problems), metadata={**meta, "errors": dg.MetadataValue.json(
                {**failed, **({"offset log": line} if pruned is None else {})})})
        yield dg.MaterializeResult(metadata=meta)

    specs = [dg.AssetCheckSpec(HEALTH_CHECK, asset=table_key(t),
                               description="the Delta table's health from its log (no Spark): warns when it needs "
                                           "maintenance (small files, commits since the last checkpoint) or its own "
                                           "retention would remove what a consumer needs; evaluated by "
                                           f"{JOB_NAME} after maintaining the table")
             for t in checked]

    @dg.multi_asset_check(name=CHECKS_NAME, specs=specs, can_subset=True, required_resource_keys={IO_MANAGER_KEY},
                          description="table_health of the selected tables, read from their Delta logs now")
    def table_health(context: dg.AssetCheckExecutionContext) -> Iterator[dg.AssetCheckResult]:
        eng = getattr(context.resources, IO_MANAGER_KEY).engine()
        needs = maintain.consumer_needs(eng)
        for key in sorted(context.selected_asset_check_keys, key=lambda k: k.asset_key.to_user_string()):
            table = ".".join(key.asset_key.path)
            h, error = _read_health(eng, table, needs)
            passed, description, meta = health_verdict(h, error)
            yield dg.AssetCheckResult(asset_key=key.asset_key, check_name=HEALTH_CHECK, passed=passed,
                                      severity=dg.AssetCheckSeverity.WARN, description=description, metadata=meta)

    job = dg.define_asset_job(JOB_NAME, selection=dg.AssetSelection.assets(MAINTENANCE_KEY),
                              description="tidemark maintain: compaction, checkpoints and cleanup of every table")
    assets: list[Any] = [tidemark_maintenance, table_health] if specs else [tidemark_maintenance]
    return assets, [job], [build_schedule(job)]


def maintain_cron(environ: dict[str, str] | None = None) -> str:
    """The schedule's cron: ``TIDEMARK_MAINTAIN_CRON``, else hourly."""
    env = os.environ if environ is None else environ
    cron = (env.get(CRON_ENV) or "").strip() or DEFAULT_CRON
    from dagster._utils.schedules import is_valid_cron_schedule

    if not is_valid_cron_schedule(cron):
        raise ConfigError(f"{CRON_ENV}={cron!r} is not a cron schedule (five fields, e.g. '0 * * * *' for hourly)")
    return cron


def build_schedule(job: Any) -> dg.ScheduleDefinition:
    @dg.schedule(name=SCHEDULE_NAME, job=job, cron_schedule=maintain_cron(), execution_timezone="UTC",
                 default_status=dg.DefaultScheduleStatus.RUNNING,
                 description=f"Runs {JOB_NAME} (cron from {CRON_ENV}, default hourly); skips a tick while a "
                             "maintenance run is still queued or running")
    def maintain_schedule(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        active = context.instance.get_runs(dg.RunsFilter(job_name=JOB_NAME, statuses=list(ACTIVE_RUNS)), limit=1)
        if active:
            return dg.SkipReason(f"maintenance run {active[0].run_id} is still {active[0].status.value.lower()}")
        return dg.RunRequest()

    return maintain_schedule
