"""Whether continuous mode holds the lineage: the ``tidemark_follow`` job's name, the
``TIDEMARK_MODE`` setting and the live follow run the sensors leave the lineage to (imported by
the sensors and by :mod:`platform_assets.dagster.follow`, which builds the job)."""

from __future__ import annotations

import os

import dagster as dg

from lineage.core.errors import ConfigError

FOLLOW_JOB = "tidemark_follow"
MODE_ENV = "TIDEMARK_MODE"
MODES = ("runs", "follow")
_ACTIVE = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
           dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def mode_setting(env: dict[str, str] | None = None) -> str:
    """``$TIDEMARK_MODE``: ``runs`` (each unit a Dagster run the planner requests; the default) or
    ``follow`` (one long-lived ``tidemark_follow`` run runs every unit)."""
    raw = ((os.environ if env is None else env).get(MODE_ENV) or "runs").strip().lower()
    if raw not in MODES:
        raise ConfigError(f"{MODE_ENV}={raw!r}: use runs (a Dagster run per unit, the default) or follow "
                          f"(one long-lived {FOLLOW_JOB} run runs every unit)")
    return raw


def follow_run(instance: dg.DagsterInstance) -> dg.DagsterRun | None:
    """The ``tidemark_follow`` run queued or running, if any (it holds the lineage's topics)."""
    runs = instance.get_runs(dg.RunsFilter(job_name=FOLLOW_JOB, statuses=_ACTIVE), limit=1)
    return runs[0] if runs else None
