"""What a PostgreSQL CDC source needs on the server, in SQL: the catalog of tables, the checks of
``assess``, the idempotent setup (publication, DDL log, event triggers, slot) and its removal.
Used by :mod:`resources.cdc.postgres`.

DDL capture: logical decoding carries no DDL, so two event triggers (``ddl_command_end`` for
CREATE TABLE [AS] / SELECT INTO / ALTER TABLE, ``sql_drop`` for dropped tables) insert a row per
table of the selection into ``tidemark.<name>_ddl``: the command, the old name (kept per table oid
in ``tidemark.<name>_tables``, so a rename is recognised), the new name, the columns and primary
key from the catalog at that moment, and ``current_query()``. That table is in the publication, so
the rows arrive in commit order with the data. The trigger also adds a table entering the
selection (created, or renamed into it) to the publication, removes one leaving it, and gives a new
selected table with neither primary key nor replica identity ``REPLICA IDENTITY FULL`` (else
PostgreSQL would refuse its UPDATE and DELETE once published). Event triggers need a superuser:
without one, DDL is not captured (``assess`` warns) but data still flows.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import psycopg
from psycopg import sql

from lineage.cdc.changes import TableSchema
from lineage.core.errors import TidemarkError
from resources.cdc.pgoutput import UNBOUNDED_NUMERIC, Selection, ddl_schema, text_only


class PostgresSource(Protocol):
    """What the setup needs of a source (:class:`resources.cdc.postgres.PostgresSource` is one): its
    names on the server and its table selection."""

    name: str
    where: str  # host:port/dbname, for messages
    slot: str
    publication: str
    selection: Selection

log = logging.getLogger(__name__)


class CdcSourceError(TidemarkError):
    """The PostgreSQL source is unreachable, not set up, or refused a replication command."""


@dataclass(frozen=True)
class Problem:
    """One finding of ``assess``: what is wrong, where, and how to fix it."""

    severity: Literal["error", "warning"]
    what: str
    where: str
    fix: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.where}: {self.what}. Fix: {self.fix}"


def check_name(name: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9_]{0,39}", name):
        raise CdcSourceError(f"CDC source name {name!r} is not usable for a replication slot; use lower-case "
                             f"letters, digits and _ (at most 40, starting with a letter), e.g. 'shop'")


# The columns (without generated ones: pgoutput does not send them) and primary key of a table
# as JSON; one text for the catalog query and the DDL trigger, so both describe a table alike.
COLUMNS_JSON = """(SELECT coalesce(jsonb_agg(jsonb_build_object('name', a.attname, 'typid', a.atttypid::bigint,
  'typmod', a.atttypmod, 'type', format_type(a.atttypid, a.atttypmod), 'notnull', a.attnotnull) ORDER BY a.attnum),
  '[]') FROM pg_attribute a WHERE a.attrelid = {rel} AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '')"""
KEY_JSON = """(SELECT coalesce(jsonb_agg(a.attname ORDER BY k.n), '[]') FROM pg_index x,
  unnest(x.indkey::int2[]) WITH ORDINALITY k(attnum, n), pg_attribute a
  WHERE x.indrelid = {rel} AND x.indisprimary AND a.attrelid = x.indrelid AND a.attnum = k.attnum)"""
_USER_TABLES = """c.relkind IN ('r', 'p') AND NOT c.relispartition AND n.nspname NOT IN ('pg_catalog',
  'information_schema', 'tidemark') AND n.nspname NOT LIKE 'pg\\_%'"""


@dataclass(frozen=True)
class TableInfo:
    schema: TableSchema
    relid: int
    identity: str  # relreplident: d(efault: the primary key) n(othing) f(ull) i(ndex)
    owned: bool  # the user may add it to a publication
    readable: bool  # the user may SELECT it (snapshot)
    typids: dict[str, int]


def catalog(conn: psycopg.Connection[Any]) -> list[TableInfo]:
    """Every user table of the database (partitioned tables as their root)."""
    rows = conn.execute(f"""SELECT c.oid, n.nspname || '.' || c.relname, c.relreplident::text,
        pg_has_role(c.relowner, 'USAGE'), has_table_privilege(c.oid, 'SELECT'),
        {COLUMNS_JSON.format(rel='c.oid')}::text, {KEY_JSON.format(rel='c.oid')}::text
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {_USER_TABLES} ORDER BY 2""").fetchall()
    out = []
    for relid, name, identity, owned, readable, cols, key in rows:
        typids = {c["name"]: c["typid"] for c in json.loads(cols)}
        out.append(TableInfo(ddl_schema(name, cols, key), relid, identity, owned, readable, typids))
    return out


def _identity_problem(t: TableInfo) -> bool:
    return t.identity == "n" or (t.identity == "d" and not t.schema.key)


def _identity_fix(table: str) -> str:
    ns, rel = table.split(".", 1)
    return f'ALTER TABLE "{ns}"."{rel}" REPLICA IDENTITY FULL;  (or add a primary key)'


def assess(conn: psycopg.Connection[Any], src: PostgresSource) -> list[Problem]:
    out: list[Problem] = []
    where = src.where
    setting = {k: v for k, v in conn.execute(
        "SELECT name, setting FROM pg_settings WHERE name IN ('wal_level', 'max_replication_slots', 'max_wal_senders')")}
    if setting["wal_level"] != "logical":
        out.append(Problem("error", f"wal_level is {setting['wal_level']}, logical decoding needs logical", where,
                           "ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL"))
    slot = conn.execute("SELECT plugin, database FROM pg_replication_slots WHERE slot_name = %s", (src.slot,)).fetchone()
    db = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
    if slot is not None and (slot[0], slot[1]) != ("pgoutput", db):
        out.append(Problem("error", f"replication slot {src.slot} exists for plugin {slot[0]} in database {slot[1]}",
                           where, f"drop it if it is not in use: SELECT pg_drop_replication_slot('{src.slot}');"))
    slots_used = conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone()[0]  # type: ignore[index]
    need = 1 + (slot is None)  # a temporary slot per snapshot, plus the main one if missing
    if int(setting["max_replication_slots"]) - slots_used < need:
        out.append(Problem("error", f"max_replication_slots = {setting['max_replication_slots']} and {slots_used} in "
                           f"use; this source needs {need} more", where,
                           f"ALTER SYSTEM SET max_replication_slots = {slots_used + need + 2}; then restart PostgreSQL"))
    senders = conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone()[0]  # type: ignore[index]
    if int(setting["max_wal_senders"]) - senders < 1:
        out.append(Problem("error", f"max_wal_senders = {setting['max_wal_senders']}, all in use", where,
                           f"ALTER SYSTEM SET max_wal_senders = {senders + 4}; then restart PostgreSQL"))
    user, superuser, replication, create = conn.execute(
        "SELECT current_user, rolsuper, rolreplication, has_database_privilege(current_database(), 'CREATE') "
        "FROM pg_roles WHERE rolname = current_user").fetchone()  # type: ignore[misc]
    if not (superuser or replication):
        out.append(Problem("error", f"user {user} may not use replication", where, f'ALTER ROLE "{user}" REPLICATION;'))
    if not (superuser or create):
        out.append(Problem("error", f"user {user} may not create the publication (no CREATE on database {db})", where,
                           f'GRANT CREATE ON DATABASE "{db}" TO "{user}";'))
    schema_ok = conn.execute("SELECT has_schema_privilege(oid, 'CREATE') FROM pg_namespace WHERE nspname = 'tidemark'"
                             ).fetchone()
    if schema_ok is not None and not (schema_ok[0] or superuser):
        out.append(Problem("error", f"user {user} may not create the DDL log in the existing schema tidemark", where,
                           f'GRANT USAGE, CREATE ON SCHEMA tidemark TO "{user}";'))
    pub = conn.execute("SELECT pg_has_role(pubowner, 'USAGE'), puballtables FROM pg_publication WHERE pubname = %s",
                       (src.publication,)).fetchone()
    if pub is not None and not (pub[0] or superuser):
        out.append(Problem("error", f"publication {src.publication} belongs to another user", where,
                           f'ALTER PUBLICATION {src.publication} OWNER TO "{user}";'))
    triggers = conn.execute("SELECT count(*) FROM pg_event_trigger WHERE evtname LIKE %s",
                            (f"tidemark\\_{src.name}\\_%",)).fetchone()[0]  # type: ignore[index]
    if not superuser and triggers < 2:
        out.append(Problem("warning", "DDL will not be captured: event triggers need a superuser (new tables, added "
                           "columns, renames and drops are not replicated)", where,
                           "run the setup once as a superuser (tidemark cdc assess/run with a superuser URL)"))
    tables = [t for t in catalog(conn) if src.selection(t.schema.table)]
    if not tables:
        out.append(Problem("error", f"no table matches {', '.join(src.selection.include)}"
                           + (f" (minus {', '.join(src.selection.exclude)})" if src.selection.exclude else ""), where,
                           "name existing tables as schema.table or patterns such as public.order_*"))
    for t in tables:
        name = t.schema.table
        if _identity_problem(t):
            out.append(Problem("error", "neither a primary key nor REPLICA IDENTITY FULL: once published, PostgreSQL "
                               "refuses its UPDATE and DELETE", name, _identity_fix(name)))
        if not (t.owned or superuser):
            out.append(Problem("error", f"user {user} does not own it and cannot add it to the publication", name,
                               f'ALTER TABLE {name} OWNER TO "{user}"; or run the setup as its owner or a superuser'))
        if not t.readable:
            out.append(Problem("error", f"user {user} may not read it (snapshot)", name,
                               f'GRANT SELECT ON {name} TO "{user}";'))
        for col in t.schema.columns:
            if text_only(col, t.typids[col.name]):
                out.append(Problem("warning", f"type {col.source_type} is replicated as text (string)",
                                   f"{name}.{col.name}", "cast it in a downstream topic if you need the structure"))
            elif col.type == UNBOUNDED_NUMERIC and col.source_type == "numeric":
                out.append(Problem("warning", f"numeric without precision is replicated as {UNBOUNDED_NUMERIC}; a "
                                   "value with more than 20 integer or 18 decimal digits fails the table",
                                   f"{name}.{col.name}", f"declare it: ALTER TABLE {name} ALTER COLUMN {col.name} "
                                   "TYPE numeric(p,s);"))
    return out


def _lit(conn: psycopg.Connection[Any], value: str) -> str:
    return sql.Literal(value).as_string(conn)


def _match(conn: psycopg.Connection[Any], src: PostgresSource, var: str) -> str:
    """SQL: whether the text ``var`` is a selected table name (the same regex as Python's)."""
    inc, exc = src.selection.include_re, src.selection.exclude_re
    cond = f"({var} ~ {_lit(conn, inc or '^$')}"
    return cond + (f" AND {var} !~ {_lit(conn, exc)})" if exc else ")")


def _trigger_sql(conn: psycopg.Connection[Any], src: PostgresSource) -> list[str]:
    n, pub = src.name, _lit(conn, src.publication)
    member = ("EXISTS (SELECT 1 FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid "
              f"WHERE p.pubname = {pub} AND pr.prrelid = r.objid)")
    # A guard setting: the trigger's own ALTER TABLE ... REPLICA IDENTITY FULL must not log itself.
    ddl_end = f"""CREATE OR REPLACE FUNCTION tidemark.{n}_ddl_end() RETURNS event_trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE r record; ns text; rel text; nm text; old text; sel_new boolean; sel_old boolean; keyless boolean;
BEGIN
  IF current_setting('tidemark.in_trigger', true) = 'on' THEN RETURN; END IF;
  FOR r IN SELECT DISTINCT ON (d.objid) d.objid, d.command_tag FROM pg_event_trigger_ddl_commands() d
           WHERE d.object_type = 'table' AND d.schema_name NOT LIKE 'pg\\_temp%' AND d.schema_name <> 'tidemark' LOOP
    SELECT s.nspname, c.relname, c.relreplident = 'n' OR (c.relreplident = 'd' AND NOT EXISTS
             (SELECT 1 FROM pg_index x WHERE x.indrelid = c.oid AND x.indisprimary))
      INTO ns, rel, keyless FROM pg_class c JOIN pg_namespace s ON s.oid = c.relnamespace
      WHERE c.oid = r.objid AND c.relkind IN ('r', 'p') AND NOT c.relispartition;
    CONTINUE WHEN rel IS NULL;
    nm := ns || '.' || rel;
    SELECT t.name INTO old FROM tidemark.{n}_tables t WHERE t.relid = r.objid;
    INSERT INTO tidemark.{n}_tables (relid, name) VALUES (r.objid, nm) ON CONFLICT (relid) DO UPDATE SET name = nm;
    sel_new := {_match(conn, src, 'nm')};
    sel_old := old IS NOT NULL AND {_match(conn, src, 'old')};
    CONTINUE WHEN NOT sel_new AND NOT sel_old;
    IF sel_new AND keyless THEN
      PERFORM set_config('tidemark.in_trigger', 'on', true);
      EXECUTE format('ALTER TABLE %I.%I REPLICA IDENTITY FULL', ns, rel);
      PERFORM set_config('tidemark.in_trigger', 'off', true);
    END IF;
    IF sel_new AND NOT {member} THEN
      EXECUTE format('ALTER PUBLICATION %I ADD TABLE %I.%I', {pub}, ns, rel);
    ELSIF NOT sel_new AND {member} THEN
      EXECUTE format('ALTER PUBLICATION %I DROP TABLE %I.%I', {pub}, ns, rel);
    END IF;
    INSERT INTO tidemark.{n}_ddl (command_tag, relid, old_name, new_name, columns, key, statement)
      VALUES (r.command_tag, r.objid, old, nm, {COLUMNS_JSON.format(rel='r.objid')}, {KEY_JSON.format(rel='r.objid')},
              current_query());
  END LOOP;
END $fn$"""
    sql_drop = f"""CREATE OR REPLACE FUNCTION tidemark.{n}_sql_drop() RETURNS event_trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE r record; old text;
BEGIN
  FOR r IN SELECT d.objid, d.schema_name, d.object_name FROM pg_event_trigger_dropped_objects() d
           WHERE d.object_type = 'table' AND NOT d.is_temporary AND d.schema_name <> 'tidemark' LOOP
    old := NULL;
    DELETE FROM tidemark.{n}_tables t WHERE t.relid = r.objid RETURNING t.name INTO old;
    old := coalesce(old, r.schema_name || '.' || r.object_name);
    CONTINUE WHEN NOT {_match(conn, src, 'old')};
    INSERT INTO tidemark.{n}_ddl (command_tag, relid, old_name, statement)
      VALUES ('DROP TABLE', r.objid, old, current_query());
  END LOOP;
END $fn$"""
    return [ddl_end, sql_drop]


def ensure(conn: psycopg.Connection[Any], src: PostgresSource) -> None:
    """Publication, DDL log, event triggers and slot, each created if missing, in the order
    decoding needs (a slot only decodes past the creation of the publication it is read with)."""
    n = src.name
    superuser = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0]  # type: ignore[index]
    tables = [t for t in catalog(conn) if src.selection(t.schema.table)]
    bad = [t.schema.table for t in tables if _identity_problem(t)]
    if bad:
        raise CdcSourceError(f"{src.where}: {', '.join(bad)}: neither a primary key nor REPLICA IDENTITY FULL; "
                             f"published, PostgreSQL would refuse their UPDATE and DELETE. Fix: "
                             + " ".join(_identity_fix(t) for t in bad))
    with conn.transaction():
        conn.execute("CREATE SCHEMA IF NOT EXISTS tidemark")
        conn.execute(f"""CREATE TABLE IF NOT EXISTS tidemark.{n}_ddl (id bigserial PRIMARY KEY, at timestamptz NOT NULL
            DEFAULT now(), command_tag text NOT NULL, relid oid, old_name text, new_name text, columns jsonb, key jsonb,
            statement text)""")
        conn.execute(f"CREATE TABLE IF NOT EXISTS tidemark.{n}_tables (relid oid PRIMARY KEY, name text NOT NULL)")
        # The WAL keeps what decoding needs; rows are for people looking at what was captured.
        conn.execute(f"DELETE FROM tidemark.{n}_ddl WHERE at < now() - interval '7 days'")
        if superuser:
            conn.execute(f"""INSERT INTO tidemark.{n}_tables SELECT c.oid, n.nspname || '.' || c.relname FROM pg_class c
                JOIN pg_namespace n ON n.oid = c.relnamespace WHERE {_USER_TABLES}
                AND NOT EXISTS (SELECT 1 FROM tidemark.{n}_tables t WHERE t.relid = c.oid
                                AND t.name = n.nspname || '.' || c.relname)
                ON CONFLICT (relid) DO UPDATE SET name = EXCLUDED.name""")
            for statement in _trigger_sql(conn, src):
                if not _function_is(conn, statement):
                    conn.execute(statement)
            for trigger, event, tags, fn in (
                    (f"tidemark_{n}_ddl", "ddl_command_end",
                     "WHEN TAG IN ('CREATE TABLE', 'CREATE TABLE AS', 'SELECT INTO', 'ALTER TABLE')", f"{n}_ddl_end"),
                    (f"tidemark_{n}_drop", "sql_drop", "", f"{n}_sql_drop")):
                if conn.execute("SELECT 1 FROM pg_event_trigger WHERE evtname = %s", (trigger,)).fetchone() is None:
                    conn.execute(f"CREATE EVENT TRIGGER {trigger} ON {event} {tags} EXECUTE FUNCTION tidemark.{fn}()")
        else:
            log.warning("%s: not a superuser: no event triggers, DDL of the selected tables is not captured", src.where)
        selected = {t.relid: t.schema.table for t in tables}
        ddl = conn.execute("SELECT %s::regclass::oid", (f"tidemark.{n}_ddl",)).fetchone()[0]  # type: ignore[index]
        pub = conn.execute("SELECT oid FROM pg_publication WHERE pubname = %s", (src.publication,)).fetchone()
        if pub is None:
            names = ", ".join([f"tidemark.{n}_ddl"] + [_ident(t) for t in selected.values()])
            conn.execute(f"CREATE PUBLICATION {src.publication} FOR TABLE {names} WITH (publish_via_partition_root)")
        else:
            have = {r[0] for r in conn.execute("SELECT prrelid FROM pg_publication_rel WHERE prpubid = %s", (pub[0],))}
            for relid in set(selected) - have:
                conn.execute(f"ALTER PUBLICATION {src.publication} ADD TABLE {_ident(selected[relid])}")
            for relid in have - set(selected) - {ddl}:  # no longer selected
                name = conn.execute("SELECT %s::regclass::text", (relid,)).fetchone()[0]  # type: ignore[index]
                conn.execute(f"ALTER PUBLICATION {src.publication} DROP TABLE {name}")
            if ddl not in have:
                conn.execute(f"ALTER PUBLICATION {src.publication} ADD TABLE tidemark.{n}_ddl")
    if conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (src.slot,)).fetchone() is None:
        try:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (src.slot,))
        except psycopg.Error as exc:
            raise CdcSourceError(f"{src.where}: cannot create replication slot {src.slot}: {str(exc).strip()}. Fix: "
                                 f"run tidemark cdc assess and fix what it lists") from None


