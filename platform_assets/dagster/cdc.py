"""Dagster wiring of the ``cdc:`` replicators (issue 10).

* every replica is an asset (key ``[<schema>, <table>]``, group = the replicas' schema, kinds
  postgres/delta), materialized by its replicator's multi-asset: one run applies one unit (or
  until caught up) of the replicator, and reports, per replica it touched, a materialization with
  the unit's figures (inserts, updates, deletes, ddl, failed, lag_s, applied LSN — numbers Dagster
  plots) and two checks: ``state`` (fails, severity error, when the replica is PAUSED or FAILING:
  the alert sensor alerts) and ``lag`` (source commit → replica commit against ``checks.max_lag``);
* the replicas are the lineage's explicit names plus those the offset store knows (a table that
  appeared in the source is an asset after the code location reloads; until then its
  materializations are still recorded under its key);
* the ``tidemark_cdc`` sensor (JVM-free) compares each PostgreSQL slot's acknowledged position with
  the server's WAL position (Debezium sources: the files' end with the replicas' applied
  position) and requests a run when changes wait; one pool per replicator keeps runs one at a time.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import dagster as dg

from lineage.cdc.changes import format_lsn
from lineage.core.errors import first_line
from lineage.spec.model import Lineage, Replicator
from platform_assets.dagster.reports import replica_checks, replica_key, replica_reports
from resources.core.settings import Settings

CHECKS = ("state", "lag")
#: Less WAL than this behind the slot is not worth a run (checkpoints and other databases write WAL too).
MIN_BEHIND_BYTES = 256


def known_replicas(settings: Settings, rep: Replicator) -> list[str]:
    """The replicator's replicas: named in the lineage, recorded in the offset store, or in the
    replicator's positions table (``etl.cdc_positions__<name>``: a lost store still lists them)."""
    names = set(rep.spec.explicit_replicas())
    try:
        from resources.state.offset_sql import open_settings_store

        store = open_settings_store(settings)
        try:
            names |= {r.topic for r in store.list() if r.processor == "cdc" and rep.spec.holds(r.topic)}
        finally:
            store.close()
    except Exception:  # noqa: BLE001 - an unreachable store must not break loading the code location
        pass
    try:
        from resources.storage import cdc_positions

        names |= set(cdc_positions.read(settings, rep.name).lsn)
    except Exception:  # noqa: BLE001 - nor an unreadable table
        pass
    return sorted(names)


def _compute(rep: Replicator, replicas: list[str]) -> Any:
    spec = rep.spec
    keys = {replica_key(r) for r in replicas}

    def compute(context):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202 - Dagster inspects the signature
        from platform_assets.cdc.run import run_replicator
        from platform_assets.dagster.io_manager import IO_MANAGER_KEY

        engine = getattr(context.resources, IO_MANAGER_KEY).engine()
        reported: set[str] = set()
        for result in run_replicator(engine, rep, until_caught_up=True):
            context.log.info(f"{rep.name}: {result.reason}")
            for replica, meta, checks in replica_reports(engine.store, rep, result):
                if replica_key(replica) in keys:
                    reported.add(replica)
                    yield dg.MaterializeResult(asset_key=replica_key(replica), metadata=meta, check_results=checks)
                else:  # appeared in the source after the code location loaded
                    context.log_event(dg.AssetMaterialization(asset_key=replica_key(replica), metadata=meta))
        if not reported:
            context.log.info(f"{rep.name}: no replica changed")
        for replica in sorted(r for r in replicas if r not in reported):
            # a replica this run did not touch (nothing changed, e.g. a run started by WAL outside the
            # selection) still has its checks evaluated, on its state now: a run with nothing to apply
            # succeeds, and a paused replica keeps its failed check
            rec = engine.store.get(replica)
            yield from replica_checks(rep, replica, rec.state if rec else "", None)

    compute.__name__ = f"cdc_{spec.name}"
    return compute


