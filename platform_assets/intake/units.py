"""The intake's operations on the collector's ready files, outside any command (issue 11):
``process_ready`` (the files in order, in units), ``replay`` and ``status``. ``tidemark events``
(:mod:`platform_assets.cli.events`) and the Dagster intake job (:mod:`platform_assets.dagster.intake`)
run them; this module imports neither (docs/layout.md, circle 1).

Replay: the failed events of a destination are frozen in a plan file
(``failed/replay.dst=<id>.json``) before anything is written, then run through the pipeline as
one unit: the events that now pass land in their tables (Delta transactions, as files do), and
one commit of ``etl.failed_events`` (its own transaction) replaces the replayed rows by those
that still fail. A crash anywhere resumes the same plan, so each replayed event leaves the
failed set exactly once and lands exactly once; the failed file is rewritten from the table.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gzip
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lineage.core.errors import TidemarkError
from lineage.intake.bodies import dumps_exact, loads_exact
from lineage.intake.config import Intake
from lineage.intake.destinations import DestinationMode
from platform_assets.core import locks
from platform_assets.intake.batch import (
    EventProcessor,
    UnitResult,
    _event_error,
    plan_units,
    unit_bytes_setting,
    unit_members,
)
from platform_assets.intake.record import UnitRecord, folder_tag, stage_table_paths
from resources.core.settings import Settings
from resources.intake import event_store as store
from resources.intake.event_queue import batch_done
from resources.intake.incoming_log import ReadyFile, iter_ready_files
from resources.state.offset_sql import open_settings_store
from resources.state.offsets import OffsetRecord


class _Archived:
    def __init__(self, proc: EventProcessor) -> None:
        self.proc = proc

    def close(self) -> None:
        self.proc.wait_archived()


@contextlib.contextmanager
def _worker_pool() -> Iterator[None]:
    """The worker processes (started on first use, for large files) end with the call."""
    from platform_assets.intake.workers import shutdown_pool

    try:
        yield
    finally:
        shutdown_pool()


def process_ready(settings: Settings, intake: Intake, *, until_empty: bool = False,
                  owner: str | None = None) -> list[UnitResult]:
    """Process the ready incoming files in order, in units of many small files
    (``$TIDEMARK_EVENT_UNIT_BYTES``) or one large one (``until_empty``: also those that become
    ready meanwhile, until none is left). Holds the intake's lock in the offset store
    (:data:`platform_assets.core.locks.INTAKE_BATCH`) throughout; ``owner``: its holder's id
    (default :func:`resources.state.offset_sql.make_owner`; a Dagster run passes one naming it)."""
    from platform_assets.intake.workers import parallel_bytes_setting

    proc = EventProcessor(settings, list(intake.spec.destinations))
    budget = unit_bytes_setting()
    alone = min(budget, parallel_bytes_setting())
    out = []
    seen: set[str] = set()

    def status_of(path: Path) -> dict[str, Any] | None:
        sp = store.status_path(path)
        return (store.read_json(sp) or {}) if sp.exists() else None

    with batch_lock(settings, owner) as keeper, _worker_pool(), contextlib.closing(_Archived(proc)):
        proc.record = UnitRecord(keeper, proc.events_dir, stage_table_paths(settings, intake.spec.destinations))
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


def batch_lock(settings: Settings, owner: str | None = None) -> contextlib.AbstractContextManager[Any]:
    """The intake's batch lock (process and replay both take it): one batch processor per offset
    store, on whatever host it runs."""
    return locks.holding_in(settings, locks.INTAKE_BATCH, processor="intake", owner=owner,
                            note=f"the intake's batch processor ({settings.events_dir()})")


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
    with batch_lock(settings) as keeper:
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
            proc.record = UnitRecord(keeper, events_dir, stage_table_paths(settings, intake.spec.destinations))

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
    queues = _queue_records(settings, intake)
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
            from resources.intake import event_queue as q

            rec = queues.get(locks.intake_queue_key(spec.id, folder_tag(events_dir)))
            # no record yet: the positions an older Tidemark kept in files, until the loop adopts them
            qs = q.state_of(rec.seq, rec.inputs) if rec else (q.legacy_files(q.queue_dir(events_dir, spec.id))[0] or q.QueueState())
            out["destinations"][spec.id]["stream"] = {
                "micro_batches": qs.seq - (1 if rec and rec.pending else 0), "files_read": len(qs.done),
                "micro_batch_under_way": bool(rec and rec.pending),
                "bytes_waiting": sum(max(0, (p.stat().st_size if (p := q.find_file(events_dir, n)) else 0) - qs.offsets.get(n, [0])[0])
                                     for n, _ in q.incoming_files(events_dir) if n not in qs.done),
            }
    return out


def _queue_records(settings: Settings, intake: Intake) -> dict[str, OffsetRecord]:
    """The queue records (read positions) of the stream destinations in this host's events folder."""
    streams = [d.id for d in intake.spec.destinations if d.mode is DestinationMode.STREAM]
    if not streams:
        return {}
    tag = folder_tag(settings.events_dir())
    offsets = open_settings_store(settings)
    try:
        return {key: rec for d in streams if (rec := offsets.get(key := locks.intake_queue_key(d, tag))) is not None}
    finally:
        offsets.close()


def _placed_elsewhere(settings: Settings) -> dict[str, dict[str, int]]:
    """Per destination, the values its units put into ``_unmapped_data`` (``unmapped_values``: an
    existing column could not hold them; ``collided_values``: another field of the event had the
    column), summed from ``etl.log``."""
    from resources.storage.delta_log import open_table
    from resources.storage.meta_tables import ETL_LOG

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
