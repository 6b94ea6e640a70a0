"""The PostgreSQL CDC source on a real server (one per module, ``wal_level=logical``): the seed's
worked examples event by event, whole transactions, TOAST, truncate, DDL, a snapshot taken while
writers commit, read/ack/retry, and ``assess`` on badly set-up sources."""

from __future__ import annotations

import contextlib
import datetime as dt
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from lineage.cdc.changes import (
    DdlChange,
    DdlKind,
    Op,
    RowChange,
    Transaction,
    number,
    reduce_keyed,
    reduce_multiset,
)
from resources.cdc.postgres import CdcSourceError, PostgresSource
from tests.pg import running_postgres

pytestmark = pytest.mark.postgres




def sql(url: str, *statements: str, tx: bool = False) -> None:
    """Run statements, each its own transaction (or all in one with ``tx``)."""
    with psycopg.connect(url, autocommit=True) as conn:
        if tx:
            with conn.transaction():
                for s in statements:
                    conn.execute(s)
        else:
            for s in statements:
                conn.execute(s)


def query(url: str, q: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(q).fetchall()


@contextlib.contextmanager
def source(url: str, schema: str, *setup: str, exclude: tuple[str, ...] = (), ready: bool = True) -> Iterator[PostgresSource]:
    """A source named after and selecting the schema ``schema`` (created with ``setup``), dropped after."""
    sql(url, f"CREATE SCHEMA {schema}", *setup)
    src = PostgresSource(url, name=schema, tables=[f"{schema}.*"], exclude=exclude)
    try:
        if ready:
            src.ensure_setup()
        yield src
    finally:
        src.drop()
        sql(url, f"DROP SCHEMA {schema} CASCADE")


def read_all(src: PostgresSource, after: int = 0, **kw: Any) -> list[Transaction]:
    out: list[Transaction] = []
    while batch := src.read(after, **kw):
        out += batch
        after = batch[-1].lsn
    return out


def changes(txs: list[Transaction]) -> list[Any]:
    return [c for tx in txs for c in tx.changes]


# ------------------------------------------------------------------ the seed's examples


@pytest.mark.fast
def test_seed_example_with_primary_key(pg: str) -> None:
    """Key-changing updates carry the old key; an update keeping its key has no before."""
    with source(pg, "ex1", "CREATE TABLE ex1.customers (id int, name varchar(50), PRIMARY KEY (id))") as src:
        sql(pg, "INSERT INTO ex1.customers (id, name) VALUES (0, 'alice')",
            "UPDATE ex1.customers set id=1 where id=0",
            "UPDATE ex1.customers set id=2 where id=1",
            "DELETE FROM ex1.customers where id=2",
            "INSERT into ex1.customers (id, name) VALUES (0, 'Alice'), (1, 'blob')",
            "UPDATE ex1.customers set name='Bob' where id='1'")
        txs = read_all(src)
        t = "ex1.customers"
        assert [list(tx.changes) for tx in txs] == [
            [RowChange(t, Op.INSERT, after={"id": 0, "name": "alice"})],
            [RowChange(t, Op.UPDATE, after={"id": 1, "name": "alice"}, before={"id": 0})],
            [RowChange(t, Op.UPDATE, after={"id": 2, "name": "alice"}, before={"id": 1})],
            [RowChange(t, Op.DELETE, before={"id": 2})],
            [RowChange(t, Op.INSERT, after={"id": 0, "name": "Alice"}), RowChange(t, Op.INSERT, after={"id": 1, "name": "blob"})],
            [RowChange(t, Op.UPDATE, after={"id": 1, "name": "Bob"})],
        ]
        assert [tx.lsn for tx in txs] == sorted(tx.lsn for tx in txs) and all(tx.end_lsn > tx.lsn for tx in txs)
        assert len({tx.xid for tx in txs}) == 6
        assert all(abs(tx.commit_time - dt.datetime.now(dt.UTC).replace(tzinfo=None)) < dt.timedelta(minutes=1) for tx in txs)
        schema = src.tables()[t]
        assert schema.key == ("id",) and [(c.name, c.type) for c in schema.columns] == [("id", "int"), ("name", "string")]
        effect = reduce_keyed(number(txs, 2), schema, schema.key)  # the seed's diff result: (0, Alice), (1, Bob)
        assert {k: e.values for k, e in effect.effects.items() if e.present} == {
            (0,): {"id": 0, "name": "Alice"}, (1,): {"id": 1, "name": "Bob"}}


def test_seed_example_without_primary_key(pg: str) -> None:
    """REPLICA IDENTITY FULL: every update and delete carries the whole old row, copies stay apart."""
    with source(pg, "ex2", "CREATE TABLE ex2.customers (name varchar(50))",
                "ALTER TABLE ex2.customers REPLICA IDENTITY FULL") as src:
        # The seed's SQL deletes name = 'alice' but its events delete the two 'Alice' rows: we follow the events.
        sql(pg, "INSERT INTO ex2.customers (name) VALUES ('alice'), ('alice'), ('Bob')",
            "UPDATE ex2.customers SET name = 'Alyce' WHERE name = 'alice'",
            "UPDATE ex2.customers SET name = 'Alice' WHERE name = 'Alyce'",
            "DELETE FROM ex2.customers WHERE name = 'Alice'")
        txs = read_all(src)
        t = "ex2.customers"
        assert [list(tx.changes) for tx in txs] == [
            [RowChange(t, Op.INSERT, after={"name": n}) for n in ("alice", "alice", "Bob")],
            [RowChange(t, Op.UPDATE, after={"name": "Alyce"}, before={"name": "alice"})] * 2,
            [RowChange(t, Op.UPDATE, after={"name": "Alice"}, before={"name": "Alyce"})] * 2,
            [RowChange(t, Op.DELETE, before={"name": "Alice"})] * 2,
        ]
        schema = src.tables()[t]
        assert schema.key == ()
        assert {k: d for k, d in reduce_multiset(number(txs, 2), schema).deltas.items() if d} == {("Bob",): 1}


def test_transactions_are_never_split(pg: str) -> None:
    """The seed's Transactions example: a limit of 3 changes falls inside tx123 (4 changes)."""
    with source(pg, "ex3", "CREATE TABLE ex3.customers (id int PRIMARY KEY, name text)") as src:
        sql(pg, "INSERT INTO ex3.customers (id, name) VALUES (0, 'alice'), (1, 'bob')",
            "UPDATE ex3.customers SET name = 'Alice' where id = 0",
            "UPDATE ex3.customers SET name = 'Bob' where id = 1", tx=True)
        sql(pg, "DELETE FROM ex3.customers WHERE id = 1", "INSERT INTO ex3.customers (id, name) VALUES (1, 'Bobby')",
            tx=True)
        first = src.read(0, max_changes=3)
        assert len(first) == 1 and first[0].rows == 4 and not first.caught_up
        assert [c.op for c in first[0].changes] == [Op.INSERT, Op.INSERT, Op.UPDATE, Op.UPDATE]
        second = src.read(first[0].lsn, max_changes=3)
        assert len(second) == 1 and [c.op for c in second[0].changes] == [Op.DELETE, Op.INSERT]
        assert second[0].xid != first[0].xid and second[0].lsn > first[0].end_lsn - 1
        assert src.read(0, max_changes=1) == first  # a limit below one transaction still returns it whole
        assert src.read(second[0].lsn) == [] and src.read(second[0].lsn).caught_up


# ------------------------------------------------------------------ values


def test_unchanged_toast_value_is_listed_not_sent(pg: str) -> None:
    big = "".join(random.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=20_000))  # stored out of line
    with source(pg, "toast", "CREATE TABLE toast.docs (id int PRIMARY KEY, body text, n int)",
                "ALTER TABLE toast.docs ALTER COLUMN body SET STORAGE EXTERNAL",
                "CREATE TABLE toast.bag (body text, n int)", "ALTER TABLE toast.bag REPLICA IDENTITY FULL",
                "ALTER TABLE toast.bag ALTER COLUMN body SET STORAGE EXTERNAL") as src:
        sql(pg, f"INSERT INTO toast.docs VALUES (1, '{big}', 1)", f"INSERT INTO toast.bag VALUES ('{big}', 1)")
        start = read_all(src)[-1].lsn
        sql(pg, "UPDATE toast.docs SET n = 2", "UPDATE toast.bag SET n = 2", "UPDATE toast.docs SET body = 'short'")
        keyed, full, changed = changes(read_all(src, start))
        assert keyed == RowChange("toast.docs", Op.UPDATE, after={"id": 1, "n": 2}, unchanged=frozenset({"body"}))
        assert full == RowChange("toast.bag", Op.UPDATE, after={"n": 2}, before={"body": big, "n": 1},
                                 unchanged=frozenset({"body"}))
        assert changed == RowChange("toast.docs", Op.UPDATE, after={"id": 1, "body": "short", "n": 2})


