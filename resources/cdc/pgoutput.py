"""PostgreSQL types and the ``pgoutput`` logical-replication protocol (version 1), decoded into
the change events of :mod:`lineage.cdc.changes` — pure Python, no I/O (``resources.cdc.postgres`` does the I/O).

One definition per rule: :func:`column_of` maps a PostgreSQL type to the replica's Spark type and
:func:`parse_text` turns a value's text form into the Python object the processor gets; both the
stream (pgoutput sends values as text) and the snapshot (``resources.cdc.postgres``) go through them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lineage.cdc import columns as cc
from lineage.cdc.changes import (
    BatchError,
    Change,
    Column,
    DdlChange,
    DdlKind,
    Op,
    RowChange,
    TableSchema,
    Transaction,
)

# ------------------------------------------------------------------ types

BOOL, BYTEA, CHAR, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 18, 19, 20, 21, 23, 25, 26
FLOAT4, FLOAT8, BPCHAR, VARCHAR, DATE, TIMESTAMP, TIMESTAMPTZ, NUMERIC = 700, 701, 1042, 1043, 1082, 1114, 1184, 1700

_SPARK: dict[int, str] = {
    BOOL: "boolean", INT2: "smallint", INT4: "int", INT8: "bigint", OID: "bigint", FLOAT4: "float", FLOAT8: "double",
    TEXT: "string", VARCHAR: "string", BPCHAR: "string", CHAR: "string", NAME: "string",
    DATE: "date", TIMESTAMP: "timestamp", TIMESTAMPTZ: "timestamp", BYTEA: "binary",
}
#: Unbounded ``numeric`` (no precision declared) becomes ``decimal(38,18)``: exact for the usual
#: amounts, and a value that does not fit fails loudly (Arrow/Spark refuse to round) instead of
#: being silently rounded; ``assess`` warns about every such column. ``numeric(p,s)`` with p > 38
#: (more than Spark can hold) is replicated as its text.
UNBOUNDED_NUMERIC = "decimal(38,18)"


def numeric_type(typmod: int) -> str:
    """Spark type of ``numeric`` with this type modifier (``((p << 16) | s) + 4``; -1 = unbounded)."""
    if typmod < 4:
        return UNBOUNDED_NUMERIC
    p = ((typmod - 4) >> 16) & 0xFFFF
    s = (((typmod - 4) & 0x7FF) ^ 1024) - 1024  # PostgreSQL 15 allows a negative scale and scale > precision
    if s < 0:
        p, s = p - s, 0  # numeric(5,-2) holds integers up to 9,999,900
    p = max(p, s)
    return f"decimal({p},{s})" if p <= 38 else "string"


def column_of(name: str, typid: int, typmod: int, source_type: str = "", notnull: bool = False) -> Column:
    """The replica column of a source column. Types without a Spark equivalent (json, jsonb, uuid,
    arrays, enums, interval, time, money, domains …) are replicated as their PostgreSQL text."""
    spark = numeric_type(typmod) if typid == NUMERIC else _SPARK.get(typid, "string")
    return Column(name, spark, source_type or str(typid), not notnull)


def text_only(column: Column, typid: int) -> bool:
    """Whether a column is replicated only as its text (worth a warning: queries see a string)."""
    return column.type == "string" and typid not in (TEXT, VARCHAR, BPCHAR, CHAR, NAME)


def _timestamp(text: str) -> dt.datetime:
    if text in ("infinity", "-infinity"):
        return dt.datetime.max if text == "infinity" else dt.datetime.min
    if text.endswith(" BC"):
        raise ValueError(f"timestamp {text!r} is before year 1 (BC): Spark cannot hold it")
    value = dt.datetime.fromisoformat(text)
    if value.tzinfo is not None:  # timestamptz: the session runs in UTC, still normalise
        value = value.astimezone(dt.UTC).replace(tzinfo=None)
    return value


def _date(text: str) -> dt.date:
    if text in ("infinity", "-infinity"):
        return dt.date.max if text == "infinity" else dt.date.min
    if text.endswith(" BC"):
        raise ValueError(f"date {text!r} is before year 1 (BC): Spark cannot hold it")
    return dt.date.fromisoformat(text)


def _bytea(text: str) -> bytes:
    if not text.startswith("\\x"):
        raise ValueError(f"bytea value not in hex format ({text[:20]!r}…): the session must use bytea_output=hex")
    return bytes.fromhex(text[2:])


_PARSERS: dict[str, Callable[[str], Any]] = {
    "boolean": lambda t: t == "t", "smallint": int, "int": int, "bigint": int, "float": float, "double": float,
    "date": _date, "timestamp": _timestamp, "binary": _bytea, "string": str,
}


def parse_text(column: Column, text: str) -> Any:
    """The Python value of a column's text form (as PostgreSQL prints it with ``TimeZone=UTC``,
    ``DateStyle=ISO``, ``bytea_output=hex``): int, float, Decimal, bool, str, date, naive-UTC
    datetime, bytes."""
    if column.type.startswith("decimal"):
        return Decimal(text)
    return _PARSERS[column.type](text)


#: Session settings under which values print the way :func:`parse_text` reads them.
SESSION_OPTIONS = "-c TimeZone=UTC -c DateStyle=ISO,MDY -c IntervalStyle=postgres -c bytea_output=hex -c extra_float_digits=3"


# ------------------------------------------------------------------ table selection


def glob_regex(patterns: Iterable[str]) -> str | None:
    """One anchored regular expression (valid for Python's ``re`` and PostgreSQL's ``~``) matching
    ``schema.table`` names against fnmatch-style patterns (``*``, ``?``, ``[...]``); a pattern
    without a schema means ``public``. None when there are no patterns."""
    parts = []
    for pattern in patterns:
        if "." not in pattern:
            pattern = f"public.{pattern}"
        out, i = [], 0
        while i < len(pattern):
            ch = pattern[i]
            if ch == "*":
                out.append(".*")
            elif ch == "?":
                out.append(".")
            elif ch == "[":
                j = i + 1 + (pattern[i + 1:i + 2] == "!")
                j += pattern[j:j + 1] == "]"  # a leading ] is a member
                end = pattern.find("]", j)
                if end < 0:
                    out.append("\\[")
                else:
                    body = pattern[i + 1:end]
                    body = "^" + body[1:] if body.startswith("!") else body
                    out.append("[" + body.replace("\\", "\\\\") + "]")
                    i = end
            elif ch.isalnum() or ch == "_":
                out.append(ch)
            else:
                out.append("\\" + ch)
            i += 1
        parts.append("".join(out))
    return f"^({'|'.join(parts)})$" if parts else None


@dataclass(frozen=True)
class Selection:
    """Which ``schema.table`` names a source replicates: included by a name or pattern, not
    excluded, never Tidemark's own ``tidemark`` schema."""

    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()

    @property
    def include_re(self) -> str | None:
        return glob_regex(self.include)

    @property
    def exclude_re(self) -> str | None:
        return glob_regex(self.exclude)

    def __call__(self, table: str) -> bool:
        inc, exc = self.include_re, self.exclude_re
        return (not table.startswith("tidemark.") and inc is not None and re.match(inc, table, re.S) is not None
                and (exc is None or re.match(exc, table, re.S) is None))


