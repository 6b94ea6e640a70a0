"""Checkpoints of the sources a follower reads (issue 55).

A Delta reader rebuilds a table's state from its newest checkpoint and every commit after it.
Spark writers checkpoint every 10 commits; ``deltalake`` writers (and so many ingestion tools, and
the demo's feeder) every 100. A follower's units read their sources at every new version, and each
such read costs Spark a state rebuild from up to 100 JSON commits (stop 65 measured Delta's state
work as most of a follower's Spark time). So the follower writes a checkpoint of a *source* (a
table the lineage declares under ``sources``: no topic writes it) once ``every`` commits follow
its newest one, JVM-free (``deltalake``'s ``create_checkpoint``), on a thread of its own, off the
units' path. ``tidemark maintain`` checkpoints sources the same way (from 20 commits): a
checkpoint is a file readers may use and need not, it changes no row and adds no version, and
one written twice (by the table's writer and here) holds the same state.

``$TIDEMARK_FOLLOW_CHECKPOINT_EVERY``: the commits after which a source is checkpointed (default
10, Spark's interval), or ``off``. A source that cannot be checkpointed (no write access, a
protocol ``deltalake`` cannot write) is said once and tried again every 10 minutes.

May import: ``lineage``, ``resources``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from lineage.core.errors import first_line

log = logging.getLogger(__name__)

EVERY_ENV = "TIDEMARK_FOLLOW_CHECKPOINT_EVERY"
DEFAULT_EVERY = 10
RETRY_S = 600.0  # a source that could not be checkpointed is tried again after this long


def every_setting() -> int | None:
    """``$TIDEMARK_FOLLOW_CHECKPOINT_EVERY``: commits after a source's newest checkpoint from which
    the follower checkpoints it (None: ``off``); a bad value is refused, naming it."""
    from resources.core.settings import whole_number_setting

    if os.environ.get(EVERY_ENV, "").strip().lower() == "off":
        return None
    return whole_number_setting(EVERY_ENV, DEFAULT_EVERY, "commits (or off)")


class SourceCheckpoints:
    """Checkpoints the sources ``paths`` (``{table: location}``) whose new versions the follower
    sees (:meth:`saw`)."""

    def __init__(self, paths: dict[str, str], every: int | None) -> None:
        self.paths, self.every = paths, every
        self._known: dict[str, int] = {}  # table -> the newest checkpoint version seen or written
        self._busy: set[str] = set()
        self._failed: dict[str, tuple[str, float]] = {}  # table -> why it failed, and when to try again
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self.written: dict[str, int] = {}  # table -> checkpoints written

    def saw(self, versions: dict[str, int | None]) -> None:
        """The newest versions the follower's look found: a source ``every`` commits past its
        newest checkpoint is checkpointed in the background."""
        if self.every is None:
            return
        now = time.monotonic()
        for table, version in versions.items():
            if version is None or table not in self.paths or version - self._known.get(table, -1) < self.every:
                continue
            if table in self._failed and now < self._failed[table][1]:
                continue
            with self._lock:
                if self._closed or table in self._busy:
                    continue
                self._busy.add(table)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="tidemark-checkpoint")
                self._pool.submit(self._checkpoint, table, version)

    def _checkpoint(self, table: str, version: int) -> None:
        from resources.storage import delta_log

        path = self.paths[table]
        try:
            newest = delta_log.last_checkpoint_hint(*delta_log.log_fs(path))
            if newest is not None and version - newest < (self.every or 0):
                self._known[table] = newest  # (its writer checkpointed it)
                return
            current = delta_log.open_table(path)
            if current is None:
                return  # (gone meanwhile)
            written = int(current.version())
            current.create_checkpoint()
            self._known[table] = written
            self.written[table] = self.written.get(table, 0) + 1
            self._failed.pop(table, None)
            log.debug("follow: checkpointed source %s at v%s", table, written)
        except Exception as exc:  # noqa: BLE001 - e.g. no write access: tried again later, said once
            why = first_line(exc)
            if table not in self._failed:
                log.warning("follow: cannot checkpoint source %s (%s); its readers replay its commits since its "
                            "newest checkpoint. Tried again every %.0f s (%s=off stops trying)",
                            table, why, RETRY_S, EVERY_ENV)
            self._failed[table] = (why, time.monotonic() + RETRY_S)
        finally:
            with self._lock:
                self._busy.discard(table)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
