"""Snapshots of many Delta tables opened at once, ahead of their use (:func:`prefetched`: a planner
tick), with the rows after given positions read ahead, and kept in this process between ticks, brought
up to date incrementally; and the greatest ``id`` of many tables (:func:`max_id`), read that way.

May import: ``lineage``, ``delta_log``, ``snapshot``, ``statistics``, ``positions``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

from lineage.core.positions import Position
from resources.storage import delta_log
from resources.storage.positions import _rows_after
from resources.storage.snapshot import _PREFETCHED, TableSnapshot
from resources.storage.statistics import _max_id, _rows_from

#: Up to this many rows after a position are read ahead by :func:`prefetched` (their ``pos`` and
#: ``id``: 16 bytes a row); more are read when a block's end is looked for, one table at a time.
PREFETCH_ROWS = 20_000


@contextlib.contextmanager
def prefetched(paths: Iterable[str], threads: int | None = None, after: Mapping[str, Collection[Position]] | None = None) -> Iterator[None]:
    """Open the newest snapshot of each of ``paths`` (its log and file list) in ``threads`` threads
    (default :func:`prefetch_threads`) at once, deltalake reading without Python's lock, and let
    :meth:`TableSnapshot.open` return
    those inside the block (waiting for the one it asks for, not for all: a caller that takes the
    tables in the order of ``paths`` works while the later ones are read). For a caller that looks
    at many tables in a row and takes each as it was when its read began: the planner's tick,
    whose block plans read that very version.
    ``after[path]``: positions whose following rows (at most :data:`PREFETCH_ROWS` by the
    statistics) are read ahead too, for :func:`~resources.storage.positions.find_block_end`."""
    unique = list(dict.fromkeys(paths))

    def fetch(path: str) -> TableSnapshot | None:
        try:
            snap = TableSnapshot(path, _kept_table(path))
            _ = snap.files, snap.columns
            for last in (after or {}).get(path, ()):
                if 0 < _rows_from(snap.files, last) <= PREFETCH_ROWS:  # (none: no block to end)
                    rows = _rows_after(snap, last, None)
                    if rows is not None:
                        snap.after[last] = rows
        except Exception:  # noqa: BLE001 - read again where it is used, which says what is wrong
            return None
        return snap

    pool = concurrent.futures.ThreadPoolExecutor(max(1, min(threads or prefetch_threads(), len(unique) or 1)))
    ready = {p: pool.submit(fetch, p) for p in unique}
    token = _PREFETCHED.set(ready)
    try:
        yield
    finally:
        _PREFETCHED.reset(token)
        pool.shutdown(wait=True, cancel_futures=True)  # (a caller that left early: reads not begun are not)
        now = time.monotonic()
        with _KEPT_LOCK:
            for path, future in ready.items():
                snap = None if future.cancelled() else future.result()
                if snap is None:
                    continue
                mark = None if snap.version is None else delta_log.commit_mark(path, snap.version)
                if mark is not None and len(_KEPT) < KEPT_TABLES:
                    _KEPT[path] = (snap.table, mark, now)
            for path in [p for p, (_, _, used) in _KEPT.items() if now - used > KEPT_SECONDS]:
                del _KEPT[path]


def prefetch_threads() -> int:
    """Threads for :func:`prefetched`: one per core this process may use, at most 4. Beside the
    planning thread, more threads than cores only contend for the cores and Python's lock: on 2
    cores a tick of 200 topics took 0.85 s with 2 threads against 0.95 s with 4 (and more CPU)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


#: The tables :func:`prefetched` opened, kept for the next time in this process (a code server
#: evaluates the planner every few seconds): brought up to date incrementally (a look for new
#: commits, and those read) instead of read again; at most this many, each for as long as it is
#: used at least every ``KEPT_SECONDS``.
KEPT_TABLES = 1024
KEPT_SECONDS = 900.0
_KEPT: dict[str, tuple[Any, tuple[str, int, int], float]] = {}  # path -> (table, its commit's mark, used at)
_KEPT_LOCK = threading.Lock()


def _kept_table(path: str) -> Any | None:
    """The newest version of the table at ``path``: a kept one brought up to date when its commit
    is still the one it was (not a table dropped and written anew), else opened."""
    with _KEPT_LOCK:
        kept = _KEPT.pop(path, None)  # one user at a time
    if kept is not None:
        table, mark, _ = kept
        try:
            if delta_log.commit_mark(path, int(table.version())) == mark:
                table.update_incremental()
                return table
        except Exception:  # noqa: BLE001 - dropped, or its log cleaned past it: opened anew
            pass
    return delta_log.open_table(path)


def max_id(tables: Mapping[str, Collection[str]]) -> int | None:
    """The greatest ``id`` held now by the tables at the paths of ``tables`` that one of the
    writers named with each (their ``txnAppId``) has committed to (None: no row has one; a path without
    a table, or without a commit of those writers, holds none), from their Delta logs' statistics
    alone: no data file is read, and a table read before in this process is brought up to date
    incrementally. Raises :class:`RemovedDataError` when a file's statistics cannot say."""
    wanted = list(tables)
    best: int | None = None
    with prefetched(wanted):
        for path in wanted:
            snap = TableSnapshot.open(path)
            if snap.table is None or "id" not in snap.columns:
                continue
            if not any(snap.table.transaction_version(app) for app in tables[path]):
                continue  # another writer's table in the same schema: its ids are not ours to count
            high = _max_id(snap.files, f"{path} (version {snap.version})")
            best = high if best is None or (high is not None and high > best) else best
    return best
