"""Change events of a CDC source and what a batch of them does to a replica (issue 10, seed 004).

Pure Python: the types every CDC source produces (PostgreSQL logical replication, Debezium JSON
files) and the processor consumes, and :func:`reduce_keyed` / :func:`reduce_multiset`, which turn an
ordered batch of row changes into the net effect per replica key — the seed's ``$DIFF_QUERY``,
done right: a key changed by an UPDATE is followed through its before-image (``0→1→2→delete``
leaves nothing), unchanged TOAST columns are carried from the row's previous state, tables
without a key are multisets whose copies are counted.

Positions in the source are PostgreSQL LSNs (``int``; shown as ``16/B374D848``). A batch holds
whole transactions only, in commit order; the sequence number of a change is assigned by
Tidemark (:func:`number`), strictly increasing over the replicator's life.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from lineage.core.positions import ZERO_TS, Position


class Op(StrEnum):
    INSERT = "insert"
    UPDATE = "update"
    DELETE = "delete"
    TRUNCATE = "truncate"


class DdlKind(StrEnum):
    CREATE = "create"  # a new table (schema = its columns)
    ALTER = "alter"  # columns added, dropped, retyped (schema = the new columns)
    DROP = "drop"
    RENAME = "rename"  # table renamed to new_table


def format_lsn(lsn: int) -> str:
    """PostgreSQL's text form of an LSN: ``16/B374D848``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_position(lsn: int) -> Position:
    """A source position as an offset-store position (the ``id`` carries it; ``pos`` is constant)."""
    return Position(ZERO_TS, lsn)


def parse_lsn(text: str) -> int:
    hi, sep, lo = text.strip().partition("/")
    if not sep:
        raise ValueError(f"{text!r} is not an LSN (expected e.g. 16/B374D848)")
    return (int(hi, 16) << 32) | int(lo, 16)


@dataclass(frozen=True)
class Column:
    name: str
    type: str  # Spark SQL type of the replica column: bigint, int, string, double, decimal(12,2), boolean, date, timestamp, binary
    source_type: str = ""  # as the source names it (e.g. ``character varying(50)``), for messages
    nullable: bool = True


@dataclass(frozen=True)
class TableSchema:
    """A source table's columns and key (empty: none, replicated as a multiset)."""

    table: str  # ``schema.table`` in the source
    columns: tuple[Column, ...]
    key: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> Column | None:
        return next((c for c in self.columns if c.name == name), None)


@dataclass(frozen=True)
class RowChange:
    """One row changed by a source transaction.

    ``after``: the new row (INSERT, UPDATE), without the columns in ``unchanged`` (TOAST values the
    source did not send: the replica keeps the row's current value). ``before``: the old row's
    identity (UPDATE, DELETE) — its key columns, or every column for a table without a key; None
    for an UPDATE that kept its key when the source sends no old image then."""

    table: str
    op: Op
    after: Mapping[str, Any] | None = None
    before: Mapping[str, Any] | None = None
    unchanged: frozenset[str] = frozenset()


@dataclass(frozen=True)
class DdlChange:
    """A schema change of a source table, captured in order with the data."""

    table: str
    kind: DdlKind
    schema: TableSchema | None = None  # CREATE / ALTER: the table's columns after the change
    new_table: str | None = None  # RENAME
    statement: str = ""  # the DDL text as the source ran it


Change = RowChange | DdlChange


@dataclass(frozen=True)
class Transaction:
    """A committed source transaction: its changes in order. ``lsn`` is the commit LSN (what a
    replica records as applied; the next read starts after it); ``end_lsn`` the position after
    the commit record, where the next transaction's commit record may begin (a read through this
    one ends at ``end_lsn - 1``: :class:`resources.cdc.postgres.ReadResult`)."""

    xid: int
    lsn: int
    commit_time: dt.datetime  # naive UTC
    changes: tuple[Change, ...]
    end_lsn: int = 0

    @property
    def rows(self) -> int:
        return sum(isinstance(c, RowChange) for c in self.changes)


@dataclass(frozen=True)
class Numbered:
    """A row change with its place: the sequence number Tidemark assigns, and its transaction."""

    seq: int
    change: RowChange
    xid: int
    lsn: int
    commit_time: dt.datetime


def number(transactions: Iterable[Transaction], first_seq: int) -> list[Numbered]:
    """The batch's row changes numbered from ``first_seq`` in commit order (deterministic: a
    retry of the same transactions numbers them the same)."""
    out: list[Numbered] = []
    seq = first_seq
    for tx in transactions:
        for ch in tx.changes:
            if isinstance(ch, RowChange):
                out.append(Numbered(seq, ch, tx.xid, tx.lsn, tx.commit_time))
                seq += 1
    return out