# ------------------------------------------------------------------ pgoutput messages

_PG_EPOCH = dt.datetime(2000, 1, 1)


def pg_time(micros: int) -> dt.datetime:
    """A protocol timestamp (microseconds since 2000-01-01 UTC) as a naive UTC datetime."""
    return _PG_EPOCH + dt.timedelta(microseconds=micros)


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def byte(self) -> str:
        self.pos += 1
        return chr(self.buf[self.pos - 1])

    def string(self) -> str:
        end = self.buf.index(b"\0", self.pos)
        text = self.buf[self.pos:end].decode()
        self.pos = end + 1
        return text

    def tuple(self) -> list[tuple[str, bytes | None]]:
        (ncols,) = self.unpack("!H")
        cols: list[tuple[str, bytes | None]] = []
        for _ in range(ncols):
            kind = self.byte()
            if kind in ("t", "b"):
                (n,) = self.unpack("!I")
                cols.append((kind, self.buf[self.pos:self.pos + n]))
                self.pos += n
            else:  # 'n' null, 'u' unchanged TOAST value (not sent)
                cols.append((kind, None))
        return cols


@dataclass
class Relation:
    """A published table as the last Relation message described it (its columns can change
    mid-stream: a new Relation message precedes the first change with the new columns)."""

    relid: int
    table: str
    columns: list[Column]
    key_flags: list[bool]  # part of the replica identity
    identity: str = "d"  # REPLICA IDENTITY: d(efault), n(othing), f(ull), i(ndex)


