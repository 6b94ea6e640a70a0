"""``tidemark`` command line: validate the lineage, look at offsets and lag, run topics, run
the demo. Commands that only read metadata (``lineage validate``, ``lag``, ``offsets``,
``log``) never start a JVM."""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lineage.core.durations import format_duration
from lineage.core.errors import ConfigError, LineageError, TidemarkError
from lineage.core.positions import Position
from lineage.spec.model import Processor
from platform_assets.cli.common import close_engines, engine_from, format_cell, format_table, settings_from
from resources.core.settings import Settings
from resources.storage.warehouse import check_warehouse, local_dir


def cmd_validate(args: argparse.Namespace) -> int:
    from lineage.spec.loader import load_lineage

    settings = settings_from(args)
    lineage = load_lineage(settings.lineage)
    rows = [(t.name, t.spec.processor.value, ", ".join(t.spec.depends_on), format_duration(t.spec.delay), format_duration(t.spec.repeat),
             t.spec.maxstep, t.where) for t in lineage.topics.values()]
    print(format_table(rows, ["topic", "processor", "depends_on", "delay", "repeat", "maxstep", "declared at"]))
    print(f"\nOK: {len(lineage.topics)} topics, {len(lineage.sources)} sources in {len(lineage.files)} file(s) under {settings.lineage}")
    for warning in [*_wait_warnings(settings, lineage), *_exactness_warnings(settings, lineage)]:
        print(f"warning: {warning}")
    return 0


def _exactness_warnings(settings: Settings, lineage: Any) -> list[str]:
    """Merge topics whose ``join_keys`` cannot give the affected keys exactly (a change of that
    input will recompute the whole view): a view column instead of the base's join column, or a
    Python transform. Reads the base's schema from its Delta log (no JVM); a base that does not
    exist yet is not judged."""
    from lineage.views.refresh import inexact
    from resources.storage.delta_meta import TableSnapshot

    out = []
    for t in lineage.topics.values():
        if t.spec.processor is not Processor.MERGE or not t.spec.join_keys:
            continue
        base = TableSnapshot.open(settings.table_path(t.spec.base, _source_path(lineage, t.spec.base)))
        if base.version is None:
            continue
        for table in t.spec.join_keys:
            why = inexact(t.spec, table, base.columns, python_transform=t.python)
            if why:
                out.append(f"{t.where}: topic '{t.name}': join_keys of {table}: {why}; every change of {table} will "
                           f"recompute the whole view (refused under refresh: incremental_strict)")
    return out


def _source_path(lineage: Any, table: str) -> str | None:
    src = lineage.sources.get(table)
    return src.spec.path if src is not None else None


def _wait_warnings(settings: Settings, lineage: Any) -> list[str]:
    """Rules that cannot be met as things stand (valid, but a topic would wait for ever): a
    source table that does not exist, a step topic whose base is declared ``static``. Reads
    only Delta metadata (no JVM)."""
    from resources.storage.delta_log import open_table

    out = []
    for t in lineage.topics.values():
        for i, dep in enumerate(t.spec.depends_on):
            src = lineage.sources.get(dep)
            if src is None:
                continue  # produced by a topic: fresh once that topic runs
            if i == 0 and src.spec.freshness == "static" and t.spec.processor.value == "step":
                out.append(f"{t.where}: topic '{t.name}': its base {dep} is declared 'freshness: static' (never changes), "
                           "so it never gets a block; use a reload topic or drop the declaration")
            elif src.spec.freshness != "static" and open_table(settings.table_path(dep, src.spec.path)) is None:
                role = "base" if i == 0 else "dependency"
                out.append(f"{t.where}: topic '{t.name}': {role} {dep} does not exist at "
                           f"{settings.table_path(dep, src.spec.path)}; the topic waits until it does (check the table "
                           "name or the source's path)")
    return out


def cmd_publish(args: argparse.Namespace) -> int:
    eng = engine_from(args)
    wrote = eng.publish_lineage()
    print(f"sch.lineage {'updated' if wrote else 'already current'} at {eng.path('sch.lineage')}")
    return 0


def _lag_rows(eng: Any) -> str:
    lag = eng.lag()
    rows = [(r.topic, r.processor, r.last, r.next, r.source_max, r.lag_s, r.offset_age_s, r.state, r.owner or "", r.reason)
            for r in lag]
    out = format_table(rows, ["topic", "processor", "last", "next", "source max", "lag s", "offset age s", "state", "owner", "reason"])
    ages = [f"  {r.topic}: " + ", ".join(f"{t} {'-' if a is None else f'{a:.0f}'} s" for t, a in r.offset_ages.items())
            for r in lag if len(r.offset_ages) > 1]
    if ages:  # merge topics: one offset per input
        out += "\noffset age per input:\n" + "\n".join(ages)
    warnings = [f"WARNING {r.topic}: {r.warning}" for r in lag if r.warning]
    from platform_assets.maintenance.tables import retention_warnings

    # A table's own retention that would let a plain VACUUM or log cleanup remove what a topic needs.
    warnings += [f"WARNING {w}" for w in retention_warnings(eng)]
    return "\n".join([out, *warnings])


