"""The offset store: the seed's ``SCH.Offsets`` (topic, last, next, rows, run, processor, state,
owner) with compare-and-set updates.

Rules every backend keeps (the contract suite in ``tests/resources/test_offsets_contract.py``
runs the same tests on SQLite and on a real PostgreSQL):

* ``last`` never moves backwards, except through :meth:`OffsetStore.reset`, which is logged;
* ``seq`` (the block number, used as the Delta ``txnVersion``) never decreases, not even on
  reset, because Delta skips a write whose txnVersion is not above the recorded one;
* every update names the owner that holds the topic's lock and the state it expects, and
  fails with :class:`OffsetError` when another writer got there first;
* a second owner trying to lock a held topic gets :class:`TopicLockedError` naming the holder;
* a lock is a lease: it expires ``lease`` after its last ``acquire`` or ``heartbeat``, and an
  expired lock is taken over by the next ``acquire`` (logged as ``steal``), so a killed process
  or a lost container never needs a manual ``unlock``.
"""

from __future__ import annotations

import abc
import builtins
import datetime as dt
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from lineage.core.durations import format_duration, parse_duration
from lineage.core.errors import ConfigError, OffsetError
from lineage.core.positions import Position, format_ts

#: Lock lease when ``TIDEMARK_LOCK_LEASE`` is not set.
DEFAULT_LEASE = dt.timedelta(minutes=5)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)

#: ``state`` values the engine writes.
STATE_NEW = "new"
STATE_PLANNED = "planned"  # next is fixed, data may or may not have landed
STATE_COMMITTED = "committed"
STATE_RELOADED = "reloaded"
STATE_FAILED = "failed"


@dataclass(frozen=True)
class OffsetRecord:
    topic: str
    last: Position
    next: Position | None  # set while a block is planned and not yet committed
    rows: int  # rows written by the last committed block / reload
    seq: int  # number of the last planned block (0 = none yet)
    run: dt.datetime | None  # when the last block / reload committed (naive UTC)
    processor: str
    state: str
    owner: str  # '' when nobody holds the lock (the seed's hostid)
    owner_since: dt.datetime | None
    source_version: int | None  # Delta version of the base table when the block was planned
    updated_at: dt.datetime
    lease_until: dt.datetime | None = None  # the lock expires then unless its holder heartbeats
    #: Delta version of the destination commit that landed the last committed block / reload:
    #: where that commit is found in the log without searching.
    delta_version: int | None = None
    #: Per-input offsets of a merge topic (Datapipe's ``transform_input_offset``): the Delta version
    #: of every input other than the base up to which its changes are applied; each only grows.
    inputs: Mapping[str, int] = field(default_factory=dict)
    #: The versions the pending unit applies up to (set by ``plan``, moved to ``inputs`` by ``commit``).
    inputs_next: Mapping[str, int] | None = None

    @property
    def pending(self) -> bool:
        """A block is planned and not committed: the next run must redo exactly it."""
        return self.next is not None


@dataclass(frozen=True)
class OffsetLogEntry:
    at: dt.datetime
    topic: str
    action: str  # init | plan | commit | reload | recover | reset | unlock | steal | release-dead | mark | forget
    who: str
    old_last: Position | None
    new_last: Position | None
    note: str


