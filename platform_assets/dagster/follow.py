"""Continuous mode in Dagster (issue 55): the ``tidemark_follow`` job and the sensor that keeps it alive.

* ``tidemark_follow`` is one long-lived run: its op runs a :class:`~platform_assets.follow.loop.Follower`
  (every topic and replicator of the lineage, each unit the moment it is due, on one Spark session)
  until the run is terminated. Every unit that did work is reported as its run's unit would be: the
  materialization of its table (a step block's with the block's partition key, added to the
  table's partitions first) with the same metadata, then its checks' evaluations
  (:mod:`platform_assets.dagster.reports`); a replicator's unit per replica it touched; the event
  intake's units as its ``tidemark_intake`` run reports them. Waits and failures go to the run's log.
* the ``tidemark_follow`` sensor keeps one such run alive when ``TIDEMARK_MODE=follow``: it requests
  one when none is queued or running (a run that died is replaced, after 10 s, 20 s, ... up to
  5 min when runs keep failing); with ``TIDEMARK_MODE=runs`` (the default) it does nothing.
* while a ``tidemark_follow`` run is queued or running, the planner and CDC sensors leave the lineage
  to it (:func:`follow_run`); when it ends they take it back at their next tick. A unit started
  by hand (``dagster asset materialize``, ``tidemark run``) still works beside it: the topic's lease
  lock lets one of them run it, and the other names the holder.
"""

from __future__ import annotations

import datetime as dt
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import dagster as dg

from lineage.core.errors import first_line
from lineage.core.partitions import partitions_name
from lineage.spec.model import Lineage, Processor
from platform_assets.dagster.followed import FAILED_RUNS, FOLLOW_JOB, MODE_ENV, follow_run, mode_setting
from platform_assets.follow.loop import EVENTS
from resources.core.settings import Settings

MAX_RESTART_WAIT_S = 300.0


def restart_wait(ended: list[tuple[dg.DagsterRunStatus, float | None]], now: float) -> tuple[float, str]:
    """How long to wait before starting a new follow run, given the last runs' ``(status, end time)``
    newest first: 0 after a success or none; after ``n`` failures in a row 10 s * 2^(n-1), at most 5 min. Pure."""
    failures = 0
    for status, _ in ended:
        if status not in FAILED_RUNS:
            break
        failures += 1
    if not failures:
        return 0.0, ""
    end = ended[0][1] or now
    wait = min(MAX_RESTART_WAIT_S, 10.0 * 2 ** (failures - 1))
    return max(0.0, end + wait - now), f"the last {failures} follow run(s) failed"


class FollowReporter:
    """Turns the follower's events (from its threads) into the Dagster events the op yields (in the
    run's thread): a unit as its materialization and check evaluations, a wait or a failure as a
    log line."""

    def __init__(self, settings: Settings, lineage: Lineage, instance: dg.DagsterInstance, log: Any,
                 intake: Any = None) -> None:
        self.settings, self.lineage, self.instance, self.log = settings, lineage, instance, log
        self.intake = intake
        self._produced: dict[str, list[str]] | None = None  # destination -> the lineage sources it writes
        self._store: Any = None
        self._partitions: dict[str, set[str]] = {}

    @property
    def store(self) -> Any:
        if self._store is None:
            from resources.state.offset_sql import open_settings_store

            self._store = open_settings_store(self.settings)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def events(self, event: Any) -> list[Any]:
        if event.error is not None:
            self.log.warning(f"{event.work}: {event.wait}: {type(event.error).__name__}: {first_line(event.error)}")
            return []
        if event.result is None:
            self.log.info(f"{event.work}: {event.wait}")
            return []
        if event.work.startswith("cdc:"):
            return self._replicator(event)
        if event.work == EVENTS:
            return self._intake(event)
        return self._topic(event.result)

    def _topic(self, result: Any) -> list[Any]:
        from platform_assets.dagster.io_manager import block_metadata
        from platform_assets.dagster.reports import topic_unit_events

        topic = self.lineage.topic(result.topic)
        self.log.info(f"{result.topic}: {result.reason}")
        if topic.spec.processor is Processor.STEP and result.block is not None:
            self._add_partition(topic.spec.destination, self.lineage.block_key(topic.name, result.block.seq))
        return topic_unit_events(self.lineage, result, block_metadata(result))

    def _add_partition(self, table: str, key: str) -> None:
        """A followed block's partition key, added like the planner adds a planned block's."""
        name = partitions_name(table)
        known = self._partitions.get(name)
        if known is None:
            known = self._partitions[name] = set(self.instance.get_dynamic_partitions(name))
        if key not in known:
            self.instance.add_dynamic_partitions(name, [key])
            known.add(key)

    def _intake(self, event: Any) -> list[Any]:
        from platform_assets.dagster.intake import produced_sources, unit_reports

        self.log.info(f"{event.work}: {event.result.reason}")
        if self._produced is None:
            self._produced = {d.id: produced_sources(d, self.lineage) for d in self.intake.spec.destinations}
        return _as_events(unit_reports(self.intake, self._produced, event.result.results))

    def _replicator(self, event: Any) -> list[Any]:
        from platform_assets.dagster.reports import replica_key, replica_reports

        rep = self.lineage.replicators[event.work.removeprefix("cdc:")]
        self.log.info(f"{event.work}: {event.result.reason}")
        return _as_events((replica_key(replica), meta, checks)
                          for replica, meta, checks in replica_reports(self.store, rep, event.result))