_FUNCTION = re.compile(r"CREATE OR REPLACE FUNCTION (tidemark\.\w+)\(\).*?\$fn\$(.*)\$fn\$", re.DOTALL)


def _function_is(conn: psycopg.Connection[Any], statement: str) -> bool:
    """Whether the function ``statement`` creates exists with that body already. ``ensure`` runs before
    every unit: replacing an unchanged function (or updating an unchanged row) would write WAL each
    time, and a follower watching the server's WAL position would take that for a change and run
    a unit again at once, forever."""
    m = _FUNCTION.search(statement)
    if m is None:
        return False
    row = conn.execute("SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure(%s)", (f"{m[1]}()",)).fetchone()
    return row is not None and row[0] == m[2]


def _ident(table: str) -> str:
    ns, rel = table.split(".", 1)
    return '"' + ns.replace('"', '""') + '"."' + rel.replace('"', '""') + '"'


def drop(conn: psycopg.Connection[Any], src: PostgresSource) -> None:
    n = src.name
    with conn.transaction():
        conn.execute(f"DROP EVENT TRIGGER IF EXISTS tidemark_{n}_ddl")
        conn.execute(f"DROP EVENT TRIGGER IF EXISTS tidemark_{n}_drop")
        conn.execute(f"DROP PUBLICATION IF EXISTS {src.publication}")
        if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'tidemark'").fetchone() is not None:
            conn.execute(f"DROP FUNCTION IF EXISTS tidemark.{n}_ddl_end(), tidemark.{n}_sql_drop()")
            conn.execute(f"DROP TABLE IF EXISTS tidemark.{n}_ddl, tidemark.{n}_tables")