class OffsetStore(abc.ABC):
    """Interface of an offset store backend. All datetimes are naive UTC."""

    #: Decides whether a lock holder is dead (e.g. a process on this host that no longer
    #: exists) so that :meth:`acquire` may take the lock over, logging a ``steal``.
    is_stale_owner: Callable[[str], bool] = staticmethod(lambda owner: False)
    #: How long a lock lives after its last acquire or heartbeat.
    lease: dt.timedelta = DEFAULT_LEASE
    #: The store's clock (naive UTC); tests replace it to let leases expire without sleeping.
    clock: Callable[[], dt.datetime] = staticmethod(utcnow)

    @abc.abstractmethod
    def get(self, topic: str) -> OffsetRecord | None: ...

    @abc.abstractmethod
    def list(self) -> list[OffsetRecord]:
        """Every record, ordered by topic."""

    @abc.abstractmethod
    def init(self, topic: str, last: Position, processor: str, *, who: str, note: str = "", seq: int = 0) -> OffsetRecord:
        """Create the record of a new topic (block numbers continue above ``seq``). ``OffsetError``
        if it exists already."""

    def ensure(self, key: str, processor: str, *, who: str, note: str) -> None:
        """Create ``key``'s record (position zero) unless it exists; a concurrent creator may win."""
        if self.get(key) is None:
            try:
                self.init(key, Position.zero(), processor, who=who, note=note)
            except OffsetError:
                pass  # another process created it first

    @abc.abstractmethod
    def take_number(self, key: str, *, who: str, at_least: int = 0, processor: str = "counter") -> int:
        """The next number of the counter ``key`` (its record's ``seq``, created at 0 if missing):
        ``max(seq, at_least) + 1``, stored before it is returned, in one transaction, so no two
        callers on any host get the same number. No lock is needed and none is taken; not logged
        (the unit planned with the number is)."""

    @abc.abstractmethod
    def acquire(self, topic: str, owner: str) -> OffsetRecord:
        """Take the topic's lock. Re-entrant for the same owner. ``UnknownTopicError`` if the
        topic has no record; ``TopicLockedError`` naming the holder if another owner holds it
        (unless the holder's lease expired or ``is_stale_owner(holder)``: then the lock is taken
        over and a ``steal`` logged). Sets ``lease_until = clock() + lease``, also on re-entry."""

    def takeover_reason(self, rec: OffsetRecord, now: dt.datetime) -> str | None:
        """Why another owner may take over the lock held in ``rec`` at ``now`` (its lease expired,
        or :attr:`is_stale_owner` finds its holder dead); None while its holder keeps it. The one
        judgment :meth:`acquire` and :meth:`holder` make."""
        expires = lease_end(rec, self.lease)
        if expires <= now:
            ago = format_duration(dt.timedelta(seconds=max(1, round((now - expires).total_seconds()))))
            return f"its lease expired at {format_ts(expires)} ({ago} ago)"
        if self.is_stale_owner(rec.owner):
            return "its process is dead"
        return None

    def holder(self, topic: str) -> str | None:
        """Who holds ``topic``'s lock now; None when nobody does, or when the next :meth:`acquire`
        would take it over (:meth:`takeover_reason`). A look: nothing is locked."""
        rec = self.get(topic)
        if rec is None or not rec.owner or self.takeover_reason(rec, self.clock()) is not None:
            return None
        return rec.owner

    @abc.abstractmethod
    def heartbeat(self, topic: str, owner: str) -> OffsetRecord:
        """Extend the lease of the lock ``owner`` holds to ``clock() + lease``. ``OffsetError`` if
        ``owner`` no longer holds it (taken over or unlocked): the run must stop writing."""

    @abc.abstractmethod
    def release_dead(self, topic: str, owner: str, *, who: str, reason: str) -> bool:
        """Clear the lock if ``owner`` still holds it, because ``who`` knows that owner is dead
        (e.g. its Dagster run ended); logged as ``release-dead`` with ``reason``. Returns whether
        it was cleared (False: the lock is free or another owner holds it now)."""

    @abc.abstractmethod
    def release(self, topic: str, owner: str) -> None:
        """Give the lock back. No-op if nobody holds it; ``OffsetError`` if another owner does."""

    @abc.abstractmethod
    def unlock(self, topic: str, *, who: str) -> str:
        """Clear the lock whoever holds it (the seed's "set hostid to ''"); logged.
        Returns the previous holder ('' if none)."""

    @abc.abstractmethod
    def plan(self, topic: str, owner: str, *, last: Position, next: Position, seq: int,
             source_version: int | None, inputs_next: Mapping[str, int] | None = None,
             release: bool = False, flush: bool = True) -> OffsetRecord:
        """Fix the next block before any data is written: set ``next``, ``seq`` and
        ``state='planned'``. Compare-and-set on (owner holds the lock, ``last`` unchanged, no
        block pending, ``seq`` greater than the stored one, ``next > last``). A merge unit also
        fixes ``inputs_next`` (no input below its committed version); with it ``next`` may equal
        ``last`` (only other inputs changed). ``release``: release the lock in the same
        transaction (a planner that only plans; its run takes the lock again). ``flush=False``:
        the plan need not wait for the disk where the store allows it; the caller then calls
        :meth:`sync` before anything acts on the plan (a planner that plans many topics at once
        waits for the disk once)."""

    @abc.abstractmethod
    def commit(self, topic: str, owner: str, *, seq: int, last: Position, next: Position, rows: int,
               state: str = STATE_COMMITTED, note: str = "", delta_version: int | None = None,
               forget: Collection[str] = ()) -> OffsetRecord:
        """``last := next`` for the pending block ``seq``: compare-and-set on owner, seq, last
        and next; clears ``next``, sets ``rows``, ``run=now``, ``state``, ``delta_version``, and
        ``inputs := inputs_next`` (a merge unit's per-input offsets, each only growing), then drops
        the inputs named in ``forget`` (a stream loop's positions in files that are gone)."""

    @abc.abstractmethod
    def commit_reload(self, topic: str, owner: str, *, seq: int, mark: Position, rows: int,
                      source_version: int | None, note: str = "", delta_version: int | None = None) -> OffsetRecord:
        """Record a finished reload: ``seq`` (> stored), ``last := max(last, mark)``, rows,
        ``run=now``, ``state='reloaded'``, ``source_version``, ``delta_version``."""

    @abc.abstractmethod
    def recover(self, topic: str, *, who: str, expected_seq: int, seq: int, last: Position, rows: int,
                run: dt.datetime | None, state: str, source_version: int | None, delta_version: int,
                note: str, inputs: Mapping[str, int] | None = None) -> OffsetRecord:
        """Catch the record up with the destination's Delta log, which recorded block (or reload)
        ``seq`` after the one the store knows (a store restored from a backup, behind, or lost):
        sets ``last``, ``seq``, ``rows``, ``run``, ``state``, ``source_version``,
        ``delta_version`` (and per-input offsets, never lowered) and clears ``next``; logged as ``recover``. Compare-and-set on
        ``expected_seq`` (another process may have caught it up first: ``OffsetError``) and
        ``seq > expected_seq``; refused (``TopicLockedError``) while another owner holds the lock."""

    @abc.abstractmethod
    def set_state(self, topic: str, owner: str, state: str) -> None:
        """Free-text state (e.g. ``failed: <error>``) written by the lock holder."""

    @abc.abstractmethod
    def reset(self, topic: str, last: Position, *, who: str, reason: str, seq: int = 0,
              late_from: Mapping[str, int] | None = None) -> OffsetRecord:
        """The one way to move ``last`` backwards (or anywhere): sets ``last``, clears ``next``
        and keeps ``seq`` (raised to ``seq`` if that is higher: block numbers the Delta log has
        recorded are never reused); refused while another owner holds the lock; logged.
        ``late_from`` (``{base: version}``): late rows are looked for only among rows the base
        gets after that version (sets ``source_version``, and a merge topic's offset for the base
        where it has one, never lowered)."""

    @abc.abstractmethod
    def forget(self, topic: str, *, who: str, reason: str) -> None:
        """Delete a topic's record (e.g. ``tidemark cdc delete``); refused while another owner holds
        its lock; logged as ``forget``. No-op when there is none."""

    @abc.abstractmethod
    def history(self, topic: str | None = None, limit: int = 100) -> builtins.list[OffsetLogEntry]:
        """The log of init/plan/commit/reload/reset/unlock/steal/mark, newest first."""

    @abc.abstractmethod
    def log_head(self) -> int:
        """A number that grows with every entry of the offset log (0: none yet): a cheap way to
        notice that a topic planned, committed or was reset since the last look."""

    @abc.abstractmethod
    def logged_after(self, head: int) -> dict[int, str]:
        """The offset log entries after ``head`` (a value of :meth:`log_head`): id -> topic. On a
        server with concurrent writers ids are not in commit order: an entry may appear below a
        head read earlier (see :mod:`platform_assets.dagster.watch`)."""

    @abc.abstractmethod
    def prune_log(self, before: dt.datetime, *, keep: int, dry_run: bool = False) -> int:
        """Delete the offset log's entries written before ``before`` (UTC), except each topic's
        newest ``keep`` (at least 1, so :meth:`log_head` never goes back); the number deleted, or
        with ``dry_run`` the number that would be. Records (``tidemark_offsets``) are never touched:
        the log is history for people, nothing plans from its old entries."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every earlier write of this store durable (a power cut keeps it), after writes
        made with ``flush=False``. A store whose every write waits for the disk has nothing to do."""

    @abc.abstractmethod
    def close(self) -> None: ...