def build_cdc(settings: Settings, lineage: Lineage) -> tuple[list[Any], list[Any], list[dg.SensorDefinition]]:
    """The replicators' multi-assets, one job per replicator and the ``tidemark_cdc`` sensor."""
    from platform_assets.dagster.io_manager import IO_MANAGER_KEY

    assets, jobs = [], []
    for rep in lineage.replicators.values():
        replicas = known_replicas(settings, rep)
        if not replicas:
            continue
        keys = {replica_key(r) for r in replicas}
        specs = [dg.AssetSpec(replica_key(r), group_name=rep.spec.schema_, kinds={rep.spec.source, "delta"}, skippable=True,
                              description=f"replica kept by cdc replicator {rep.name} ({rep.spec.comment or rep.where})",
                              metadata={"replicator": rep.name, "location": settings.table_path(r)})
                 for r in replicas]
        check_specs = [dg.AssetCheckSpec(c, asset=replica_key(r), description=f"replica {c}") for r in replicas for c in CHECKS]
        assets.append(dg.multi_asset(name=f"cdc_{rep.name}", specs=specs, check_specs=check_specs, can_subset=False,
                                     required_resource_keys={IO_MANAGER_KEY}, pool=f"tidemark/cdc/{rep.name}")(
            _compute(rep, replicas)))
        jobs.append(dg.define_asset_job(f"tidemark__cdc__{rep.name}", selection=dg.AssetSelection.assets(*keys)))
    sensors = [build_cdc_sensor(settings, lineage, jobs)] if jobs else []
    return assets, jobs, sensors


def pending(settings: Settings, rep: Replicator) -> tuple[bool, str]:
    """Whether changes wait for the replicator, and a description (JVM-free)."""
    from platform_assets.cdc.run import open_source

    source: Any = open_source(rep)
    try:
        if rep.spec.source == "postgres":
            pos, parked = source.position(), source.parked()
            resumed = [r.topic for r in (_following(settings, rep) if parked else [])
                       if source.parked_slot(r.topic) in parked]
            if resumed:  # resumed after a pause: it catches up from its parked slot
                return True, f"{', '.join(resumed)} catching up from a parked slot"
            return pos.behind_bytes >= MIN_BEHIND_BYTES, (f"slot acknowledged {format_lsn(pos.confirmed_flush)}, "
                                                          f"WAL at {format_lsn(pos.current)}")
        end = source.position_end()
    finally:
        source.close()
    applied = [r.last.id for r in _following(settings, rep)]
    return end > min(applied, default=0), f"files end at position {end}, replicas at {min(applied, default=0)}"


def _following(settings: Settings, rep: Replicator) -> list[Any]:
    """The offset records of ``rep``'s replicas that are neither paused nor dropped."""
    from resources.state.offset_sql import open_settings_store

    store = open_settings_store(settings)
    try:
        return [r for r in store.list() if r.processor == "cdc" and rep.spec.holds(r.topic)
                and r.state.split(":")[0] not in ("paused", "dropped")]
    finally:
        store.close()


def build_cdc_sensor(settings: Settings, lineage: Lineage, jobs: list[Any],
                     interval_s: int = 30) -> dg.SensorDefinition:
    by_name = {j.name: j for j in jobs}

    @dg.sensor(name="tidemark_cdc", minimum_interval_seconds=interval_s, jobs=jobs,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Requests a replicator run when its source has changes the replicas have not applied "
                           "(PostgreSQL: the slot's acknowledged LSN behind the server's WAL position).")
    def cdc_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        from platform_assets.dagster.followed import follow_run

        following = follow_run(context.instance)
        if following is not None:
            return dg.SensorResult(skip_reason=f"run {following.run_id} of tidemark_follow runs the replicators "
                                               f"({following.status.value})")
        requests, notes = [], []
        for rep in lineage.replicators.values():
            job = by_name.get(f"tidemark__cdc__{rep.name}")
            if job is None:
                continue
            active = context.instance.get_runs(dg.RunsFilter(job_name=job.name, statuses=[
                dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
                dg.DagsterRunStatus.STARTED]), limit=1)
            if active:
                notes.append(f"{rep.name}: run {active[0].run_id} in progress")
                continue
            try:
                waiting, where = pending(settings, rep)
            except Exception as exc:  # noqa: BLE001 - a source that is down is reported, the next tick retries
                notes.append(f"{rep.name}: cannot read the source: {first_line(exc)}")
                continue
            notes.append(f"{rep.name}: {'changes waiting' if waiting else 'caught up'} ({where})")
            if waiting:
                minute = dt.datetime.now(dt.UTC).strftime("%Y%m%d%H%M")
                requests.append(dg.RunRequest(run_key=f"cdc:{rep.name}:{where}:{minute}", job_name=job.name,
                                              tags={"tidemark/replicator": rep.name}))
        return dg.SensorResult(run_requests=requests, skip_reason=None if requests else "; ".join(notes) or "no replicators")

    return cdc_sensor