def _as_events(reports: Iterable[tuple[dg.AssetKey, dict[str, Any], list[dg.AssetCheckResult]]]) -> list[Any]:
    """Each ``(asset, metadata, checks)`` a unit reports as the events its run would log."""
    from platform_assets.dagster.reports import evaluation

    out: list[Any] = []
    for key, meta, checks in reports:
        out.append(dg.AssetMaterialization(asset_key=key, metadata=meta))
        out.extend(evaluation(c) for c in checks)
    return out


def follow_events(settings: Settings, lineage: Lineage, context: Any, *, poll_s: float = 0.5,
                  max_seconds: float | None = None, until_idle_s: float | None = None) -> Iterator[Any]:
    """Run a follower in a thread and yield its units' Dagster events as they come, until the run is
    terminated (the op's thread is interrupted: the follower stops, its units in flight finish or are
    redone by the next start) or, for tests, ``max_seconds`` / ``until_idle_s``."""
    from platform_assets.follow.loop import Follower, batch_intake

    events: queue.SimpleQueue[Any] = queue.SimpleQueue()
    intake = batch_intake()
    follower = Follower(settings, lineage, report=events.put, intake=intake)
    reporter = FollowReporter(settings, lineage, context.instance, context.log, intake)
    stop = threading.Event()
    failed: list[BaseException] = []

    def follow() -> None:
        try:
            follower.run(stop, max_seconds=max_seconds, until_idle_s=until_idle_s)
        except BaseException as exc:  # noqa: BLE001 - raised again in the run's thread
            failed.append(exc)
        finally:
            stop.set()

    context.log.info(f"following {len(follower.works)} topics and replicators on {follower.threads} threads: "
                     f"{', '.join(follower.works)}")
    for name, why in follower.left_out.items():
        context.log.warning(f"{name} not followed: {why}")
    thread = threading.Thread(target=follow, name="tidemark-follower", daemon=True)
    thread.start()
    try:
        while True:
            try:
                event = events.get(timeout=poll_s)
            except queue.Empty:
                if not thread.is_alive():
                    break
                continue
            yield from reporter.events(event)
        while True:  # what the last units reported before the follower stopped
            try:
                yield from reporter.events(events.get_nowait())
            except queue.Empty:
                break
    finally:
        stop.set()
        thread.join()
        follower.close()
        reporter.close()
    if failed:
        raise failed[0]
    context.log.info(f"the follower stopped after {follower.units} units")


def build_follow_job(settings: Settings, lineage: Lineage) -> dg.JobDefinition:
    # Run config (both unset: follow until the run is terminated).
    config = {
        "until_idle_s": dg.Field(float, is_required=False,
                                 description="stop once nothing ran for this long and nothing is due (a catch-up)"),
        "max_seconds": dg.Field(float, is_required=False, description="stop after this long"),
    }

    @dg.op(name="follow", config_schema=config, out={},
           description="Runs every unit of the lineage the moment it is due (continuous mode), reporting each as its "
                       "asset's materialization and checks.")
    def follow_op(context):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202 - Dagster inspects the signature
        yield from follow_events(settings, lineage, context, until_idle_s=context.op_config.get("until_idle_s"),
                                 max_seconds=context.op_config.get("max_seconds"))

    @dg.job(name=FOLLOW_JOB, tags={"tidemark/follow": "all"},
            description="Continuous mode: one long-lived run (tidemark follow inside Dagster). The tidemark_follow "
                        "sensor keeps it alive with TIDEMARK_MODE=follow; the planner leaves the topics to it meanwhile.")
    def follow_job() -> None:
        follow_op()

    return follow_job


def build_follow_sensor(job: dg.JobDefinition, *, interval_s: int = 10) -> dg.SensorDefinition:
    @dg.sensor(name="tidemark_follow", job=job, minimum_interval_seconds=interval_s,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description=f"With {MODE_ENV}=follow, keeps one {FOLLOW_JOB} run alive: starts it when none is queued "
                           "or running, and replaces one that died (backing off when runs keep failing).")
    def follow_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        mode = mode_setting()
        if mode != "follow":
            return dg.SensorResult(skip_reason=f"{MODE_ENV}={mode}: the planner requests a run per unit")
        active = follow_run(context.instance)
        if active is not None:
            return dg.SensorResult(skip_reason=f"run {active.run_id} follows the lineage ({active.status.value})")
        now = dt.datetime.now(dt.UTC).timestamp()
        records = context.instance.get_run_records(dg.RunsFilter(job_name=FOLLOW_JOB), limit=10)
        wait, why = restart_wait([(r.dagster_run.status, r.end_time) for r in records], now)
        if wait > 0:
            return dg.SensorResult(skip_reason=f"{why}: the next starts in {wait:.0f} s")
        return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"follow@{now:.0f}")])

    return follow_sensor
