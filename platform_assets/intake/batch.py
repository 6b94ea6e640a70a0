"""The batch event processor (issue 11, seed 002 "Batch processing"): ready incoming files, in
order, into the destinations' Delta stage tables, each (file, destination, table) exactly once.

Files are processed in units (:func:`plan_units`): consecutive small files up to
``$TIDEMARK_EVENT_UNIT_BYTES`` together, a large file alone. A unit is one unit of the commit
protocol (DESIGN.md):

1. *plan*: in the offset-store record the processor holds, the unit and its ordinal (row ids are
   ``ordinal << 32 | line``, lines counted across its files; :mod:`platform_assets.intake.record`
   says when a plan is resumed and when it is stale); then its files and, for every
   (destination, table) pair and every destination's failed events, a Delta transaction version
   (``tidemark-intake:<dest>:<table>`` / ``tidemark-intake-failed:<dest>``, the table's last
   version + 1, and the table's Delta version then), are stored in the first file's ``.status``
   before anything is written;
2. *land*: failed events first (the ``failed.dst=<id>.log`` file, then ``etl.failed_events``),
   then each pair in one Delta commit carrying its transaction and userMetadata (unit, files, lines);
3. *reconcile*: on a retry a planned pair whose transaction version the table holds is done when
   the commit that took it names this unit (:func:`landed_before`), else it is planned anew;
   after a lost status file the files are planned again (perhaps grouped
   differently) and each table drops the files its recent commits' userMetadata already hold;
4. *log*: per pair statistics to ``etl.log`` (processor ``events``); the unit is committed in the
   record and marked done in its status, then its files are archived, the first one last.

``pos`` is the receive time (``_timestamp``) raised to the running maximum of the table, so
``(pos, id)`` only grows in commit order: a step topic over a stage table never sees a late row.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime as dt
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from lineage.core.errors import ProcessingError, TidemarkError
from lineage.intake.bodies import dumps_exact, loads_exact
from lineage.intake.destinations import DestinationMode, DestinationSpec
from lineage.intake.pipeline import (
    GeoLookup,
    received_at,
)
from platform_assets.core.faults import crashpoint
from platform_assets.intake.record import UnitRecord, streamed_by
from platform_assets.intake.workers import (
    ParallelTyper,
    TypedPair,
    TypedUnit,
    parallel_bytes_setting,
    type_events,
    workers_setting,
)
from resources.core.settings import Settings
from resources.intake import event_store as store
from resources.intake.event_store import stage_app_id
from resources.intake.incoming_log import ReadyFile, read_events
from resources.state.offset_sql import open_settings_store
from resources.state.offsets import OffsetStore
from resources.storage.meta_tables import LogEntry, write_etl_log

_TS = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True)
class Members:
    """The incoming files of a unit in order and where their lines are: the unit numbers its lines
    one after another (a file's line ``n`` is unit line ``base + n``)."""

    names: list[str]
    bases: list[int]  # each file's base (its line 1 is unit line base + 1)

    @classmethod
    def single(cls, unit: str) -> Members:
        return cls([unit], [0])

    @classmethod
    def of(cls, names: list[str], lines: list[int]) -> Members:
        """``lines``: each file's number of complete lines."""
        bases, n = [], 0
        for k in lines:
            bases.append(n)
            n += k
        return cls(list(names), bases)

    def where(self, line: int) -> tuple[str, int]:
        """Unit line -> (file, its line)."""
        i = bisect.bisect_right(self.bases, line - 1) - 1
        return self.names[i], line - self.bases[i]

    def file_of(self, line: int) -> str:
        return self.names[bisect.bisect_right(self.bases, line - 1) - 1]


def landed_before(path: str, app_id: str, entry: dict[str, Any], names: list[str]) -> bool:
    """A planned status entry (a table's or failed events') whose transaction version the table
    holds already: whether the commit that took it carries this unit's files ``names`` (it landed
    before a crash), else another processor's unit took that version. Raises when the log no
    longer holds every commit since the plan."""
    return set(names) <= store.committed_files(path, app_id, names, version=entry["version"], since=entry.get("since"))


def _same_queue_plan(path: str, app_id: str, unit: str, queue: dict[str, Any]) -> None:
    """A table holds stream micro-batch ``unit`` while its queue record plans it afresh: the
    commit's plan must be this one, else the record is behind the Delta log (the offset store
    was restored from a backup, or lost, while this loop ran) and landing would skip or double
    lines. The loop's next start catches the record up from the log."""
    found = store.newest_unit_meta(path, app_id, lambda m: m.get("unit") == unit)
    theirs = (found[0].get("queue") if found else None)
    if isinstance(theirs, dict) and "ranges" in theirs and theirs["ranges"] != queue.get("ranges"):
        raise ProcessingError(
            f"{path}: its commit v{found[1] if found else '?'} holds stream micro-batch {unit} planned otherwise than "
            "the queue record plans it now: the offset store is behind the Delta log (restored from a backup, or "
            "lost, while the loop ran). Nothing was written; start the stream loop again, which catches the "
            "record up from the log")


def drop_files(pair: TypedPair, files: set[str], file_of: Callable[[int], str]) -> TypedPair:
    """``pair`` without the rows (and failures) of ``files``: their part landed before."""
    keep = [file_of(line) not in files for line in pair.lines]
    mask = pa.array(keep, pa.bool_())
    return dataclasses.replace(pair, data=pair.data.filter(mask), received=pair.received.filter(mask),
                               lines=[line for line, k in zip(pair.lines, keep, strict=True) if k],
                               failed=[f for f in pair.failed if file_of(f[0]) not in files])


@dataclass
class UnitResult:
    unit: str
    events_in: int = 0
    written: int = 0
    failed: int = 0
    skipped: int = 0
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)  # "<dest>:<table>" -> status entry
    failed_by_dest: dict[str, int] = field(default_factory=dict)
    files: int = 1  # incoming files in the unit