TYPES = {  # column: (type, literal, decoded value)
    "i2": ("smallint", "-3", -3), "i8": ("bigint", "9007199254740993", 9007199254740993),
    "f4": ("real", "1.5", 1.5), "f8": ("double precision", "0.1", 0.1), "b": ("boolean", "true", True),
    "n": ("numeric(12,2)", "1234.5", Decimal("1234.50")), "nu": ("numeric", "3.25", Decimal("3.25")),
    "d": ("date", "'2024-02-29'", dt.date(2024, 2, 29)),
    "ts": ("timestamp", "'2024-01-02 03:04:05.123456'", dt.datetime(2024, 1, 2, 3, 4, 5, 123456)),
    "tz": ("timestamptz", "'2024-01-02 03:04:05+02'", dt.datetime(2024, 1, 2, 1, 4, 5)),
    "by": ("bytea", "'\\x00ff10'::bytea", b"\x00\xff\x10"), "j": ("jsonb", "'{\"a\": [1, 2]}'", '{"a": [1, 2]}'),
    "u": ("uuid", "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    "ar": ("int[]", "'{1,2}'", "{1,2}"), "iv": ("interval", "'1 day 02:00'", "1 day 02:00:00"),
    "t": ("time", "'12:30'", "12:30:00"), "nul": ("text", "NULL", None),
}


def test_types_decoded_alike_in_stream_and_snapshot(pg: str) -> None:
    """One mapping: the stream's values, the snapshot's Arrow values and the Spark types agree."""
    cols = ", ".join(f"{c} {t}" for c, (t, _, _) in TYPES.items())
    with source(pg, "ty", f"CREATE TABLE ty.all (id int PRIMARY KEY, {cols})") as src:
        sql(pg, f"INSERT INTO ty.all VALUES (1, {', '.join(v for _, v, _ in TYPES.values())})")
        (insert,) = changes(read_all(src))
        expected = {"id": 1, **{c: v for c, (_, _, v) in TYPES.items()}}
        assert insert.after == expected
        with src.snapshot() as snap:
            (batch,) = list(snap.rows("ty.all"))
        assert batch.to_pylist() == [expected]
        types = {c.name: c.type for c in src.tables()["ty.all"].columns}
        assert types == {"id": "int", "i2": "smallint", "i8": "bigint", "f4": "float", "f8": "double", "b": "boolean",
                         "n": "decimal(12,2)", "nu": "decimal(38,18)", "d": "date", "ts": "timestamp", "tz": "timestamp",
                         "by": "binary", **{c: "string" for c in ("j", "u", "ar", "iv", "t", "nul")}}
        assert str(batch.schema.field("n").type) == "decimal128(12, 2)" and str(batch.schema.field("tz").type) == "timestamp[us]"


def test_truncate_is_one_change_per_selected_table(pg: str) -> None:
    with source(pg, "tr", "CREATE TABLE tr.a (id int PRIMARY KEY)", "CREATE TABLE tr.b (id int PRIMARY KEY)",
                "CREATE TABLE tr.skip (id int PRIMARY KEY)", exclude=("tr.skip",)) as src:
        sql(pg, "INSERT INTO tr.a VALUES (1)", "INSERT INTO tr.skip VALUES (1)", "TRUNCATE tr.a, tr.b, tr.skip",
            "INSERT INTO tr.b VALUES (2)")
        assert changes(read_all(src)) == [RowChange("tr.a", Op.INSERT, after={"id": 1}), RowChange("tr.a", Op.TRUNCATE),
                                          RowChange("tr.b", Op.TRUNCATE), RowChange("tr.b", Op.INSERT, after={"id": 2})]


def test_partitioned_table_is_replicated_under_its_root(pg: str) -> None:
    with source(pg, "pt", "CREATE TABLE pt.ev (id int, day date, PRIMARY KEY (id, day)) PARTITION BY RANGE (day)",
                "CREATE TABLE pt.ev_2024 PARTITION OF pt.ev FOR VALUES FROM ('2024-01-01') TO ('2025-01-01')") as src:
        assert list(src.tables()) == ["pt.ev"]
        sql(pg, "INSERT INTO pt.ev VALUES (1, '2024-05-01')",
            "CREATE TABLE pt.ev_2025 PARTITION OF pt.ev FOR VALUES FROM ('2025-01-01') TO ('2026-01-01')",
            "INSERT INTO pt.ev VALUES (2, '2025-05-01')")
        assert changes(read_all(src)) == [RowChange("pt.ev", Op.INSERT, after={"id": i, "day": dt.date(2024 + i - 1, 5, 1)})
                                          for i in (1, 2)]
        with src.snapshot() as snap:
            assert sum(b.num_rows for b in snap.rows("pt.ev")) == 2


# ------------------------------------------------------------------ positions


def test_read_ack_position_and_retry(pg: str) -> None:
    with source(pg, "pos", "CREATE TABLE pos.t (id int PRIMARY KEY, v int)") as src:
        for i in range(5):
            sql(pg, f"INSERT INTO pos.t VALUES ({i}, 0)")
        before = src.position()
        assert before.confirmed_flush < before.current and not before.active
        txs = src.read(0)
        assert len(txs) == 5 and txs.caught_up and txs.end >= txs[-1].end_lsn - 1
        assert src.position().confirmed_flush == before.confirmed_flush  # read acknowledges nothing
        upto = txs[2].lsn
        sql(pg, "INSERT INTO pos.t VALUES (10, 0)")
        assert src.read(txs[0].lsn, upto=upto) == txs[1:3] == src.read(txs[0].lsn, upto=upto)  # a retry reads the same
        src.ack(txs[1].end_lsn)
        after = src.position()
        assert after.confirmed_flush == txs[1].end_lsn
        assert [tx.lsn for tx in src.read(0)] == [tx.lsn for tx in txs[2:]] + [src.read(txs[-1].lsn)[0].lsn]
        src.ack(txs[0].end_lsn)  # never backwards
        assert src.position().confirmed_flush == txs[1].end_lsn
        last = src.read(0)
        src.ack(last.end)
        assert src.position().confirmed_flush >= last[-1].end_lsn - 1 and src.read(0) == []


def test_a_transaction_committed_right_after_a_read_s_last_one_is_read_next(pg: str) -> None:
    """Two transactions committed one after the other, the second's commit record beginning where
    the first's ends (nothing written between the two COMMITs): a read that stops after the first
    (``max_changes``), then a read from where it ended, returns the second. (A read that ended at
    the first's ``end_lsn`` skipped it: the server starts decoding after the position asked for.)"""
    with source(pg, "adj", "CREATE TABLE adj.t (id int PRIMARY KEY)") as src:
        start = src.read(0).end
        for attempt in range(20):
            with psycopg.connect(pg, autocommit=False) as one, psycopg.connect(pg, autocommit=False) as two:
                one.execute(f"INSERT INTO adj.t VALUES ({2 * attempt})")
                two.execute(f"INSERT INTO adj.t VALUES ({2 * attempt + 1})")
                one.commit()
                two.commit()
            first = src.read(start, max_changes=1)
            assert len(first) == 1 and first.end == first[0].end_lsn - 1
            second = src.read(first.end)
            assert [tx.xid for tx in second] != [first[0].xid] and len(second) == 1, (attempt, first, second)
            adjacent = second[0].lsn == first[0].end_lsn
            start = second.end
            if adjacent:
                break
        assert adjacent, "no two commit records were adjacent in 20 tries: the case was not tried"


def test_wanted_drops_changes_without_counting_them(pg: str) -> None:
    """A paused table's backlog neither counts towards max_changes nor stalls the others."""
    with source(pg, "wa", "CREATE TABLE wa.a (id int PRIMARY KEY)", "CREATE TABLE wa.paused (id int PRIMARY KEY)") as src:
        for i in range(4):
            sql(pg, f"INSERT INTO wa.paused VALUES ({i})")
        sql(pg, "INSERT INTO wa.a VALUES (1)", "INSERT INTO wa.paused VALUES (9)", "INSERT INTO wa.a VALUES (2)")
        got = src.read(0, max_changes=1, wanted=lambda table, lsn: table != "wa.paused")
        assert len(got) == 1 and changes(got) == [RowChange("wa.a", Op.INSERT, after={"id": 1})]  # no empty transactions
        got2 = src.read(got[-1].lsn, max_changes=1, wanted=lambda table, lsn: table != "wa.paused")
        assert changes(got2) == [RowChange("wa.a", Op.INSERT, after={"id": 2})] and got2.end == got2[-1].end_lsn - 1
        assert len(changes(read_all(src))) == 7


def test_a_parked_slot_keeps_a_paused_tables_place_while_the_main_slot_moves_on(pg: str) -> None:
    with source(pg, "pk", "CREATE TABLE pk.a (id int PRIMARY KEY)", "CREATE TABLE pk.b (id int PRIMARY KEY)") as src:
        sql(pg, "INSERT INTO pk.a VALUES (1)", "INSERT INTO pk.b VALUES (1)")
        first = src.read(0)
        applied = first[-1].end_lsn
        src.ack(applied)
        sql(pg, "INSERT INTO pk.a VALUES (2)", "INSERT INTO pk.b VALUES (2)", "INSERT INTO pk.a VALUES (3)")
        assert src.parked() == {} and src.park("r.a", applied) is None and src.park("r.a", applied) is None  # idempotent
        slot = src.parked_slot("r.a")
        assert list(src.parked()) == [slot] and slot.startswith("tidemark_pk_p_")
        others = src.read(applied, wanted=lambda table, lsn: table != "pk.a")
        src.ack(others.end)  # the main slot moves past the paused table's changes
        assert "past" in (src.park("r.c", applied) or "")  # refused: the main slot is past where that one stopped
        free = query(pg, "SELECT current_setting('max_replication_slots')::int - count(*) FROM pg_replication_slots")[0][0]
        fill = [f"pk_fill_{i}" for i in range(free)]
        for name in fill:  # the server full: the replica is not parked, and nothing fails
            sql(pg, f"SELECT pg_create_physical_replication_slot('{name}')")
        try:
            assert "max_replication_slots" in (src.park("r.d", others.end) or "")
        finally:
            for name in fill:
                sql(pg, f"SELECT pg_drop_replication_slot('{name}')")
        assert src.position().confirmed_flush > src.parked()[slot].confirmed_flush
        held = src.read(applied, slot=slot, wanted=lambda table, lsn: table == "pk.a")
        assert changes(held) == [RowChange("pk.a", Op.INSERT, after={"id": 2}), RowChange("pk.a", Op.INSERT, after={"id": 3})]
        src.ack(held.end, slot=slot)
        assert src.parked()[slot].confirmed_flush == held.end
        src.unpark("r.a")
        sql(pg, "SELECT pg_create_logical_replication_slot('tidemark_pk_p_eu', 'pgoutput')")  # a source named pk_p_eu
        assert src.parked() == {}
        src.park("r.a", others.end)
    # drop() removed this source's slots, parked ones too, and nothing of the source named pk_p_eu
    assert query(pg, "SELECT slot_name FROM pg_replication_slots WHERE slot_name LIKE 'tidemark_pk%'") == [("tidemark_pk_p_eu",)]
    sql(pg, "SELECT pg_drop_replication_slot('tidemark_pk_p_eu')")


# ------------------------------------------------------------------ DDL


def test_ddl_arrives_in_order_with_the_rows(pg: str) -> None:
    with source(pg, "dd", exclude=("dd.tmp_*",)) as src:
        sql(pg, "CREATE TABLE dd.a (id int PRIMARY KEY, x int)", "INSERT INTO dd.a VALUES (1, 1)",
            "ALTER TABLE dd.a ADD COLUMN y text", "INSERT INTO dd.a VALUES (2, 2, 'b')",
            "ALTER TABLE dd.a RENAME TO b", "INSERT INTO dd.b VALUES (3, 3, 'c')", "DROP TABLE dd.b",
            "CREATE TABLE dd.k (v int)", "INSERT INTO dd.k VALUES (7)", "UPDATE dd.k SET v = 8",
            "ALTER TABLE dd.k RENAME TO tmp_k", "INSERT INTO dd.tmp_k VALUES (0)",
            "CREATE TABLE dd.tmp_x (id int PRIMARY KEY)", "INSERT INTO dd.tmp_x VALUES (5)",
            "ALTER TABLE dd.tmp_x RENAME TO x", "INSERT INTO dd.x VALUES (6)")
        sql(pg, "CREATE TABLE dd.c (id bigint PRIMARY KEY)", "INSERT INTO dd.c VALUES (1)", tx=True)
        txs = read_all(src)
        got = [(c.kind.value if isinstance(c, DdlChange) else c.op.value, c.table) for c in changes(txs)]
        assert got == [("create", "dd.a"), ("insert", "dd.a"), ("alter", "dd.a"), ("insert", "dd.a"),
                       ("rename", "dd.a"), ("insert", "dd.b"), ("drop", "dd.b"),
                       ("create", "dd.k"), ("insert", "dd.k"), ("update", "dd.k"), ("drop", "dd.k"),
                       ("create", "dd.x"), ("insert", "dd.x"), ("create", "dd.c"), ("insert", "dd.c")]
        ddl = [c for c in changes(txs) if isinstance(c, DdlChange)]
        create_a, alter_a, rename, _, create_k, _, create_x, create_c = ddl
        assert create_a.schema is not None and create_a.schema.key == ("id",)
        assert [(c.name, c.type) for c in create_a.schema.columns] == [("id", "int"), ("x", "int")]
        assert alter_a.schema is not None and alter_a.schema.names == ["id", "x", "y"]
        assert alter_a.statement == "ALTER TABLE dd.a ADD COLUMN y text"
        assert rename.new_table == "dd.b" and rename.kind is DdlKind.RENAME
        assert create_k.schema is not None and create_k.schema.key == ()
        assert create_x.statement == "ALTER TABLE dd.tmp_x RENAME TO x"  # renamed into the selection: a new table
        assert create_c.schema is not None and create_c.schema.columns[0].type == "bigint"
        update_k = changes(txs)[9]  # the trigger gave the new key-less table REPLICA IDENTITY FULL
        assert update_k == RowChange("dd.k", Op.UPDATE, after={"v": 8}, before={"v": 7})
        published = {r[0] for r in query(pg, "SELECT schemaname || '.' || tablename FROM pg_publication_tables "
                                             "WHERE pubname = 'tidemark_dd'")}
        assert published == {"dd.x", "dd.c", "tidemark.dd_ddl"}


# ------------------------------------------------------------------ snapshot


def apply(state: dict[str, Any], txs: list[Transaction]) -> None:
    """A replica in Python: ``items`` keyed by id (unchanged columns carried), ``bag`` a multiset."""
    for ch in changes(txs):
        if ch.table == "sn.items":
            if ch.op is Op.TRUNCATE:
                state["items"].clear()
                continue
            old = state["items"].pop((ch.before or ch.after or {})["id"]) if ch.op is not Op.INSERT else {}
            if ch.op is not Op.DELETE:
                row = {**old, **(ch.after or {})}
                state["items"][row["id"]] = row
        else:
            if ch.op in (Op.UPDATE, Op.DELETE):
                state["bag"][ch.before["v"]] -= 1
            if ch.op in (Op.INSERT, Op.UPDATE):
                state["bag"][ch.after["v"]] += 1


def test_snapshot_is_consistent_with_the_stream_under_concurrent_writers(pg: str) -> None:
    with source(pg, "sn", "CREATE TABLE sn.items (id int PRIMARY KEY, v int, note text)",
                "CREATE TABLE sn.bag (v int)", "ALTER TABLE sn.bag REPLICA IDENTITY FULL",
                "INSERT INTO sn.items SELECT g, g, 'n' FROM generate_series(1, 200) g",
                "INSERT INTO sn.bag SELECT g % 7 FROM generate_series(1, 100) g") as src:
        stop = threading.Event()
        commits = Counter[str]()

        def writer(seed: int) -> None:
            rnd = random.Random(seed)
            with psycopg.connect(pg, autocommit=True) as conn:
                while not stop.is_set():
                    try:
                        with conn.transaction():
                            for _ in range(rnd.randint(1, 4)):
                                i = rnd.randint(1, 300)
                                conn.execute(rnd.choice([
                                    f"INSERT INTO sn.items VALUES ({i}, {i}, 'w') ON CONFLICT (id) DO NOTHING",
                                    f"UPDATE sn.items SET v = v + 1 WHERE id = {i}",
                                    f"UPDATE sn.items SET id = id + 1000 WHERE id = {i}",  # key change
                                    f"DELETE FROM sn.items WHERE id = {i}",
                                    f"INSERT INTO sn.bag VALUES ({i % 7})",
                                    f"UPDATE sn.bag SET v = v + 1 WHERE ctid = (SELECT ctid FROM sn.bag WHERE v = {i % 7} LIMIT 1)",
                                    f"DELETE FROM sn.bag WHERE ctid = (SELECT ctid FROM sn.bag WHERE v = {i % 9} LIMIT 1)"]))
                        commits["ok"] += 1
                    except psycopg.errors.Error:
                        commits["failed"] += 1

        threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
        for th in threads:
            th.start()
        def committed(n: int) -> None:
            """Wait (by count, not by time: a loaded machine's writers stall on locks) for ``n`` commits."""
            deadline = time.monotonic() + 60
            while commits["ok"] < n and time.monotonic() < deadline:
                time.sleep(0.02)
            assert commits["ok"] >= n, f"the writers committed {commits['ok']} of {n} in 60 s ({commits['failed']} failed)"

        try:
            committed(10)
            with src.snapshot() as snap:
                committed_before = commits["ok"]
                committed(committed_before + 5)  # writers keep committing while the snapshot is read
                items = {r["id"]: r for b in snap.rows("sn.items", batch_rows=64) for r in b.to_pylist()}
                bag = Counter(r["v"] for b in snap.rows("sn.bag") for r in b.to_pylist())
                lsn = snap.lsn
            committed(commits["ok"] + 10)
        finally:
            stop.set()
            for th in threads:
                th.join()
        state = {"items": items, "bag": bag}
        apply(state, read_all(src, lsn))
        final_items = {r[0]: {"id": r[0], "v": r[1], "note": r[2]} for r in query(pg, "SELECT id, v, note FROM sn.items")}
        assert state["items"] == final_items
        assert +state["bag"] == Counter(r[0] for r in query(pg, "SELECT v FROM sn.bag"))


def test_a_transaction_committed_right_at_the_snapshots_lsn_is_in_the_stream(pg: str) -> None:
    """The boundary, forced (up to three tries: a WAL record PostgreSQL writes by itself, e.g. the
    background writer's running-xacts record on a loaded machine, can come first; every try checks
    that nothing is lost or doubled)."""
    assert any(_snapshot_boundary(pg, f"bd{i}") for i in range(3)), "the boundary was never forced in three tries"


def _snapshot_boundary(pg: str, schema: str) -> bool:
    with source(pg, schema, f"CREATE TABLE {schema}.t (id int PRIMARY KEY)", f"INSERT INTO {schema}.t VALUES (1)") as src, \
            psycopg.connect(pg) as a, psycopg.connect(pg) as b, psycopg.connect(pg) as t, \
            psycopg.connect(pg, autocommit=True) as watch:

        def xid(conn: psycopg.Connection[Any]) -> str:
            return str(conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0])  # type: ignore[index]

        def awaited(x: str) -> None:  # the slot's builder waits for transaction x
            deadline = time.monotonic() + 30
            while not watch.execute("SELECT 1 FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted "
                                    "AND transactionid::text = %s", (x,)).fetchone():
                assert time.monotonic() < deadline, f"the snapshot's slot never waited for transaction {x}"
                time.sleep(0.02)

        xa = xid(a)
        failed: list[BaseException] = []

        def interleave() -> None:
            try:
                awaited(xa)
                xb = xid(b)
                a.commit()
                awaited(xb)
                t.execute(f"INSERT INTO {schema}.t VALUES (2)")
                b.commit()
            except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
                failed.append(exc)
                a.rollback()
                b.rollback()

        helper = threading.Thread(target=interleave)
        helper.start()
        try:
            with src.snapshot() as snap:
                helper.join()
                assert not failed, failed
                t.commit()  # nothing else writes WAL: its commit record starts at the consistent point
                rows = [r["id"] for batch in snap.rows(f"{schema}.t") for r in batch.to_pylist()]
                lsn = snap.lsn
        finally:
            helper.join()
        assert rows == [1]  # t is not in the snapshot ...
        after = src.read(lsn)  # ... so it is in the stream after it
        assert [list(tx.changes) for tx in after] == [[RowChange(f"{schema}.t", Op.INSERT, after={"id": 2})]]
        return after[0].lsn == lsn + 1  # forced: t's commit is the first WAL record after the consistent point


