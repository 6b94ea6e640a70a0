"""The alert sensor: failed runs and failed asset checks become alerts, one per incident.

``build_alert_sensor()`` returns the sensor ``tidemark_alerts`` (running by default). Each tick:

1. reads the run-status events that ended runs since the cursor (``RUN_FAILURE``,
   ``RUN_SUCCESS``, ``RUN_CANCELED``), at most ``max_runs_per_tick`` of each, in storage order,
   from the instance's event index (``instance.fetch_run_status_changes``);
2. turns each failed run into a ``run_failure`` alert (key ``run:<run_id>``) naming the job, the
   planned assets and partition (the block), the failed step and its error;
3. reads the ``ASSET_CHECK_EVALUATION`` events of each of those ended runs (one indexed query per
   run; a check is evaluated inside a run, so its result is complete once the run ended), plus
   check results reported outside any run, and turns each that did not pass with severity at
   least ``min_check_severity`` into a ``check_failure`` alert (key
   ``check:<asset>:<check>:<partition or ->:<run_id>``) with its severity, description and
   metadata. The checks of a live ``tidemark_follow`` run (continuous mode: one run, many units) are
   read while it runs, each evaluation its own incident, so a followed unit alerts like a run's;
4. hands the alerts to the :class:`~resources.core.alerts.AlertNotifier` (log file, then webhook; it
   drops incidents it already alerted, across restarts) and stores a JSON cursor (event storage
   ids), so the next tick starts after what this one read.

A tick without a cursor (first start, or the cursor was reset) starts ``lookback_seconds`` in
the past; incidents it finds again are deduplicated by the notifier. Ticks stay light: a few
indexed queries against the Dagster instance, no Spark and no Delta access. A webhook failure does
not fail the tick (the alert is in the log file and the webhook is retried on the next ticks); it
is logged as an error in the tick's log and named in the tick's skip message. A log file that
cannot be written fails the tick, so the cursor does not move and the next tick tries again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import dagster as dg
from pydantic import Field

from platform_assets.dagster.followed import FOLLOW_JOB
from resources.core.alerts import DEFAULT_WEBHOOK_ENV, Alert, AlertNotifier, SendReport

SENSOR_NAME = "tidemark_alerts"
RESOURCE_KEY = "alert_notifier"
RUNLESS_RUN_ID = ""  # dagster._core.instance.utils.RUNLESS_RUN_ID: events reported outside a run
_Ended = Literal[dg.DagsterEventType.RUN_FAILURE, dg.DagsterEventType.RUN_SUCCESS, dg.DagsterEventType.RUN_CANCELED]
ENDED: tuple[_Ended, ...] = (dg.DagsterEventType.RUN_FAILURE, dg.DagsterEventType.RUN_SUCCESS,
                             dg.DagsterEventType.RUN_CANCELED)
_SEVERITY_RANK = {dg.AssetCheckSeverity.WARN: 1, dg.AssetCheckSeverity.ERROR: 2}
_MAX_TEXT = 2000

log = logging.getLogger("tidemark.alerts")


class AlertNotifierResource(dg.ConfigurableResource):
    """Where Tidemark's alerts go: a JSON-lines log file (always) and a webhook (JSON POST) whose
    URL comes from an environment variable. One alert per incident, also across restarts."""

    log_path: str | None = Field(
        default=None,
        description="Path of the JSON-lines alert log (one alert per line). Default: "
                    "$TIDEMARK_HOME/alerts.log (TIDEMARK_HOME defaults to ./.tidemark). The sent-incident "
                    "state is kept next to it in <log_path>.state.json.",
    )
    webhook_url_env: str = Field(
        default=DEFAULT_WEBHOOK_ENV,
        description="Name of the environment variable holding the webhook URL (http:// or https://). "
                    "When that variable is unset or empty, alerts go to the log file only.",
    )
    webhook_timeout_s: float = Field(
        default=10.0,
        description="Timeout in seconds of one webhook POST.",
    )
    webhook_retry_for_s: float = Field(
        default=3600.0,
        description="How long, in seconds, a failed webhook delivery is retried on later sensor ticks "
                    "before it is given up (the alert stays in the log file either way).",
    )
    max_remembered_incidents: int = Field(
        default=10_000,
        description="How many sent incident keys are remembered for deduplication (the newest ones).",
    )

    def notifier(self) -> AlertNotifier:
        return AlertNotifier(
            self.log_path,
            webhook_env=self.webhook_url_env,
            timeout_s=self.webhook_timeout_s,
            retry_for_s=self.webhook_retry_for_s,
            max_keys=self.max_remembered_incidents,
        )


@dataclass
class AlertCursor:
    """The sensor's cursor: the last storage id read per run-ending event type, the Dagster
    cursor of the run-less check results, and the start time used while a stream has none."""

    since: float
    runs: dict[str, int] = field(default_factory=dict)
    runless: str | None = None
    follow: dict[str, str] = field(default_factory=dict)  # a live tidemark_follow run -> its events read

    @classmethod
    def parse(cls, text: str | None, *, now: float, lookback_s: float) -> AlertCursor:
        fresh = cls(since=now - lookback_s)
        if not text:
            return fresh
        try:
            raw = json.loads(text)
            runless = raw.get("runless")
            if runless is not None and not isinstance(runless, str):
                raise TypeError("runless must be a string")
            return cls(since=float(raw["since"]), runs={str(k): int(v) for k, v in raw.get("runs", {}).items()},
                       runless=runless, follow={str(k): str(v) for k, v in raw.get("follow", {}).items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("alert sensor: ignoring an unreadable cursor %r; starting %ss back", text[:200], lookback_s)
            return fresh

    def to_json(self) -> str:
        return json.dumps({"v": 1, "since": self.since, "runs": self.runs, "runless": self.runless,
                           "follow": self.follow}, sort_keys=True)


@dataclass
class Scan:
    alerts: list[Alert]
    cursor: AlertCursor
    runs_read: int = 0
    problems: list[str] = field(default_factory=list)


def scan_incidents(
    instance: dg.DagsterInstance,
    cursor: AlertCursor,
    *,
    max_runs_per_tick: int = 100,
    max_checks_per_run: int = 500,
    min_check_severity: str = "WARN",
    dagster_ui_url: str | None = None,
) -> Scan:
    """Incidents recorded since ``cursor``, and the cursor after them. Reads only; sends nothing."""
    min_rank = _SEVERITY_RANK[dg.AssetCheckSeverity(min_check_severity)]
    out = Scan(alerts=[], cursor=AlertCursor(since=cursor.since, runs=dict(cursor.runs), runless=cursor.runless,
                                             follow=dict(cursor.follow)))
    for event_type in ENDED:
        after = cursor.runs.get(event_type.name)
        records_filter = (dg.RunStatusChangeRecordsFilter(event_type, after_storage_id=after) if after is not None
                          else dg.RunStatusChangeRecordsFilter(event_type, after_timestamp=cursor.since))
        result = instance.fetch_run_status_changes(records_filter, limit=max_runs_per_tick, ascending=True)
        for record in result.records:
            out.runs_read += 1
            run = instance.get_run_by_id(record.run_id)
            # one run whose events cannot be read must not block every other alert: report it, go on
            if event_type == dg.DagsterEventType.RUN_FAILURE:
                try:
                    out.alerts.append(_run_failure_alert(instance, record, run, dagster_ui_url))
                except Exception as exc:
                    out.problems.append(f"run {record.run_id}: details unavailable: {type(exc).__name__}: {exc}")
                    out.alerts.append(_bare_run_failure_alert(record, f"{type(exc).__name__}: {exc}"))
            try:
                if run is not None and run.job_name == FOLLOW_JOB:  # its checks were read while it ran: the rest
                    out.alerts.extend(_follow_check_alerts(instance, run, out.cursor, min_rank, max_checks_per_run,
                                                           dagster_ui_url))
                    out.cursor.follow.pop(run.run_id, None)
                else:
                    out.alerts.extend(_check_alerts(instance, record.run_id, run, min_rank, max_checks_per_run,
                                                    dagster_ui_url, out.problems))
            except Exception as exc:
                out.problems.append(f"run {record.run_id}: check results unreadable: {type(exc).__name__}: {exc}")
            out.cursor.runs[event_type.name] = record.storage_id

    # A tidemark_follow run lives for days: its units' checks are read while it runs, each its own incident.
    for run in instance.get_runs(dg.RunsFilter(job_name=FOLLOW_JOB, statuses=[dg.DagsterRunStatus.STARTED])):
        try:
            out.alerts.extend(_follow_check_alerts(instance, run, out.cursor, min_rank, max_checks_per_run, dagster_ui_url))
        except Exception as exc:
            out.problems.append(f"run {run.run_id}: check results unreadable: {type(exc).__name__}: {exc}")

    conn = instance.get_records_for_run(RUNLESS_RUN_ID, cursor=cursor.runless,
                                        of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION,
                                        limit=max_checks_per_run)
    for record in conn.records:
        if record.timestamp > cursor.since:
            alert = _check_alert(record, None, min_rank, dagster_ui_url)
            if alert is not None:
                out.alerts.append(alert)
    out.cursor.runless = conn.cursor if conn.records else cursor.runless
    return out


def build_alert_sensor(
    *,
    name: str = SENSOR_NAME,
    minimum_interval_seconds: int = 30,
    lookback_seconds: float = 24 * 3600,
    max_runs_per_tick: int = 100,
    max_checks_per_run: int = 500,
    min_check_severity: str = "WARN",
    dagster_ui_url: str | None = None,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.RUNNING,
) -> dg.SensorDefinition:
    """The alert sensor; it needs the resource ``alert_notifier`` (:class:`AlertNotifierResource`).

    ``min_check_severity``: ``WARN`` (every failed check) or ``ERROR``. ``dagster_ui_url``: base URL
    of the Dagster UI, to put a link to the run into each alert.
    """
    dg.AssetCheckSeverity(min_check_severity)  # fail at definition time on a bad value
    if max_runs_per_tick < 1 or max_checks_per_run < 1:
        raise ValueError("max_runs_per_tick and max_checks_per_run must be >= 1")

    @dg.sensor(
        name=name,
        minimum_interval_seconds=minimum_interval_seconds,
        default_status=default_status,
        description="Sends one alert per failed run and per failed asset check (log file + webhook).",
    )
    def _alert_sensor(context: dg.SensorEvaluationContext, alert_notifier: AlertNotifierResource) -> dg.SensorResult:
        cursor = AlertCursor.parse(context.cursor, now=time.time(), lookback_s=lookback_seconds)
        scan = scan_incidents(context.instance, cursor, max_runs_per_tick=max_runs_per_tick,
                              max_checks_per_run=max_checks_per_run, min_check_severity=min_check_severity,
                              dagster_ui_url=dagster_ui_url)
        for problem in scan.problems:
            context.log.warning(f"alert sensor: {problem}")
        notifier = alert_notifier.notifier()
        report = notifier.send_all(scan.alerts)
        _log_report(context.log, notifier, report)
        return dg.SensorResult(
            skip_reason=f"read {scan.runs_read} ended run(s): {report.summary()}",
            cursor=scan.cursor.to_json(),
        )

    return _alert_sensor


# -- alerts from events -----------------------------------------------------------------------


def _log_report(logger: logging.Logger, notifier: AlertNotifier, report: SendReport) -> None:
    for d in report.new:
        logger.info(f"alert {d.key}: written to {notifier.log_path}, webhook {d.webhook}")
    for d in report.failures:
        logger.error(f"alert {d.key}: webhook delivery {d.webhook}: {d.error} (the alert is in {notifier.log_path})")


def _at(record: dg.EventLogRecord) -> datetime:
    return datetime.fromtimestamp(record.timestamp, UTC)


def _truncate(text: str | None, limit: int = _MAX_TEXT) -> str | None:
    if text is None:
        return None
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _root_error(error: Any) -> str | None:
    """``Class: message`` of the innermost cause of a SerializableErrorInfo (the user's error)."""
    if error is None:
        return None
    while getattr(error, "cause", None) is not None:
        error = error.cause
    return _truncate(getattr(error, "message", None) or str(error))


def _run_url(base: str | None, run_id: str) -> str | None:
    return f"{base.rstrip('/')}/runs/{run_id}" if base and run_id else None


def _partition(run: dg.DagsterRun | None) -> str | None:
    return run.tags.get("dagster/partition") if run is not None else None


def _bare_run_failure_alert(record: dg.EventLogRecord, problem: str) -> Alert:
    return Alert(kind="run_failure", key=f"run:{record.run_id}", at=_at(record),
                 title=f"Run {record.run_id} failed (details unavailable: {problem})",
                 details={"run_id": record.run_id, "message": _truncate(record.event_log_entry.message)})


def _run_failure_alert(instance: dg.DagsterInstance, record: dg.EventLogRecord, run: dg.DagsterRun | None,
                       ui_url: str | None) -> Alert:
    run_id = record.run_id
    event = record.event_log_entry.dagster_event
    data = event.event_specific_data if event is not None else None
    step_event = getattr(data, "first_step_failure_event", None)
    if step_event is None:  # older runs / other executors: read the first step failure of the run
        steps = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_FAILURE, limit=1).records
        step_event = steps[0].event_log_entry.dagster_event if steps else None
    step_data = step_event.event_specific_data if step_event is not None else None
    user_failure = getattr(step_data, "user_failure_data", None)
    error = (getattr(user_failure, "description", None) or _root_error(getattr(step_data, "error", None))
             or _root_error(getattr(data, "error", None)))

    assets: set[str] = set()
    partitions: set[str] = set()
    if run is not None and run.asset_selection:
        assets = {k.to_user_string() for k in run.asset_selection}
    planned = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_MATERIALIZATION_PLANNED,
                                           limit=200).records
    for r in planned:
        ev = r.event_log_entry.dagster_event
        if ev is not None and ev.asset_key is not None:
            assets.add(ev.asset_key.to_user_string())
            if ev.partition:
                partitions.add(ev.partition)
    partition = _partition(run) or (next(iter(partitions)) if len(partitions) == 1 else None)

    job = run.job_name if run is not None else (event.job_name if event is not None else None)
    what = ", ".join(sorted(assets)) if assets else f"job {job}"
    title = f"Run failed: {what}{f' [{partition}]' if partition else ''}"
    if error:
        title += f": {error.splitlines()[0][:200]}"
    failure_reason = getattr(data, "failure_reason", None)
    details: dict[str, Any] = {
        "run_id": run_id,
        "job": job,
        "assets": sorted(assets),
        "partition": partition,
        "partitions": sorted(partitions) if len(partitions) > 1 else None,
        "failure_reason": failure_reason.value if failure_reason is not None else None,
        "failed_step": step_event.step_key if step_event is not None else None,
        "error": error,
        "message": _truncate(event.message if event is not None else record.event_log_entry.message),
        "tags": dict(run.tags) if run is not None else {},
        "url": _run_url(ui_url, run_id),
    }
    return Alert(kind="run_failure", key=f"run:{run_id}", title=title, details=details, at=_at(record))


