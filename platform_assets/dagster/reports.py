"""How a unit shows in Dagster: its asset key, its checks' results, and (for a unit the follower ran
outside any asset's compute) its materialization and check evaluations as events. A run's unit and
a followed unit are reported by the same functions, so the UI and the alert sensor see them alike."""

from __future__ import annotations

import datetime as dt
from typing import Any

import dagster as dg

from lineage.cdc.changes import format_lsn
from lineage.core.checks import CheckOutcome, ChecksSpec, Severity, evaluate_block, evaluate_unit
from lineage.spec.model import Lineage, Processor, Replicator


def asset_key(table: str) -> dg.AssetKey:
    return dg.AssetKey(table.split(".", 1))


def _meta_value(v: Any) -> Any:
    if isinstance(v, dt.datetime):
        return v.isoformat()
    if isinstance(v, dict):
        return dg.MetadataValue.json(v)
    return v


def check_results(key: dg.AssetKey, spec: ChecksSpec, stats: dict[str, Any], prefix: str = "",
                  outcomes: list[CheckOutcome] | None = None) -> list[dg.AssetCheckResult]:
    """The block's checks: its etl.log figures against the spec's thresholds (``prefix``: says
    when the figures are those of an earlier commit); ``outcomes``: already judged (a merge unit)."""
    severity = {Severity.WARN: dg.AssetCheckSeverity.WARN, Severity.ERROR: dg.AssetCheckSeverity.ERROR}
    return [
        dg.AssetCheckResult(asset_key=key, check_name=o.name, passed=o.passed, severity=severity[o.severity],
                            description=prefix + o.description,
                            metadata={k: _meta_value(v) for k, v in o.metadata.items() if v is not None})
        for o in (outcomes if outcomes is not None else evaluate_block(spec, stats))
    ]


def evaluation(result: dg.AssetCheckResult, partition: str | None = None) -> dg.AssetCheckEvaluation:
    """A check result as the event a run's asset check would log (for a unit run outside an asset)."""
    key = result.asset_key
    assert key is not None and result.check_name is not None  # noqa: S101 - built above with both
    return dg.AssetCheckEvaluation(asset_key=key, check_name=result.check_name, passed=result.passed,
                                   metadata=dict(result.metadata or {}), severity=result.severity,
                                   description=result.description, partition=partition)


def topic_unit_events(lineage: Lineage, result: Any, metadata: dict[str, Any]) -> list[Any]:
    """A topic's unit (a :class:`~platform_assets.core.protocol.StepResult` that did work) as the
    events its run would have logged: the materialization of its table (a step block's with its
    block's partition key) carrying ``metadata``, then its checks' evaluations."""
    topic = lineage.topic(result.topic)
    spec = topic.spec
    key = asset_key(spec.destination)
    partition = None
    checks: list[dg.AssetCheckResult] = []
    if spec.processor is Processor.STEP and result.block is not None:
        partition = lineage.block_key(topic.name, result.block.seq)
        checks = check_results(key, spec.checks, {**result.stats, "base_rows": result.base_rows})
    elif spec.processor is Processor.MERGE:
        checks = check_results(key, spec.checks, result.stats, outcomes=evaluate_unit(spec.checks, result.stats))
    return [dg.AssetMaterialization(asset_key=key, partition=partition, metadata=metadata),
            *(evaluation(c, partition) for c in checks)]


def replica_key(replica: str) -> dg.AssetKey:
    return dg.AssetKey(replica.split(".", 1))


def replica_reports(store: Any, rep: Replicator, result: Any) -> list[tuple[str, dict[str, Any], list[dg.AssetCheckResult]]]:
    """Per replica a unit touched: its materialization metadata (the unit's figures, numbers Dagster
    plots) and its checks, read with the replica's record in ``store`` (a run's unit and a followed
    one report alike)."""
    out = []
    for replica in sorted(set(result.tables) | set(result.snapshots) | set(result.paused)):
        counts = result.tables.get(replica, {})
        rec = store.get(replica)
        meta: dict[str, Any] = {k: counts.get(k, 0) for k in ("inserts", "updates", "deletes", "truncates", "ddl", "failed")}
        meta.update(unit=result.unit, snapshot_rows=result.snapshots.get(replica, 0),
                    state=(rec.state if rec else "?"), lag_s=float(result.lag_s or 0.0),
                    applied_lsn=format_lsn(rec.last.id) if rec and not rec.last.is_zero() else "-")
        out.append((replica, meta, replica_checks(rep, replica, rec.state if rec else "", result.lag_s)))
    return out


def replica_checks(rep: Replicator, replica: str, state: str, lag_s: float | None) -> list[dg.AssetCheckResult]:
    from platform_assets.cdc.units import FAILING, PAUSED, state_word

    word = state_word(state)
    bad = word in (PAUSED, FAILING)
    max_lag = rep.spec.checks.max_lag
    lag_ok = max_lag is None or lag_s is None or lag_s <= max_lag.total_seconds()
    return [
        dg.AssetCheckResult(asset_key=replica_key(replica), check_name="state", passed=not bad,
                            severity=dg.AssetCheckSeverity.ERROR,
                            description=state if bad else f"{word or 'replicating'}"),
        dg.AssetCheckResult(asset_key=replica_key(replica), check_name="lag", passed=lag_ok,
                            severity=dg.AssetCheckSeverity.WARN,
                            description=(f"source commit -> replica commit {lag_s:.1f} s" if lag_s is not None else "no changes")
                            + (f" > {max_lag.total_seconds():.0f} s" if not lag_ok and max_lag else ""),
                            metadata={"lag_s": float(lag_s or 0.0)}),
    ]
