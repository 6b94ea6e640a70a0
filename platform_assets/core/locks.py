"""The one lock every processor takes: a record of the offset store, held with its lease.

Topics (step, reload, merge) lock their own record through the Engine. The processors without a
topic lock a record named for what they work on, through :func:`holding`:

- a CDC replicator: ``cdc:<name>`` (:attr:`lineage.cdc.replicas.ReplicatorSpec.state_key`);
- the intake's batch processor (``tidemark events process|replay``, the Dagster intake job):
  :data:`INTAKE_BATCH`;
- a stream loop, per destination: :func:`intake_stream_key` (and the record of its read
  positions in its events folder, :func:`intake_queue_key`).

The intake plans and commits each unit in the record it holds
(:mod:`platform_assets.intake.record`), a CDC replicator each of its units.

The lock is the store's (:meth:`resources.state.offsets.OffsetStore.acquire`): one holder at a
time across every host that shares the store, a lease kept alive by a heartbeat thread
(:class:`resources.state.lease.LeaseKeeper`) while the holder works, taken over when the lease
expires or when the holder is a dead process of this host, and freed by the planner sensor when
the holder is a Dagster run that failed. A second holder gets
:class:`lineage.core.errors.TopicLockedError`, naming the holder and when its lease ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from resources.core.settings import Settings
from resources.state.lease import LeaseKeeper
from resources.state.offset_sql import make_owner, open_settings_store
from resources.state.offsets import OffsetRecord, OffsetStore

#: the record the intake's batch processor locks (one per offset store: the stage tables it writes
#: number their Delta transactions per destination and table, so two writers must not interleave)
INTAKE_BATCH = "intake:batch"


#: the counter of the intake's unit ordinals (the high 32 bits of stage-table row ids), shared by
#: the batch processor and every stream loop on every host that uses the store
#: (:class:`platform_assets.intake.record.UnitRecord`)
INTAKE_ORDINALS = "intake:ordinal"


def intake_stream_key(dest: str) -> str:
    """The record a stream loop locks for destination ``dest``."""
    return f"intake:stream:{dest}"


def intake_queue_key(dest: str, folder_tag: str) -> str:
    """The record of a stream destination's read positions in one events folder (its tag:
    :func:`platform_assets.intake.record.folder_tag`): the micro-batch planned there and the
    bytes and lines of each incoming file consumed. Only that folder's stream loop writes it,
    holding its lock beside :func:`intake_stream_key`'s."""
    return f"intake:queue:{dest}@{folder_tag}"


@contextmanager
def holding(store: OffsetStore, key: str, owner: str, *, processor: str, note: str) -> Iterator[LeaseKeeper]:
    """Hold ``key``'s lock for the ``with`` block, its lease kept alive; yields the keeper (its
    :meth:`~resources.state.lease.LeaseKeeper.check` raises once the lock was taken over). The
    lock is released at the end unless it was taken over meanwhile."""
    acquire(store, key, owner, processor=processor, note=note)
    keeper = LeaseKeeper(store, key, owner).start()
    try:
        yield keeper
    finally:
        if keeper.stop():  # a lock taken over is not ours to release
            store.release(key, owner)


def acquire(store: OffsetStore, key: str, owner: str, *, processor: str, note: str) -> OffsetRecord:
    """``key``'s record, created (position zero) if needed, locked by ``owner`` (raises
    ``TopicLockedError``)."""
    store.ensure(key, processor, who=owner, note=note)
    return store.acquire(key, owner)


@contextmanager
def holding_in(settings: Settings, key: str, *, processor: str, note: str, owner: str | None = None) -> Iterator[LeaseKeeper]:
    """:func:`holding` in the settings' offset store (opened for the block, closed after), for the
    processors that run without an Engine (the intake); ``owner``: default :func:`make_owner`."""
    store = open_settings_store(settings)
    try:
        with holding(store, key, owner or make_owner(), processor=processor, note=note) as keeper:
            yield keeper
    finally:
        store.close()


def holder(settings: Settings, key: str) -> str | None:
    """Who holds ``key``'s lock now, else None (nobody, its lease expired, or its holder is a dead
    process of this host: the next taker takes it over). A look: no lock is taken."""
    store = open_settings_store(settings)
    try:
        return store.holder(key)
    finally:
        store.close()