def lease_end(rec: OffsetRecord, lease: dt.timedelta) -> dt.datetime:
    """When the lock of ``rec`` expires. A lock taken by a Tidemark without leases (no
    ``lease_until``) gets one lease from when it was taken."""
    if rec.lease_until is not None:
        return rec.lease_until
    return rec.owner_since + lease if rec.owner_since else dt.datetime.min


# -- the log's retention ------------------------------------------------------------------------

#: Environment variables of the offset log's retention (see :func:`log_retention_from_env`).
LOG_RETENTION_ENV = "TIDEMARK_OFFSET_LOG_RETENTION"
LOG_KEEP_ENV = "TIDEMARK_OFFSET_LOG_KEEP"
DEFAULT_LOG_RETENTION = dt.timedelta(days=30)
MIN_LOG_RETENTION = dt.timedelta(hours=1)
DEFAULT_LOG_KEEP = 1000


@dataclass(frozen=True)
class LogRetention:
    """How long the offset log keeps its entries (``age``; zero: for ever) and how many of each
    topic's newest it keeps whatever their age (``keep``)."""

    age: dt.timedelta
    keep: int

    def prune(self, store: OffsetStore, *, dry_run: bool = False) -> int:
        """Prune ``store``'s log to this retention (by the store's clock); the entries removed."""
        if not self.age:
            return 0
        return store.prune_log(store.clock() - self.age, keep=self.keep, dry_run=dry_run)

    def describe(self) -> str:
        if not self.age:
            return f"the offset log is kept whole: {LOG_RETENTION_ENV}=0"
        return f"entries older than {format_duration(self.age)}, each topic's newest {self.keep} kept"