# ------------------------------------------------------------------ net effect of a batch

#: A column value not known from the batch: the replica's current value of the row's origin key.
class _Unknown:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()


@dataclass
class KeyEffect:
    """What a batch leaves at one replica key: the row (present) or nothing (absent).

    ``origin``: the key of the replica row (as it was before the batch) this row descends from,
    when some of its values are :data:`UNKNOWN` (unchanged TOAST values never sent in the batch):
    they are taken from that row. ``versions`` (SCD2): the states the key went through, one per
    transaction, oldest first, as ``(values or None for absent, seq, commit_time)``. ``key`` and
    ``origin`` are key identities (:func:`key_identity`); ``values`` hold the key columns as decoded."""

    key: tuple[Any, ...]
    present: bool
    values: dict[str, Any] | None
    seq: int
    commit_time: dt.datetime
    origin: tuple[Any, ...] | None = None
    op: Op = Op.INSERT
    versions: list[tuple[dict[str, Any] | None, int, dt.datetime, int]] = field(default_factory=list)  # (values, seq, time, xid)

    @property
    def unknown(self) -> list[str]:
        return [c for c, v in (self.values or {}).items() if v is UNKNOWN]


@dataclass
class BatchEffect:
    """The net effect of a batch on one replica."""

    effects: dict[tuple[Any, ...], KeyEffect]
    truncated_at: int | None = None  # seq of the last TRUNCATE: every row before it is gone
    counts: dict[str, int] = field(default_factory=lambda: {"inserts": 0, "updates": 0, "deletes": 0, "truncates": 0})


class BatchError(ValueError):
    """A change the replica cannot take (e.g. an UPDATE without a before-image on a key change)."""


#: The one NaN a key identity holds (a tuple holding this very object equals and hashes as any other).
_NAN = float("nan")


def key_value(v: Any) -> Any:
    """A key column's value as key identity: any NaN is one key (PostgreSQL's float8 ``NaN = NaN``; Spark
    joins and groups so too) and ``-0.0`` is ``0.0`` (PostgreSQL's ``-0 = 0``; Spark normalizes it in join and
    grouping keys). Python alone would make two decoded NaNs two keys (``nan != nan``; a NaN hashes by
    identity). :func:`lineage.cdc.columns.same` is the rule on Arrow columns. Only identity: values written
    to a replica stay as decoded."""
    if isinstance(v, float):
        if v != v:
            return _NAN
        if v == 0.0:
            return 0.0
    return v


def key_identity(values: Iterable[Any]) -> tuple[Any, ...]:
    """A key (or a multiset's row) as the tuple that compares and hashes as the key (:func:`key_value`)."""
    return tuple(key_value(v) for v in values)


def _key_of(row: Mapping[str, Any], key: Sequence[str], *, table: str, what: str) -> tuple[Any, ...]:
    try:
        return tuple(row[k] for k in key)
    except KeyError as exc:
        raise BatchError(f"{table}: the {what} lacks key column {exc.args[0]!r} (key: {', '.join(key)})") from None