@dataclass
class _Open:
    xid: int
    lsn: int
    commit_time: dt.datetime
    changes: list[Change] = field(default_factory=list)


def ddl_schema(table: str, columns_json: str | None, key_json: str | None) -> TableSchema:
    """A table's schema from the JSON the DDL trigger (and :func:`resources.cdc.postgres` 's catalog
    query) records: ``[{"name", "typid", "typmod", "type", "notnull"}]`` and ``["key", …]``."""
    cols = json.loads(columns_json or "[]")
    return TableSchema(table, tuple(column_of(c["name"], c["typid"], c["typmod"], c["type"], c["notnull"]) for c in cols),
                       tuple(json.loads(key_json or "[]")))


class DecodeError(ValueError):
    """A pgoutput message this decoder cannot read (a protocol bug or an unsupported option)."""


class Decoder:
    """Turns pgoutput messages (the payload of XLogData) into whole :class:`Transaction` s.

    Changes of tables outside ``selected`` are dropped; so are changes ``wanted(table,
    commit_lsn)`` declines. INSERTs into the DDL log table ``ddl_table`` become
    :class:`DdlChange` s. :meth:`feed` returns a transaction when its COMMIT arrives."""

    def __init__(self, selected: Callable[[str], bool], ddl_table: str,
                 wanted: Callable[[str, int], bool] | None = None) -> None:
        self.selected, self.ddl_table, self.wanted = selected, ddl_table, wanted
        self.relations: dict[int, Relation] = {}
        self.described: dict[str, Relation] = {}  # by table name: a renamed table's old name stays
        self.open: _Open | None = None

    def _keep(self, table: str) -> bool:
        return self.selected(table) and self._keep_ddl(table)

    def schemas(self) -> dict[str, TableSchema]:
        """The tables' schemas as the stream's Relation messages last described them (the key: the
        replica identity's columns; none for identity FULL, which flags every column)."""
        return {rel.table: TableSchema(rel.table, tuple(rel.columns), () if rel.identity == "f" else
                                       tuple(c.name for c, k in zip(rel.columns, rel.key_flags, strict=True) if k))
                for rel in self.described.values()}

    def feed(self, msg: bytes) -> Transaction | None:
        r = _Reader(msg)
        tag = r.byte()
        if tag == "B":
            lsn, ts, xid = r.unpack("!QqI")
            self.open = _Open(xid, lsn, pg_time(ts))
        elif tag == "C":
            _flags, lsn, end_lsn, ts = r.unpack("!BQQq")
            tx, self.open = self.open, None
            if tx is None or tx.lsn != lsn:
                raise DecodeError(f"COMMIT at {lsn:X} without its BEGIN")
            return Transaction(tx.xid, lsn, pg_time(ts), tuple(tx.changes), end_lsn)
        elif tag == "R":
            (relid,) = r.unpack("!I")
            table = f"{r.string() or 'pg_catalog'}.{r.string()}"
            identity, ncols = r.unpack("!BH")
            cols, keys = [], []
            for _ in range(ncols):
                (flags,) = r.unpack("!B")
                name = r.string()
                typid, typmod = r.unpack("!Ii")
                cols.append(column_of(name, typid, typmod))
                keys.append(bool(flags & 1))
            self.relations[relid] = self.described[table] = Relation(relid, table, cols, keys, chr(identity))
        elif tag in ("I", "U", "D"):
            self._row(tag, r)
        elif tag == "T":
            nrels, _options = r.unpack("!IB")
            for relid in r.unpack(f"!{nrels}I"):
                rel = self.relations[relid]
                if rel.table != self.ddl_table and self._keep(rel.table):
                    self._add(RowChange(rel.table, Op.TRUNCATE))
        elif tag in ("Y", "O", "M"):
            pass  # types, origins, logical messages: nothing to replicate
        else:
            raise DecodeError(f"unknown pgoutput message {tag!r} (streaming or two-phase options are not used)")
        return None

    def _add(self, change: Change) -> None:
        if self.open is None:
            raise DecodeError("a change outside a transaction")
        self.open.changes.append(change)

    def _row(self, tag: str, r: _Reader) -> None:
        (relid,) = r.unpack("!I")
        rel = self.relations.get(relid)
        if rel is None:
            raise DecodeError(f"a change of relation {relid} before its Relation message")
        before: dict[str, Any] | None = None
        after: dict[str, Any] | None = None
        unchanged: set[str] = set()
        kind = r.byte()
        if kind in ("K", "O"):  # old key (default identity) or old row (REPLICA IDENTITY FULL)
            before, _ = self._values(rel, r.tuple(), key_only=kind == "K")
            if tag == "U":
                kind = r.byte()
        if kind == "N":
            after, unchanged = self._values(rel, r.tuple(), key_only=False)
        if rel.table == self.ddl_table:
            if tag == "I" and after is not None:
                self._ddl(after)
            return
        if not self._keep(rel.table):
            return
        op = {"I": Op.INSERT, "U": Op.UPDATE, "D": Op.DELETE}[tag]
        self._add(RowChange(rel.table, op, after=after, before=before, unchanged=frozenset(unchanged)))

    @staticmethod
    def _values(rel: Relation, values: Sequence[tuple[str, bytes | None]],
                key_only: bool) -> tuple[dict[str, Any], set[str]]:
        out: dict[str, Any] = {}
        unchanged: set[str] = set()
        for col, is_key, (kind, raw) in zip(rel.columns, rel.key_flags, values, strict=True):
            if key_only and not is_key:
                continue
            if kind == "u":
                unchanged.add(col.name)
            elif kind == "n" or raw is None:
                out[col.name] = None
            elif kind == "b":
                raise DecodeError(f"{rel.table}.{col.name}: binary values are not requested")
            else:
                out[col.name] = parse_text(col, bytes(raw).decode())
        return out, unchanged

    def _ddl(self, row: dict[str, Any]) -> None:
        """A row of the DDL log as a :class:`DdlChange` when it concerns the selection. A rename
        into the selection is a CREATE (the replica starts: snapshot it), out of it a DROP."""
        tag, old, new, stmt = row["command_tag"], row["old_name"], row["new_name"], row["statement"] or ""
        sel_old, sel_new = old is not None and self.selected(old), new is not None and self.selected(new)
        change: DdlChange | None = None
        if tag == "DROP TABLE":
            change = DdlChange(old, DdlKind.DROP, statement=stmt) if sel_old else None
        elif new is not None:
            schema = ddl_schema(new, row["columns"], row["key"])
            renamed = tag == "ALTER TABLE" and old is not None and old != new
            if renamed and sel_old and sel_new:
                change = DdlChange(old, DdlKind.RENAME, schema=schema, new_table=new, statement=stmt)
            elif renamed and sel_old:
                change = DdlChange(old, DdlKind.DROP, statement=stmt)
            elif sel_new:
                kind = DdlKind.ALTER if tag == "ALTER TABLE" and not renamed else DdlKind.CREATE
                change = DdlChange(new, kind, schema=schema, statement=stmt)
        if change is not None and self._keep_ddl(change.table):
            self._add(change)

    def _keep_ddl(self, table: str) -> bool:
        if self.open is None:
            raise DecodeError("a change outside a transaction")
        return self.wanted is None or self.wanted(table, self.open.lsn)