def _check_alerts(instance: dg.DagsterInstance, run_id: str, run: dg.DagsterRun | None, min_rank: int,
                  limit: int, ui_url: str | None, problems: list[str]) -> list[Alert]:
    conn = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION, limit=limit)
    if conn.has_more:
        problems.append(f"run {run_id}: more than {limit} check evaluations; only the first {limit} were read")
    alerts = (_check_alert(r, run, min_rank, ui_url) for r in conn.records)
    return [a for a in alerts if a is not None]


def _follow_check_alerts(instance: dg.DagsterInstance, run: dg.DagsterRun, cursor: AlertCursor, min_rank: int,
                         limit: int, ui_url: str | None) -> list[Alert]:
    """The check evaluations a ``tidemark_follow`` run logged since ``cursor`` (moved past them)."""
    conn = instance.get_records_for_run(run.run_id, cursor=cursor.follow.get(run.run_id),
                                        of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION, limit=limit)
    if conn.records:
        cursor.follow[run.run_id] = conn.cursor
    alerts = (_check_alert(r, run, min_rank, ui_url) for r in conn.records)
    return [a for a in alerts if a is not None]


def _check_alert(record: dg.EventLogRecord, run: dg.DagsterRun | None, min_rank: int,
                 ui_url: str | None) -> Alert | None:
    evaluation = record.event_log_entry.asset_check_evaluation
    if evaluation is None or evaluation.passed or _SEVERITY_RANK.get(evaluation.severity, 2) < min_rank:
        return None
    asset = evaluation.asset_key.to_user_string()
    run_id = record.run_id
    partition = evaluation.partition or _partition(run)
    # one incident per run, or per unit of a long-lived follow run (many units, one run id)
    incident = f"{run_id}#{record.storage_id}" if run is not None and run.job_name == FOLLOW_JOB else run_id or f"runless#{record.storage_id}"
    severity = evaluation.severity.value
    title = f"Check {evaluation.check_name} failed ({severity}) on {asset}{f' [{partition}]' if partition else ''}"
    if evaluation.description:
        title += f": {evaluation.description.splitlines()[0][:200]}"
    details: dict[str, Any] = {
        "asset": asset,
        "check": evaluation.check_name,
        "severity": severity,
        "passed": False,
        "blocking": evaluation.blocking,
        "partition": partition,
        "description": _truncate(evaluation.description),
        "metadata": {k: _metadata_value(v) for k, v in evaluation.metadata.items()},
        "run_id": run_id or None,
        "job": run.job_name if run is not None else None,
        "url": _run_url(ui_url, run_id),
    }
    return Alert(kind="check_failure", key=f"check:{asset}:{evaluation.check_name}:{partition or '-'}:{incident}",
                 title=title, details=details, at=_at(record))


def _metadata_value(value: Any) -> Any:
    raw = getattr(value, "value", value)
    if raw is None or isinstance(raw, str | int | float | bool | Mapping | list):
        return raw
    return str(raw)
