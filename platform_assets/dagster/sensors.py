"""The planner sensor: runs the platform by itself.

Each tick, for every step topic it plans the next block in the offset store (JVM-free: offsets,
Delta statistics and ``pos``/``id`` of new files only), adds the block's partition and requests
its run in the same tick; for reload topics it requests a rebuild when the base changed. A
topic that may not run reports why (the planner's reason) in the tick's skip reason.

A failed block keeps its partition key (the same ``(last, next]``) and is retried with
exponential backoff up to ``max_attempts``; each attempt has its own ``run_key``, because
Dagster never relaunches a run key it has seen.

A lock held by a Dagster run that Dagster reports as ended (failed or canceled, e.g. its container
was killed) is freed at the start of the tick, logged in the offset store as ``release-dead``, so
its block is retried without waiting for the lock's lease to expire.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

from lineage.core.checks import CHECK_NAMES, HEALTH_CHECK
from lineage.core.errors import TidemarkError, TopicLockedError
from lineage.core.partitions import expired_block_keys, partitions_name
from lineage.core.positions import Position
from lineage.spec.model import Lineage, Processor
from platform_assets.dagster import watch
from platform_assets.dagster.followed import ACTIVE_RUNS, FAILED_RUNS
from resources.core.settings import Settings
from resources.state.offsets import OffsetStore
from resources.storage import delta_meta
from resources.storage.delta_log import newest_version

BLOCK_TAG = "tidemark/block"
TOPIC_TAG = "tidemark/topic"
PRIORITY_TAG = "dagster/priority"  # the run queue launches higher values first
UNREADABLE = -2  # the version of a table the planner could not look at


@dataclass(frozen=True)
class PastRun:
    status: dg.DagsterRunStatus
    ended_at: float | None  # unix seconds


def launch_decision(runs: Sequence[PastRun], now: float, *, max_attempts: int, backoff_s: float) -> tuple[bool, int, str]:
    """Whether to launch a block's run now: ``(launch, attempt number, reason)``. Pure."""
    if any(r.status in ACTIVE_RUNS for r in runs):
        return False, 0, "a run is in progress"
    failures = [r for r in runs if r.status in FAILED_RUNS]
    if any(r.status == dg.DagsterRunStatus.SUCCESS for r in runs) and not failures:
        return False, 0, "already ran successfully"
    attempt = len(failures) + 1
    if attempt > max_attempts:
        return False, attempt, f"gave up after {len(failures)} failed attempts (materialize the partition by hand to retry)"
    if failures:
        last_end = max(r.ended_at or 0.0 for r in failures)
        wait_until = last_end + backoff_s * 2 ** (len(failures) - 1)
        if now < wait_until:
            return False, attempt, f"retry {attempt} after {dt.datetime.fromtimestamp(wait_until, dt.UTC):%H:%M:%S} UTC (backoff)"
    return True, attempt, "retry" if failures else "new block"


def job_name(table: str) -> str:
    return "tidemark__" + table.replace(".", "__")


def table_jobs(tables: list[str]) -> dict[str, dg.UnresolvedAssetJobDefinition]:
    """An asset job per destination table (the unit a block or reload run materializes) with the
    table's unit checks; ``table_health`` is the maintenance job's (a block does not evaluate it)."""
    def selection(key: dg.AssetKey) -> dg.AssetSelection:
        return dg.AssetSelection.assets(key) - dg.AssetSelection.checks(dg.AssetCheckKey(key, HEALTH_CHECK))

    return {t: dg.define_asset_job(job_name(t), selection=selection(dg.AssetKey(t.split(".")))) for t in tables}


def _blocked_tables(instance: dg.DagsterInstance, lineage: Lineage) -> dict[str, str]:
    """Tables whose latest evaluation of a *blocking* check failed: their downstream topics
    wait until a later block of theirs passes. One query for every blocking check."""
    keys = {
        dg.AssetCheckKey(dg.AssetKey(t.spec.destination.split(".")), name): t.spec.destination
        for t in lineage.topics.values() if t.spec.checks.blocking for name in CHECK_NAMES
    }
    if not keys:
        return {}
    latest = instance.event_log_storage.get_latest_asset_check_execution_by_key(list(keys))
    out: dict[str, str] = {}
    for key, record in latest.items():
        if record.status == AssetCheckExecutionRecordStatus.FAILED:
            table = keys[key]
            out[table] = (out[table] + ", " if table in out else "") + f"check '{key.name}' failed"
    return out