def test_snapshot_needs_the_main_slot(pg: str) -> None:
    with source(pg, "ns", "CREATE TABLE ns.t (id int PRIMARY KEY)", ready=False) as src, \
            pytest.raises(CdcSourceError, match="slot tidemark_ns does not exist"), src.snapshot():
        pass


# ------------------------------------------------------------------ assess


def test_assess_lists_every_problem_with_a_fix(pg: str) -> None:
    with source(pg, "bad", "CREATE TABLE bad.nokey (v int, doc jsonb, amount numeric)",
                "CREATE TABLE bad.ok (id int PRIMARY KEY)", "CREATE ROLE app LOGIN",
                "GRANT USAGE ON SCHEMA bad TO app", "GRANT SELECT ON bad.ok TO app", ready=False) as src:
        try:
            problems = {(p.severity, p.where, p.what.split(":")[0].split(" (")[0]): p.fix for p in src.assess()}
            assert problems == {
                ("error", "bad.nokey", "neither a primary key nor REPLICA IDENTITY FULL"):
                    'ALTER TABLE "bad"."nokey" REPLICA IDENTITY FULL;  (or add a primary key)',
                ("warning", "bad.nokey.doc", "type jsonb is replicated as text"):
                    "cast it in a downstream topic if you need the structure",
                ("warning", "bad.nokey.amount", "numeric without precision is replicated as decimal(38,18); a value "
                 "with more than 20 integer or 18 decimal digits fails the table"):
                    "declare it: ALTER TABLE bad.nokey ALTER COLUMN amount TYPE numeric(p,s);",
            }
            with pytest.raises(CdcSourceError, match=r'bad.nokey: neither a primary key.*REPLICA IDENTITY FULL'):
                src.ensure_setup()
            app = PostgresSource(pg.replace("postgres@", "app@"), name="bad", tables=["bad.ok", "bad.none*"])
            errors = [p for p in app.assess() if p.severity == "error"]
            assert {p.fix for p in errors} >= {'ALTER ROLE "app" REPLICATION;', 'GRANT CREATE ON DATABASE "tidemark" TO "app";',
                                               'ALTER TABLE bad.ok OWNER TO "app"; or run the setup as its owner or a superuser'}
            assert any("event triggers need a superuser" in p.what for p in app.assess() if p.severity == "warning")
            nothing = PostgresSource(pg, name="bad", tables=["bad.missing_*"])
            assert [p.what for p in nothing.assess()] == ["no table matches bad.missing_*"]
        finally:
            sql(pg, "DROP OWNED BY app", "DROP ROLE app")
        down = PostgresSource("postgresql://postgres@127.0.0.1:1/x", name="bad", tables=["a.b"])
        (unreachable,) = down.assess()
        assert unreachable.severity == "error" and "cannot connect" in unreachable.what


