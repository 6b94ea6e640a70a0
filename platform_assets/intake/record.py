"""The intake's units in the offset store (DESIGN.md, "One commit protocol").

Every unit of the intake is one of the shared protocol: a batch of incoming files, a replay, a
stream micro-batch. Its processor holds a record of the offset store: ``intake:batch``, or
``intake:stream:<dest>`` for a stream loop (:mod:`platform_assets.core.locks`). In that record,
like a CDC replicator's unit, the unit is:

- *planned* before anything is written: ``seq`` = the unit's ordinal, ``next`` = its position,
  ``state`` naming the unit and the events folder it reads;
- *committed* once every table holds it.

Row ids are ``ordinal << 32 | line``, and the ordinal comes from one counter of the store,
:data:`~platform_assets.core.locks.INTAKE_ORDINALS`. Every host and loop writing through that
store draws from it, so row ids are unique across them all, not only within an events folder.
Two floors keep a lost store, or one restored from a backup, from giving out a number again: the
greatest ordinal in the stage tables the destinations wrote (their Delta statistics: what any
host landed; another writer's table in the same schema is not counted), and the
folder's own counter (``processor.json``: what this folder planned and may not have landed yet).
A plan whose ordinal the record does not know (the store lost or went back past it) draws anew.

What a unit holds in detail stays in its status file beside its files:
- its files;
- each table's Delta transaction version;
- its statistics.

The Delta log stays the truth of what landed. The record decides whether that status plan may
still be trusted (:meth:`UnitRecord.begin`):

- **The record's pending unit is this one:** it is resumed as planned.
- **Another unit is pending:** its processor died or lost the lock (it may be on another host,
  reading another folder). That unit is superseded: committed with a note that says so.
- **The record planned a later unit since this one's plan was written:** another processor took
  the lock over meanwhile, and its units may hold the very transaction versions this plan names.
  So the plan is stale: the unit gets a new ordinal (the record's ``seq`` only grows), and each
  of its tables is checked as below. A file's rows land once, and none is skipped.
- **The unit landed and was committed** (its files not archived yet): the record is left be.

Beyond the record, a planned table (or failed-events entry) whose transaction version is already
taken counts as landed only when the commit that took it names this unit's files. That commit is
looked for among every commit since the plan was made, however many. Otherwise the version went to
another processor's unit (after a takeover, or one that a store restored from a backup forgot), and
the table is planned anew.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lineage.core.errors import OffsetError
from lineage.core.positions import ZERO_TS, Position
from platform_assets.core.locks import INTAKE_ORDINALS, intake_queue_key
from resources.intake import event_store
from resources.intake.event_queue import DONE
from resources.intake.event_store import stage_app_id
from resources.state.lease import LeaseKeeper
from resources.state.offset_sql import owner_host
from resources.state.offsets import STATE_PLANNED, OffsetRecord, OffsetStore
from resources.storage import delta_meta
from resources.storage.warehouse import delta_tables

if TYPE_CHECKING:
    from lineage.intake.destinations import DestinationSpec
    from resources.core.settings import Settings


def folder_tag(events_dir: Path) -> str:
    """A short name of this events folder, for unit names that must not meet another folder's (a
    stream loop numbers its micro-batches per folder) and for its stream queues' records. Drawn
    once at random (two hosts of one name and home path still get two) and kept in
    ``events/.folder_tag``, so a new host name or a moved home keeps it and the stream's read
    positions stay found. A folder whose stream queues still keep files from before the
    positions were records draws it from the host and the path, as the version that wrote them
    did, so the micro-batch they name keeps its name."""
    path = events_dir / ".folder_tag"
    with contextlib.suppress(FileNotFoundError):
        return _checked_tag(path, path.read_text().strip())
    events_dir.mkdir(parents=True, exist_ok=True)
    legacy = any(events_dir.glob("queue.dst=*/pending.json")) or any(events_dir.glob("queue.dst=*/state.json"))
    tag = (hashlib.sha1(f"{owner_host()}:{events_dir.resolve()}".encode()).hexdigest()[:8] if legacy
           else secrets.token_hex(4))
    tmp = events_dir / f".folder_tag.{os.getpid()}.tmp"
    with tmp.open("w") as fh:
        fh.write(tag)
        fh.flush()
        os.fsync(fh.fileno())  # never an empty tag file after a power cut
    try:
        os.link(tmp, path)  # the first writer's stays
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    event_store.fsync_dir(events_dir)
    return _checked_tag(path, path.read_text().strip())


def _checked_tag(path: Path, tag: str) -> str:
    if len(tag) != 8 or any(c not in "0123456789abcdef" for c in tag):
        raise OffsetError(f"{path}: {tag!r} is not an events folder's tag (8 hex digits). Write back the tag this folder "
                          "had: it ends the names of its stream queues' records (intake:queue:<destination>@<tag>, "
                          "`tidemark offsets show`) and of its micro-batches in its tables' commits. A new tag would "
                          "not find this folder's read positions")
    return tag


class UnitRecord:
    """The record a processor of the intake holds (its lock's keeper), and the units it plans there."""

    def __init__(self, keeper: LeaseKeeper, events_dir: Path, stage_tables: Callable[[], dict[str, list[str]]]) -> None:
        """``stage_tables()``: the stage tables whose row ids floor the ordinals, each path with the
        ``txnAppId`` of each destination that may write it (:func:`stage_table_paths`)."""
        self.keeper = keeper
        self.events_dir = events_dir
        self.stage_tables = stage_tables
        self.where = f"{owner_host()}:{events_dir}"

    def begin(self, unit: str, ordinal: int | None, save: Callable[[int], None]) -> int:
        """Plan ``unit`` in the record, or find it planned. ``ordinal`` is the unit's ordinal as
        its status file has it (None: no plan yet). ``save(n)`` must write the status plan with
        ordinal ``n`` before the record plans it; it is called when the unit needs a new ordinal. Returns the
        ordinal the unit lands with."""
        store, key, owner = self.keeper.store, self.keeper.topic, self.keeper.owner
        rec = self._record()
        if ordinal is not None and rec.seq == ordinal and (not rec.pending or rec.state in (STATE_PLANNED, self._state(unit))):
            return ordinal  # planned before a crash (or committed just before one): the tables say what is left
        if rec.pending:
            store.commit(key, owner, seq=rec.seq, last=rec.last, next=rec.next or rec.last, rows=0,
                         note=f"unit {rec.seq} ({rec.state}) did not finish; superseded by {unit} ({self.where}). "
                              "When its processor runs it again, it plans it anew from what the tables hold")
            rec = self._record()
        if ordinal is None or ordinal != rec.seq:  # (a record behind the plan: the store lost or restored it)
            ordinal = event_store.next_ordinal(
                self.events_dir, at_least=max(rec.seq, self._landed_ordinal()),
                take=lambda floor: store.take_number(INTAKE_ORDINALS, who=owner, at_least=floor, processor="intake"))
            save(ordinal)
        store.plan(key, owner, last=rec.last, next=Position(ZERO_TS, ordinal), seq=ordinal, source_version=None)
        store.set_state(key, owner, self._state(unit))
        return ordinal

    def commit(self, unit: str, ordinal: int, rows: int) -> None:
        """The unit landed in every table: close it in the record."""
        store, key, owner = self.keeper.store, self.keeper.topic, self.keeper.owner
        rec = self._record()
        if not rec.pending and rec.seq == ordinal:
            return  # committed before a crash
        store.commit(key, owner, seq=ordinal, last=rec.last, next=Position(ZERO_TS, ordinal), rows=rows,
                     note=f"{unit}: {rows} rows")

    def _landed_ordinal(self) -> int:
        """The greatest ordinal the stage tables hold (row ids are ``ordinal << 32 | line``), from
        their Delta statistics: the floor of the next one even when the store's counter was lost
        or restored from a backup, and other hosts' folders drew numbers this one never saw (the
        Delta log is the truth, DESIGN.md). A table is read incrementally once opened."""
        high = delta_meta.max_id(self.stage_tables())
        ordinal = 0 if high is None else high >> 32
        if ordinal >= MAX_ORDINAL:
            raise OffsetError(f"the intake's stage tables hold a row id of {high}, whose unit ordinal ({ordinal}) leaves "
                              f"no room for another (ids are ordinal << 32 | line, at most {MAX_ORDINAL} units): "
                              "a row id the intake did not give (written by hand?); find it in the destinations' "
                              "tables and remove it")
        return ordinal

    def _state(self, unit: str) -> str:
        return f"planned: {unit} ({self.where})"

    def _record(self) -> OffsetRecord:
        return held_record(self.keeper)


def stage_table_paths(settings: Settings, destinations: Iterable[DestinationSpec]) -> Callable[[], dict[str, list[str]]]:
    """Every table in the schemas of ``destinations`` as the warehouse lists them when called (a
    unit may add one), each path with the ``txnAppId`` each destination would write it under: a
    table none of them wrote (another writer's, in the same schema) is not theirs."""
    specs = list(destinations)
    schemas = sorted({d.schema_ for d in specs})

    def tables() -> dict[str, list[str]]:
        return {settings.table_path(t): [stage_app_id(d.id, t) for d in specs if t.split(".", 1)[0] == d.schema_]
                for t in delta_tables(settings.warehouse, schemas)}

    return tables


#: Unit ordinals stay below this: a row id ``ordinal << 32 | line`` is a signed 64-bit integer.
MAX_ORDINAL = 2**31 - 1


def held_record(keeper: LeaseKeeper) -> OffsetRecord:
    """The record ``keeper`` holds, once its lock is known to be still ours (raises the lost lock's
    error)."""
    keeper.check()
    rec = keeper.store.get(keeper.topic)
    if rec is None:
        raise OffsetError(f"'{keeper.topic}': its record is gone from the offset store while this processor "
                          "held it (removed by hand?); run again")
    return rec


def streamed_by(store: OffsetStore, events_dir: Path, stream_ids: Sequence[str]) -> Callable[[str], bool] | None:
    """``streamed(name)``: every stream destination of ``stream_ids`` read incoming file ``name``
    of ``events_dir`` to its end (their queue records say so); None without stream destinations."""
    if not stream_ids:
        return None
    tag = folder_tag(events_dir)

    def streamed(name: str) -> bool:
        for dest in stream_ids:
            rec = store.get(intake_queue_key(dest, tag))
            if rec is None or name + DONE not in rec.inputs:
                return False
        return True

    return streamed