# ------------------------------------------------------------------ changes as columns


@dataclass(frozen=True)
class Committed:
    """A transaction the :class:`ColumnDecoder` finished: its positions and how many of its row
    changes it kept (``changes``, as a :class:`Transaction`'s are counted: nonzero means kept)."""

    lsn: int
    end_lsn: int
    changes: int

    @property
    def rows(self) -> int:
        return self.changes


class ColumnDecoder(Decoder):
    """:class:`Decoder`'s reading of the stream, the kept row changes gathered as Arrow columns, one
    table per source table (:class:`lineage.cdc.columns.ColumnRead` ``parts``), instead of
    :class:`RowChange` objects: values are parsed by :func:`parse_text` as there and turned into
    Arrow every ``chunk_rows`` changes of a table, so a transaction of millions of rows is held as
    Arrow buffers, not a Python object per value. With ``spill_dir``, once a read holds
    ``spill_rows`` changes every table's chunks go to a Parquet file there as they fill
    (``ColumnRead.spilled``): the process then holds one chunk per table, whatever the read's size.

    ``wanted_after[t]``: changes of ``t`` committed after that LSN are kept (None: none are). It
    raises :class:`lineage.cdc.columns.NotColumnar` (the caller reads the same span with a plain
    :class:`Decoder`) for what only the change-by-change path carries: a table not in
    ``wanted_after`` (new to the reader), a kept DDL change or TRUNCATE, a TOAST value not sent, a
    column named ``_tm_*``, a table whose columns or replica identity change within the read."""

    def __init__(self, selected: Callable[[str], bool], ddl_table: str, wanted_after: Mapping[str, int | None],
                 *, chunk_rows: int = 65_536, spill_dir: Path | None = None, spill_rows: int = 1_000_000) -> None:
        super().__init__(selected, ddl_table, self._wants)
        self.wanted_after, self.chunk_rows = wanted_after, chunk_rows
        self.spill_dir, self.spill_rows = spill_dir, spill_rows
        self.spilling = False
        self._files = 0
        self.parts: dict[str, _Part] = {}
        self.transactions = 0  # finished transactions with kept changes
        self.rows = 0  # kept changes so far (finished transactions and the open one)
        self._kept_in_open = 0

    def _wants(self, table: str, lsn: int) -> bool:
        if table not in self.wanted_after:
            raise cc.NotColumnar(f"a change of {table}, new to the replicator")
        applied = self.wanted_after[table]
        return applied is not None and lsn > applied

    def _add(self, change: Change) -> None:
        raise cc.NotColumnar(f"a {'schema change' if isinstance(change, DdlChange) else 'TRUNCATE'} of {change.table}")

    def feed(self, msg: bytes) -> Transaction | Committed | None:  # type: ignore[override]
        if msg[:1] != b"C":
            return super().feed(msg)
        tx = super().feed(msg)
        if not isinstance(tx, Transaction):
            raise DecodeError("a COMMIT without its transaction")
        kept, self._kept_in_open = self._kept_in_open, 0
        if kept:
            self.transactions += 1
            for part in self.parts.values():
                part.commit()
        return Committed(tx.lsn, tx.end_lsn, kept)

    def _row(self, tag: str, r: _Reader) -> None:
        (relid,) = struct.unpack_from("!I", r.buf, r.pos)
        rel = self.relations.get(relid)
        if rel is None or rel.table == self.ddl_table or not self.selected(rel.table):
            return super()._row(tag, r)  # as the plain decoder reads it: a DDL row, or dropped
        r.pos += 4
        tx = self.open
        if tx is None:
            raise DecodeError("a change outside a transaction")
        if not self._wants(rel.table, tx.lsn):
            return
        part = self.parts.get(rel.table)
        if part is None:
            part = self.parts[rel.table] = _Part(rel)
            if self.spilling:
                part.spill(self._spill_path(rel.table))
        elif part.columns != rel.columns or part.key_flags != rel.key_flags:
            raise cc.NotColumnar(f"{rel.table}'s columns or replica identity changed within the read")
        kind = r.byte()
        before = None
        if kind in ("K", "O"):
            before = r.tuple()
            if tag == "U":
                kind = r.byte()
        after = r.tuple() if kind == "N" else None
        for col, values, (vk, raw) in zip(rel.columns, part.after, after or part.nulls, strict=True):
            if vk == "u":
                raise cc.NotColumnar(f"{rel.table}.{col.name}: a TOAST value the source did not send")
            values.append(self._value(rel, col, vk, raw))
        for i, values in part.before.items():
            values.append(None if before is None else self._value(rel, rel.columns[i], *before[i]))
        part.add(self.rows, self.transactions, tx.lsn, tx.commit_time, _OP_NAMES[tag], before is not None)
        self.rows += 1
        self._kept_in_open += 1
        if len(part.row) >= self.chunk_rows:
            part.flush()
        if self.spill_dir is not None and not self.spilling and self.rows >= self.spill_rows:
            self.spilling = True
            for table, p in self.parts.items():
                p.spill(self._spill_path(table))

    def _spill_path(self, table: str) -> Path:
        assert self.spill_dir is not None  # noqa: S101 - only called while spilling
        self._files += 1  # (the number keeps two tables apart whose cleaned names are alike)
        return self.spill_dir / f"{self._files:04d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', table)}.parquet"

    def close(self) -> None:
        """Close the Parquet files still open (a read that failed while spilling)."""
        for part in self.parts.values():
            if part.writer is not None:
                part.writer.close()
                part.writer = None

    @staticmethod
    def _value(rel: Relation, col: Column, kind: str, raw: bytes | None) -> Any:
        if kind == "n" or raw is None:
            return None
        if kind == "b":
            raise DecodeError(f"{rel.table}.{col.name}: binary values are not requested")
        return parse_text(col, bytes(raw).decode())

    def frames(self) -> dict[str, pa.Table]:
        """Per source table held in memory its kept changes of the finished transactions, in source
        order: ``_tm_row`` (the change's index in the read), ``_tm_pos`` and ``_tm_lsn`` (the commit
        LSN: pgoutput gives a change no position of its own), ``_tm_time``, ``_tm_tx``, ``_tm_table``,
        ``_tm_op``, the table's columns, ``_tm_before_<k>`` per replica identity column, ``_tm_has_before``."""
        finished = self.rows - self._kept_in_open  # a read that ended inside a transaction (the server went quiet)
        out: dict[str, pa.Table] = {}
        for table, part in self.parts.items():
            if part.writer is not None:
                continue
            part.flush()
            body = pa.concat_tables(part.chunks) if part.chunks else None
            if body is None:
                continue
            body = body.slice(0, pc.sum(pc.less(body[cc.ROW], finished)).as_py() or 0)  # rows are in order: a prefix
            part.chunks = [body]
            if body.num_rows:
                out[table] = body.add_column(1, cc.POS, body[cc.LSN]).add_column(
                    6, cc.TABLE, pa.repeat(pa.scalar(table), body.num_rows))
        return out

    def spilled(self) -> dict[str, cc.Spilled]:
        """Per source table written to Parquet (:meth:`frames` holds the others) its file and figures."""
        out: dict[str, cc.Spilled] = {}
        for table, part in self.parts.items():
            if part.writer is None:
                continue
            part.flush()
            part.writer.close()
            part.writer = None
            if part.stats.count:
                out[table] = cc.Spilled(str(part.path), self.rows - self._kept_in_open, **dataclasses.asdict(part.stats))
        return out


