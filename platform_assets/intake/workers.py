"""Typing a unit's events into Arrow, in this process or split over worker processes.

A unit's files are cut into chunks: a large file at line boundaries, many small files into runs
of whole files of about equal bytes; worker processes (a
``ProcessPoolExecutor``, ``$TIDEMARK_EVENT_WORKERS``, default 2) parse, route, name, enrich, map
and type each chunk against the tables' current columns and return Arrow tables. The result is
the one a single pass over the unit gives: when chunks typed a new column differently (int in
one, string in another), the type promotion of the whole unit is applied and those chunks are
typed again with it. Only the type promotion *count* (a statistic) may differ.

Units smaller than ``$TIDEMARK_EVENT_PARALLEL_BYTES`` (default 8 MiB) are typed in-process.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from lineage.intake.bodies import has_long_digits, loads_exact
from lineage.intake.columns import SqlType, promote
from lineage.intake.destinations import DestinationSpec
from lineage.intake.pipeline import (
    UNMAPPED,
    BatchHeader,
    ColumnType,
    Destination,
    GeoLookup,
    prepare,
    type_batch,
)

Key = tuple[str, str]  # (destination, table)
_TS = pa.timestamp("us", tz="UTC")


def workers_setting() -> int:
    raw = os.environ.get("TIDEMARK_EVENT_WORKERS", "2")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"TIDEMARK_EVENT_WORKERS={raw!r}: give a number of worker processes (1: none)") from None
    return max(1, n)


def parallel_bytes_setting() -> int:
    return int(os.environ.get("TIDEMARK_EVENT_PARALLEL_BYTES", str(8 * 1024**2)))


@dataclass
class TypedPair:
    """One (destination, table) of a unit, typed: columns (no ``pos``/``id``) and their lines."""

    data: pa.Table
    lines: list[int]
    received: pa.Array  # the rows' receive times (timestamp, null when unknown), aligned to ``lines``
    added: list[str]
    unmapped_values: int
    failed: list[tuple[int, str]]
    promotions: int
    rows_in: int
    types: dict[str, SqlType | None] = field(default_factory=dict)  # each column's type (None: not one we write)
    header: dict[str, SqlType] = field(default_factory=dict)
    table_columns: dict[str, ColumnType] = field(default_factory=dict)  # what the table had when typed
    collided_values: int = 0  # values of fields that collided in a column, kept in _unmapped_data


@dataclass
class TypedUnit:
    pairs: dict[Key, TypedPair] = field(default_factory=dict)
    failures: dict[str, list[tuple[int, str | None, str]]] = field(default_factory=dict)  # template failures
    events_in: int = 0
    skipped: int = 0


def _arrow_type(ct: ColumnType) -> pa.DataType:
    from resources.intake.event_store import arrow_type

    return arrow_type(ct)


def type_events(events: Iterable[tuple[int, dict[str, Any]]], destinations: list[Destination],
                geo: dict[str, GeoLookup], columns_of: Callable[[str], dict[str, ColumnType]],
                forced: dict[Key, dict[str, SqlType]] | None = None) -> TypedUnit:
    """Every step of the pipeline over ``events``, typed against ``columns_of(table)``;
    ``forced``: the header to type a pair with (a whole file's promotion)."""
    prepared = prepare(events, destinations, geo)
    out = TypedUnit(failures=prepared.failures, events_in=prepared.events_in, skipped=prepared.skipped)
    for key, pair in prepared.pairs.items():
        header = pair.header
        if forced and key in forced:
            header = BatchHeader(header.table, dict(forced[key]), header.promotions, pytypes=header.pytypes,
                                 rows=header.rows, collided_rows=header.collided_rows)
        table_cols = columns_of(pair.table)
        batch = type_batch(header, pair.rows, table_cols, pair.dest.spec.unmapped)
        written = set(batch.lines)
        received = [rec for (line, _), rec in zip(pair.rows, pair.received, strict=True) if line in written] \
            if len(written) != len(pair.rows) else list(pair.received)
        arrays, fields = [], []
        for name, (ct, values) in batch.columns.items():
            at = _arrow_type(ct)
            arrays.append(pa.array(values, at))
            fields.append(pa.field(name, at))
        out.pairs[key] = TypedPair(pa.Table.from_arrays(arrays, schema=pa.schema(fields)), batch.lines,
                                   pa.array(received, _TS),
                                   batch.added, batch.unmapped_values, batch.failed, pair.header.promotions,
                                   len(pair.rows), {n: ct.type for n, (ct, _) in batch.columns.items()},
                                   dict(pair.header.fields), dict(table_cols), batch.collided_values)
    return out


# -- the worker side --------------------------------------------------------------------------

Segment = tuple[str, int, int, int]  # bytes [start, end) of an incoming file; the unit line of its first line


@dataclass(frozen=True)
class ChunkTask:
    segments: tuple[Segment, ...]
    specs: list[DestinationSpec]
    modes: tuple[str, ...]
    settings: Any  # resources.core.settings.Settings
    forced: dict[Key, dict[str, SqlType]] | None = None


_CACHE: dict[str, Any] = {}


def _chunk_events(task: ChunkTask) -> Iterable[tuple[int, dict[str, Any]]]:
    for path, start, end, first_line in task.segments:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
        lines = data.split(b"\n")
        lines.pop()  # b"" after the last newline, or an unterminated tail: a torn write, never acknowledged
        loads = loads_exact if has_long_digits(data) else orjson.loads  # per segment: the common case stays orjson's
        for k, line in enumerate(lines):
            try:
                ev = loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(ev, dict):
                yield first_line + k, ev


def run_chunk(task: ChunkTask) -> TypedUnit:
    """In a worker process: one chunk of a file, typed."""
    from lineage.intake.destinations import DestinationMode
    from lineage.intake.pipeline import build_destinations
    from resources.intake import event_store as store

    key = repr((task.specs, task.modes))
    if _CACHE.get("key") != key:
        dests = build_destinations(task.specs, tuple(DestinationMode(m) for m in task.modes))
        geo = {d.id: store.open_geo(d.spec.lookups.geo_db) for d in dests if d.spec.lookups.geo_db}
        _CACHE.update(key=key, dests=dests, geo=geo)
    settings = task.settings
    return type_events(_chunk_events(task), _CACHE["dests"], _CACHE["geo"],
                       lambda table: store.table_columns(settings.table_path(table)), task.forced)


# -- the main side ----------------------------------------------------------------------------

def split_unit(files: list[tuple[Path, int]], parts: int) -> list[tuple[Segment, ...]]:
    """The chunks of a unit: one file cut into ``parts`` chunks at line ends, or several files
    (each ``(path, base)``: its line n is unit line base + n) in about ``parts`` runs of whole
    files of about equal bytes, in order."""
    if len(files) == 1:
        path, base = files[0]
        return [((str(path), a, b, base + first),) for a, b, first in split_file(path, parts)]
    sizes = [p.stat().st_size for p, _ in files]
    share = sum(sizes) / parts
    out: list[tuple[Segment, ...]] = []
    run: list[Segment] = []
    taken = 0
    for (path, base), size in zip(files, sizes, strict=True):
        run.append((str(path), 0, size, base + 1))
        taken += size
        if taken >= share * (len(out) + 1) and len(out) < parts - 1:
            out.append(tuple(run))
            run = []
    if run:
        out.append(tuple(run))
    return out


def split_file(path: Path, parts: int) -> list[tuple[int, int, int]]:
    """``(start, end, first line)`` of ``parts`` chunks of ``path`` cut after a newline."""
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as f:
        for i in range(1, parts):
            f.seek(max(bounds[-1], size * i // parts))
            f.readline()  # to the end of the line the cut falls in
            pos = f.tell()
            if pos >= size:
                break
            bounds.append(pos)
        bounds.append(size)
        out, line = [], 1
        for a, b in zip(bounds, bounds[1:], strict=False):
            if b <= a:
                continue
            out.append((a, b, line))
            f.seek(a)
            line += f.read(b - a).count(b"\n")
    return out


def _target_types(p: TypedPair) -> dict[str, SqlType | None]:
    return {n: t for n, t in p.types.items() if n != UNMAPPED}


def merge_chunks(chunks: list[TypedUnit]) -> tuple[TypedUnit, dict[Key, dict[str, SqlType]], set[int]]:
    """Merge typed chunks (in file order). Returns the merged unit, and when chunks typed a column
    differently: the whole file's headers to type again with, and the chunks that need it."""
    forced: dict[Key, dict[str, SqlType]] = {}
    redo: set[int] = set()
    keys: list[Key] = []
    for c in chunks:
        keys += [k for k in c.pairs if k not in keys]
    for key in keys:
        indexed = [(i, c.pairs[key]) for i, c in enumerate(chunks) if key in c.pairs]
        types: dict[str, SqlType | None] = {}
        conflict = False
        for _, p in indexed:
            for n, t in _target_types(p).items():
                if n in types and types[n] is not t:
                    conflict = True
                types.setdefault(n, t)
        if conflict:
            header: dict[str, SqlType] = {}
            for _, p in indexed:
                for n, t in p.header.items():
                    header[n] = promote(header[n], t) if n in header else t
            forced[key] = header
            redo |= {i for i, _ in indexed}
    merged = TypedUnit()
    for c in chunks:
        merged.events_in += c.events_in
        merged.skipped += c.skipped
        for d, f in c.failures.items():
            merged.failures.setdefault(d, []).extend(f)
    if forced:
        return merged, forced, redo
    for key in keys:
        parts = [c.pairs[key] for c in chunks if key in c.pairs]
        data = pa.concat_tables([p.data for p in parts], promote_options="default")
        if UNMAPPED in data.column_names:  # last, as a single pass puts it
            data = data.select([n for n in data.column_names if n != UNMAPPED] + [UNMAPPED])
        added: list[str] = []
        for p in parts:
            added += [n for n in p.added if n not in added and n != UNMAPPED]
        if any(UNMAPPED in p.added for p in parts):
            added.append(UNMAPPED)
        merged.pairs[key] = TypedPair(
            data, [x for p in parts for x in p.lines], pa.concat_arrays([p.received for p in parts]), added,
            sum(p.unmapped_values for p in parts), [x for p in parts for x in p.failed],
            sum(p.promotions for p in parts), sum(p.rows_in for p in parts),
            collided_values=sum(p.collided_values for p in parts))
    return merged, {}, set()


_POOL: dict[str, Any] = {}


def pool(workers: int) -> Executor:
    """One pool per process, started on first use (forkserver: the workers do not inherit the
    parent's threads, e.g. deltalake's runtime)."""
    ex = _POOL.get("ex")
    if ex is None or _POOL.get("n") != workers:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["platform_assets.intake.workers", "platform_assets.intake.batch", "resources.intake.event_store"])
        ex = ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
        _POOL.update(ex=ex, n=workers)
    return ex


def shutdown_pool() -> None:
    ex = _POOL.pop("ex", None)
    if ex is not None:
        ex.shutdown(wait=True, cancel_futures=True)


class ParallelTyper:
    """Types units (a large file, or many small ones) in the worker pool, one unit ahead: while
    the caller writes a unit's tables, the next one is typed against the tables as they were. A
    unit typed against columns that changed since (the previous unit added some) is typed again."""

    def __init__(self, specs: list[DestinationSpec], modes: tuple[str, ...], settings: Any, workers: int) -> None:
        self.specs, self.modes, self.settings, self.workers = specs, modes, settings, workers
        self.ahead: dict[tuple[Path, ...], tuple[list[ChunkTask], list[Future[TypedUnit]]]] = {}

    def _submit(self, files: list[tuple[Path, int]], forced: dict[Key, dict[str, SqlType]] | None = None
                ) -> tuple[list[ChunkTask], list[Future[TypedUnit]]]:
        tasks = [ChunkTask(segs, self.specs, self.modes, self.settings, forced)
                 for segs in split_unit(files, self.workers * 2)]
        ex = pool(self.workers)
        return tasks, [ex.submit(run_chunk, t) for t in tasks]

    def prefetch(self, files: list[tuple[Path, int]]) -> None:
        key = tuple(p for p, _ in files)
        if key not in self.ahead and all(p.exists() for p in key):
            self.ahead[key] = self._submit(files)

    def _stale(self, chunks: list[TypedUnit]) -> bool:
        from resources.intake import event_store as store

        now: dict[str, dict[str, ColumnType]] = {}
        for c in chunks:
            for (_, table), p in c.pairs.items():
                if table not in now:
                    now[table] = store.table_columns(self.settings.table_path(table))
                if p.table_columns != now[table]:
                    return True
        return False

    def type_unit(self, files: list[tuple[Path, int]]) -> TypedUnit:
        """Type one unit's files, each ``(path, base)`` (see the module docstring)."""
        ahead = self.ahead.pop(tuple(p for p, _ in files), None)
        tasks, futures = ahead if ahead is not None else self._submit(files)
        chunks = [f.result() for f in futures]
        if ahead is not None and self._stale(chunks):  # typed ahead, before the tables changed: again
            tasks, futures = self._submit(files)
            chunks = [f.result() for f in futures]
        merged, forced, redo = merge_chunks(chunks)
        if forced:
            ex = pool(self.workers)
            again = [dataclasses.replace(t, forced=forced) for t in tasks]
            for i, c in zip(sorted(redo), ex.map(run_chunk, [again[i] for i in sorted(redo)]), strict=True):
                chunks[i] = c
            merged, forced, _ = merge_chunks(chunks)
            if forced:  # cannot happen: every chunk of a pair now has the same header
                raise RuntimeError(f"{files[0][0]}: chunks typed differently after promotion: {sorted(forced)}")
        return merged
