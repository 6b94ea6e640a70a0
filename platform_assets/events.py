"""The batch event processor (issue 11, seed 002 "Batch processing"): ready incoming files, in
order, into the destinations' Delta stage tables, each (file, destination, table) exactly once.

A file is one unit of the commit protocol (DESIGN.md):

1. *plan*: its ordinal (row ids are ``ordinal << 32 | line``) and, for every (destination,
   table) pair and every destination's failed events, a Delta transaction version
   (``tidemark-intake:<dest>:<table>`` / ``tidemark-intake-failed:<dest>``, the table's last
   version + 1), are stored in ``<file>.status`` before anything is written;
2. *land*: failed events first (the ``failed.dst=<id>.log`` file, then ``etl.failed_events``),
   then each pair in one Delta commit carrying its transaction and userMetadata (file, lines);
3. *reconcile*: on a retry a planned pair whose transaction the table holds is done, whatever
   the status file says; a lost status file is covered by the commits' userMetadata;
4. *log*: per pair statistics to ``etl.log`` (processor ``events``), then the file is archived.

``pos`` is the receive time (``_timestamp``) raised to the running maximum of the table, so
``(pos, id)`` only grows in commit order: a step topic over a stage table never sees a late row.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from lineage.event_pipeline import (
    BatchHeader,
    Destination,
    EventFailure,
    GeoLookup,
    lookup_enrichment,
    route,
)
from lineage.event_types import parse_timestamp
from lineage.events import dumps_exact, loads_exact
from lineage.intake_destinations import DestinationMode, DestinationSpec
from platform_assets.event_workers import (
    ParallelTyper,
    TypedUnit,
    parallel_bytes_setting,
    type_events,
    workers_setting,
)
from platform_assets.faults import crashpoint
from resources import event_store as store
from resources.incoming_log import ReadStats, ReadyFile, read_events
from resources.meta_tables import LogEntry, write_etl_log
from resources.settings import Settings

_TS = pa.timestamp("us", tz="UTC")


def stage_app_id(dest: str, table: str) -> str:
    return f"tidemark-intake:{dest}:{table}"


@dataclass
class Pair:
    """The events of one unit for one (destination, table)."""

    dest: Destination
    table: str
    header: BatchHeader
    rows: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    received: list[dt.datetime | None] = field(default_factory=list)


@dataclass
class Prepared:
    pairs: dict[tuple[str, str], Pair] = field(default_factory=dict)
    failures: dict[str, list[tuple[int, str | None, str]]] = field(default_factory=dict)  # dest -> (line, table, error)
    events_in: int = 0
    skipped: int = 0


def _received(event: dict[str, Any]) -> dt.datetime | None:
    ts = event.get("_timestamp")
    if isinstance(ts, str):
        try:
            return parse_timestamp(ts)
        except ValueError:
            return None
    return None


def prepare(events: Iterable[tuple[int, dict[str, Any]]], destinations: list[Destination],
            geo: dict[str, GeoLookup]) -> Prepared:
    """Multiplex, name, enrich and map every event: rows grouped by (destination, table) with
    their BatchHeader, and the events that failed (a template error)."""
    out = Prepared()
    for line, event in events:
        out.events_in += 1
        targets = route(event, destinations)
        received = _received(event)
        for i, d in enumerate(targets):
            ev = event if i == len(targets) - 1 else loads_exact(dumps_exact(event))  # steps change it in place
            try:
                table = d.table_name(ev)
            except EventFailure as exc:
                out.failures.setdefault(d.id, []).append((line, None, str(exc)))
                continue
            if table is None:
                out.skipped += 1
                continue
            lookup_enrichment(ev, user_agent=d.spec.lookups.user_agent, geo=geo.get(d.id))
            row = d.map_event(ev)
            pair = out.pairs.get((d.id, table))
            if pair is None:
                pair = out.pairs[(d.id, table)] = Pair(d, table, BatchHeader(table))
            pair.header.add(row, d.explicit)
            pair.rows.append((line, row))
            pair.received.append(received)
    return out


@dataclass
class UnitResult:
    unit: str
    events_in: int = 0
    written: int = 0
    failed: int = 0
    skipped: int = 0
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)  # "<dest>:<table>" -> status entry
    failed_by_dest: dict[str, int] = field(default_factory=dict)


class EventProcessor:
    """Runs units (incoming files, replays) of one intake config against one warehouse."""

    def __init__(self, settings: Settings, destinations: list[DestinationSpec],
                 modes: tuple[DestinationMode, ...] = (DestinationMode.BATCH,)) -> None:
        from lineage.event_pipeline import build_destinations

        self.settings = settings
        self.events_dir = settings.events_dir()
        self.destinations = build_destinations(destinations, modes)
        # stream destinations read the same incoming files: the last reader archives a file
        self.stream_ids = [d.id for d in destinations if d.mode is DestinationMode.STREAM]
        self.workers = workers_setting()
        self.typer: ParallelTyper | None = None
        self.next_file: Path | None = None  # the file after the one being processed (typed ahead)
        self._archiver: ThreadPoolExecutor | None = None
        self._archiving: list[Future[None]] = []
        self.geo: dict[str, GeoLookup] = {}
        for d in self.destinations:
            if d.spec.lookups.geo_db:
                self.geo[d.id] = store.open_geo(d.spec.lookups.geo_db)

    def _parallel(self, file: Path) -> bool:
        try:
            return self.workers > 1 and file.stat().st_size >= parallel_bytes_setting()
        except FileNotFoundError:
            return False

    # -- one unit ---------------------------------------------------------------------------
    def run_unit(self, unit: str, status_file: Path, events: Callable[[], Iterable[tuple[int, dict[str, Any]]]],
                 originals: Callable[[set[int]], dict[int, dict[str, Any]]], *,
                 failure_ids: Callable[[int, str], str], replace: dict[str, list[str]] | None = None,
                 file: Path | None = None) -> UnitResult:
        """Plan, land and log one unit (see the module docstring). ``replace``: per destination,
        the failure ids this unit takes out of ``etl.failed_events`` (a replay). ``file``: the
        unit is this whole incoming file (a large one is typed by worker processes)."""
        started = time.monotonic()
        status = store.read_json(status_file)
        if status is None or "ordinal" not in status:
            status = {"unit": unit, "ordinal": store.next_ordinal(self.events_dir), "destinations": {}}
            store.write_json_atomic(status_file, status)
        ordinal = int(status["ordinal"])
        tables: dict[str, dict[str, Any]] = {}  # each table's columns, read once per unit

        def columns_of(table: str) -> Any:
            if table not in tables:
                tables[table] = store.table_columns(self.settings.table_path(table))
            return tables[table]

        if file is not None and self._parallel(file):
            if self.typer is None:
                modes = tuple(sorted({d.spec.mode.value for d in self.destinations}))
                self.typer = ParallelTyper([d.spec for d in self.destinations], modes, self.settings, self.workers)
            prepared = self.typer.type_file(file)
            if self.next_file is not None and self._parallel(self.next_file):
                self.typer.prefetch(self.next_file)  # typed while this one is written
        else:
            prepared = type_events(events(), self.destinations, self.geo, columns_of)
        result = UnitResult(unit, prepared.events_in, skipped=prepared.skipped)
        failures = {d: list(f) for d, f in prepared.failures.items()}
        typed: dict[tuple[str, str], Any] = {}
        # 1. plan: every pair's transaction version, before anything is written
        for key, pair in prepared.pairs.items():
            dest, table = key
            dstat = status["destinations"].setdefault(dest, {"tables": {}})
            entry = dstat["tables"].get(table)
            path = self.settings.table_path(table)
            app = stage_app_id(dest, table)
            st = store.table_state(path, app)
            if entry is not None and (entry["state"] == "ok" or st.txn_version >= entry["version"]):
                entry["state"] = "ok"  # landed before a crash: the Delta log is the truth
                continue
            if entry is None and st.txn_version and store.committed_unit(path, app, unit):
                dstat["tables"][table] = {"version": st.txn_version, "state": "ok", "rows": None, "recovered": True}
                continue
            if pair.failed:
                failures.setdefault(dest, []).extend((line, table, why) for line, why in pair.failed)
            pos = positions(pair.received, st.max_pos)
            typed[key] = (pair, pos)
            first, last = (pos[0].as_py(), pos[-1].as_py()) if len(pos) else (None, None)
            dstat["tables"][table] = {
                "version": entry["version"] if entry else st.txn_version + 1, "state": "planned",
                "rows": len(pair.lines), "lines": [pair.lines[0], pair.lines[-1]] if pair.lines else None,
                "columns_added": pair.added, "promotions": pair.promotions,
                "unmapped_values": pair.unmapped_values, "failed": len(pair.failed),
                "min_pos": first.isoformat() if first else None, "max_pos": last.isoformat() if last else None,
                "max_id": (ordinal << 32 | pair.lines[-1]) if pair.lines else None,
            }
        failed_path = self.settings.table_path(store.FAILED_EVENTS)
        for dest in sorted({d for d, f in failures.items() if f} | set(replace or {})):  # no empty commits
            dstat = status["destinations"].setdefault(dest, {"tables": {}})
            if "failed" not in dstat:
                flog = store.failed_log(self.events_dir, dest)
                dstat["failed"] = {"version": store.failed_version(failed_path, dest) + 1, "state": "planned",
                                   "offset": flog.stat().st_size if flog.exists() else 0, "count": len(failures.get(dest, []))}
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
            rows = self._failure_rows(unit, dest, failures.get(dest, []), originals, failure_ids)
            store.append_failed(store.failed_log(self.events_dir, dest), f["offset"],
                                [orjson.dumps(_event_error(r)) + b"\n" for r in rows])
            crashpoint("events_failed_file")
            store.write_failed_events(failed_path, rows, dest, f["version"], unit,
                                      replace_ids=(replace or {}).get(dest))
            f["state"] = "ok"
            store.write_json_atomic(status_file, status)
            crashpoint("events_failed_written")
        for (dest, table), (pair, pos) in typed.items():
            entry = status["destinations"][dest]["tables"][table]
            ids = pa.array([ordinal << 32 | line for line in pair.lines], pa.int64())
            if pair.lines:
                store.write_stage(self.settings.table_path(table), pair.data, pos, ids, stage_app_id(dest, table),
                                  entry["version"], {"unit": unit, "destination": dest, "table": table,
                                                     "lines": entry["lines"], "rows": len(ids)})
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
        return result

    def _failure_rows(self, unit: str, dest: str, failures: list[tuple[int, str | None, str]],
                      originals: Callable[[set[int]], dict[int, dict[str, Any]]],
                      failure_ids: Callable[[int, str], str]) -> list[dict[str, Any]]:
        events = originals({line for line, _, _ in failures})
        now = dt.datetime.now(dt.UTC)
        rows = []
        for line, table, error in sorted(failures, key=lambda f: f[0]):
            ev = events.get(line, {})
            rows.append({"failure_id": failure_ids(line, dest), "destination": dest, "table": table, "error": error,
                         "event": dumps_exact(ev).decode(), "file": unit, "line": line, "failed_at": now,
                         "received_at": _received(ev)})
        return rows

    def _log(self, dest: str, table: str, entry: dict[str, Any], unit: str, prepared: TypedUnit, seconds: float) -> None:
        if entry.get("rows") is None:
            return  # recovered from the Delta log alone: the statistics went with the lost status
        ts = dt.datetime.now(dt.UTC)
        pair = prepared.pairs.get((dest, table))
        changes = {"events_in": pair.rows_in if pair else 0, "written": entry["rows"], "failed": entry.get("failed", 0),
                   "columns_added": len(entry.get("columns_added") or []), "promotions": entry.get("promotions", 0),
                   "unmapped_values": entry.get("unmapped_values", 0)}
        lines = entry.get("lines") or [0, 0]
        write_etl_log(self.settings, LogEntry(
            topic=f"events:{dest}:{table}", ts=ts, rows=entry["rows"], max_id=entry.get("max_id"),
            min_ts=_ts(entry.get("min_pos")), max_ts=_ts(entry.get("max_pos")), nulls={}, run_id=unit,
            processor="events", seq=entry["version"], last=f"{unit}:{lines[0]}", next=f"{unit}:{lines[1]}",
            base_rows=changes["events_in"], bad_rows=changes["failed"] + changes["unmapped_values"],
            delta_version=None, duration_s=seconds, detail=",".join(entry.get("columns_added") or []) or None,
            changes=changes))

    # -- files ------------------------------------------------------------------------------
    def process_file(self, rf: ReadyFile) -> UnitResult:
        from resources.event_queue import batch_done, finish_file

        if batch_done(rf.path):  # processed; waits for a stream destination to read it too
            finish_file(self.events_dir, rf.path, rf.start.date(), batch=True, stream_ids=self.stream_ids, has_batch=True)
            return UnitResult(rf.path.name)
        stats = ReadStats()

        def originals(lines: set[int]) -> dict[int, dict[str, Any]]:
            return {n: ev for n, ev in read_events(rf.path) if n in lines} if lines else {}

        name = rf.path.name
        result = self.run_unit(name, store.status_path(rf.path), lambda: read_events(rf.path, stats), originals,
                               failure_ids=lambda line, dest: f"{name}:{line}:{dest}", file=rf.path)
        def archive() -> None:
            finish_file(self.events_dir, rf.path, rf.start.date(), batch=True, stream_ids=self.stream_ids, has_batch=True)
            crashpoint("events_archived")

        # gzip (zlib frees the GIL) while the next file is processed; a crash before it ends leaves
        # the file in ready/ with every pair done, and the next run only archives it
        if self._archiver is None:
            self._archiver = ThreadPoolExecutor(1, thread_name_prefix="tidemark-archive")
        self._archiving.append(self._archiver.submit(archive))
        return result

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
    return {"event": orjson.loads(row["event"]), "error": row["error"], "destination": row["destination"],
            "table": row["table"], "failure_id": row["failure_id"], "file": row["file"], "line": row["line"],
            "failed_at": row["failed_at"].isoformat()}
