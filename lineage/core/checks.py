"""Block checks: the seed's ETL.Log figures of a block judged against thresholds from the
lineage spec. Pure: the Dagster asset checks call :func:`evaluate_block`."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lineage.core.durations import format_duration, parse_duration


class Severity(StrEnum):
    WARN = "warn"
    ERROR = "error"


class ChecksSpec(BaseModel):
    """``checks:`` of a topic. Every block is judged by three checks: ``rows``, ``lag``, ``nulls``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    require_rows: bool = Field(True, description="a block whose base rows were > 0 must write rows")
    max_lag: dt.timedelta | None = Field(None, description="the block's oldest row may be at most this old when written")
    max_null_share: dict[str, float] = Field(default_factory=dict, description="column -> highest allowed share of nulls (0..1)")
    max_offset_age: dt.timedelta | None = Field(
        None, description="merge: every input's offset (the newest data applied) may be at most this old (Datapipe's "
                          "offset_age_seconds alert)")
    verify_sample: int = Field(0, ge=0, description="merge: after every unit compare this many random keys of the view "
                                                     "with its transform recomputed from scratch (tidemark verify "
                                                     "--sample N); the 'exact' check fails with severity error when any "
                                                     "differs. 0: off (each check costs a recompute of those keys)")
    severity: Severity = Field(Severity.WARN, description="severity of a failed check: warn or error")
    blocking: bool = Field(False, description="a failed check stops downstream assets of the run")

    @field_validator("max_lag", "max_offset_age", mode="before")
    @classmethod
    def _lag(cls, v: Any) -> Any:
        return None if v in (None, "") else v if isinstance(v, dt.timedelta) else parse_duration(v)

    @field_validator("max_null_share")
    @classmethod
    def _shares(cls, v: dict[str, float]) -> dict[str, float]:
        for col, share in v.items():
            if not 0 <= share <= 1:
                raise ValueError(f"max_null_share of '{col}' is {share}; a share is between 0 and 1")
        return v


CHECK_NAMES = ("rows", "lag", "nulls", "late_rows")
MERGE_CHECK_NAMES = ("offset_age", "late_rows", "refresh")
#: The merge check ``checks.verify_sample`` adds.
VERIFY_CHECK = "exact"
#: Every topic's destination: its Delta table's health (small files, checkpoint, what its own
#: retention would remove of what a consumer needs), judged by the maintenance job, not per unit.
HEALTH_CHECK = "table_health"


def merge_check_names(spec: ChecksSpec) -> tuple[str, ...]:
    """The asset checks of a merge topic with these ``checks``."""
    return (*MERGE_CHECK_NAMES, VERIFY_CHECK) if spec.verify_sample else MERGE_CHECK_NAMES


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    passed: bool
    severity: Severity
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)