def log_retention_from_env(env: Mapping[str, str] | None = None) -> LogRetention:
    """``TIDEMARK_OFFSET_LOG_RETENTION`` (a duration, ``0``: keep the whole log; default 30 days)
    and ``TIDEMARK_OFFSET_LOG_KEEP`` (each topic's newest entries kept whatever their age,
    default 1000, at least 1)."""
    env = os.environ if env is None else env
    text = env.get(LOG_RETENTION_ENV, "").strip()
    try:
        age = DEFAULT_LOG_RETENTION if not text else parse_duration(text)
    except ValueError as exc:
        raise ConfigError(f"{LOG_RETENTION_ENV}: {exc}") from None
    if text and age and age < MIN_LOG_RETENTION:
        raise ConfigError(f"{LOG_RETENTION_ENV}={text!r}: keep the offset log at least 1h (or 0: for ever); "
                          f"unset: {format_duration(DEFAULT_LOG_RETENTION)}")
    raw = env.get(LOG_KEEP_ENV, "").strip()
    try:
        keep = int(raw) if raw else DEFAULT_LOG_KEEP
    except ValueError:
        keep = 0
    if keep < 1:
        raise ConfigError(f"{LOG_KEEP_ENV}={raw!r}: give how many of each topic's newest log entries to keep, "
                          f"a whole number >= 1 (unset: {DEFAULT_LOG_KEEP})")
    return LogRetention(age, keep)