class EventProcessor:
    """Runs units (incoming files, replays) of one intake config against one warehouse."""

    def __init__(self, settings: Settings, destinations: list[DestinationSpec],
                 modes: tuple[DestinationMode, ...] = (DestinationMode.BATCH,)) -> None:
        from lineage.intake.pipeline import build_destinations

        self.settings = settings
        self.events_dir = settings.events_dir()
        self.destinations = build_destinations(destinations, modes)
        # stream destinations read the same incoming files: the last reader archives a file
        self.stream_ids = [d.id for d in destinations if d.mode is DestinationMode.STREAM]
        self.workers = workers_setting()
        self.typer: ParallelTyper | None = None
        #: the files of the unit after the one being processed, each (path, base): typed ahead
        self.next_unit: Callable[[], list[tuple[Path, int]] | None] | None = None
        self._archiver: ThreadPoolExecutor | None = None
        self._archiving: list[Future[None]] = []
        self.geo: dict[str, GeoLookup] = {}
        #: the offset-store record the processor holds, where each unit is planned and committed
        #: (None: units are numbered by the events folder alone, for tools that hold no lock)
        self.record: UnitRecord | None = None
        for d in self.destinations:
            if d.spec.lookups.geo_db:
                self.geo[d.id] = store.open_geo(d.spec.lookups.geo_db)

    def _parallel(self, files: list[tuple[Path, int]]) -> bool:
        try:
            return self.workers > 1 and sum(p.stat().st_size for p, _ in files) >= parallel_bytes_setting()
        except FileNotFoundError:
            return False

    # -- one unit ---------------------------------------------------------------------------
    def run_unit(self, unit: str, status_file: Path, events: Callable[[], Iterable[tuple[int, dict[str, Any]]]],
                 originals: Callable[[set[int]], dict[int, dict[str, Any]]], *,
                 failure_ids: Callable[[int, str], str], replace: dict[str, list[str]] | None = None,
                 files: list[tuple[Path, int]] | None = None, members: Members | None = None,
                 queue: dict[str, Any] | None = None) -> UnitResult:
        """Plan, land and log one unit (see the module docstring). ``replace``: per destination,
        the failure ids this unit takes out of ``etl.failed_events`` (a replay). ``files``: the
        unit is these whole incoming files, each ``(path, base)`` (large units are typed by worker
        processes). ``members``: the unit's incoming files by name and where each one's lines are
        (default: the unit alone). ``queue``: a stream micro-batch's plan in its queue record, in
        every commit of the unit (the Delta log's word on where the queue stood, should the
        store lose it); a table that holds this unit under another plan stops the unit."""
        started = time.monotonic()
        members = members if members is not None else Members.single(unit)
        status: dict[str, Any] = store.read_json(status_file) or {}
        known = int(status["ordinal"]) if "ordinal" in status else None

        def fresh(n: int) -> None:
            """The plan under ordinal ``n``, keeping each table's entry: one that says landed is a fact;
            one only planned is checked against the table's commits below (its version may have
            gone to another processor's unit)."""
            nonlocal status
            status = {"unit": unit, "ordinal": n, "destinations": status.get("destinations") or {}}
            if len(members.names) > 1:
                status["files"] = members.names
            store.write_json_atomic(status_file, status)

        if self.record is not None and not status.get("committed"):
            ordinal = self.record.begin(unit, known, fresh)
        elif known is None:
            fresh(ordinal := store.next_ordinal(self.events_dir))
        else:
            ordinal = known
        tables: dict[str, dict[str, Any]] = {}  # each table's columns, read once per unit

        def columns_of(table: str) -> Any:
            if table not in tables:
                tables[table] = store.table_columns(self.settings.table_path(table))
            return tables[table]

        if files is not None and self._parallel(files):
            if self.typer is None:
                modes = tuple(sorted({d.spec.mode.value for d in self.destinations}))
                self.typer = ParallelTyper([d.spec for d in self.destinations], modes, self.settings, self.workers)
            prepared = self.typer.type_unit(files)
            nxt = self.next_unit() if self.next_unit is not None else None
            if nxt is not None and self._parallel(nxt):
                self.typer.prefetch(nxt)  # typed while this one is written
        else:
            prepared = type_events(events(), self.destinations, self.geo, columns_of)
        result = UnitResult(unit, prepared.events_in, skipped=prepared.skipped, files=len(members.names))
        failures = {d: list(f) for d, f in prepared.failures.items()}
        meta_files: dict[str, Any] = {"files": members.names} if len(members.names) > 1 else {}
        if queue is not None:
            meta_files["queue"] = queue
        typed: dict[tuple[str, str], Any] = {}
        # 1. plan: every pair's transaction version, before anything is written
        for key, pair in prepared.pairs.items():
            dest, table = key
            dstat = status["destinations"].setdefault(dest, {"tables": {}})
            entry = dstat["tables"].get(table)
            path = self.settings.table_path(table)
            app = stage_app_id(dest, table)
            st = store.table_state(path, app)
            if entry is not None and entry["state"] != "ok" and st.txn_version >= entry["version"]:
                # its version was taken: by this unit before a crash, or by another processor's unit
                # (after a takeover, or one a store restored from a backup forgot): that commit says which
                if landed_before(path, app, entry, members.names):
                    entry["state"] = "ok"  # landed before a crash: the Delta log is the truth
                else:
                    dstat["tables"].pop(table)  # planned anew, below
                    entry = None
            if entry is not None and entry["state"] == "ok":
                continue
            if entry is None and st.txn_version:
                # no plan for this pair: first time, or the status file was lost. The table's own
                # commits say which of the unit's files it already holds (per file: a lost status
                # may regroup the files differently)
                landed = store.committed_files(path, app, members.names)
                if landed and queue is not None:
                    _same_queue_plan(path, app, unit, queue)
                if landed:
                    pair = prepared.pairs[key] = drop_files(pair, landed, members.file_of)
                    if not pair.lines:
                        dstat["tables"][table] = {"version": st.txn_version, "state": "ok", "rows": None,
                                                  "recovered": True}
                        continue
            if pair.failed:
                failures.setdefault(dest, []).extend((line, table, why) for line, why in pair.failed)
            pos = positions(pair.received, st.max_pos)
            typed[key] = (pair, pos)
            first, last = (pos[0].as_py(), pos[-1].as_py()) if len(pos) else (None, None)
            dstat["tables"][table] = {
                "version": entry["version"] if entry else st.txn_version + 1, "state": "planned",
                "since": entry.get("since", st.version) if entry else st.version,
                "rows": len(pair.lines), "lines": [pair.lines[0], pair.lines[-1]] if pair.lines else None,
                "columns_added": pair.added, "promotions": pair.promotions,
                "unmapped_values": pair.unmapped_values, "collided_values": pair.collided_values,
                "failed": len(pair.failed),
                "min_pos": first.isoformat() if first else None, "max_pos": last.isoformat() if last else None,
                "max_id": (ordinal << 32 | pair.lines[-1]) if pair.lines else None,
            }
        failed_path = self.settings.table_path(store.FAILED_EVENTS)
        for dest in sorted({d for d, f in failures.items() if f} | set(replace or {})):  # no empty commits
            dstat = status["destinations"].setdefault(dest, {"tables": {}})
            f = dstat.get("failed")
            if f is not None and f["state"] == "ok":  # landed already: nothing to read or plan
                continue
            taken, table_version = store.failed_state(failed_path, dest)  # nothing writes it while planning
            if f is not None and taken >= f["version"]:
                if landed_before(failed_path, store.failed_app_id(dest), f, members.names):
                    f["state"] = "ok"
                else:  # the version went to another processor's unit: planned anew
                    del dstat["failed"]
            if "failed" not in dstat:
                if failures.get(dest) and taken:
                    landed = store.committed_files(failed_path, store.failed_app_id(dest), members.names)
                    if landed and queue is not None:
                        _same_queue_plan(failed_path, store.failed_app_id(dest), unit, queue)
                    failures[dest] = [f for f in failures[dest] if members.file_of(f[0]) not in landed]
                flog = store.failed_log(self.events_dir, dest)
                dstat["failed"] = {"version": taken + 1, "state": "planned", "since": table_version,
                                   "count": len(failures.get(dest, [])),
                                   "offset": flog.stat().st_size if flog.exists() else 0}
        store.write_json_atomic(status_file, status)
        crashpoint("events_planned")
        # 2. land: failed events first, so a retry that finds a pair landed never recomputes them
        for dest, dstat in status["destinations"].items():
            f = dstat.get("failed")
            if not f or f["state"] == "ok":
                continue
            if store.failed_version(failed_path, dest) >= f["version"]:
                f["state"] = "ok"
                continue
            rows = self._failure_rows(members, dest, failures.get(dest, []), originals, failure_ids)
            store.append_failed(store.failed_log(self.events_dir, dest), f["offset"],
                                [dumps_exact(_event_error(r)) + b"\n" for r in rows])
            crashpoint("events_failed_file")
            store.write_failed_events(failed_path, rows, dest, f["version"], unit,
                                      replace_ids=(replace or {}).get(dest), files=members.names,
                                      extra={"queue": queue} if queue is not None else None)
            f["state"] = "ok"
            store.write_json_atomic(status_file, status)
            crashpoint("events_failed_written")
        for (dest, table), (pair, pos) in typed.items():
            entry = status["destinations"][dest]["tables"][table]
            ids = pa.array([ordinal << 32 | line for line in pair.lines], pa.int64())
            if pair.lines:
                entry["max_id"] = ordinal << 32 | pair.lines[-1]  # (a plan kept from an ordinal drawn anew)
                store.write_stage(self.settings.table_path(table), pair.data, pos, ids, stage_app_id(dest, table),
                                  entry["version"], {"unit": unit, "destination": dest, "table": table,
                                                     "lines": entry["lines"], "rows": len(ids), **meta_files})
            crashpoint("events_written")
            entry["state"] = "ok"
            store.write_json_atomic(status_file, status)
        # 3. log (idempotent per pair and version), then the caller acknowledges the unit
        for dest, dstat in status["destinations"].items():
            n_failed = (dstat.get("failed") or {}).get("count", 0) or 0
            result.failed += n_failed
            result.failed_by_dest[dest] = n_failed
            for table, entry in dstat["tables"].items():
                result.written += entry.get("rows") or 0
                result.tables[f"{dest}:{table}"] = entry
                self._log(dest, table, entry, unit, prepared, time.monotonic() - started)
        crashpoint("events_logged")
        if self.record is not None and not status.get("committed"):
            self.record.commit(unit, ordinal, result.written)
            status["committed"] = True  # a unit retried from here on (its files not archived yet) leaves the record be
            store.write_json_atomic(status_file, status)
        return result

    def _failure_rows(self, members: Members, dest: str, failures: list[tuple[int, str | None, str]],
                      originals: Callable[[set[int]], dict[int, dict[str, Any]]],
                      failure_ids: Callable[[int, str], str]) -> list[dict[str, Any]]:
        events = originals({line for line, _, _ in failures})
        now = dt.datetime.now(dt.UTC)
        rows = []
        for line, table, error in sorted(failures, key=lambda f: f[0]):
            ev = events.get(line, {})
            name, file_line = members.where(line)
            rows.append({"failure_id": failure_ids(line, dest), "destination": dest, "table": table, "error": error,
                         "event": dumps_exact(ev).decode(), "file": name, "line": file_line, "failed_at": now,
                         "received_at": received_at(ev)})
        return rows

    def _log(self, dest: str, table: str, entry: dict[str, Any], unit: str, prepared: TypedUnit, seconds: float) -> None:
        if entry.get("rows") is None:
            return  # recovered from the Delta log alone: the statistics went with the lost status
        ts = dt.datetime.now(dt.UTC)
        pair = prepared.pairs.get((dest, table))
        changes = {"events_in": pair.rows_in if pair else 0, "written": entry["rows"], "failed": entry.get("failed", 0),
                   "columns_added": len(entry.get("columns_added") or []), "promotions": entry.get("promotions", 0),
                   "unmapped_values": entry.get("unmapped_values", 0), "collided_values": entry.get("collided_values", 0)}
        lines = entry.get("lines") or [0, 0]
        write_etl_log(self.settings, LogEntry(
            topic=f"events:{dest}:{table}", ts=ts, rows=entry["rows"], max_id=entry.get("max_id"),
            min_ts=_ts(entry.get("min_pos")), max_ts=_ts(entry.get("max_pos")), nulls={}, run_id=unit,
            processor="events", seq=entry["version"], last=f"{unit}:{lines[0]}", next=f"{unit}:{lines[1]}",
            base_rows=changes["events_in"], bad_rows=changes["failed"] + changes["unmapped_values"] + changes["collided_values"],
            delta_version=None, duration_s=seconds, detail=",".join(entry.get("columns_added") or []) or None,
            changes=changes))

    # -- files ------------------------------------------------------------------------------
    def process_files(self, rfs: list[ReadyFile]) -> UnitResult | None:
        """One unit of ready files (a group from :func:`plan_units`); ``None`` when it was done
        before (its files are only archived, or wait for a stream destination)."""
        from resources.intake.event_queue import batch_done

        first = rfs[0]
        status_file = store.status_path(first.path)
        if batch_done(first.path):  # processed; waits for a stream destination to read it too
            self._finish(rfs, wait=True)
            return None
        members = unit_members(rfs)
        paths = {rf.path.name: rf.path for rf in rfs}

        def events() -> Iterator[tuple[int, dict[str, Any]]]:
            for name, base in zip(members.names, members.bases, strict=True):
                for n, ev in read_events(paths[name]):
                    yield base + n, ev

        def originals(lines: set[int]) -> dict[int, dict[str, Any]]:
            wanted: dict[str, set[int]] = {}
            for line in lines:
                name, n = members.where(line)
                wanted.setdefault(name, set()).add(n)
            out = {}
            for name, base in zip(members.names, members.bases, strict=True):
                if name in wanted:
                    out.update({base + n: ev for n, ev in read_events(paths[name]) if n in wanted[name]})
            return out

        def failure_id(line: int, dest: str) -> str:
            name, n = members.where(line)
            return f"{name}:{n}:{dest}"

        result = self.run_unit(first.path.name, status_file, events, originals, failure_ids=failure_id,
                               files=[(rf.path, base) for rf, base in zip(rfs, members.bases, strict=True)],
                               members=members)
        if len(rfs) > 1:
            # done, said durably before any file goes: the first file's status names the group, and
            # with stream destinations (which archive files too) every file says it for itself
            for rf in rfs[1:] if self.stream_ids else []:
                st = store.read_json(store.status_path(rf.path)) or {}
                store.write_json_atomic(store.status_path(rf.path), {**st, "batch_done": True})
            store.write_json_atomic(status_file, {**(store.read_json(status_file) or {}), "batch_done": True})
        self._finish(rfs)
        return result

    def _finish(self, rfs: list[ReadyFile], wait: bool = False) -> None:
        """Archive the unit's files (or mark them done for a stream destination), the first one
        last: until it goes, its status file says the unit is done."""
        from resources.intake.event_queue import finish_file

        def archive() -> None:
            with self._store() as offsets:
                streamed = None if offsets is None else streamed_by(offsets, self.events_dir, self.stream_ids)
                for rf in reversed(rfs):
                    finish_file(self.events_dir, rf.path, rf.start.date(), batch=True, streamed=streamed, has_batch=True)
                    crashpoint("events_archived")

        if wait:
            archive()
            return
        # gzip (zlib frees the GIL) while the next unit is processed; a crash before it ends leaves
        # files in ready/ with every pair done, and the next run only archives them
        if self._archiver is None:
            self._archiver = ThreadPoolExecutor(1, thread_name_prefix="tidemark-archive")
        self._archiving.append(self._archiver.submit(archive))

    @contextlib.contextmanager
    def _store(self) -> Iterator[OffsetStore | None]:
        """The offset store where stream destinations keep their read positions (None without
        stream destinations): the held record's, else one opened for the block."""
        if not self.stream_ids:
            yield None
            return
        if self.record is not None:
            yield self.record.keeper.store
            return
        opened = open_settings_store(self.settings)
        try:
            yield opened
        finally:
            opened.close()

    def wait_archived(self) -> None:
        """Wait for the files handed to the archiving thread (raises what it raised)."""
        try:
            for f in self._archiving:
                f.result()
        finally:
            self._archiving.clear()
            if self._archiver is not None:
                self._archiver.shutdown(wait=True)
                self._archiver = None