def evaluate_block(spec: ChecksSpec, stats: dict[str, Any]) -> list[CheckOutcome]:
    """Judge one block. ``stats`` holds the etl.log figures: rows, base_rows, max_id, min_ts,
    max_ts, max_lag (seconds), nulls (column -> count, every column of the output, zeros too).

    A ``max_null_share`` column missing from ``nulls`` fails the check (unless the block wrote no
    rows): a threshold on a column nobody counted must not pass silently."""
    rows = int(stats.get("rows") or 0)
    base_rows = int(stats.get("base_rows") or 0)
    nulls: dict[str, int] = dict(stats.get("nulls") or {})
    figures = {k: stats.get(k) for k in ("rows", "base_rows", "max_id", "min_ts", "max_ts", "max_lag")}
    figures["nulls"] = nulls
    out = []

    ok = not (spec.require_rows and base_rows > 0 and rows == 0)
    out.append(CheckOutcome("rows", ok, spec.severity,
                            f"{rows} rows written from {base_rows} base rows" + ("" if ok else ": the block wrote nothing"),
                            figures))

    lag = stats.get("max_lag")
    if spec.max_lag is None or lag is None:
        out.append(CheckOutcome("lag", True, spec.severity, f"max_lag {lag} s (no threshold)", figures))
    else:
        limit = spec.max_lag.total_seconds()
        ok = float(lag) <= limit
        out.append(CheckOutcome("lag", ok, spec.severity,
                                f"max_lag {float(lag):.0f} s {'<=' if ok else '>'} {format_duration(spec.max_lag)}", figures))

    bad, unknown = [], []
    for col, share in sorted(spec.max_null_share.items()):
        if col not in nulls:
            # Every column of the output is counted (zeros too): a missing one is not in the
            # output, or its figure is unknown. Either way the check cannot pass on it.
            if rows:
                unknown.append(col)
            continue
        actual = nulls[col] / rows if rows else 0.0
        if actual > share:
            bad.append(f"{col} {actual:.1%} > {share:.1%}")
    problems = (["too many nulls: " + ", ".join(bad)] if bad else []) + (
        [f"no null count for {', '.join(unknown)} (not a column of the block's output; fix max_null_share)"] if unknown else [])
    desc = "; ".join(problems) or "null shares within limits"
    out.append(CheckOutcome("nulls", not problems, spec.severity, desc, figures))

    # Late rows are quarantined (counted in bad_rows); this check fails only when they could
    # not all be looked for: a warning, whatever the topic's severity.
    warnings = [str(w) for w in stats.get("warnings") or []]
    out.append(CheckOutcome("late_rows", not warnings, Severity.WARN,
                            "; ".join(warnings) or f"late-row detection complete ({int(stats.get('bad_rows') or 0)} bad rows quarantined)",
                            {"bad_rows": stats.get("bad_rows"), "warnings": "; ".join(warnings) or None}))
    return out


def evaluate_unit(spec: ChecksSpec, stats: dict[str, Any]) -> list[CheckOutcome]:
    """Judge one unit of a merge topic. ``stats``: ``offset_age_s`` (input -> seconds), ``late_rows``
    (late base rows re-derived), ``strategy`` and ``strategy_reason``, ``fallback``."""
    ages = {str(k): float(v) for k, v in (stats.get("offset_age_s") or {}).items() if v is not None}
    oldest = max(ages.items(), key=lambda kv: kv[1]) if ages else None
    meta: dict[str, Any] = {"offset_age_s": ages, "max_offset_age_s": oldest[1] if oldest else None}
    if spec.max_offset_age is None or oldest is None:
        ok, desc = True, f"oldest input offset {oldest[0]} {oldest[1]:.0f} s old (no threshold)" if oldest else "no input offsets"
    else:
        limit = spec.max_offset_age.total_seconds()
        ok = oldest[1] <= limit
        desc = f"oldest input offset {oldest[0]} {oldest[1]:.0f} s old {'<=' if ok else '>'} {format_duration(spec.max_offset_age)}"
    out = [CheckOutcome("offset_age", ok, spec.severity, desc, meta)]
    late = int(stats.get("late_rows") or 0)
    warnings = [str(w) for w in stats.get("warnings") or []]
    out.append(CheckOutcome("late_rows", late == 0 and not warnings, Severity.WARN,
                            "; ".join([*([f"{late} late base rows landed at or before last and were re-derived"] if late else []),
                                       *warnings]) or "no late rows", {"late_rows": late}))
    fallback = bool(stats.get("fallback"))
    out.append(CheckOutcome("refresh", not fallback, Severity.WARN, str(stats.get("strategy_reason") or stats.get("strategy") or ""),
                            {"strategy": stats.get("strategy")}))
    if spec.verify_sample:
        v = dict(stats.get("verify") or {})
        if "error" in v:
            ok, desc = False, f"could not verify the view: {v['error']}"
        elif not v:
            ok, desc = False, "the unit reported no verification (checks.verify_sample is set)"
        else:
            ok = not v.get("differing") and not v.get("duplicates")
            desc = (f"{v.get('keys')} sampled keys equal a recompute" if ok else
                    f"{v.get('differing')} of {v.get('keys')} sampled keys differ from a recompute"
                    + (f", {v.get('duplicates')} duplicate keys" if v.get("duplicates") else "")
                    + (f" (e.g. {v.get('example')})" if v.get("example") else "") + "; run: tidemark verify TOPIC")
        out.append(CheckOutcome(VERIFY_CHECK, ok, Severity.ERROR, desc,
                                {k: v.get(k) for k in ("keys", "differing", "duplicates")}))
    return out
