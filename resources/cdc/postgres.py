"""A PostgreSQL source of change events (issue 10): logical replication with ``pgoutput``.

Objects per source ``name`` (all idempotent, made by :meth:`PostgresSource.ensure_setup`):
the publication and slot ``tidemark_<name>``, and in the schema ``tidemark`` the DDL log
``<name>_ddl`` (in the publication, so DDL arrives in order with the data), the name registry
``<name>_tables`` (a rename's old name) and the event-trigger functions.

Why ``pgoutput``: built into PostgreSQL ≥ 10 (no server package to install, works on managed
services), filtered by a publication on the server, and its binary protocol carries per-column
"unchanged TOAST" markers, the replica identity flags and commit/end LSNs exactly. wal2json
needs ``postgresql-NN-wal2json`` on the server and gives JSON we would parse anyway.

The replication protocol runs on psycopg 3's libpq layer (``psycopg.pq``): its high-level API has
no COPY BOTH, but ``PGconn.get_copy_data``/``put_copy_data`` are all the protocol needs, and unlike
psycopg2's ``LogicalReplicationConnection`` nothing is ever confirmed behind our back (psycopg2
moves the flush position to a keepalive's WAL end on its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import select
import struct
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from lineage.cdc import columns as cc
from lineage.cdc.changes import TableSchema, format_lsn, parse_lsn
from lineage.cdc.columns import ColumnRead, NotColumnar
from resources.cdc import pg_setup
from resources.cdc.pg_setup import CdcSourceError, Problem
from resources.cdc.pgoutput import SESSION_OPTIONS, ColumnDecoder, Decoder, Selection, ddl_schema, parse_text

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotPosition:
    """Where the main slot stands (plain SQL, cheap: what a sensor polls)."""

    confirmed_flush: int  # acknowledged up to here
    restart: int  # WAL kept from here
    current: int  # pg_current_wal_flush_lsn(): what logical decoding can send up to (a read never passes it)
    retained_bytes: int  # current - restart: WAL the slot holds on the server's disk
    active: bool  # a reader is connected right now

    @property
    def behind_bytes(self) -> int:
        """WAL written after the acknowledged position (not all of it holds changes; a read ends one
        byte before the WAL it reached, so 1 counts as none)."""
        behind = self.current - self.confirmed_flush
        return behind if behind > 1 else 0


class ReadResult(list[Any]):
    """The transactions of :meth:`PostgresSource.read` (a list), plus ``end``: the source holds
    nothing more of the selection whose commit LSN is after ``after`` and at or before ``end`` —
    once every returned transaction is applied, acknowledging ``end`` is safe (it moves the slot
    past WAL without changes, so an idle selection does not pin WAL forever). ``end`` is one byte
    before where the read stopped (the last commit record's end, or how far the server had
    decoded; at most the read's limit): the next transaction's commit record may begin right there (two transactions
    committing together), and ``read(end)`` reads commits after ``end``. ``caught_up``: the read
    stopped because it reached the server's WAL end as of the call."""

    def __init__(self, txs: Sequence[Any], end: int, caught_up: bool) -> None:
        super().__init__(txs)
        self.end, self.caught_up = end, caught_up
        #: the schemas of the tables whose changes the read met, as the stream described them (a table
        #: renamed or dropped since is no longer in the catalog)
        self.schemas: dict[str, TableSchema] = {}


_NATIVE = ("smallint", "int", "bigint", "boolean", "double")  # psycopg's text loaders parse these as parse_text does


class Snapshot:
    """A consistent view of the source at ``lsn``: every transaction whose commit LSN is at or
    before it, none after. Read tables with :meth:`rows`; apply the stream's transactions with
    lsn > ``lsn`` (what :meth:`PostgresSource.read` of ``lsn`` returns)."""

    def __init__(self, lsn: int, conn: psycopg.Connection[Any], selection: Selection) -> None:
        self.lsn, self._conn, self._selection = lsn, conn, selection

    def tables(self) -> dict[str, TableSchema]:
        """The selected tables as of the snapshot."""
        return {t.schema.table: t.schema for t in pg_setup.catalog(self._conn) if self._selection(t.schema.table)}

    def rows(self, table: str, batch_rows: int = 50_000) -> Iterator[pa.RecordBatch]:
        """The table's rows at the snapshot, streamed (a server-side cursor) in Arrow batches typed
        by its :class:`TableSchema` (values as the stream decodes them)."""
        import pyarrow as pa

        schema = self.tables().get(table)
        if schema is None:
            raise CdcSourceError(f"{table}: not a selected table of the snapshot at {format_lsn(self.lsn)}; "
                                 f"selected: {', '.join(sorted(self.tables())) or 'none'}")
        fields = pa.schema([pa.field(c.name, cc.arrow_type(c.type, timestamp_tz=None), c.nullable) for c in schema.columns])
        native = [c.type in _NATIVE or c.type.startswith("decimal") for c in schema.columns]
        cols = sql.SQL(", ").join(sql.Identifier(c.name) if n else sql.SQL("{}::text").format(sql.Identifier(c.name))
                                  for c, n in zip(schema.columns, native, strict=True))
        ns, rel = table.split(".", 1)
        query = sql.SQL("SELECT {} FROM {}.{}").format(cols, sql.Identifier(ns), sql.Identifier(rel))
        with self._conn.cursor(name=f"tidemark_snap_{secrets.token_hex(4)}") as cur:
            cur.itersize = batch_rows
            cur.execute(query)
            while chunk := cur.fetchmany(batch_rows):
                arrays = []
                for i, (col, nat) in enumerate(zip(schema.columns, native, strict=True)):
                    values = [r[i] for r in chunk] if nat else [None if r[i] is None else parse_text(col, r[i])
                                                                 for r in chunk]
                    arrays.append(cc.column_array(values, fields.field(i).type, f"{table}.{col.name} ({col.type})"))
                yield pa.RecordBatch.from_arrays(arrays, schema=fields)


class PostgresSource:
    """Change events of selected tables of one PostgreSQL database.

    ``tables``/``exclude``: ``schema.table`` names or fnmatch patterns (``public.order_*``; no
    schema means ``public``). ``idle_timeout``: how long :meth:`read` waits for the server when it
    sends nothing at all (it never waits for new traffic: it stops at the WAL end of the call)."""

    snapshots = True  # new replicas are copied from a consistent snapshot, then follow the slot

    def __init__(self, dsn: str, *, name: str, tables: Sequence[str], exclude: Sequence[str] = (),
                 idle_timeout: float = 10.0) -> None:
        pg_setup.check_name(name)
        if not tables:
            raise CdcSourceError(f"source {name!r}: no tables selected; name tables or patterns, e.g. public.orders, "
                                 f"public.order_*")
        self.dsn, self.name = dsn, name
        self.selection = Selection(tuple(tables), tuple(exclude))
        self.slot = self.publication = f"tidemark_{name}"
        self.ddl_table = f"tidemark.{name}_ddl"  # the DDL log, read in order with the data
        self.idle_timeout = idle_timeout
        info = conninfo_to_dict(dsn)
        self.where = f"{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"

    def close(self) -> None:
        """Nothing held between calls: every call opens and closes its own connections."""

    # ------------------------------------------------------------------ connections

    def _conninfo(self, **extra: str) -> str:
        info = conninfo_to_dict(self.dsn)
        info["options"] = f"{info.get('options') or ''} {SESSION_OPTIONS}".strip()
        return make_conninfo("", **{**info, **extra})

    def _sql(self) -> psycopg.Connection[Any]:
        try:
            return psycopg.connect(self._conninfo(), autocommit=True)
        except psycopg.OperationalError as exc:
            raise CdcSourceError(f"cannot connect to PostgreSQL at {self.where}: {str(exc).strip()}. Fix: check the "
                                 f"URL, that the server runs, and pg_hba.conf") from None

    def _replication(self) -> pq.abc.PGconn:
        conn = pq.PGconn.connect(self._conninfo(replication="database").encode())
        if conn.status != pq.ConnStatus.OK:
            msg = pq.error_message(conn)
            conn.finish()
            raise CdcSourceError(f"cannot open a replication connection to {self.where}: {msg.strip()}. Fix: the user "
                                 f"needs the REPLICATION attribute (ALTER ROLE ... REPLICATION) and pg_hba.conf must "
                                 f"allow it; wal_level must be logical")
        return conn

    def _command(self, conn: pq.abc.PGconn, command: str) -> pq.abc.PGresult:
        res = conn.exec_(command.encode())
        if res.status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK, pq.ExecStatus.COPY_BOTH):
            raise CdcSourceError(f"{self.where}: {command.split(' (')[0]} failed: {pq.error_message(res).strip()}")
        return res

    def _slot_row(self, conn: psycopg.Connection[Any], slot: str | None = None) -> tuple[Any, ...] | None:
        return conn.execute("SELECT plugin, database, confirmed_flush_lsn::text, restart_lsn::text, active,"
                            " pg_current_wal_flush_lsn()::text, active_pid FROM pg_replication_slots WHERE slot_name = %s",
                            (slot or self.slot,)).fetchone()

    def _require_slot(self, conn: psycopg.Connection[Any], slot: str | None = None) -> tuple[Any, ...]:
        row = self._slot_row(conn, slot)
        if row is None:
            raise CdcSourceError(f"{self.where}: replication slot {slot or self.slot} does not exist. Fix: set the source "
                                 f"up (PostgresSource.ensure_setup, run by tidemark cdc on every run)")
        return row

    def _wait_inactive(self, conn: psycopg.Connection[Any], timeout: float = 10.0, slot: str | None = None) -> None:
        """A reader that just closed its connection releases the slot a moment later."""
        deadline = time.monotonic() + timeout
        while (row := self._require_slot(conn, slot))[4]:
            if time.monotonic() > deadline:
                raise CdcSourceError(f"{self.where}: replication slot {slot or self.slot} is in use by process {row[6]} "
                                     f"(another tidemark run reading this source?); retry when it ends")
            time.sleep(0.05)

    # ------------------------------------------------------------------ parked replicas

    def parked_slot(self, replica: str) -> str:
        """The name of the slot that holds a paused replica's place (``tidemark_<name>_p_<hash>``)."""
        return f"{self.slot}_p_{hashlib.sha1(replica.encode()).hexdigest()[:10]}"

    def park(self, replica: str, applied: int) -> str | None:
        """Give a paused ``replica`` a slot of its own: a copy of the main slot, so the main slot
        moves on without it and no read of the others decodes the WAL the pause holds. None when
        parked (now or before), else why it cannot be: the main slot is acknowledged past
        ``applied``, or the server refuses another slot."""
        parked = self.parked_slot(replica)
        with self._sql() as conn:
            if self._slot_row(conn, parked) is not None:
                return None
            confirmed = parse_lsn(self._require_slot(conn)[2])
            if confirmed > applied:
                return f"the main slot is acknowledged at {format_lsn(confirmed)}, past {format_lsn(applied)}"
            try:
                conn.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (self.slot, parked))
            except psycopg.Error as exc:
                return (f"{self.where} refused a slot for it: {str(exc).strip()} (raise max_replication_slots to "
                        f"let paused replicas park)")
            return None

    def wal_insert_lsn(self) -> int:
        """The server's WAL insert position now (past every transaction committed, flushed or not)."""
        with self._sql() as conn:
            row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        return parse_lsn(row[0]) if row else 0

    def parked(self) -> dict[str, SlotPosition]:
        """Every parked slot of this source (by slot name) and where it stands."""
        with self._sql() as conn:
            rows = conn.execute("SELECT slot_name, plugin, database, confirmed_flush_lsn::text, restart_lsn::text, active,"
                                " pg_current_wal_flush_lsn()::text, active_pid FROM pg_replication_slots WHERE slot_name LIKE %s",
                                (f"{self.slot}\\_p\\_%",)).fetchall()
        return {r[0]: _position(r[1:]) for r in rows if self._is_parked(r[0])}

    def _is_parked(self, slot: str) -> bool:
        """Exactly ``tidemark_<name>_p_<10 hex>``: not the main slot of a source whose name has ``_p_``."""
        return re.fullmatch(re.escape(self.slot) + r"_p_[0-9a-f]{10}", slot) is not None

    def unpark(self, replica: str) -> None:
        """Drop ``replica``'s parked slot (it follows the main slot again, or needs no place kept)."""
        parked = self.parked_slot(replica)
        with self._sql() as conn:
            if self._slot_row(conn, parked) is not None:
                self._wait_inactive(conn, slot=parked)
                conn.execute("SELECT pg_drop_replication_slot(%s)", (parked,))

    # ------------------------------------------------------------------ setup

    def assess(self) -> list[Problem]:
        """Every problem that would stop replication, found before anything runs."""
        try:
            conn = self._sql()
        except CdcSourceError as exc:
            return [Problem("error", str(exc).split(". Fix: ")[0], self.where,
                            "check the URL, that the server runs and accepts connections (pg_hba.conf)")]
        with conn:
            return pg_setup.assess(conn, self)

    def ensure_setup(self) -> None:
        """Create what is missing (idempotent; safe on every run). The publication is a ``FOR
        TABLE`` list, not ``FOR TABLES IN SCHEMA``: publishing a table makes PostgreSQL refuse its
        UPDATE/DELETE unless it has a replica identity, so a schema-wide publication would break the
        application's writes to unselected key-less tables; it also needs no superuser. New tables
        of the selection are added by the DDL event trigger as they are created or renamed in."""
        with self._sql() as conn:
            pg_setup.ensure(conn, self)

    def tables(self) -> dict[str, TableSchema]:
        """The selected tables now: columns with their Spark types, primary key."""
        with self._sql() as conn:
            return {t.schema.table: t.schema for t in pg_setup.catalog(conn) if self.selection(t.schema.table)}

    def drop(self) -> None:
        """Remove the slot (and parked replicas' slots), publication, event triggers and DDL tables of this source."""
        parked = list(self.parked())
        with self._sql() as conn:
            for slot in ([self.slot] if self._slot_row(conn) is not None else []) + parked:
                self._wait_inactive(conn, slot=slot)
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            pg_setup.drop(conn, self)

    # ------------------------------------------------------------------ snapshot

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Snapshot]:
        """A consistent snapshot and its LSN, from a temporary slot's exported snapshot (the
        temporary slot and its connection end as soon as the snapshot is imported).

        The slot's consistent point is where the stream of changes not in the snapshot starts: a
        transaction whose commit record begins exactly there (one running when the slot became
        consistent, committed as the next WAL record) is not in the snapshot, and logical
        decoding started at the consistent point sends it. The snapshot's ``lsn`` is therefore
        the consistent point - 1, so that ``read(snap.lsn)`` (commits after ``lsn``) includes it."""
        with self._sql() as check:
            self._require_slot(check)
        repl = self._replication()
        conn = psycopg.connect(self._conninfo(), autocommit=False)
        try:
            temp = f"tidemark_{self.name}_snap_{os.getpid()}_{secrets.token_hex(3)}"
            res = self._command(repl, f"CREATE_REPLICATION_SLOT {temp} TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')")
            consistent, name = parse_lsn(res.get_value(0, 1).decode()), res.get_value(0, 2).decode()  # type: ignore[union-attr]
            conn.isolation_level, conn.read_only = psycopg.IsolationLevel.REPEATABLE_READ, True
            conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(name)))
            repl.finish()  # the importing transaction now holds the snapshot; the temporary slot goes
            with self._sql() as check:
                confirmed = parse_lsn(self._require_slot(check)[2])
            if confirmed > consistent:
                raise CdcSourceError(f"{self.where}: slot {self.slot} is acknowledged up to {format_lsn(confirmed)}, past "
                                     f"the snapshot at {format_lsn(consistent)}: changes in between are gone. Fix: drop "
                                     f"and set up the source again (tidemark cdc delete), then resnapshot")
            yield Snapshot(consistent - 1, conn, self.selection)
        finally:
            repl.finish()
            conn.close()

    # ------------------------------------------------------------------ stream

    def read(self, after: int, *, upto: int | None = None, max_changes: int = 100_000,
             wanted: Callable[[str, int], bool] | None = None, slot: str | None = None) -> ReadResult:
        """Whole transactions committed after ``after`` (and at or before ``upto``), in commit
        order, until ``max_changes`` wanted row changes, ``upto``, or the server's WAL end as of the
        call. ``wanted(table, commit_lsn)`` is asked for every change (DDL too; say yes for a table
        you do not know yet: a new table); unwanted changes are dropped and not counted, and a
        transaction left without changes is left out — ``ReadResult.end`` says how far the read
        looked, so the caller can move past them. Acknowledges nothing: the same (after, upto)
        reads the same again. ``slot``: a parked replica's slot instead of the main one."""
        return self._read(after, upto, max_changes, Decoder(self.selection, self.ddl_table, wanted), slot or self.slot)

    def read_columns(self, after: int, *, upto: int | None = None, max_changes: int = 100_000,
                     wanted_after: Mapping[str, int | None], spill_dir: Path | None = None,
                     spill_rows: int = 1_000_000) -> ColumnRead | None:
        """``read(after, upto=upto, max_changes=max_changes, wanted=...)`` on the main slot as Arrow
        tables, one per source table (:class:`resources.cdc.pgoutput.ColumnDecoder`: values turned into
        Arrow every 64k changes, so a big transaction is held as Arrow buffers, not Python objects);
        ``wanted_after[t]``: changes of ``t`` committed after that LSN are wanted (None: none are).
        With ``spill_dir``, a read past ``spill_rows`` changes writes them to Parquet files there as
        they stream (``ColumnRead.spilled``; the caller removes the directory). None when the span
        holds what only read() carries (a new table, DDL, TRUNCATE, a TOAST value not sent): the
        caller then reads it with read(). ``lsn``: where the read ended, as
        ``max(ReadResult.end, the last transaction's lsn)``."""
        decoder = ColumnDecoder(self.selection, self.ddl_table, wanted_after, spill_dir=spill_dir, spill_rows=spill_rows)
        try:
            txs = self._read(after, upto, max_changes, decoder, self.slot)
            return ColumnRead(cc.empty_frame(), len(txs), max(txs.end, txs[-1].lsn if txs else 0), parts=decoder.frames(),
                              spilled=decoder.spilled() or None)
        except NotColumnar as exc:
            log.info("%s: changes after %s read change by change (%s)", self.where, format_lsn(after), exc)
            return None
        finally:
            decoder.close()

    def _read(self, after: int, upto: int | None, max_changes: int, decoder: Decoder, slot: str) -> ReadResult:
        with self._sql() as conn:
            self._wait_inactive(conn, slot=slot)
            repl = self._replication()
            try:
                target = parse_lsn(self._command(repl, "IDENTIFY_SYSTEM").get_value(0, 2).decode())  # type: ignore[union-attr]
                limit = target if upto is None else min(upto, target)
                self._command(repl, f"START_REPLICATION SLOT {slot} LOGICAL {format_lsn(after + 1 if after else 0)} "
                                    f"(proto_version '1', publication_names '{self.publication}')")
                result = self._stream(repl, after, limit, target, max_changes, decoder)
                result.schemas = decoder.schemas()
                return result
            finally:
                repl.finish()
                self._wait_inactive(conn, slot=slot)

    def _stream(self, repl: pq.abc.PGconn, after: int, limit: int, target: int, max_changes: int,
                decoder: Decoder) -> ReadResult:
        txs: list[Any] = []  # Transaction (Decoder) or Committed (ColumnDecoder)
        rows, wal_end, end = 0, 0, after
        repl.nonblocking = 1
        last_data = last_ping = time.monotonic()
        while True:
            n, buf = repl.get_copy_data(1)
            now = time.monotonic()
            if n == 0:
                if now - last_data > self.idle_timeout:
                    log.warning("%s: no answer from the server for %.0f s; returning what was read", self.where,
                                self.idle_timeout)
                    return ReadResult(txs, end, False)
                if now - last_ping > 0.2:  # ask for a keepalive: it says how far the server has decoded
                    self._status(repl, reply=True)
                    last_ping = now
                select.select([repl.socket], [], [], 0.2)
                repl.consume_input()
                continue
            if n < 0:
                raise CdcSourceError(f"{self.where}: the replication stream of slot {self.slot} ended: "
                                     f"{pq.error_message(repl).strip() or 'server closed it'}")
            data = bytes(buf)
            if data[:1] == b"k":
                end_now, _, reply = struct.unpack_from("!QqB", data, 1)
                if end_now > wal_end:
                    wal_end, last_data = end_now, now
                if reply:
                    self._status(repl)
                if decoder.open is None and wal_end >= limit:  # everything committed up to limit has arrived
                    # (decoded past limit: every commit at or before it is read; decoded up to it: a commit
                    # record may begin right there)
                    return ReadResult(txs, max(end, min(wal_end - 1, limit)), limit == target)
                continue
            last_data = now
            msg = data[25:]  # XLogData: 'w', start, end, clock
            if msg[:1] == b"B" and struct.unpack_from("!Q", msg, 1)[0] > limit:
                return ReadResult(txs, end, limit == target)
            tx = decoder.feed(msg)
            if tx is None or tx.lsn <= after:
                continue
            end = tx.end_lsn - 1  # (a commit record may begin at tx.end_lsn: the next read must take it)
            if tx.changes:  # a transaction of unwanted changes only is left out: `end` covers it
                txs.append(tx)
                rows += tx.rows
            if rows >= max_changes or tx.end_lsn >= limit:
                return ReadResult(txs, end, tx.end_lsn >= target)

    @staticmethod
    def _status(repl: pq.abc.PGconn, reply: bool = False) -> None:
        """A standby status update confirming nothing (positions 0 are ignored by the server)."""
        now = int((time.time() - 946_684_800) * 1_000_000)  # microseconds since 2000-01-01
        repl.put_copy_data(b"r" + struct.pack("!QQQqB", 0, 0, 0, now, int(reply)))
        while repl.flush() > 0:
            select.select([], [repl.socket], [], 1.0)

    def ack(self, lsn: int, slot: str | None = None) -> None:
        """Confirm the slot (default: the main one) up to ``lsn`` (a transaction's ``end_lsn`` or a
        read's ``end``): the server may then recycle the WAL before it. Never moves back; a no-op if
        already past."""
        slot = slot or self.slot
        with self._sql() as conn:
            self._wait_inactive(conn, slot=slot)
            if lsn > parse_lsn(self._require_slot(conn, slot)[2]):
                conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, format_lsn(lsn)))

    def position(self) -> SlotPosition:
        """The main slot's positions (plain SQL, no replication connection)."""
        with self._sql() as conn:
            return _position(self._require_slot(conn))


def _position(row: tuple[Any, ...]) -> SlotPosition:
    _, _, confirmed, restart, active, current, _ = row
    c, r, cur = parse_lsn(confirmed), parse_lsn(restart), parse_lsn(current)
    return SlotPosition(c, r, cur, max(0, cur - r), bool(active))


__all__ = ["CdcSourceError", "PostgresSource", "Problem", "ReadResult", "SlotPosition", "Snapshot",
           "ddl_schema"]
