"""The columnar read of the PostgreSQL source (``PostgresSource.read_columns``, pgoutput decoded
into Arrow columns) gives read()'s answer exactly, on a real server: random DML in random
transactions over several tables and types, key changes, wanted positions, ``max_changes`` and
``upto``, chunks smaller than a transaction; and None for what only read() carries."""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from lineage.cdc.columns import ColumnRead
from resources.cdc import pgoutput as pg_decode
from resources.cdc.postgres import PostgresSource
from tests.resources.test_debezium_columns import frame_from
from tests.resources.test_pg_cdc import source, sql

pytestmark = [pytest.mark.postgres, pytest.mark.fast]

TABLES = ("CREATE TABLE {s}.a (id bigint PRIMARY KEY, name text, amount numeric(12,2), at timestamptz, day date, "
          "flag boolean, score double precision)",
          "CREATE TABLE {s}.b (k1 text, k2 int, note varchar(20), PRIMARY KEY (k1, k2))",
          "CREATE TABLE {s}.c (id int PRIMARY KEY, qty smallint)",
          "ALTER TABLE {s}.c REPLICA IDENTITY FULL")


def random_dml(pg: str, s: str, rng: random.Random, txs: int) -> None:
    import psycopg

    with psycopg.connect(pg, autocommit=True) as conn:
        for _ in range(txs):
            with conn.transaction():
                for _ in range(rng.randint(1, 8)):
                    k, op = rng.randint(1, 40), rng.random()
                    if op < 0.4:
                        conn.execute(f"INSERT INTO {s}.a VALUES (%s, %s, %s, now() - %s * interval '1 hour', "
                                     f"current_date - %s, %s, %s) ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name",
                                     (k, rng.choice(["x", None, "ü é"]), rng.randint(-999, 999) / 4, k, k,
                                      rng.choice([True, False, None]), rng.random()))
                        conn.execute(f"INSERT INTO {s}.b VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                                     (rng.choice("pqr"), k % 5, str(k)))
                        conn.execute(f"INSERT INTO {s}.c VALUES (%s, %s) ON CONFLICT DO NOTHING", (k, k))
                    elif op < 0.65:
                        conn.execute(f"UPDATE {s}.a SET amount = amount + 1, flag = NOT flag WHERE id = %s", (k,))
                        conn.execute(f"UPDATE {s}.c SET qty = qty + 1 WHERE id = %s", (k,))
                    elif op < 0.8:  # key changes
                        conn.execute(f"UPDATE {s}.a SET id = %s WHERE id = %s AND NOT EXISTS (SELECT 1 FROM {s}.a "
                                     f"WHERE id = %s)", (k + 100, k, k + 100))
                        conn.execute(f"UPDATE {s}.b SET k2 = k2 + 10 WHERE k1 = %s AND k2 = %s AND NOT EXISTS "
                                     f"(SELECT 1 FROM {s}.b WHERE k1 = %s AND k2 = %s)",
                                     ("p", k % 5, "p", k % 5 + 10))
                    else:
                        conn.execute(f"DELETE FROM {s}.a WHERE id = %s", (k,))
                        conn.execute(f"DELETE FROM {s}.b WHERE k1 = %s AND k2 = %s", (rng.choice("pqr"), k % 5))
                        conn.execute(f"DELETE FROM {s}.c WHERE id = %s", (k,))


def same(src: PostgresSource, after: int, *, upto: int | None = None, max_changes: int,
         wanted_after: Mapping[str, int | None], spill_dir: Path | None = None) -> ColumnRead:
    got = src.read_columns(after, upto=upto, max_changes=max_changes, wanted_after=wanted_after, spill_dir=spill_dir,
                           spill_rows=50)
    assert got is not None
    positions: list[int] = []

    def wanted(table: str, lsn: int) -> bool:
        applied = wanted_after[table]
        return applied is not None and lsn > applied

    txs = src.read(after, upto=upto, max_changes=max_changes, wanted=wanted)
    positions = [tx.lsn for tx in txs for _ in tx.changes]
    expected = max(txs.end, txs[-1].lsn if txs else 0)
    assert got.transactions == len(txs)
    if txs.caught_up:  # both reads ran to the server's WAL end as of their call: WAL the server wrote in
        # between (a standby snapshot, another test's schema) moves only the second one's end
        assert max(after, txs[-1].lsn if txs else 0) <= got.lsn <= expected
    else:
        assert got.lsn == expected
    schemas = src.tables()
    want = {t: frame_from(txs, schemas, positions, only=t) for t in {c.table for tx in txs for c in tx.changes}}
    assert got.frame.num_rows == 0 and got.parts is not None
    parts = dict(got.parts)
    for table, spilled in (got.spilled or {}).items():  # read back as Spark reads it, with the figures
        rows = pq.read_table(spilled.path)
        rows = rows.filter(pc.less(rows["_tm_row"], spilled.rows_below))
        assert rows.schema.field("_tm_time").type == pa.timestamp("us", tz="UTC")  # an instant for Spark
        rows = rows.set_column(rows.schema.get_field_index("_tm_time"), "_tm_time", rows["_tm_time"].cast(pa.timestamp("us")))
        assert (spilled.count, spilled.first_row, spilled.last_row) == (
            rows.num_rows, rows["_tm_row"][0].as_py(), rows["_tm_row"][-1].as_py())
        assert (spilled.oldest, spilled.lsn) == (pc.min(rows["_tm_time"]).as_py(), rows["_tm_lsn"][-1].as_py())
        assert spilled.path.startswith(str(spill_dir))
        ops = rows["_tm_op"].to_pylist()
        assert spilled.counts == {"inserts": ops.count("insert"), "updates": ops.count("update"),
                                  "deletes": ops.count("delete"), "truncates": 0}
        parts[table] = rows.append_column("_tm_pos", rows["_tm_lsn"]).append_column(
            "_tm_table", pa.repeat(pa.scalar(table), rows.num_rows))
    assert set(parts) == set(want) and len(parts) == len(got.parts) + len(got.spilled or {})
    if spill_dir is not None and got.rows >= 50:
        assert got.spilled and not got.parts  # past spill_rows every table is spilled
    for table, part in parts.items():
        extra = set(part.column_names) - set(want[table].column_names)
        assert all(c.startswith("_tm_before_") for c in extra), extra  # REPLICA IDENTITY FULL: every column's
        names = ["_tm_row", "_tm_pos", "_tm_lsn", "_tm_time", "_tm_tx", "_tm_table", "_tm_op", "_tm_has_before",
                 *schemas[table].names, *(f"_tm_before_{k}" for k in schemas[table].key)]
        for name in names:
            a, b = part.column(name), want[table].column(name)
            assert a.type == b.type, (table, name)
            assert a.to_pylist() == b.to_pylist(), (table, name)
    return got


@pytest.mark.parametrize(("chunk", "spill"), [(65_536, False), (3, False), (3, True)])
def test_random_dml_reads_like_read(pg: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, chunk: int,
                                    spill: bool) -> None:
    """(``spill``: a read past 50 changes goes to Parquet files as it streams.)"""
    init = pg_decode.ColumnDecoder.__init__
    monkeypatch.setattr(pg_decode.ColumnDecoder, "__init__",
                        lambda self, *a, **kw: init(self, *a, **{**kw, "chunk_rows": chunk}))
    s = f"pc{chunk}{'s' if spill else ''}"
    spill_dir = tmp_path if spill else None
    with source(pg, s, *(t.format(s=s) for t in TABLES)) as src:
        rng = random.Random(11)
        random_dml(pg, s, rng, 120)
        tables = [f"{s}.a", f"{s}.b", f"{s}.c"]
        everything = same(src, 0, max_changes=10**9, wanted_after=dict.fromkeys(tables, 0))
        assert not everything.spilled
        if spill:
            everything = same(src, 0, max_changes=10**9, wanted_after=dict.fromkeys(tables, 0), spill_dir=tmp_path / "all")
            assert everything.spilled and not everything.parts
            parts = [pq.read_table(x.path) for x in everything.spilled.values()]
        else:
            parts = list((everything.parts or {}).values())
        lsns = sorted({lsn for p in parts for lsn in p["_tm_lsn"].to_pylist()})
        assert everything.transactions == len(lsns) >= 100
        assert {op for p in parts for op in p["_tm_op"].to_pylist()} == {"insert", "update", "delete"}
        for _ in range(25):
            after = rng.choice([0, *lsns])
            upto = rng.choice(lsns) if rng.random() < 0.3 else None
            wanted_after = {t: rng.choice([None, 0, rng.choice(lsns)]) if rng.random() < 0.4 else after for t in tables}
            same(src, after, upto=upto, max_changes=rng.choice([1, 7, 50, 10**9]), wanted_after=wanted_after,
                 spill_dir=spill_dir and spill_dir / str(_))


def test_what_only_read_carries_gives_none(pg: str) -> None:
    with source(pg, "pn", "CREATE TABLE pn.a (id int PRIMARY KEY, t text)", "CREATE TABLE pn.b (id int PRIMARY KEY)",
                "ALTER TABLE pn.a ALTER COLUMN t SET STORAGE EXTERNAL") as src:
        sql(pg, "INSERT INTO pn.a VALUES (1, 'x')")
        known = {"pn.a": 0, "pn.b": 0}
        first = src.read_columns(0, max_changes=10**9, wanted_after=known)
        assert first is not None and first.rows == 1
        lsn = first.lsn
        sql(pg, "INSERT INTO pn.b VALUES (1)")
        assert src.read_columns(lsn, max_changes=10**9, wanted_after={"pn.a": 0}) is None  # pn.b: new to the reader
        assert src.read_columns(lsn, max_changes=10**9, wanted_after={"pn.a": 0, "pn.b": None}).rows == 0  # type: ignore[union-attr]
        sql(pg, "TRUNCATE pn.b")
        assert src.read_columns(lsn, max_changes=10**9, wanted_after=known) is None
        lsn = src.read(lsn, max_changes=10**9)[-1].lsn
        sql(pg, f"UPDATE pn.a SET t = '{'y' * 10_000}' WHERE id = 1", "UPDATE pn.a SET id = 2 WHERE id = 1")
        assert src.read_columns(lsn, max_changes=10**9, wanted_after=known) is None  # the second UPDATE: TOAST unsent
        lsn = src.read(lsn, max_changes=10**9)[-1].lsn
        sql(pg, "ALTER TABLE pn.a ADD COLUMN n int")
        assert src.read_columns(lsn, max_changes=10**9, wanted_after=known) is None  # DDL, in order with the data