def release_ended_runs(instance: dg.DagsterInstance, store: OffsetStore) -> list[str]:
    """Free the locks whose owner names a Dagster run that ended as failed or canceled; returns
    what was freed. One store query, and one run query for the runs that hold locks."""
    from resources.state.offset_sql import OwnerId

    held: dict[str, list[tuple[str, str]]] = {}  # run id -> [(topic, owner)]
    for rec in store.list():
        parsed = OwnerId.parse(rec.owner) if rec.owner else None
        if parsed is not None and parsed.run_id:
            held.setdefault(parsed.run_id, []).append((rec.topic, rec.owner))
    if not held:
        return []
    freed = []
    for record in instance.get_run_records(dg.RunsFilter(run_ids=list(held))):
        run = record.dagster_run
        if run.status not in FAILED_RUNS:  # alive, or succeeded (a successful run releases its locks)
            continue
        for topic, owner in held[run.run_id]:
            reason = f"Dagster run {run.run_id} ended as {run.status.value}"
            if store.release_dead(topic, owner, who="tidemark_planner", reason=reason):
                freed.append(f"{topic}: freed the lock of '{owner}': {reason}")
    return freed


def offset_age_checks(engine: Any, lineage: Lineage, states: dict[str, str]) -> tuple[list[dg.AssetCheckEvaluation], dict[str, str]]:
    """The ``offset_age`` check of every merge topic with ``checks.max_offset_age``, judged on each
    tick (a topic that stops running gets no unit, hence no check from a run): an evaluation is
    reported (runless; the alert sensor alerts on a failed one) only when the verdict changes
    from ``states`` (topic -> "pass" | "fail", kept in the sensor's cursor)."""
    from lineage.core.checks import Severity
    from platform_assets.core import blocks

    out: list[dg.AssetCheckEvaluation] = []
    new = dict(states)
    for topic in lineage.topics.values():
        limit = topic.spec.checks.max_offset_age
        if topic.spec.processor is not Processor.MERGE or limit is None:
            continue
        rec = engine.store.get(topic.name)
        if rec is None or not rec.inputs:
            continue
        ages = {k: v for k, v in blocks.offset_ages(engine, topic, rec.last, dict(rec.inputs)).items() if v is not None}
        if not ages:
            continue
        oldest, age = max(ages.items(), key=lambda kv: kv[1])
        verdict = "pass" if age <= limit.total_seconds() else "fail"
        if states.get(topic.name) == verdict:
            continue
        new[topic.name] = verdict
        severity = dg.AssetCheckSeverity.ERROR if topic.spec.checks.severity is Severity.ERROR else dg.AssetCheckSeverity.WARN
        out.append(dg.AssetCheckEvaluation(
            asset_key=dg.AssetKey(topic.spec.destination.split(".", 1)), check_name="offset_age", passed=verdict == "pass",
            severity=severity,
            description=f"oldest input offset {oldest} {age:.0f} s old {'<=' if verdict == 'pass' else '>'} "
                        f"{limit.total_seconds():.0f} s (checked by tidemark_planner)",
            metadata={"max_offset_age_s": age, "offset_age_s": dg.MetadataValue.json(ages)}))
    return out, new