_UTC = pa.timestamp("us", tz="UTC")
_OP_NAMES = {"I": Op.INSERT.value, "U": Op.UPDATE.value, "D": Op.DELETE.value}


@dataclass
class _Stats:
    """Figures of a table's kept changes (a :class:`lineage.cdc.columns.Spilled`'s)."""

    count: int = 0
    first_row: int = 0
    last_row: int = 0
    oldest: dt.datetime | None = None
    lsn: int = 0
    inserts: int = 0
    updates: int = 0
    deletes: int = 0

    def fold(self, other: _Stats) -> None:
        if not other.count:
            return
        if not self.count:
            self.first_row = other.first_row
        self.count += other.count
        self.last_row, self.lsn = other.last_row, other.lsn
        self.oldest = other.oldest if self.oldest is None or (other.oldest and other.oldest < self.oldest) else self.oldest
        self.inserts += other.inserts
        self.updates += other.updates
        self.deletes += other.deletes


class _Part:
    """A table's kept changes of a :class:`ColumnDecoder` read: Arrow chunks (or, spilling, a Parquet
    file) and the lists filling the next."""

    def __init__(self, rel: Relation) -> None:
        self.table = rel.table
        self.columns, self.key_flags = list(rel.columns), list(rel.key_flags)
        for c in self.columns:
            if c.name.startswith("_tm_"):
                raise cc.NotColumnar(f"{rel.table}: a source column named {c.name!r} (the frame's own prefix)")
        self.types = [cc.arrow_type(c.type) for c in self.columns]
        self.keys = [i for i, k in enumerate(self.key_flags) if k]
        self.nulls = [("n", None)] * len(self.columns)
        self.schema = pa.schema([(cc.ROW, pa.int64()), (cc.LSN, pa.int64()), (cc.TIME, pa.timestamp("us")),
                                 (cc.TX, pa.int64()), (cc.OP, pa.string()),
                                 *((c.name, t) for c, t in zip(self.columns, self.types, strict=True)),
                                 *((cc.before(self.columns[i].name), self.types[i]) for i in self.keys),
                                 (cc.HAS_BEFORE, pa.bool_())])
        self.chunks: list[pa.Table] = []
        self.writer: pq.ParquetWriter | None = None
        self.path: Path | None = None
        self.stats, self.open = _Stats(), _Stats()
        self._reset()

    def _reset(self) -> None:
        self.row: list[int] = []
        self.meta: tuple[list[int], list[int], list[dt.datetime], list[str], list[bool]] = ([], [], [], [], [])
        self.after: list[list[Any]] = [[] for _ in self.columns]
        self.before: dict[int, list[Any]] = {i: [] for i in self.keys}

    def add(self, row: int, tx: int, lsn: int, time: dt.datetime, op: str, has_before: bool) -> None:
        self.row.append(row)
        for values, v in zip(self.meta, (tx, lsn, time, op, has_before), strict=True):
            values.append(v)  # type: ignore[attr-defined]
        o = self.open
        if not o.count:
            o.first_row, o.oldest = row, time
        o.count += 1
        o.last_row, o.lsn = row, lsn
        if op == Op.INSERT.value:
            o.inserts += 1
        elif op == Op.UPDATE.value:
            o.updates += 1
        else:
            o.deletes += 1

    def commit(self) -> None:
        self.stats.fold(self.open)
        self.open = _Stats()

    def spill(self, path: Path) -> None:
        """From now on, chunks go to the Parquet file ``path`` (those held so far first). ``_tm_time``
        is written as a UTC instant there (Spark reads a naive Parquet timestamp as TIMESTAMP_NTZ,
        which a cast would take as the session's local time)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.writer = path, pq.ParquetWriter(path, self._spilled_schema())
        for chunk in self.chunks:
            self._write(chunk)
        self.chunks = []

    def _spilled_schema(self) -> pa.Schema:
        i = self.schema.get_field_index(cc.TIME)
        return self.schema.set(i, pa.field(cc.TIME, _UTC))

    def _write(self, chunk: pa.Table) -> None:
        assert self.writer is not None  # noqa: S101 - only called while spilling
        i = chunk.schema.get_field_index(cc.TIME)
        self.writer.write_table(chunk.set_column(i, cc.TIME, chunk[cc.TIME].cast(_UTC)))

    def _array(self, i: int, values: list[Any]) -> pa.Array:
        """Column ``i``'s values as Arrow; one its replica type cannot hold (a ``numeric`` NaN or
        Infinity in a decimal) sends the read to the change-by-change path, which pauses only that
        replica, naming the column."""
        col = self.columns[i]
        try:
            return cc.column_array(values, self.types[i], f"{self.table}.{col.name} ({col.type})")
        except BatchError as exc:
            raise cc.NotColumnar(str(exc)) from None

    def flush(self) -> None:
        if not self.row:
            return
        tx, lsn, time, op, has = self.meta
        arrays = [pa.array(self.row, pa.int64()), pa.array(lsn, pa.int64()), pa.array(time, pa.timestamp("us")),
                  pa.array(tx, pa.int64()), pa.array(op, pa.string()),
                  *(self._array(i, values) for i, values in enumerate(self.after)),
                  *(self._array(i, values) for i, values in self.before.items()),
                  pa.array(has, pa.bool_())]
        chunk = pa.Table.from_arrays(arrays, schema=self.schema)
        if self.writer is not None:
            self._write(chunk)
        else:
            self.chunks.append(chunk)
        self._reset()