def test_a_replication_user_without_superuser_replicates_data_but_not_ddl(pg: str) -> None:
    sql(pg, "CREATE SCHEMA IF NOT EXISTS tidemark", "CREATE ROLE rep LOGIN REPLICATION", "GRANT CREATE ON DATABASE tidemark TO rep",
        "CREATE SCHEMA su AUTHORIZATION rep", "CREATE TABLE su.t (id int PRIMARY KEY)", "ALTER TABLE su.t OWNER TO rep")
    src = PostgresSource(pg.replace("postgres@", "rep@"), name="su", tables=["su.*"])
    try:
        problems = src.assess()
        assert [p.fix for p in problems if p.severity == "error"] == ['GRANT USAGE, CREATE ON SCHEMA tidemark TO "rep";']
        sql(pg, "GRANT USAGE, CREATE ON SCHEMA tidemark TO rep")
        assert [p.severity for p in src.assess()] == ["warning"]  # DDL will not be captured
        src.ensure_setup()
        sql(pg, "INSERT INTO su.t VALUES (1)", "ALTER TABLE su.t ADD COLUMN x int", "INSERT INTO su.t VALUES (2, 2)")
        got = src.read(0)
        assert changes(got) == [RowChange("su.t", Op.INSERT, after={"id": 1}),
                                RowChange("su.t", Op.INSERT, after={"id": 2, "x": 2})]  # the new column, no DdlChange
        src.ack(got.end)
        assert src.position().confirmed_flush == got.end
    finally:
        src.drop()
        sql(pg, "DROP SCHEMA su CASCADE", "DROP OWNED BY rep", "DROP ROLE rep")