def cmd_explain(args: argparse.Namespace) -> int:
    eng = engine_from(args)
    topic = eng.lineage.topic(args.topic)
    if topic.spec.processor is Processor.MERGE:
        from platform_assets.views import operate as views

        print("\n".join(views.explain(eng, topic, keys=args.keys)))
        return 0
    row = next(r for r in eng.lag() if r.topic == topic.name)
    print(f"topic {topic.name} ({topic.spec.processor.value} into {topic.spec.destination}): last {format_cell(row.last)}"
          f"{', block pending up to ' + format_cell(row.next) if row.next else ''}\n  {row.reason}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from platform_assets.views.verify import verify

    eng = engine_from(args)
    verdict = verify(eng, eng.lineage.topic(args.topic), sample=args.sample, show=args.show, seed=args.seed)
    print("\n".join(verdict.lines()))
    return 0 if verdict.ok else 1


def cmd_lag(args: argparse.Namespace) -> int:
    print(_lag_rows(engine_from(args)))
    return 0


def cmd_tables(args: argparse.Namespace) -> int:
    from platform_assets.maintenance import tables as maintain

    eng = engine_from(args)
    healths = maintain.healths(eng, args.tables or None)
    print(format_table([maintain.health_row(h) for h in healths], maintain.HEALTH_COLUMNS))
    for h in healths:
        for warning in h.warnings:
            print(f"warning: {warning}")
    return 0


def cmd_maintain(args: argparse.Namespace) -> int:
    from platform_assets.maintenance import tables as maintain

    eng = engine_from(args)
    opts = maintain.Options(retain_hours=args.retain_hours, dry_run=args.dry_run, compact=not args.no_compact,
                            cleanup=not args.no_cleanup, cluster=args.cluster, writers_idle=args.writers_idle)
    # A whole maintenance also prunes the offset log's history; its settings are checked first.
    retention = _log_retention(args) if not args.tables and opts.cleanup else None
    failed: list[str] = []

    def show(h: Any, report: Any, exc: Exception | None) -> None:
        if exc is not None:
            failed.append(h.table)
            print(f"{h.table}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            return
        print(f"{h.table} {maintain.heading(h, report)}", flush=True)
        for line in maintain.describe(h, report):
            print(f"  {line}", flush=True)

    reports = maintain.run(eng, args.tables or None, opts, on_report=show)
    done = maintain.totals(reports)
    would = "would be " if args.dry_run else ""
    purged = done["deletion_vector_files_purged"]
    print(f"{len(reports)} table(s): {done['small_files_compacted']} small files {would}compacted, "
          + (f"{purged} files with deletion vectors {would}purged, " if purged else "") +
          f"{done['data_files_removed']} data files and {done['log_files_removed']} log files {would}removed")
    problems = [f"{len(failed)} table(s) failed: {', '.join(failed)} (the others were maintained)"] if failed else []
    from platform_assets.views import indexes

    refreshed = indexes.refresh(eng, args.tables or None, dry_run=args.dry_run)
    for r in refreshed:
        print(r.line(), flush=True)
    if bad := [f"{r.view} on {r.column}" for r in refreshed if r.failed]:
        problems.append(f"{len(bad)} join index(es) failed: {', '.join(bad)} (units scan the base meanwhile)")
    if retention is not None:
        pruned, line = maintain.prune_offset_log(eng.store, retention, dry_run=args.dry_run)
        print(line, flush=True)
        if pruned is None:
            problems.append("the offset log was not pruned (above)")
    if problems:
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 1
    return 0


def _log_retention(args: argparse.Namespace) -> Any:
    """The offset log's retention: ``TIDEMARK_OFFSET_LOG_RETENTION``/``_KEEP``, overridden by
    ``--older-than``/``--keep`` where given."""
    from lineage.core.durations import parse_duration
    from resources.state.offsets import (
        LOG_RETENTION_ENV,
        MIN_LOG_RETENTION,
        LogRetention,
        log_retention_from_env,
    )

    retention = log_retention_from_env()
    older = getattr(args, "older_than", None)
    if older is not None:
        try:
            age = parse_duration(older)
        except ValueError as exc:
            raise ConfigError(f"--older-than: {exc}") from None
        if not age:
            raise ConfigError(f"--older-than {older!r}: give an age such as 30d (to keep the whole log, prune nothing; "
                              f"{LOG_RETENTION_ENV}=0 makes tidemark maintain keep it)")
        if age < MIN_LOG_RETENTION:
            raise ConfigError(f"--older-than {older!r}: keep the offset log at least 1h (the offset log's entries "
                              "of the last hour tell what is running now)")
        retention = LogRetention(age, retention.keep)
    keep = getattr(args, "keep", None)
    if keep is not None:
        if keep < 1:
            raise ConfigError(f"--keep {keep}: each topic keeps at least its newest log entry (give a number >= 1)")
        retention = LogRetention(retention.age, keep)
    return retention


def cmd_offsets(args: argparse.Namespace) -> int:
    eng = engine_from(args)
    store = eng.store
    if args.action == "show":
        if args.history:
            entries = store.history(args.topic, limit=args.limit)
            print(format_table([(e.at, e.topic, e.action, e.who, e.old_last, e.new_last, e.note) for e in entries],
                               ["at", "topic", "action", "who", "old last", "new last", "note"]))
            return 0
        recs = [r for r in store.list() if args.topic in (None, r.topic)]
        print(format_table([(r.topic, r.last, r.next, r.rows, r.seq, r.run, r.processor, r.state, r.owner,
                             r.lease_until if r.owner else None) for r in recs],
                           ["topic", "last", "next", "rows", "seq", "run", "processor", "state", "owner", "lease until"]))
        merged = [r for r in recs if r.inputs or r.inputs_next]
        if merged:  # merge topics: the Delta version applied of every input (and the pending unit's)
            print("\nper-input offsets (a merge topic: Delta versions; a stream queue, intake:queue:...: per incoming "
                  "file, bytes read, #lines read, #done once read to its end):")
            print(format_table([(r.topic, ", ".join(f"{k}@{v}" for k, v in sorted(r.inputs.items())),
                                 ", ".join(f"{k}@{v}" for k, v in sorted((r.inputs_next or {}).items())) or None) for r in merged],
                               ["topic", "applied", "pending unit"]))
        return 0
    if args.action == "prune":
        if args.topic:
            raise TidemarkError(f"tidemark offsets prune takes no topic ({args.topic!r}): it prunes the log of every "
                                "topic, keeping each topic's newest entries (--keep)")
        from platform_assets.maintenance import tables as maintain

        retention = _log_retention(args)
        if not retention.age:
            raise TidemarkError(f"tidemark offsets prune: {retention.describe()}; give --older-than AGE (e.g. 30d) "
                                "to prune by hand")
        pruned, line = maintain.prune_offset_log(store, retention, dry_run=args.dry_run)
        if pruned is None:
            raise TidemarkError("the offset log was not pruned: " + line.removeprefix("offset log: FAILED: "))
        print(line)
        return 0
    if not args.topic:
        raise TidemarkError(f"tidemark offsets {args.action}: name the topic")
    if args.action == "unlock" and args.topic not in eng.lineage.topics and store.get(args.topic) is not None:
        # a processor's lock that is not a topic's: a replicator (cdc:<name>), the intake (intake:...)
        prev = store.unlock(args.topic, who=eng.owner)
        print(f"{args.topic}: lock cleared (was held by {prev or 'nobody'})")
        return 0
    topic = eng.lineage.topic(args.topic)
    if args.action == "init":
        rec = eng.ensure_offsets(topic, Position.parse(args.start) if args.start else None)
        print(f"{rec.topic}: last = {format_cell(rec.last)}")
    elif args.action == "reset":
        if not args.to or not args.reason:
            raise TidemarkError("tidemark offsets reset needs --to POSITION and --reason TEXT (it is logged)")
        rec = eng.reset_offsets(topic, Position.parse(args.to), args.reason, late_from_now=args.late_from_now)
        late = (f"; late rows of {topic.spec.base} looked for from version {rec.source_version} on"
                if args.late_from_now else "")
        print(f"{rec.topic}: last reset to {format_cell(rec.last)} (logged; seq stays {rec.seq}{late})")
    elif args.action == "adopt":
        if topic.spec.processor is not Processor.MERGE:
            raise TidemarkError(f"tidemark offsets adopt: '{topic.name}' is a {topic.spec.processor.value} topic; adopt takes "
                                f"over merge views (a step topic starts where you say: tidemark offsets init {topic.name} --start POSITION)")
        from platform_assets.views import operate as views

        print("\n".join(views.adopt(eng, topic, dry_run=args.dry_run)))
    elif args.action == "unlock":
        prev = store.unlock(topic.name, who=eng.owner)
        print(f"{topic.name}: lock cleared (was held by {prev or 'nobody'})")
    return 0


def _print_result(r: Any) -> None:
    if r.processed:
        rng = f" {format_cell(r.block.last)} .. {format_cell(r.block.next)}" if r.block else ""
        extra = " [recovered: data had landed, offset caught up]" if r.recovered else ""
        bad = f", {r.bad_rows} bad rows quarantined" if r.bad_rows else ""
        print(f"  {r.topic:<22} {r.reason:<10} rows={r.rows:<7} delta v{r.delta_version} {r.duration_s:5.1f}s{rng}{bad}{extra}", flush=True)
    else:
        print(f"  {r.topic:<22} waits: {r.reason}", flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    eng = engine_from(args)
    eng.publish_lineage()
    names = args.topics or None
    if names:
        for n in names:
            eng.lineage.topic(n)
    failed: dict[str, TidemarkError] = {}

    def report(name: str, exc: TidemarkError) -> None:  # that topic stops; the others go on
        failed[name] = exc
        print(f"  {name:<22} FAILED: {exc}", flush=True)

    if args.until_caught_up:
        eng.run_until_caught_up(names, on_result=_print_result, on_error=report)
    else:
        for n in names or list(eng.lineage.topics):
            try:
                _print_result(eng.run_topic(n))
            except TidemarkError as exc:
                report(n, exc)
    code = _missing_sources(eng, names or list(eng.lineage.topics))
    if failed:
        for name, why in failed.items():  # the reasons on stderr too, for a caller that reads only that
            print(f"error: {name}: {why}", file=sys.stderr)
        print(f"error: {len(failed)} topic(s) failed: {', '.join(failed)} (the others ran)", file=sys.stderr)
        return 1
    return code


def _missing_sources(eng: Any, names: list[str]) -> int:
    """1 (after saying which) when a topic's base is a source table that does not exist: a wrong
    name or path must not pass as "no new rows". A base some topic writes may not exist yet."""
    from resources.storage.delta_log import open_table

    bases = sorted({eng.lineage.topic(n).spec.base for n in names})
    missing = [b for b in bases if not eng.lineage.producers(b) and open_table(eng.path(b)) is None]
    for b in missing:
        print(f"error: {b} does not exist at {eng.path(b)}; check the table name or the source's path", file=sys.stderr)
    return 1 if missing else 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan the next block of a step topic and add its Dagster partition (the Dagster CLI cannot
    create dynamic partitions); prints the key to pass to ``dagster asset materialize``."""
    from dagster import DagsterInstance

    from lineage.core.partitions import partitions_name

    eng = engine_from(args)
    topic = eng.lineage.topic(args.topic)
    planned = eng.plan_block(topic.name)
    if planned.block is None:
        print(f"{topic.name}: no block to plan: {planned.reason}")
        return 3
    name = partitions_name(topic.spec.destination)
    key = eng.lineage.block_key(topic.name, planned.block.seq)
    os.environ["DAGSTER_HOME"] = str(eng.settings.dagster_home())
    instance = DagsterInstance.get()
    if not instance.has_dynamic_partition(name, key):
        instance.add_dynamic_partitions(name, [key])
    b = planned.block
    print(f"{topic.name}: {'pending' if planned.retry else 'planned'} block {b.seq} ({format_cell(b.last)} .. {format_cell(b.next)})")
    print(key)
    return 0


def cmd_log(args: argparse.Namespace) -> int:
    from resources.storage.meta_tables import read_etl_log

    rows = read_etl_log(settings_from(args), args.topic, args.limit)
    print(format_table([(r["ts"], r["topic"], r["seq"], r["rows"], r["max_id"], r["min_ts"], r["max_ts"], r["max_lag"],
                         {k: n for k, n in (r["nulls"] or []) if n}, r["bad_rows"], r["delta_version"], r["duration_s"]) for r in rows],
                       ["ts", "topic", "seq", "rows", "max_id", "min_ts", "max_ts", "max_lag s", "nulls", "bad", "delta v", "secs"]))
    units = [r for r in rows if r.get("strategy")]
    if units:  # merge topics: what each unit did and why
        print("\nmerge units:")
        print(format_table([(r["ts"], r["topic"], r["seq"], r["strategy"], dict(r.get("changes") or []), r.get("detail") or "")
                            for r in units], ["ts", "topic", "seq", "strategy", "changes", "why"]))
    return 0


def _print_run(r: Any) -> None:
    """One Dagster run of the demo: the asset's materialization metadata and its checks."""
    m = r.metadata
    if not r.success:
        print(f"  {r.job:<28} FAILED (run {r.run_id[:8]}): {r.error}", flush=True)
        return
    what = f"block {m['block']}" if "block" in m else ("reload" if "rows" in m else "no-op")
    if "strategy" in m:  # a merge unit: its number and what it did
        what = f"unit {m.get('block', '?')} {m['strategy']}"
    rng = f" {m['last'][:23]} .. {m['next'][:23]}" if "next" in m else ""
    bad = f", {m['bad_rows']} bad rows quarantined" if m.get("bad_rows") else ""
    recovered = " [recovered: data had landed, offset caught up]" if m.get("recovered") else ""
    checks = f"  checks: {', '.join(f'{n} ' + ('ok' if ok else 'FAILED') for n, ok in sorted(r.checks.items()))}" if r.checks else ""
    figures = f"rows={m.get('rows', 0):<7} delta v{m.get('delta_version')} {m.get('duration_s', 0.0):5.1f}s" if "rows" in m else m.get("note", "")
    print(f"  {m.get('topic', r.job):<22} {what:<10} {figures}{rng}{bad}{recovered}{checks}  [run {r.run_id[:8]}]", flush=True)


def _demo_runs(settings: Settings, instance: Any) -> bool:
    """Run the platform through Dagster until every topic waits: the planner sensor plans the
    blocks, each requested run materializes one asset partition in this process."""
    from platform_assets.dagster.definitions import build_definitions
    from platform_assets.dagster.local_daemon import run_until_idle

    # The runs' own logs stay in the Dagster instance (the UI shows them); here one line per run.
    logging.getLogger("dagster").setLevel(logging.WARNING)
    runs, waiting = run_until_idle(build_definitions(settings), instance, on_run=_print_run, log_level="WARNING")
    failed = [r for r in runs if not r.success]
    print(f"  {len(runs)} Dagster runs; {'FAILED: ' + waiting if failed else 'every topic waits: ' + waiting}", flush=True)
    return not failed


def _view_check(eng: Any, name: str) -> bool:
    """Print whether merge topic ``name``'s view equals its transform computed from scratch over the
    inputs its last unit applied (``tidemark verify``, the view's promise)."""
    from platform_assets.views.verify import verify

    verdict = verify(eng, eng.lineage.topic(name))
    print(f"check: tidemark verify {name}: " + "\n".join(verdict.lines()[1:]).strip())
    return verdict.ok


def _readers_check(eng: Any) -> bool:
    """Every table the demo wrote, read by the JVM-free ``deltalake`` reader (pandas, polars)."""
    from platform_assets.maintenance.tables import jvm_free_reads

    reads = jvm_free_reads(eng)
    bad = [(t, a, b) for t, a, b in reads if a != b]
    print(f"\n7. JVM-free readers: {len(reads)} tables the demo wrote, read with deltalake: "
          + ("row counts equal to Spark's -> OK" if not bad else f"{len(bad)} DIFFER"))
    for t, a, b in bad:
        print(f"   {t}: deltalake {a}, Spark {b} rows")
    return not bad


def cmd_demo(args: argparse.Namespace) -> int:
    from dagster import DagsterInstance

    from platform_assets.demo.shop import ShopFeeder

    settings = settings_from(args)
    check_warehouse(settings.warehouse)  # before the sources are written
    own_dagster_home = "DAGSTER_HOME" not in os.environ
    if not args.keep:
        local = local_dir(settings.warehouse)  # a plain path or a file: URI; never an object store
        if local is not None and local.is_relative_to(settings.home):
            shutil.rmtree(local, ignore_errors=True)
        if settings.offsets_url.startswith("sqlite:///"):
            Path(settings.offsets_url.removeprefix("sqlite:///")).unlink(missing_ok=True)
        if own_dagster_home:  # the runs and partitions of the wiped warehouse
            shutil.rmtree(settings.home / "dagster", ignore_errors=True)
        shutil.rmtree(settings.events_dir(), ignore_errors=True)  # the event intake's files of the wiped tables
    t0 = time.monotonic()
    print(f"== Tidemark demo (state in {settings.home}; Dagster instance in {settings.dagster_home()})")
    os.environ["DAGSTER_HOME"] = str(settings.dagster_home())
    feeder = ShopFeeder(settings)
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None, microsecond=0)
    made = feeder.append(orders=args.orders, start=now - dt.timedelta(hours=2), end=now - dt.timedelta(minutes=1),
                         new_customers=200, bad_rows=2)
    print(f"1. stage layer written: {made}")
    from platform_assets.demo import events as demo_events

    posted = demo_events.collect_demo_events(settings)
    print(f"   events: a collector on a free loopback port acknowledged {posted.accepted} of {posted.posted} events "
          f"({posted.page_views} page views, {posted.carts} cart events) in {posted.seconds * 1000:.0f} ms; stopped, files rotated")
    eng = engine_from(args, settings)
    print(f"2. lineage valid: {len(eng.lineage.topics)} topics; published to sch.lineage")
    eng.publish_lineage()
    print("3. first pass through Dagster, until caught up (starting Spark; one session serves every run):", flush=True)
    eng.spark  # noqa: B018 - start the session the in-process runs share
    ok = True
    with DagsterInstance.get() as instance:
        ok &= demo_events.process_with_dagster(settings, instance, posted)  # the intake job: files -> stage tables
        ok &= _demo_runs(settings, instance)
        print("\n" + _lag_rows(eng))
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None, microsecond=0)
        made = feeder.append(orders=args.orders // 3, start=now - dt.timedelta(seconds=50), end=now - dt.timedelta(seconds=1),
                             new_customers=20, late=2)
        print(f"\n4. more source rows appended: {made}")
        print("5. incremental pass (only the new rows are read):", flush=True)
        ok &= _demo_runs(settings, instance)
    print("\n" + _lag_rows(eng))
    print("\nlast etl.log rows:")
    cmd_log(argparse.Namespace(**{**vars(args), "topic": None, "limit": 8}))
    eng.register_tables()
    check = eng.spark.sql(
        "SELECT (SELECT count(*) FROM fact.orders) AS fact_orders, "
        "(SELECT count(*) FROM stage.orders WHERE pos IS NOT NULL AND id IS NOT NULL) AS stage_orders_valid, "
        "(SELECT count(*) FROM etl.quarantine WHERE topic = 'fact.orders' AND reason LIKE 'late%') AS late, "
        "(SELECT count(*) FROM etl.quarantine WHERE topic = 'fact.orders') AS quarantined"
    ).collect()[0]
    exact = check.fact_orders + check.late == check.stage_orders_valid
    print(f"\ncheck: fact.orders={check.fact_orders} rows + {check.late} late rows quarantined = stage.orders "
          f"with a position ({check.stage_orders_valid}); {check.quarantined} fact.orders rows in etl.quarantine "
          f"-> {'OK, each row exactly once' if exact else 'MISMATCH'}")
    view_ok = _view_check(eng, "mart.daily_revenue")
    exact = exact and view_ok and demo_events.report(settings, posted)
    print("\n6. CDC: a PostgreSQL table replicated into the lakehouse (tidemark cdc):", flush=True)
    from platform_assets.demo import cdc as cdc_demo

    exact = cdc_demo.run(eng) and exact
    exact = _readers_check(eng) and exact
    print(f"demo finished in {time.monotonic() - t0:.0f}s; see the runs in the UI: ./scripts/dev.sh (FEED=0 to only look); "
          "or try: tidemark lag | tidemark log | tidemark offsets show --history")
    return 0 if ok and exact else 1


def cmd_spark(args: argparse.Namespace) -> int:
    """``spark up|down|status``: the local Spark Connect server under the state dir."""
    from resources.spark import server as spark_server

    settings = settings_from(args)
    home = settings.home
    if args.action == "up":
        t0 = time.monotonic()
        check_warehouse(settings.warehouse)  # a wrong store setting fails here, not in the first run
        server = spark_server.start(home, port=args.port, master=args.master, warehouse=settings.warehouse)
        print(f"Spark Connect server running (pid {server.pid}, log {server.log}, {time.monotonic() - t0:.0f}s)")
        print(f"export TIDEMARK_SPARK_MASTER={server.url}")
    elif args.action == "down":
        stopped = spark_server.stop(home)
        print(f"stopped the Spark Connect server (pid {stopped.pid}, port {stopped.port})" if stopped
              else f"no Spark Connect server runs under {home}")
    else:
        found = spark_server.status(home)
        if found is None:
            print(f"no Spark Connect server runs under {home}; start one with: tidemark spark up")
            return 1
        print(f"running: pid {found.pid}, log {found.log}")
        print(f"export TIDEMARK_SPARK_MASTER={found.url}")
    return 0


def cmd_postgres(args: argparse.Namespace) -> int:
    """``postgres up|down|status``: the local PostgreSQL server under the state dir (the prod
    profile's Dagster instance and offset store on one machine)."""
    from resources.state import local_pg

    # Only the state dir matters here: `up` is how a prod profile without its URL gets one.
    env = {**os.environ, "TIDEMARK_PROFILE": "embedded", "TIDEMARK_DAGSTER_PG_URL": ""}
    home = Settings.from_env(env, home=args.home).home
    if args.action == "up":
        t0 = time.monotonic()
        server = local_pg.start(home, port=args.port)
        print(f"PostgreSQL running (pid {server.pid}, data {server.folder / 'data'}, log {server.log}, "
              f"{time.monotonic() - t0:.1f}s)")
    elif args.action == "down":
        stopped = local_pg.stop(home)
        print(f"stopped PostgreSQL (pid {stopped.pid}, port {stopped.port}); its data stays in {stopped.folder}"
              if stopped else f"no PostgreSQL runs under {home}")
        return 0
    else:
        found = local_pg.status(home)
        if found is None:
            print(f"no PostgreSQL runs under {home}; start one with: tidemark postgres up")
            return 1
        server = found
        print(f"running: pid {server.pid}, data {server.folder / 'data'}, log {server.log}")
    print(f"export TIDEMARK_DAGSTER_PG_URL={server.dagster_url}")
    print(f"export TIDEMARK_OFFSETS_URL={server.url}")
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    """``cluster up|down|status``: a Spark standalone master and workers on loopback, and a
    Spark Connect server on them."""
    from resources.spark import cluster as spark_cluster

    home = settings_from(args).home
    if args.action == "up":
        t0 = time.monotonic()
        started = spark_cluster.up(home, workers=args.workers, worker_cores=args.worker_cores, worker_memory=args.worker_memory,
                                 master_port=args.master_port, connect_port=args.port)
        print(f"Spark cluster running ({time.monotonic() - t0:.0f}s); logs in {spark_cluster.cluster_dir(home)}")
        _print_cluster(started)
        return 0
    if args.action == "down":
        stopped = spark_cluster.down(home)
        print(f"stopped: {', '.join(stopped)}" if stopped else f"no Spark cluster runs under {home}")
        return 0
    found = spark_cluster.status(home)
    if found is None:
        print(f"no Spark cluster runs under {home}; start one with: tidemark cluster up")
        return 1
    _print_cluster(found)
    if not found.healthy:
        print(f"the cluster is not whole (see above and the logs in {spark_cluster.cluster_dir(home)}); "
              "restart it: tidemark cluster down && tidemark cluster up")
        return 1
    return 0


def _print_cluster(found: Any) -> None:
    st = found.state
    master = "running" if found.running["master"] else "NOT RUNNING"
    print(f"master   {st.master_url}  {master}, {found.view.status if found.view else 'not answering'}  "
          f"(pid {st.master.pid}, web UI {st.webui_url})")
    for w in st.workers:
        info = found.worker_info(w)
        seen = f"{info.state}, {info.cores} cores ({info.cores_used} used), {info.memory_mb} MB ({info.memory_used_mb} used)" \
            if info else "not registered"
        print(f"{w.name:<8} {'running' if found.running[w.name] else 'NOT RUNNING'}, {seen}  (pid {w.pid}, log {w.log})")
    if found.connect is None:
        print(f"connect  NOT RUNNING (was to listen on port {st.connect_port})")
    else:
        print(f"connect  {found.connect.url}  running (pid {found.connect.pid}, log {found.connect.log})")
        print(f"export TIDEMARK_SPARK_MASTER={found.connect.url}")


def cmd_collect(args: argparse.Namespace) -> int:
    """``collect``: the event collector (HTTP) writing the durable incoming log."""
    from lineage.intake.config import IntakeConfigError, intake_path, load_intake
    from resources.intake import collector

    try:
        intake = load_intake(intake_path(args.config))
    except IntakeConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    c = intake.collector
    host, port = args.host or c.host, c.port if args.port is None else args.port
    events_dir = settings_from(args).events_dir()
    tokens = ", ".join(f"{t.id} ({t.kind})" for t in intake.tokens)
    if args.print_config:
        print(f"config {intake.file}\nlisten http://{host}:{port}\ntokens {tokens}\nlog {events_dir / 'incoming'}")
        print(intake.spec.collector.model_dump_json(indent=2))
        return 0
    app = collector.Collector(intake, events_dir)
    recovered = app.log.open()
    sock = collector.bind(host, port)
    print(f"collector listening on http://{host}:{sock.getsockname()[1]} (config {intake.file}); tokens: {tokens}; "
          f"incoming log: {app.log.folder}" + (f"; {len(recovered)} file(s) of a previous run moved to ready/"
                                              if recovered else ""), flush=True)
    collector.serve(app, sock)  # uvicorn re-raises SIGTERM/SIGINT after its graceful stop
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tidemark", description="Incremental Delta tables, block by block.")
    p.add_argument("--lineage", help="lineage YAML file or directory (env TIDEMARK_LINEAGE; default demo/lineage)")
    p.add_argument("--home", help="state directory (env TIDEMARK_HOME; default .tidemark)")
    p.add_argument("--warehouse", help="Delta warehouse root (env TIDEMARK_WAREHOUSE)")
    p.add_argument("--offsets-url", help="offset store: sqlite:///path or postgresql://... (env TIDEMARK_OFFSETS_URL)")
    p.add_argument("--spark-master", help="Spark master or sc:// URL (env TIDEMARK_SPARK_MASTER; default local[*])")
    sub = p.add_subparsers(dest="command", required=True)

    lin = sub.add_parser("lineage", help="validate or publish the lineage").add_subparsers(dest="action", required=True)
    lin.add_parser("validate", help="check every lineage file; exit 2 listing every problem").set_defaults(func=cmd_validate)
    lin.add_parser("publish", help="write the lineage to the Delta table sch.lineage").set_defaults(func=cmd_publish)

    off = sub.add_parser("offsets", help="show, init, reset, unlock, adopt topic offsets, or prune the offset log")
    off.add_argument("action", choices=["show", "init", "reset", "unlock", "adopt", "prune"])
    off.add_argument("topic", nargs="?")
    off.add_argument("--start", help="init: start position, e.g. 2026-01-31T00:00:00[/id] or start")
    off.add_argument("--to", help="reset: the new last position")
    off.add_argument("--reason", help="reset: why (kept in the offset log)")
    off.add_argument("--late-from-now", action="store_true",
                     help="reset: look for late rows only among rows the base gets from now on (when the files or "
                          "commits that would show earlier ones were removed by VACUUM or log retention)")
    off.add_argument("--history", action="store_true", help="show: the offset log instead of the records")
    off.add_argument("--dry-run", action="store_true", help="adopt: show what would be set, set nothing; prune: count "
                                                               "what would be removed, remove nothing")
    off.add_argument("--older-than", metavar="AGE", help="prune: remove log entries older than AGE, at least 1h, e.g. "
                                                         "30d (default: TIDEMARK_OFFSET_LOG_RETENTION, else 30d)")
    off.add_argument("--keep", type=int, metavar="N", help="prune: keep each topic's newest N entries whatever their age "
                                                            "(default: TIDEMARK_OFFSET_LOG_KEEP, else 1000)")
    off.add_argument("--limit", type=int, default=50)
    off.set_defaults(func=cmd_offsets)

    sub.add_parser("lag", help="every topic: last, next, source max, lag, state, why it waits").set_defaults(func=cmd_lag)

    tables = sub.add_parser("tables", help="every table's health: files, small files, bytes, commits since the last "
                                           "checkpoint, the oldest version a consumer needs (no Spark)")
    tables.add_argument("tables", nargs="*", metavar="TABLE", help="schema.table (default: every table)")
    tables.set_defaults(func=cmd_tables)

    mnt = sub.add_parser("maintain", help="compact small files, checkpoint and clean up tables, keeping every version, "
                                          "file and commit a topic still needs (no Spark)")
    mnt.add_argument("tables", nargs="*", metavar="TABLE", help="schema.table (default: every table in the warehouse "
                                                                 "and the lineage)")
    mnt.add_argument("--retain-hours", type=float, default=None, metavar="H",
                     help="remove what no consumer needs once older than H hours (default: each table's "
                          "delta.deletedFileRetentionDuration / delta.logRetentionDuration, else 7 / 30 days); below 1 "
                          "only while no writer of the table runs")
    mnt.add_argument("--dry-run", action="store_true", help="say what would be compacted and removed; change nothing")
    mnt.add_argument("--no-compact", action="store_true", help="no compaction")
    mnt.add_argument("--no-cleanup", action="store_true", help="no VACUUM or log cleanup (nor pruning of the offset log)")
    mnt.add_argument("--cluster", action="store_true", help="views (merge topics): Z-order the compacted files by the key")
    mnt.add_argument("--writers-idle", action="store_true",
                     help="nothing writes these tables now (allows --retain-hours below 1 for tables Tidemark does not write)")
    mnt.set_defaults(func=cmd_maintain)

    explain = sub.add_parser("explain", help="what the next run of a topic would do and why (no Spark, nothing written)")
    explain.add_argument("topic")
    explain.add_argument("--keys", type=int, nargs="?", const=20, default=0, metavar="N",
                         help="merge topics: also list the view keys the next unit would re-derive, by where they come "
                              "from (up to N each, default 20; starts Spark, writes nothing)")
    explain.set_defaults(func=cmd_explain)

    ver = sub.add_parser("verify", help="compare a materialized view (merge topic) with its transform recomputed from "
                                        "scratch over the inputs its last unit applied; exit 1 listing the keys that differ")
    ver.add_argument("topic")
    ver.add_argument("--sample", type=int, default=0, metavar="N", help="compare N keys drawn at random from the view "
                                                                         "instead of every key")
    ver.add_argument("--show", type=int, default=20, metavar="N", help="print up to N differing keys with both rows (default 20)")
    ver.add_argument("--seed", type=int, default=None, help="the random seed of --sample")
    ver.set_defaults(func=cmd_verify)

    run = sub.add_parser("run", help="process topics (one block each, or until caught up)")
    run.add_argument("topics", nargs="*", help="topics to run (default: all, in dependency order)")
    run.add_argument("--until-caught-up", action="store_true", help="keep going until every topic waits")
    run.set_defaults(func=cmd_run)

    plan = sub.add_parser("plan", help="plan the next block of a step topic and add its Dagster partition; prints the key")
    plan.add_argument("topic")
    plan.set_defaults(func=cmd_plan)

    log = sub.add_parser("log", help="the newest rows of etl.log")
    log.add_argument("--topic")
    log.add_argument("--limit", type=int, default=20)
    log.set_defaults(func=cmd_log)

    spark = sub.add_parser("spark", help="start, stop or show the local Spark Connect server (a warm JVM for every run)")
    spark.add_argument("action", choices=["up", "down", "status"])
    spark.add_argument("--port", type=int, default=15002, help="up: port on 127.0.0.1 (default 15002)")
    spark.add_argument("--master", default="local[*]", help="up: the server's Spark master (default local[*])")
    spark.set_defaults(func=cmd_spark)

    pg = sub.add_parser("postgres", help="start, stop or show the local PostgreSQL of the prod profile (under the state dir)")
    pg.add_argument("action", choices=["up", "down", "status"])
    pg.add_argument("--port", type=int, default=None, help="up: port on 127.0.0.1 (default 15432)")
    pg.set_defaults(func=cmd_postgres)

    cluster = sub.add_parser("cluster", help="start, stop or show a Spark standalone cluster on 127.0.0.1 with a Connect server on it")
    cluster.add_argument("action", choices=["up", "down", "status"])
    cluster.add_argument("--workers", type=int, default=2, help="up: number of workers (default 2)")
    cluster.add_argument("--worker-cores", type=int, default=1, help="up: cores each worker offers (default 1)")
    cluster.add_argument("--worker-memory", default="1g", help="up: memory each worker offers, e.g. 512m (default 1g)")
    cluster.add_argument("--master-port", type=int, default=7077, help="up: the master's port (default 7077)")
    cluster.add_argument("--port", type=int, default=15002, help="up: the Connect server's port (default 15002)")
    cluster.set_defaults(func=cmd_cluster)

    from platform_assets.cli import cdc as cdc_cli

    cdc_cli.register(sub)

    from platform_assets.cli import events as events_cli

    events_cli.register(sub)

    from platform_assets.cli import follow as follow_cli

    follow_cli.register(sub)

    demo = sub.add_parser("demo", help="generate the demo shop data and run the demo lineage twice")
    demo.add_argument("--orders", type=int, default=3000)
    demo.add_argument("--keep", action="store_true", help="keep existing demo state instead of starting fresh")
    demo.set_defaults(func=cmd_demo)

    collect = sub.add_parser("collect", help="the event collector: HTTP endpoints writing the durable incoming log")
    collect.add_argument("--config", help="intake YAML (env TIDEMARK_INTAKE; default demo/intake.yaml)")
    collect.add_argument("--host", help="bind address (default: collector.host, 127.0.0.1)")
    collect.add_argument("--port", type=int, help="port (default: collector.port, 8421; 0: any free port)")
    collect.add_argument("--print-config", action="store_true", help="print the checked config and exit")
    collect.set_defaults(func=cmd_collect)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except LineageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TidemarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        close_engines()


def run() -> None:
    """Console entry point. Exits with ``os._exit`` once output is flushed and Spark stopped:
    the native runtimes of deltalake/pyarrow can abort in their exit-time destructors while
    the JVM gateway winds down, after all work is committed, turning success into SIGABRT."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
