"""Whether continuous mode holds the lineage: the ``tidemark_follow`` job's name, the
``TIDEMARK_MODE`` setting and the live follow run the sensors leave the lineage to (imported by
the sensors and by :mod:`platform_assets.dagster.follow`, which builds the job); and the run
statuses every sensor means by "in progress" and "failed"."""

from __future__ import annotations

import os

import dagster as dg

from lineage.core.errors import ConfigError

FOLLOW_JOB = "tidemark_follow"
MODE_ENV = "TIDEMARK_MODE"
MODES = ("runs", "follow")
#: A run queued or running (the sensors' "in progress"), and a run that ended without success.
ACTIVE_RUNS = frozenset({dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
                         dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING})
FAILED_RUNS = frozenset({dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED})


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
    runs = instance.get_runs(dg.RunsFilter(job_name=FOLLOW_JOB, statuses=list(ACTIVE_RUNS)), limit=1)
    return runs[0] if runs else None
