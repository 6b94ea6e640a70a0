"""Keeps a topic's lock alive while a block runs: a daemon thread heartbeats the lease.

The offset store's lock is a lease (see :mod:`resources.state.offsets`): it expires ``lease`` after its
last heartbeat, and then another run may take the topic over. A :class:`LeaseKeeper` heartbeats
every ``lease / 3`` from when the engine takes the lock until it releases it, so a live run keeps
its lock however long its block takes, and a killed one loses it one lease after its last beat.

The thread shares the engine's store object: :class:`~resources.state.offset_sql.SqlOffsetStore`
serialises every call (one transaction at a time) with its own lock, for SQLite and PostgreSQL.
"""

from __future__ import annotations

import logging
import threading

from lineage.core.errors import OffsetError, UnknownTopicError
from resources.state.offsets import OffsetStore

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Heartbeats ``owner``'s lock of ``topic`` from a daemon thread until :meth:`stop`."""

    def __init__(self, store: OffsetStore, topic: str, owner: str, interval_s: float | None = None) -> None:
        self.store = store
        self.topic = topic
        self.owner = owner
        self.interval_s = interval_s if interval_s is not None else store.lease.total_seconds() / 3
        #: Set when a heartbeat found the lock taken over (or unlocked): the run must stop.
        self.lost: OffsetError | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tidemark-lease:{topic}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> bool:
        """Stop heartbeating (waits for a beat in flight). Returns False if the lock was lost."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.lost is None

    def check(self) -> None:
        """Raise the ``OffsetError`` of a lost lock: call before anything that must not happen
        once another run has taken the topic over (writing the block)."""
        if self.lost is not None:
            raise self.lost

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                self.store.heartbeat(self.topic, self.owner)
            except OffsetError as exc:  # taken over or unlocked: stop, the engine reports it
                self.lost = exc
                log.error("topic '%s': lock lost by %s: %s", self.topic, self.owner, exc)
                return
            except UnknownTopicError as exc:  # the record is gone (the store lost or replaced under the run):
                # the lock with it, so another run may hold the topic now; stop like a takeover (issue 57)
                self.lost = OffsetError(f"topic '{self.topic}': lock lost by {self.owner}: its record is no longer in "
                                        f"the offset store (store lost or replaced while the unit ran): {exc}")
                log.error("%s", self.lost)
                return
            except Exception as exc:  # e.g. the database is briefly unreachable: retry next beat
                log.warning("topic '%s': lease heartbeat failed (retrying in %.1fs): %s",
                            self.topic, self.interval_s, exc)