def reduce_keyed(changes: Iterable[Numbered], schema: TableSchema, key: Sequence[str], *, history: bool = False) -> BatchEffect:
    """The net effect per key of an ordered batch on a keyed replica (SCD1; with ``history`` the
    per-transaction states for SCD2 too).

    INSERT sets the after-row's key; UPDATE clears the before-image's key (when the key changed)
    and sets the after key; DELETE clears; TRUNCATE clears everything before it. A key the batch
    does not touch is absent from the result (the replica keeps it)."""
    names = schema.names
    out = BatchEffect({})
    state = out.effects

    def previous(k: tuple[Any, ...]) -> tuple[dict[str, Any], tuple[Any, ...] | None]:
        """The row at key ``k`` just before the change: from the batch, or the replica's (unknown here)."""
        eff = state.get(k)
        if eff is not None and eff.present and eff.values is not None:
            return dict(eff.values), eff.origin
        if eff is None and out.truncated_at is None:
            return {c: UNKNOWN for c in names}, k
        return {c: UNKNOWN for c in names}, None  # deleted in this batch: nothing to carry (cannot happen in a consistent stream)

    def put(k: tuple[Any, ...], n: Numbered, values: dict[str, Any] | None, origin: tuple[Any, ...] | None) -> None:
        eff = state.get(k)
        if eff is None:
            eff = state[k] = KeyEffect(k, False, None, n.seq, n.commit_time)
        eff.present, eff.values, eff.seq, eff.commit_time, eff.origin, eff.op = (
            values is not None, values, n.seq, n.commit_time, origin if values is not None else None, n.change.op)
        if history:
            if eff.versions and eff.versions[-1][3] == n.xid:  # one state per key per transaction
                eff.versions[-1] = (values, n.seq, n.commit_time, n.xid)
            else:
                eff.versions.append((values, n.seq, n.commit_time, n.xid))

    for n in changes:
        ch = n.change
        if ch.op is Op.TRUNCATE:
            out.counts["truncates"] += 1
            out.truncated_at = n.seq
            if history:
                for eff in state.values():  # SCD2: every current row closes at the truncate
                    if eff.present:
                        put(eff.key, n, None, None)
            else:
                state.clear()
            continue
        if ch.op is Op.INSERT:
            out.counts["inserts"] += 1
            after = dict(ch.after or {})
            put(key_identity(_key_of(after, key, table=ch.table, what="inserted row")), n, {c: after.get(c) for c in names},
                None)
        elif ch.op is Op.UPDATE:
            out.counts["updates"] += 1
            after = dict(ch.after or {})
            new_key = _key_of({**after, **{c: UNKNOWN for c in ch.unchanged if c not in after}}, key, table=ch.table,
                              what="updated row")
            old_key = _key_of(ch.before, key, table=ch.table, what="before-image") if ch.before else new_key
            if any(v is UNKNOWN for v in new_key):  # a key column unchanged and not sent: it is the old key's
                new_key = tuple(o if v is UNKNOWN else v for v, o in zip(new_key, old_key, strict=True))
            old_id, new_id = key_identity(old_key), key_identity(new_key)  # NaN = NaN: not a key change
            prev, origin = previous(old_id)
            values = {c: (prev.get(c, UNKNOWN) if c in ch.unchanged or c not in after else after[c]) for c in names}
            for c, v in zip(key, new_key, strict=True):
                values[c] = v
            if not any(v is UNKNOWN for v in values.values()):
                origin = None
            if old_id != new_id:
                put(old_id, n, None, None)
            put(new_id, n, values, origin)
        elif ch.op is Op.DELETE:
            out.counts["deletes"] += 1
            if not ch.before:
                raise BatchError(f"{ch.table}: a DELETE without a before-image (the source sent no old key)")
            put(key_identity(_key_of(ch.before, key, table=ch.table, what="before-image")), n, None, None)
    return out


@dataclass
class MultisetEffect:
    """The net effect of a batch on a replica without a key: the change in the number of copies of
    every distinct row it touched (rows as tuples of the columns' values, in schema order, as first
    decoded; rows of one :func:`key_identity` are one row: all NaNs alike)."""

    deltas: dict[tuple[Any, ...], int]
    truncated_at: int | None = None
    last_seq: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"inserts": 0, "updates": 0, "deletes": 0, "truncates": 0})


def reduce_multiset(changes: Iterable[Numbered], schema: TableSchema) -> MultisetEffect:
    """Copies added and removed per distinct row; after a TRUNCATE the deltas count from zero.
    An UPDATE or DELETE needs the whole old row (PostgreSQL: ``REPLICA IDENTITY FULL``)."""
    names = schema.names
    out = MultisetEffect({})
    seen: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # key identity -> the row as first decoded (the deltas' key)
    for n in changes:
        ch = n.change
        out.last_seq = n.seq
        if ch.op is Op.TRUNCATE:
            out.counts["truncates"] += 1
            out.truncated_at = n.seq
            out.deltas.clear()
            seen.clear()
            continue
        if ch.op in (Op.UPDATE, Op.DELETE):
            if not ch.before or any(c not in ch.before for c in names):
                raise BatchError(
                    f"{ch.table}: an {ch.op.value.upper()} on a table without a key needs the whole old row (the source "
                    f"sent {sorted(ch.before or {})}); in PostgreSQL: ALTER TABLE {ch.table} REPLICA IDENTITY FULL")
            old = seen.setdefault(key_identity(ch.before[c] for c in names), tuple(ch.before[c] for c in names))
            out.deltas[old] = out.deltas.get(old, 0) - 1
        if ch.op in (Op.INSERT, Op.UPDATE):
            after = dict(ch.after or {})
            if ch.op is Op.UPDATE:
                for c in ch.unchanged:  # unchanged TOAST value: the old row's
                    after.setdefault(c, (ch.before or {}).get(c))
            new = seen.setdefault(key_identity(after.get(c) for c in names), tuple(after.get(c) for c in names))
            out.deltas[new] = out.deltas.get(new, 0) + 1
        out.counts[{Op.INSERT: "inserts", Op.UPDATE: "updates", Op.DELETE: "deletes"}[ch.op]] += 1
    return out
