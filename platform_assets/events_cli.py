"""``tidemark events process|status|replay``: the batch event processor's commands (issue 11).
``status`` never starts a JVM (and neither do the others: the intake writes with ``deltalake``).

Replay: the failed events of a destination are frozen in a plan file
(``failed/replay.dst=<id>.json``) before anything is written, then run through the pipeline as
one unit: the events that now pass land in their tables (Delta transactions, as files do), and
one commit of ``etl.failed_events`` (its own transaction) replaces the replayed rows by those
that still fail. A crash anywhere resumes the same plan, so each replayed event leaves the
failed set exactly once and lands exactly once; the failed file is rewritten from the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from lineage.errors import TidemarkError
from lineage.event_types import parse_timestamp
from lineage.events import dumps_exact, loads_exact
from lineage.intake import Intake, IntakeConfigError, intake_path, load_intake
from lineage.intake_destinations import DestinationMode
from platform_assets.events import (
    EventProcessor,
    UnitResult,
    _event_error,
    plan_units,
    unit_bytes_setting,
    unit_members,
)
from resources import event_store as store
from resources.event_queue import batch_done
from resources.incoming_log import ReadyFile, iter_ready_files
from resources.settings import Settings


class _Archived:
    def __init__(self, proc: EventProcessor) -> None:
        self.proc = proc

    def close(self) -> None:
        self.proc.wait_archived()


@contextlib.contextmanager
def _worker_pool() -> Iterator[None]:
    """The worker processes (started on first use, for large files) end with the call."""
    from platform_assets.event_workers import shutdown_pool

    try:
        yield
    finally:
        shutdown_pool()


def process_ready(settings: Settings, intake: Intake, *, until_empty: bool = False) -> list[UnitResult]:
    """Process the ready incoming files in order, in units of many small files
    (``$TIDEMARK_EVENT_UNIT_BYTES``) or one large one (``until_empty``: also those that become
    ready meanwhile, until none is left)."""
    from platform_assets.event_workers import parallel_bytes_setting

    proc = EventProcessor(settings, list(intake.spec.destinations))
    budget = unit_bytes_setting()
    alone = min(budget, parallel_bytes_setting())
    out = []
    seen: set[str] = set()

    def status_of(path: Path) -> dict[str, Any] | None:
        sp = store.status_path(path)
        return (store.read_json(sp) or {}) if sp.exists() else None

    with store.ProcessorLock(proc.events_dir), _worker_pool(), contextlib.closing(_Archived(proc)):
        while True:
            # a file processed earlier that a stream destination has not read to its end yet stays
            # in ready/ (the stream loop archives it): it is only looked at once per call
            files = [rf for rf in iter_ready_files(proc.events_dir) if rf.path.name not in seen]
            units = plan_units(files, status_of, lambda p: p.stat().st_size, budget=budget, alone=alone)
            for i, unit in enumerate(units):
                proc.next_unit = _next(units, i)
                seen.update(rf.path.name for rf in unit)
                result = proc.process_files(unit)
                if result is not None:
                    out.append(result)
            if not files or not until_empty:
                return out


def _next(units: list[list[ReadyFile]], i: int) -> Callable[[], list[tuple[Path, int]] | None]:
    """The files of the unit after ``units[i]`` (each with its base), when asked."""
    def files() -> list[tuple[Path, int]] | None:
        if i + 1 >= len(units):
            return None
        nxt = units[i + 1]
        return [(rf.path, base) for rf, base in zip(nxt, unit_members(nxt).bases, strict=True)]
    return files


def _write_failed_file(events_dir: Path, settings: Settings, dest: str) -> None:
    """Archive the destination's failed file and write it anew from ``etl.failed_events``."""
    flog = store.failed_log(events_dir, dest)
    now = dt.datetime.now(dt.UTC)
    if flog.exists() and flog.stat().st_size:
        folder = events_dir / "archive" / now.date().isoformat()
        folder.mkdir(parents=True, exist_ok=True)
        with open(flog, "rb") as src, gzip.open(folder / f"failed.dst={dest}-{now:%Y-%m-%dT%H-%M-%S.%f}.log.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    rows = store.read_failed_events(settings.table_path(store.FAILED_EVENTS), dest)
    tmp = flog.with_name(flog.name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(b"".join(dumps_exact(_event_error(r)) + b"\n" for r in sorted(rows, key=lambda r: r["failure_id"])))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(flog)


def replay(settings: Settings, intake: Intake, dest: str | None = None,
           since: dt.datetime | None = None) -> dict[str, UnitResult]:
    """Send the failed events of ``dest`` (every destination if None), failed at or after
    ``since``, through the pipeline again."""
    dests = [intake.spec.destination(dest)] if dest else list(intake.spec.destinations)
    events_dir = settings.events_dir()
    out: dict[str, UnitResult] = {}
    with store.ProcessorLock(events_dir):
        pending = [rf.path.name for rf in iter_ready_files(events_dir)
                   if store.status_path(rf.path).exists() and not batch_done(rf.path)]
        if pending:
            raise TidemarkError(f"{pending[0]} is half-processed; run `tidemark events process` before a replay")
        failed_path = settings.table_path(store.FAILED_EVENTS)
        for spec in dests:
            plan_path = store.failed_dir(events_dir) / f"replay.dst={spec.id}.json"
            plan = store.read_json(plan_path)
            if plan is None:
                rows = [r for r in store.read_failed_events(failed_path, spec.id)
                        if since is None or r["failed_at"] >= since]
                if not rows:
                    continue
                rows.sort(key=lambda r: (r["received_at"] or r["failed_at"], r["failure_id"]))
                stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
                plan = {"unit": f"replay.dst={spec.id}.{stamp}",
                        "failures": [{"failure_id": r["failure_id"], "event": r["event"]} for r in rows]}
                plan_path.parent.mkdir(parents=True, exist_ok=True)
                store.write_json_atomic(plan_path, plan)
            failures: list[dict[str, Any]] = plan["failures"]
            proc = EventProcessor(settings, [spec], modes=tuple(DestinationMode))

            def events(failures: list[dict[str, Any]] = failures) -> Any:
                return ((i, loads_exact(f["event"])) for i, f in enumerate(failures, start=1))

            def originals(lines: set[int], failures: list[dict[str, Any]] = failures) -> dict[int, dict[str, Any]]:
                return {n: loads_exact(failures[n - 1]["event"]) for n in lines}

            def failure_id(line: int, _dest: str, failures: list[dict[str, Any]] = failures) -> str:
                return str(failures[line - 1]["failure_id"])

            status_file = plan_path.with_name(plan_path.name.removesuffix(".json") + ".status")
            out[spec.id] = proc.run_unit(plan["unit"], status_file, events, originals,
                                         failure_ids=failure_id,
                                         replace={spec.id: [f["failure_id"] for f in failures]})
            _write_failed_file(events_dir, settings, spec.id)
            status_file.unlink(missing_ok=True)
            plan_path.unlink()
    return out


def status(settings: Settings, intake: Intake) -> dict[str, Any]:
    """Files pending / in progress / processed and failed events per destination (no JVM)."""
    events_dir = settings.events_dir()
    ready = iter_ready_files(events_dir)
    archived = sorted((events_dir / "archive").glob("*/incoming.tok=*.log.gz")) if (events_dir / "archive").is_dir() else []
    failed = store.read_failed_events(settings.table_path(store.FAILED_EVENTS))
    placed = _placed_elsewhere(settings)
    out: dict[str, Any] = {"pending_files": len(ready), "pending_bytes": sum(rf.path.stat().st_size for rf in ready),
                           "processed_files": len(archived), "destinations": {}}
    for spec in intake.spec.destinations:
        in_progress = {}
        for rf in ready:
            st = store.read_json(store.status_path(rf.path))
            if st and spec.id in st.get("destinations", {}):
                in_progress[rf.path.name] = {t: e["state"] for t, e in st["destinations"][spec.id]["tables"].items()}
        plan = store.failed_dir(events_dir) / f"replay.dst={spec.id}.json"
        out["destinations"][spec.id] = {
            "mode": spec.mode.value,
            "pending_files": sum(1 for rf in ready if not spec.only_keys or rf.token in spec.only_keys),
            "in_progress": in_progress, "failed_events": sum(1 for r in failed if r["destination"] == spec.id),
            **placed.get(spec.id, {"unmapped_values": 0, "collided_values": 0}),
            "replay_pending": plan.exists(),
        }
        if spec.mode is DestinationMode.STREAM:  # its queue: micro-batches committed, and one under way
            from resources import event_queue as q

            qdir = q.queue_dir(events_dir, spec.id)
            qs = q.read_state(qdir)
            out["destinations"][spec.id]["stream"] = {
                "micro_batches": qs.seq, "files_read": len(qs.done),
                "micro_batch_under_way": (qdir / "pending.json").exists(),
                "bytes_waiting": sum(max(0, (p.stat().st_size if (p := q.find_file(events_dir, n)) else 0) - qs.offsets.get(n, [0])[0])
                                     for n, _ in q.incoming_files(events_dir) if n not in qs.done),
            }
    return out


def _placed_elsewhere(settings: Settings) -> dict[str, dict[str, int]]:
    """Per destination, the values its units put into ``_unmapped_data`` (``unmapped_values``: an
    existing column could not hold them; ``collided_values``: another field of the event had the
    column), summed from ``etl.log``."""
    from resources.delta_meta import open_table
    from resources.meta_tables import ETL_LOG

    table = open_table(settings.table_path(ETL_LOG))
    out: dict[str, dict[str, int]] = {}
    if table is None:
        return out
    data = table.to_pyarrow_table(columns=["topic", "processor", "changes"])
    for topic, processor, changes in zip(*(data.column(c).to_pylist() for c in ("topic", "processor", "changes")),
                                         strict=True):
        if processor != "events" or not topic.startswith("events:"):
            continue
        d = out.setdefault(topic.split(":")[1], {"unmapped_values": 0, "collided_values": 0})
        for k, v in changes or []:
            if k in d:
                d[k] += v or 0
    return out


def _intake(args: argparse.Namespace) -> Intake:
    return load_intake(intake_path(args.config), secrets=False)


def cmd_events(args: argparse.Namespace) -> int:
    from platform_assets.cli import _settings

    try:
        intake = _intake(args)
    except IntakeConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = _settings(args)
    if args.action == "process":
        results = process_ready(settings, intake, until_empty=args.until_empty)
        for r in results:
            print(f"{r.unit}" + (f" (+{r.files - 1} files)" if r.files > 1 else "") + f": {r.events_in} events, {r.written} rows written, {r.failed} failed, {r.skipped} skipped"
                  + "".join(f"\n  {k}: v{e['version']} {e.get('rows')} rows"
                            + (f", +{len(e['columns_added'])} columns" if e.get("columns_added") else "")
                            + (f", {e['unmapped_values']} unmapped values" if e.get("unmapped_values") else "")
                            + (f", {e['collided_values']} collided values" if e.get("collided_values") else "")
                            for k, e in r.tables.items()))
            for spec in intake.spec.destinations:
                n = r.failed_by_dest.get(spec.id, 0)
                if n and r.events_in and n / r.events_in > spec.failed_share_threshold:
                    print(f"  warning: {n} of {r.events_in} events failed for destination {spec.id} (over its "
                          f"failed_share_threshold {spec.failed_share_threshold:.0%}); see `tidemark events status`, "
                          "fix the config, then `tidemark events replay`", file=sys.stderr)
        print(f"{sum(r.files for r in results)} file(s) processed in {len(results)} unit(s)")
        return 0
    if args.action == "stream":
        from platform_assets.event_stream import StreamLoop, describe

        loop = StreamLoop(settings, intake, args.destination or None, interval_ms=args.interval_ms,
                          max_events=args.max_events)
        print(f"streaming destination(s) {', '.join(s.id for s in loop.specs)} from {settings.events_dir() / 'incoming'} "
              f"(a micro-batch every {args.interval_ms} ms or {args.max_events} events); SIGTERM or Ctrl-C stops",
              flush=True)
        n = 0
        for mb in loop.run(once=args.once):
            n += 1
            print(describe(mb), flush=True)
        print(f"stream stopped after {n} micro-batch(es)", flush=True)
        return 0
    if args.action == "status":
        print(orjson.dumps(status(settings, intake), option=orjson.OPT_INDENT_2).decode())
        return 0
    since = None
    if args.since:
        try:
            since = parse_timestamp(args.since)
        except ValueError:
            print(f"error: --since {args.since!r} is not an ISO 8601 time (e.g. 2026-01-31T12:00:00Z)", file=sys.stderr)
            return 2
    done = replay(settings, intake, args.destination, since)
    for d, r in done.items():
        print(f"{d}: {r.events_in} failed events replayed: {r.written} rows written, {r.failed} still failing")
    if not done:
        print("no failed events to replay")
    return 0


def register(sub: Any) -> None:
    ev = sub.add_parser("events", help="process the collector's incoming files into Delta stage tables")
    acts = ev.add_subparsers(dest="action", required=True)
    p = acts.add_parser("process", help="process the ready incoming files in order")
    p.add_argument("--until-empty", action="store_true", help="also files that become ready meanwhile, until none is left")
    acts.add_parser("status", help="files pending / processed and failed events per destination (JSON; no JVM)")
    r = acts.add_parser("replay", help="send failed events through the pipeline again (after fixing the config)")
    r.add_argument("--destination", help="only this destination's failed events")
    r.add_argument("--since", help="only events that failed at or after this time (ISO 8601)")
    st = acts.add_parser("stream", help="apply the events of `mode: stream` destinations continuously, in micro-batches")
    st.add_argument("--destination", action="append", help="only this stream destination (repeatable)")
    st.add_argument("--interval-ms", type=int, default=500, help="a micro-batch at most this often (default 500)")
    st.add_argument("--max-events", type=int, default=10_000, help="at most this many events per micro-batch (default 10000)")
    st.add_argument("--once", action="store_true", help="apply what waits now, then exit")
    for a in (p, acts.choices["status"], r, st):
        a.add_argument("--config", help="intake YAML (env TIDEMARK_INTAKE; default demo/intake.yaml)")
        a.set_defaults(func=cmd_events)