def test_assess_reports_wal_level() -> None:
    with running_postgres(options={"wal_level": "replica"}) as url:
        sql(url, "CREATE TABLE t (id int PRIMARY KEY)")
        problems = PostgresSource(url, name="w", tables=["public.t"]).assess()
        assert [(p.severity, p.what, p.fix) for p in problems] == [
            ("error", "wal_level is replica, logical decoding needs logical",
             "ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL")]


def test_setting_up_a_source_that_is_set_up_writes_no_wal(pg: str) -> None:
    """``ensure_setup`` runs before every unit: on a source that is set up it must write nothing, or a
    follower watching the server's WAL position would take its own setup for a change and run a unit
    again at once, forever (issue 55's idle target)."""
    with source(pg, "idle", "CREATE TABLE idle.t (id int PRIMARY KEY, v int)") as src:
        # (the server may log a record of its own meanwhile, e.g. the bgwriter's running transactions,
        # tens of bytes; each setup wrote ~2.5 KB when it replaced its functions and rows every time)
        before = src.wal_insert_lsn()
        for _ in range(5):
            src.ensure_setup()
        assert src.wal_insert_lsn() - before < 200
        sql(pg, "CREATE TABLE idle.u (id int PRIMARY KEY)")  # a new table of the selection: recorded once
        src.ensure_setup()
        after = src.wal_insert_lsn()
        for _ in range(5):
            src.ensure_setup()
        assert src.wal_insert_lsn() - after < 200
        assert ("idle.u",) in query(pg, "SELECT name FROM tidemark.idle_tables")