def build_planner_sensor(settings: Settings, lineage: Lineage, *, max_attempts: int = 3, backoff_s: float = 60.0,
                         interval_s: int | None = None, every_s: int | None = None,
                         retention: int | None = None) -> dg.SensorDefinition:
    """``retention``: block partitions kept per topic (default ``$TIDEMARK_PARTITION_RETENTION``
    or 1000); older keys are deleted (Dagster recommends at most ~100k partitions per asset).
    ``interval_s``: seconds between ticks (default ``$TIDEMARK_PLANNER_INTERVAL`` or 5); a tick
    plans only when a table or the offset store changed, a delay passed, or the last planning is
    ``every_s`` old (default ``$TIDEMARK_PLANNER_FULL_INTERVAL`` or 30): see :mod:`platform_assets.dagster.watch`."""
    keep = retention or int(os.environ.get("TIDEMARK_PARTITION_RETENTION", "1000"))
    interval_s = interval_s or watch.env_seconds("TIDEMARK_PLANNER_INTERVAL", 5)
    every_s = every_s or watch.env_seconds("TIDEMARK_PLANNER_FULL_INTERVAL", 30)
    rescan_s = watch.env_seconds("TIDEMARK_PLANNER_RESCAN", 300)
    producers: dict[str, set[str]] = {}
    for t in lineage.topics.values():
        producers.setdefault(t.spec.destination, set()).add(t.name)
    priority = watch.downstream_counts({t.name: (t.spec.destination, t.spec.depends_on) for t in lineage.topics.values()})
    # What moves each topic: the tables it reads (its inputs and, for a reload or a merge view, its
    # own table) and the topics producing its inputs; and the delay its rows must reach.
    moved_by = {t.name: watch.Reads(frozenset({*t.spec.depends_on, t.spec.destination}),
                                    frozenset(p for d in t.spec.depends_on for p in producers.get(d, ()) if p != t.name))
                for t in lineage.topics.values()}
    reads = [(moved_by[t.name].tables, t.spec.delay.total_seconds()) for t in lineage.topics.values()]
    tables = sorted(set().union(*(r.tables for r in moved_by.values())))

    # One job per table: a sensor may target several jobs, but one asset job cannot mix the
    # tables' different block partitions.
    jobs = table_jobs(list(lineage.destinations()))

    @dg.sensor(name="tidemark_planner", minimum_interval_seconds=interval_s, jobs=list(jobs.values()),
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Plans the next block of every topic and requests its run when delay, "
                           "depends_on and repeat allow; the skip reason says why topics wait. Plans "
                           "when a table or the offset store changed, a delay passed, or every "
                           f"{every_s} s; other ticks only look (one file lookup per table).")
    def planner(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        from platform_assets.dagster.followed import follow_run
        from platform_assets.engine.runner import Engine

        following = follow_run(context.instance)
        if following is not None:  # continuous mode holds the lineage; the next tick after it ends plans again
            return dg.SensorResult(skip_reason=f"run {following.run_id} of tidemark_follow runs every unit "
                                               f"({following.status.value}); planning resumes when it ends")
        engine = Engine(settings, lineage)
        now = dt.datetime.now(dt.UTC).timestamp()
        last, states = watch.read_cursor(context.cursor)
        try:
            full = last is None or now - last.planned_at >= every_s
            versions: dict[str, int | None] = {}
            for t in tables:
                try:
                    versions[t] = newest_version(engine.path(t), None if last is None else last.versions.get(t), recheck=full)
                except Exception as exc:  # noqa: BLE001 - one unreadable table must not stop the lineage
                    versions[t] = UNREADABLE  # its topics are planned, and say why they cannot run
                    context.log.warning(f"planner: cannot look at {t} ({engine.path(t)}): {type(exc).__name__}: {exc}")
            head = engine.store.log_head()
        except BaseException:
            engine.close()
            raise
        why = watch.why_plan(last, versions, head, now, every_s=every_s)
        if why is None and last is not None:
            engine.close()
            since = dt.datetime.fromtimestamp(last.planned_at, dt.UTC).strftime("%H:%M:%S")
            return dg.SensorResult(skip_reason=f"nothing changed since the planning at {since} UTC"
                                               f"{'; it found: ' + last.waits if last.waits else ''}")
        try:
            logged, recent = watch.new_entries(last, engine.store.logged_after(watch.log_window(last)), head)
        except BaseException:
            engine.close()
            raise
        changed = watch.changed_tables(last, versions)
        due = [d for d in (last.due if last else []) if d > now]
        due += watch.delays_started(reads, changed, now)
        rescan = last is None or now - last.rescanned_at >= rescan_s
        to_plan = watch.topics_to_plan(last, moved_by, changed, logged, rescan=rescan, head=head)
        quiet: dict[str, str] = {}  # topics this planning found waiting for their inputs only

        def wait(name: str, reason: str) -> None:
            waits.append(f"{name}: {reason}")
            if watch.is_quiet(reason):
                quiet[name] = reason
        context.log.info(f"planning {len(to_plan)} of {len(moved_by)} topics: {why}")
        blocked = _blocked_tables(context.instance, lineage)
        # Dagster validates each run request's partition key through this same caching loader
        # (with the keys this tick adds): asking it here saves Dagster a second query per key.
        partitions = context.caching_dynamic_partitions_loader or context.instance
        requests: list[dg.RunRequest] = []
        adds: dict[str, list[str]] = {}
        deletes: dict[str, list[str]] = {}
        blocks: list[tuple[str, str, int, str]] = []  # (topic, table, seq, partition key)
        units: list[tuple[str, str, str]] = []  # merge units and reloads: (topic, table, run tag)
        waits: list[str] = []
        held_open = contextlib.ExitStack()
        try:
            for line in release_ended_runs(context.instance, engine.store):
                context.log.info(line)
            try:
                evaluations, states = offset_age_checks(engine, lineage, states)
                for evaluation in evaluations:
                    context.instance.report_runless_asset_event(evaluation)
            except (TidemarkError, OSError) as exc:  # never let the check stop the planning
                context.log.warning(f"offset_age checks skipped this tick: {type(exc).__name__}: {exc}")
            # The step topics' bases, opened at once in threads before they are planned one by one,
            # with the rows after each topic's last position (where its next block ends).
            records = {r.topic: r for r in engine.store.list()}
            bases: dict[str, list[Position]] = {}
            for step in lineage.topics.values():
                rec = records.get(step.name)
                if (step.spec.processor is Processor.STEP and (step.name in to_plan or last is None)
                        and not (rec and (rec.pending or rec.owner))):  # (a pending block is planned already)
                    # (no record yet: most often a new topic, whose first block starts at the beginning)
                    bases.setdefault(engine.path(step.spec.base), []).append(rec.last if rec else Position.zero())
            held_open.enter_context(delta_meta.prefetched(bases, after=bases))
            for topic in lineage.topics.values():
                name, table = topic.name, topic.spec.destination
                if name not in to_plan and last is not None:  # quiet, and nothing it reads changed
                    wait(name, last.quiet[name])
                    continue
                held = [f"{d} ({blocked[d]})" for d in topic.spec.depends_on if d in blocked]
                if held:
                    waits.append(f"{name}: blocked by a failed blocking check of {', '.join(held)}")
                    continue
                try:
                    if topic.spec.processor is Processor.MERGE:
                        # A unit is planned by its run, under the lock. Its tag names the unit and, for a new
                        # one, what the run will see: a failed run is retried with backoff like a block, and
                        # new changes after a run that found nothing to do still get a run.
                        rec = engine.ensure_offsets(topic)
                        if rec.pending:
                            units.append((name, table, f"{name}@{rec.seq}"))
                            continue
                        look = engine.merge.look(topic, rec)
                        if look.ready:
                            sig = ",".join([look.end.to_text(), str(look.base.version), *(str(c.new) for c in look.changes)])
                            units.append((name, table, f"{name}@{rec.seq + 1}:{sig}"))
                        else:
                            wait(name, look.reason)
                        continue
                    if topic.spec.processor is Processor.RELOAD:
                        rec = engine.ensure_offsets(topic)
                        decision, _ = engine.decide(topic, rec)
                        if decision.ready:  # retried like a unit: a run key Dagster has seen never runs again
                            units.append((name, table, f"{name}@{rec.seq + 1}:reload"))
                        else:
                            wait(name, decision.reason)
                        continue
                    planned = engine.plan_block(name, durable=False)  # one wait for the disk, below
                except TopicLockedError as exc:
                    waits.append(f"{name}: running ({exc.holder})")
                    continue
                except TidemarkError as exc:
                    waits.append(f"{name}: error: {exc}")
                    continue
                if planned.block is None:
                    wait(name, planned.reason)
                    continue
                seq = planned.block.seq
                pkey = lineage.block_key(name, seq)
                pname = partitions_name(table)
                if seq > keep:  # only then can retention have anything to delete
                    existing = list(context.instance.get_dynamic_partitions(pname))
                    deletes.setdefault(pname, []).extend(k for k in expired_block_keys([*existing, pkey], keep) if k != pkey)
                    present = pkey in existing
                else:
                    # A block planned in this tick is added without asking: its key is new
                    # unless the offset store was restored, and the daemon skips existing keys
                    # anyway. A pending block's key may be missing (a tick failed after planning,
                    # or `tidemark run` crashed after planning): ask.
                    present = planned.retry and partitions.has_dynamic_partition(pname, pkey)
                if not present:
                    adds.setdefault(pname, []).append(pkey)
                blocks.append((name, table, seq, pkey))
            if blocks:  # the plans are durable before their runs are requested
                engine.store.sync()
        finally:
            held_open.close()
            engine.close()
        # One query for the past runs of every planned block (not one per topic).
        tags = [f"{name}@{seq}" for name, _, seq, _ in blocks]
        unit_tags = [tag for _, _, tag in units]
        past: dict[str, list[PastRun]] = {}
        if tags or unit_tags:
            every = [*tags, *unit_tags]
            for r in context.instance.get_run_records(dg.RunsFilter(tags={BLOCK_TAG: every}), limit=50 * len(every)):
                past.setdefault(r.dagster_run.tags.get(BLOCK_TAG, ""), []).append(PastRun(r.dagster_run.status, r.end_time))
        for (name, table, seq, pkey), tag in zip(blocks, tags, strict=True):
            launch, attempt, why = launch_decision(past.get(tag, []), now, max_attempts=max_attempts, backoff_s=backoff_s)
            if launch:
                requests.append(dg.RunRequest(run_key=f"{tag}#{attempt}", partition_key=pkey, job_name=jobs[table].name,
                                              tags={BLOCK_TAG: tag, TOPIC_TAG: name, PRIORITY_TAG: str(priority[name])}))
            else:
                waits.append(f"{name} block {seq}: {why}")
        # A merge unit's (or reload's) run plans the unit itself: while a run of the topic is queued or running,
        # a new look (new changes, another tag) must not queue a second one, which would find the
        # first one's work done. One query for every unit's topic.
        active: dict[str, str] = {}
        if units:
            for r in context.instance.get_run_records(dg.RunsFilter(tags={TOPIC_TAG: [n for n, _, _ in units]},
                                                                    statuses=list(ACTIVE_RUNS)), limit=10 * len(units)):
                active.setdefault(r.dagster_run.tags.get(TOPIC_TAG, ""), r.dagster_run.run_id)
        for name, table, tag in units:
            launch, attempt, why = launch_decision(past.get(tag, []), now, max_attempts=max_attempts, backoff_s=backoff_s)
            if launch and name in active:
                launch, why = False, f"run {active[name][:8]} of the topic is queued or running"
            if launch:
                requests.append(dg.RunRequest(run_key=f"{tag}#{attempt}", job_name=jobs[table].name,
                                              tags={BLOCK_TAG: tag, TOPIC_TAG: name, PRIORITY_TAG: str(priority[name])}))
            else:
                waits.append(f"{name} unit {tag.partition('@')[2].partition(':')[0]}: {why}")
        deletes = {n: keys for n, keys in deletes.items() if keys}
        if waits:  # the skip reason shows only on ticks that request nothing; the log always
            context.log.info(f"{len(waits)} waiting:\n" + "\n".join(waits))
        skip = "; ".join(waits) or "no topics"
        # The offset log's head as read before this planning: what this planning wrote (planned
        # blocks, freed locks) makes the next tick plan once more, but a commit that lands while
        # this one plans is never taken for seen.
        seen = watch.Look(versions=versions, log_head=head, planned_at=now, due=due, waits=skip, quiet=quiet,
                          rescanned_at=now if rescan else last.rescanned_at if last else 0.0, recent=recent)
        return dg.SensorResult(
            cursor=watch.write_cursor(seen, states),
            run_requests=requests,
            dynamic_partitions_requests=[
                *(dg.AddDynamicPartitionsRequest(n, keys) for n, keys in adds.items()),
                *(dg.DeleteDynamicPartitionsRequest(n, keys) for n, keys in deletes.items()),
            ],
            skip_reason=None if requests else skip,
        )

    return planner