def unit_members(rfs: list[ReadyFile]) -> Members:
    if len(rfs) == 1:
        return Members.single(rfs[0].path.name)
    return Members.of([rf.path.name for rf in rfs], [_complete_lines(rf.path) for rf in rfs])


def _complete_lines(path: Path) -> int:
    """The lines :func:`read_events` numbers in ``path`` (an unterminated tail is not one)."""
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def unit_bytes_setting() -> int:
    raw = os.environ.get("TIDEMARK_EVENT_UNIT_BYTES", str(64 * 1024**2))
    try:
        return max(1, int(raw))
    except ValueError:
        raise ValueError(f"TIDEMARK_EVENT_UNIT_BYTES={raw!r}: give the bytes of incoming files one unit takes "
                         "(default 67108864)") from None


MAX_UNIT_FILES = 1000


def plan_units(files: list[ReadyFile], status_of: Callable[[Path], dict[str, Any] | None],
               size_of: Callable[[Path], int], *, budget: int, alone: int,
               max_files: int = MAX_UNIT_FILES) -> list[list[ReadyFile]]:
    """Ready files (in order) -> units. A file with a status file is where it was planned: the
    group its status names (a file of it already archived is gone once the group is done), or
    itself. Other files are taken in order into units of at most ``budget`` bytes and
    ``max_files`` files; a file of ``alone`` bytes or more is a unit of its own (worker
    processes type it)."""
    by_name = {rf.path.name: rf for rf in files}
    used: set[str] = set()
    units: list[list[ReadyFile]] = []
    for i, rf in enumerate(files):
        if rf.path.name in used:
            continue
        st = status_of(rf.path)
        if st is not None:
            names = list(st.get("files") or [rf.path.name])
            missing = [n for n in names if n not in by_name]
            if missing and not st.get("batch_done"):
                raise TidemarkError(f"{missing[0]} of the unit planned in {store.status_path(rf.path)} is gone from "
                                    f"{rf.path.parent}; it was moved or removed by hand before the unit landed. "
                                    "Put it back, or remove that status file to plan the files again")
            unit = [by_name[n] for n in names if n in by_name and n not in used]
        else:
            unit, size = [rf], size_of(rf.path)
            for nxt in files[i + 1:] if size < alone else []:
                if len(unit) >= max_files or nxt.path.name in used:
                    break
                more = size_of(nxt.path)
                if more >= alone or size + more > budget or status_of(nxt.path) is not None:
                    break
                unit.append(nxt)
                size += more
        used.update(u.path.name for u in unit)
        units.append(unit)
    return units


def positions(received: pa.Array, start: dt.datetime | None) -> pa.Array:
    """``pos`` of rows in order: the receive time raised to the running maximum (from ``start``,
    the table's newest ``pos``); a row without one gets the running maximum (or now)."""
    import pyarrow.compute as pc

    if not len(received):
        return pa.array([], _TS)
    raw = received.cast(pa.int64())
    seed = start if start is not None else (dt.datetime.now(dt.UTC) if raw[0].as_py() is None else None)
    if seed is not None:
        raw = pa.concat_arrays([pa.array([seed], _TS).cast(pa.int64()), raw])
    running = pc.fill_null_forward(pc.cumulative_max(raw, skip_nulls=True))
    if seed is not None:
        running = running.slice(1)
    return running.cast(_TS)


def _ts(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value) if value else None


def _event_error(row: dict[str, Any]) -> dict[str, Any]:
    """A failed-events file line: the seed's EventError (original event + error) and where it failed."""
    return {"event": loads_exact(row["event"]), "error": row["error"], "destination": row["destination"],
            "table": row["table"], "failure_id": row["failure_id"], "file": row["file"], "line": row["line"],
            "failed_at": row["failed_at"].isoformat()}
