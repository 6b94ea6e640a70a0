"""What Delta records of a replicator's replicas, and when the slot may move past it (issue 57).

A replica's commits record the source position each of its units applied; the replicator's
positions table (:mod:`resources.storage.cdc_positions`) records how far each replica is complete
beyond that (a span of the stream with nothing for it), its pause, and the replicator's numbering.
:class:`Positions` keeps both for one unit and writes the table before the slot is acknowledged
past what the two record (:meth:`Positions.durable`), so a lost or restored offset store recovers
every replica's exact position from Delta. Plain bookkeeping over that one table: no Spark.
"""

from __future__ import annotations

import datetime as dt
import os
import threading

from lineage.core.errors import TidemarkError
from platform_assets.core import faults
from resources.core.settings import Settings
from resources.storage import cdc_positions

EVERY_ENV = "TIDEMARK_CDC_POSITIONS_EVERY_S"


def every_setting() -> float:
    """In continuous mode (``tidemark follow``, where idle units follow each other every fraction
    of a second), at most one write of a replicator's positions table every this many seconds
    while idle (``$TIDEMARK_CDC_POSITIONS_EVERY_S``, default 5; 0: every idle unit that moves a
    position); until then the slot is not acknowledged past what Delta records. A unit of a run
    (``tidemark cdc run``, a Dagster run) is at most one per run and writes when it must."""
    raw = os.environ.get(EVERY_ENV, "5")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # (also NaN)
        raise TidemarkError(f"{EVERY_ENV}={raw!r}: expected a number of seconds >= 0")
    return value


class Positions:
    """One unit's view of what Delta records of replicator ``name``'s replicas."""

    def __init__(self, settings: Settings, name: str, every_s: float = 0.0) -> None:
        self.settings, self.name = settings, name
        self.every = every_s
        #: what the positions table holds (:meth:`load` at the unit's start, then each write)
        self.recorded = cdc_positions.Recorded()
        self._committed: dict[str, int] = {}  # replica -> the position its newest commit records, where known
        self._lock = threading.Lock()  # replicas land from threads

    @property
    def table(self) -> str:
        return cdc_positions.table_name(self.name)

    def load(self) -> cdc_positions.Recorded:
        self.recorded = cdc_positions.read(self.settings, self.name)
        return self.recorded

    def committed(self, replica: str, lsn: int) -> None:
        """``replica``'s newest commit records ``lsn``."""
        with self._lock:
            self._committed[replica] = lsn

    def durable(self, wanted: dict[str, tuple[int, str]], *, idle: bool, unit: int, changes: int) -> bool:
        """Whether Delta records ``wanted`` (replica -> (the position it is complete up to, its kept
        state)): each position by a commit of the replica or by the table, each state by the table.
        Writes the table when it must, except while ``idle`` within :attr:`every` seconds of its last
        write (False: the slot may not move past what Delta records yet)."""
        got = self.recorded
        with self._lock:
            moved = [r for r, (lsn, _) in wanted.items() if lsn > max(self._committed.get(r, -1), got.lsn.get(r, -1))]
        states = [r for r, (_, state) in wanted.items() if state != got.state.get(r, state)]
        if not moved and not states and set(wanted) <= set(got.lsn):
            return True
        now = dt.datetime.now(dt.UTC)
        if idle and not states and got.ts is not None and (now - got.ts).total_seconds() < self.every:
            return False
        self.recorded = cdc_positions.write(self.settings, self.name, wanted, unit=max(unit, got.unit),
                                            changes=max(changes, got.changes), now=now)
        faults.crashpoint("cdc-positions")
        return True
