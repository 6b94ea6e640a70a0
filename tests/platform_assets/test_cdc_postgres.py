"""Replicas of a real PostgreSQL (``wal_level=logical``, started by the test) kept by the cdc
processor on real Spark + Delta: the seed's examples, TOAST, an added column, SCD2, a new table,
an incompatible type change (paused, fixed, caught up), random DML in random transactions
concurrently with the snapshot, and SIGKILL between the Delta commit and the slot acknowledgement."""

from __future__ import annotations

import os
import random
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from lineage.spec.loader import load_lineage
from platform_assets.cdc.run import run_replicator
from platform_assets.dagster.cdc import pending
from platform_assets.engine.runner import Engine
from resources.core.settings import Settings
from resources.storage import delta_read
from tests.platform_assets.shop import tidemark

pytestmark = [pytest.mark.spark, pytest.mark.postgres]




def sql(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for s in statements:
            conn.execute(s)


def query(url: str, q: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(q).fetchall()


def setup(settings: Settings, root: Path, pg: str, name: str, *, options: str = "", maxstep: int = 1000) -> Settings:
    lineage = root / "lineage.yaml"
    lineage.write_text(f"cdc:\n  - name: {name}\n    dsn_env: TM_TEST_DSN\n    tables: [{name}.*]\n    schema: r_{name}\n"
                       f"    maxstep: {maxstep}\n" + (f"    options:\n{options}" if options else ""))
    os.environ["TM_TEST_DSN"] = pg
    return settings.with_(lineage=lineage)


def run(spark: Any, settings: Settings, name: str, *, until_caught_up: bool = True) -> list[Any]:
    eng = Engine(settings, load_lineage(settings.lineage), spark=spark)
    try:
        return list(run_replicator(eng, eng.lineage.replicators[name], until_caught_up=until_caught_up))
    finally:
        eng.close()


def replica(spark: Any, settings: Settings, table: str, cols: str, *, jvm_free: bool = True) -> list[tuple]:
    """The replica's rows through Spark; ``jvm_free``: the ``deltalake`` reader opens it too and
    counts as many rows (its DataFusion reader, which applies the deletion vectors new replicas have;
    no reader of it has type widening, which a widened column turns on)."""
    df = spark.read.format("delta").load(settings.table_path(table))
    if jvm_free:
        assert delta_read.count_rows(DeltaTable(settings.table_path(table))) == df.count(), table
    return sorted(tuple(r) for r in df.selectExpr(*cols.split(",")).collect())


def test_seed_examples_toast_added_column_and_scd2(spark, settings: Settings, tmp_path: Path, pg: str) -> None:
    sql(pg, "CREATE SCHEMA s1", "CREATE TABLE s1.customers (id int PRIMARY KEY, name varchar(50))",
        "CREATE TABLE s1.names (name varchar(50))", "ALTER TABLE s1.names REPLICA IDENTITY FULL",
        "CREATE TABLE s1.docs (id int PRIMARY KEY, doc text, n int)", "ALTER TABLE s1.docs ALTER doc SET STORAGE EXTERNAL",
        "CREATE TABLE s1.hist (id int PRIMARY KEY, v text)", "INSERT INTO s1.hist VALUES (1, 'a')")
    s = setup(settings, tmp_path, pg, "s1", options="      s1.hist: {scd: 2}\n")
    first = run(spark, s, "s1")
    assert first[0].snapshots == {"r_s1.s1__customers": 0, "r_s1.s1__names": 0, "r_s1.s1__docs": 0, "r_s1.s1__hist": 1}
    big = "".join(random.Random(1).choice("abcdefghij") for _ in range(20_000))
    sql(pg, "INSERT INTO s1.customers VALUES (0, 'alice')", "UPDATE s1.customers SET id = 1 WHERE id = 0",
        "UPDATE s1.customers SET id = 2 WHERE id = 1", "DELETE FROM s1.customers WHERE id = 2",
        "INSERT INTO s1.customers VALUES (0, 'Alice'), (1, 'blob')", "UPDATE s1.customers SET name = 'Bob' WHERE id = 1",
        "INSERT INTO s1.names VALUES ('alice'), ('alice'), ('Bob')", "UPDATE s1.names SET name = 'Alyce' WHERE name = 'alice'",
        "UPDATE s1.names SET name = 'Alice' WHERE name = 'Alyce'", "DELETE FROM s1.names WHERE name = 'Alice'",
        f"INSERT INTO s1.docs VALUES (1, '{big}', 0)", "UPDATE s1.docs SET n = 1 WHERE id = 1",
        "UPDATE s1.hist SET v = 'b' WHERE id = 1", "UPDATE s1.hist SET id = 2 WHERE id = 1")
    run(spark, s, "s1")
    sql(pg, "UPDATE s1.docs SET n = 2 WHERE id = 1", "ALTER TABLE s1.customers ADD COLUMN tier int",
        "UPDATE s1.customers SET tier = 3 WHERE id = 0")
    results = run(spark, s, "s1")
    assert replica(spark, s, "r_s1.s1__customers", "id,name,tier") == [(0, "Alice", 3), (1, "Bob", None)]
    assert replica(spark, s, "r_s1.s1__names", "name") == [("Bob",)]
    assert replica(spark, s, "r_s1.s1__docs", "id,n,length(doc)") == [(1, 2, 20_000)]
    assert replica(spark, s, "r_s1.s1__docs", "doc") == [(big,)]
    hist = replica(spark, s, "r_s1.s1__hist", "id,v,_is_current,_valid_to IS NULL")
    assert hist == [(1, "a", False, False), (1, "b", False, False), (2, "b", True, True)]
    assert any(r.tables.get("r_s1.s1__customers", {}).get("ddl") for r in results)
    slot = query(pg, "SELECT confirmed_flush_lsn >= pg_current_wal_lsn() - 1000000 FROM pg_replication_slots "
                     "WHERE slot_name = 'tidemark_s1'")
    assert slot == [(True,)]


def test_new_table_appears_and_an_incompatible_type_change_pauses_then_resumes(spark, settings: Settings, tmp_path: Path,
                                                                                pg: str, cli_spark) -> None:
    sql(pg, "CREATE SCHEMA s2", "CREATE TABLE s2.a (id int PRIMARY KEY, v int)", "INSERT INTO s2.a VALUES (1, 10)")
    s = setup(settings, tmp_path, pg, "s2")
    run(spark, s, "s2")
    sql(pg, "CREATE TABLE s2.b AS SELECT g AS id, g * 2 AS w FROM generate_series(1, 5) g", "ALTER TABLE s2.b ADD PRIMARY KEY (id)",
        "INSERT INTO s2.b VALUES (6, 12)", "ALTER TABLE s2.a ALTER COLUMN v TYPE text", "UPDATE s2.a SET v = 'ten' WHERE id = 1",
        "INSERT INTO s2.a VALUES (2, 'two')")
    results = run(spark, s, "s2")
    assert replica(spark, s, "r_s2.s2__b", "id,w") == [(i, 2 * i) for i in range(1, 7)]
    assert any("r_s2.s2__a" in r.paused for r in results)
    status = tidemark(s, "cdc", "status", env={"TM_TEST_DSN": pg})
    assert status.returncode == 0 and "PAUSED" in status.stdout and "changed type from int to string" in status.stdout, status.stdout
    assert replica(spark, s, "r_s2.s2__a", "id,v") == [(1, 10)]  # nothing after the change applied
    sql(pg, "INSERT INTO s2.b VALUES (7, 14)", "ALTER TABLE s2.b ALTER COLUMN w TYPE bigint",  # other tables go on; a
        "INSERT INTO s2.b VALUES (8, 1099511627776)")  # type Delta widens in place (the copy has type widening on)
    assert "typeWidening" not in str(DeltaTable(s.table_path("r_s2.s2__b")).protocol())
    run(spark, s, "s2")
    assert replica(spark, s, "r_s2.s2__b", "id,w", jvm_free=False)[-2:] == [(7, 14), (8, 2**40)]
    # the widening took type widening on, for this replica only (the deltalake reader refuses it now)
    assert "typeWidening" in str(DeltaTable(s.table_path("r_s2.s2__b")).protocol())
    assert "typeWidening" not in str(DeltaTable(s.table_path("r_s2.s2__a")).protocol())
    fix = tidemark(s, "cdc", "resume", "r_s2.s2__a", "--resync", env={"TM_TEST_DSN": pg})
    assert fix.returncode == 0, fix.stderr
    run(spark, s, "s2")
    assert replica(spark, s, "r_s2.s2__a", "id,v") == [(1, "ten"), (2, "two")]


def test_tables_renamed_or_dropped_between_runs_retire_their_replicas(spark, settings: Settings, tmp_path: Path,
                                                                      pg: str) -> None:
    """Under Dagster a table is renamed or dropped between two units, so the catalog the next unit
    reads no longer lists it: its replica is still found (by its record), the stream is read from
    its position, changes before the rename or drop land, and the rename or drop retires it."""
    sql(pg, "CREATE SCHEMA rn", "CREATE TABLE rn.a (id int PRIMARY KEY, v int)", "CREATE TABLE rn.c (id int PRIMARY KEY, v int)",
        "CREATE TABLE rn.d (id int PRIMARY KEY, v int)", "CREATE TABLE rn.e (id int PRIMARY KEY, v int)",
        "CREATE TABLE rn.m (x int)", "ALTER TABLE rn.m REPLICA IDENTITY FULL", "CREATE TABLE rn.x (id int PRIMARY KEY)",
        "INSERT INTO rn.a VALUES (1, 10)", "INSERT INTO rn.c VALUES (1, 10)", "INSERT INTO rn.d VALUES (1, 10)",
        "INSERT INTO rn.e VALUES (1, 10)", "INSERT INTO rn.m VALUES (1), (1)", "INSERT INTO rn.x VALUES (1)")
    s = setup(settings, tmp_path, pg, "rn")
    try:
        run(spark, s, "rn")
        sql(pg, "INSERT INTO rn.a VALUES (2, 20)", "ALTER TABLE rn.a RENAME TO b", "INSERT INTO rn.b VALUES (3, 30)",
            "UPDATE rn.c SET v = 11 WHERE id = 1", "INSERT INTO rn.c VALUES (2, 20)", "DROP TABLE rn.c",
            "INSERT INTO rn.d VALUES (2, 20)", "DROP TABLE rn.e", "INSERT INTO rn.m VALUES (1), (2)",
            "DELETE FROM rn.m WHERE ctid = (SELECT min(ctid) FROM rn.m WHERE x = 1)", "DROP TABLE rn.m")
        selected = s.lineage.read_text()
        s.lineage.write_text(selected + "    exclude: [rn.x]\n")  # rn.x leaves the selection: no rename or drop of it
        run(spark, s, "rn")
        assert replica(spark, s, "r_rn.rn__b", "id,v") == [(1, 10), (2, 20), (3, 30)]
        assert replica(spark, s, "r_rn.rn__c", "id,v") == [(1, 11), (2, 20)]  # kept (on_drop: keep) as it was dropped
        assert replica(spark, s, "r_rn.rn__d", "id,v") == [(1, 10), (2, 20)]
        assert DeltaTable.is_deltatable(s.table_path("r_rn.rn__d"))
        assert not DeltaTable.is_deltatable(s.table_path("r_rn.rn__a"))  # the old name's replica removed
        status = tidemark(s, "cdc", "status", env={"TM_TEST_DSN": pg})
        lines = {line.split()[0]: line for line in status.stdout.splitlines() if line.startswith("r_rn.")}
        assert all("DROPPED" in lines[f"r_rn.rn__{t}"] for t in "ace"), status.stdout
        assert replica(spark, s, "r_rn.rn__e", "id,v") == [(1, 10)]
        assert replica(spark, s, "r_rn.rn__m", "x") == [(1,), (1,), (2,)]  # a multiset: one of three 1s deleted
        assert "DROPPED" in lines["r_rn.rn__x"] and "no longer in the source's catalog or selection" in lines["r_rn.rn__x"], status.stdout
        assert "DROPPED" not in lines["r_rn.rn__b"] + lines["r_rn.rn__d"], status.stdout
        sql(pg, "UPDATE rn.b SET v = 31 WHERE id = 3", "INSERT INTO rn.d VALUES (3, 30)")
        run(spark, s, "rn")
        assert replica(spark, s, "r_rn.rn__b", "id,v") == [(1, 10), (2, 20), (3, 31)]
        assert replica(spark, s, "r_rn.rn__d", "id,v") == [(1, 10), (2, 20), (3, 30)]
        assert replica(spark, s, "r_rn.rn__c", "id,v") == [(1, 11), (2, 20)]
        # a dropped table created again (other columns), one dropped and created again between two runs, a
        # table renamed back to its old name: each replica follows the table there now
        sql(pg, "CREATE TABLE rn.c (id int PRIMARY KEY, w text)", "INSERT INTO rn.c VALUES (5, 'x')",
            "INSERT INTO rn.d VALUES (4, 40)", "DROP TABLE rn.d", "CREATE TABLE rn.d (id int PRIMARY KEY, v int)",
            "INSERT INTO rn.d VALUES (9, 90)", "ALTER TABLE rn.b RENAME TO a", "INSERT INTO rn.x VALUES (2)")
        s.lineage.write_text(selected)  # rn.x back in the selection
        run(spark, s, "rn")
        assert replica(spark, s, "r_rn.rn__c", "id,w") == [(5, "x")]
        assert replica(spark, s, "r_rn.rn__d", "id,v") == [(9, 90)]
        assert replica(spark, s, "r_rn.rn__a", "id,v") == [(1, 10), (2, 20), (3, 31)]
        status = tidemark(s, "cdc", "status", env={"TM_TEST_DSN": pg})
        lines = {line.split()[0]: line for line in status.stdout.splitlines() if line.startswith("r_rn.")}
        assert replica(spark, s, "r_rn.rn__x", "id") == [(1,), (2,)]
        assert all("DROPPED" not in lines[f"r_rn.rn__{t}"] for t in "acdx"), status.stdout
        assert "DROPPED" in lines["r_rn.rn__b"] and "DROPPED" in lines["r_rn.rn__e"], status.stdout
    finally:
        sql(pg, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE 'tidemark_rn%'")


def test_a_table_swap_and_a_case_only_rename_between_runs(spark, settings: Settings, tmp_path: Path, pg: str) -> None:
    """``a -> a_old; a_new -> a`` between two runs (a blue/green swap): each replica ends with its
    table's rows, none of the new ``a`` in ``a_old``'s; ``"Foo" -> foo`` keeps its one replica."""
    sql(pg, "CREATE SCHEMA sw", "CREATE TABLE sw.a (id int PRIMARY KEY, v int)", "CREATE TABLE sw.a_new (id int PRIMARY KEY, v int)",
        'CREATE TABLE sw."Foo" (id int PRIMARY KEY, v int)', "INSERT INTO sw.a VALUES (1, 10)",
        "INSERT INTO sw.a_new VALUES (5, 50)", 'INSERT INTO sw."Foo" VALUES (1, 1)')
    s = setup(settings, tmp_path, pg, "sw")
    try:
        run(spark, s, "sw")
        sql(pg, "INSERT INTO sw.a VALUES (2, 20)", "INSERT INTO sw.a_new VALUES (6, 60)", "ALTER TABLE sw.a RENAME TO a_old",
            "ALTER TABLE sw.a_new RENAME TO a", "INSERT INTO sw.a VALUES (7, 70)", "UPDATE sw.a_old SET v = 11 WHERE id = 1",
            'INSERT INTO sw."Foo" VALUES (2, 2)', 'ALTER TABLE sw."Foo" RENAME TO foo', "INSERT INTO sw.foo VALUES (3, 3)")
        run(spark, s, "sw")
        assert replica(spark, s, "r_sw.sw__a_old", "id,v") == [(1, 11), (2, 20)]
        assert replica(spark, s, "r_sw.sw__a", "id,v") == [(5, 50), (6, 60), (7, 70)]
        assert replica(spark, s, "r_sw.sw__foo", "id,v") == [(1, 1), (2, 2), (3, 3)]
        status = tidemark(s, "cdc", "status", env={"TM_TEST_DSN": pg})
        lines = {line.split()[0]: line for line in status.stdout.splitlines() if line.startswith("r_sw.")}
        assert "DROPPED" in lines["r_sw.sw__a_new"], status.stdout
        assert all("DROPPED" not in lines[f"r_sw.sw__{t}"] for t in ("a", "a_old", "foo")), status.stdout
        sql(pg, "INSERT INTO sw.a VALUES (8, 80)", "INSERT INTO sw.a_old VALUES (3, 30)")
        run(spark, s, "sw")
        assert replica(spark, s, "r_sw.sw__a_old", "id,v") == [(1, 11), (2, 20), (3, 30)]
        assert replica(spark, s, "r_sw.sw__a", "id,v") == [(5, 50), (6, 60), (7, 70), (8, 80)]
    finally:
        sql(pg, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE 'tidemark_sw%'")


def _slots(pg: str, like: str) -> dict[str, tuple[int, int]]:
    """slot name -> (confirmed_flush, restart) LSNs as numbers."""
    rows = query(pg, "SELECT slot_name, confirmed_flush_lsn - '0/0', restart_lsn - '0/0' FROM pg_replication_slots "
                     f"WHERE slot_name LIKE '{like}'")
    return {r[0]: (int(r[1]), int(r[2])) for r in rows}


def test_a_paused_replica_is_parked_on_its_own_slot_and_catches_up_when_resumed(spark, settings: Settings, tmp_path: Path,
                                                                               pg: str, cli_spark) -> None:
    sql(pg, "CREATE SCHEMA s7", "CREATE TABLE s7.a (id int PRIMARY KEY, v int)", "CREATE TABLE s7.b (id int PRIMARY KEY, w int)",
        "INSERT INTO s7.a VALUES (1, 1)", "INSERT INTO s7.b VALUES (1, 1)")
    s = setup(settings, tmp_path, pg, "s7", maxstep=300)
    run(spark, s, "s7")
    env = {"TM_TEST_DSN": pg}
    assert tidemark(s, "cdc", "pause", "r_s7.s7__a", "--reason", "test", env=env).returncode == 0
    # while paused: its table changes (rows, a new column, more rows), and much WAL is written for the other
    sql(pg, "INSERT INTO s7.a SELECT g, g FROM generate_series(2, 400) g", "ALTER TABLE s7.a ADD COLUMN note text",
        "UPDATE s7.a SET note = 'n' || id WHERE id % 7 = 0", "DELETE FROM s7.a WHERE id % 11 = 0",
        "INSERT INTO s7.b SELECT g, g FROM generate_series(2, 20000) g",
        "CHECKPOINT")  # a running-transactions record past it: where PostgreSQL may move a slot's restart position
    results = run(spark, s, "s7")
    assert sum(r.changes for r in results) == 19_999  # b's rows only
    parked = _slots(pg, "tidemark_s7_p_%")
    assert len(parked) == 1, parked
    (parked_at, parked_restart), = parked.values()
    main_at, main_restart = _slots(pg, "tidemark_s7")["tidemark_s7"]
    # the main slot moved on past all of it: no read of b decodes the WAL the pause holds
    assert main_at > parked_at and main_restart > parked_restart
    status = tidemark(s, "cdc", "status", env=env)
    assert f"parked slot {next(iter(parked))} of r_s7.s7__a" in status.stdout and "PAUSED" in status.stdout, status.stdout
    assert replica(spark, s, "r_s7.s7__a", "id,v") == [(1, 1)]

    rep = load_lineage(s.lineage).replicators["s7"]
    assert tidemark(s, "cdc", "resume", "r_s7.s7__a", env=env).returncode == 0
    assert pending(s, rep) == (True, "r_s7.s7__a catching up from a parked slot")  # the sensor requests a run
    sql(pg, "UPDATE s7.a SET v = -v WHERE id < 5", "INSERT INTO s7.b VALUES (20001, 1)")  # after the main slot's position
    results = run(spark, s, "s7")
    assert len(results) >= 2, [r.reason for r in results]  # maxstep 300: the catch-up took more than one unit
    assert _slots(pg, "tidemark_s7_p_%") == {}  # caught up: its parked slot is gone, it follows the main slot
    want = sorted(query(pg, "SELECT id, v, note FROM s7.a"))
    assert replica(spark, s, "r_s7.s7__a", "id,v,note") == want
    assert len(replica(spark, s, "r_s7.s7__b", "id")) == 20_001
    sql(pg, "UPDATE s7.a SET v = 0 WHERE id = 2")  # it follows the main slot again
    run(spark, s, "s7")
    assert replica(spark, s, "r_s7.s7__a", "id,v,note") == sorted(query(pg, "SELECT id, v, note FROM s7.a"))
    # paused and copied again: its parked slot goes with the old copy
    assert tidemark(s, "cdc", "pause", "r_s7.s7__a", env=env).returncode == 0
    run(spark, s, "s7")
    assert len(_slots(pg, "tidemark_s7_p_%")) == 1
    assert tidemark(s, "cdc", "resume", "r_s7.s7__a", "--resync", env=env).returncode == 0
    run(spark, s, "s7")
    assert _slots(pg, "tidemark_s7_p_%") == {}
    assert replica(spark, s, "r_s7.s7__a", "id,v,note") == sorted(query(pg, "SELECT id, v, note FROM s7.a"))
    # parked, then its slot dropped by hand while the main slot moves on: the replica does not follow the main
    # slot past changes it lacks; it stays paused, asking for a new copy
    assert tidemark(s, "cdc", "pause", "r_s7.s7__a", env=env).returncode == 0
    run(spark, s, "s7")
    (gone,) = _slots(pg, "tidemark_s7_p_%")
    sql(pg, "INSERT INTO s7.b VALUES (20002, 2)")
    run(spark, s, "s7")  # the main slot moves on (a unit writes no WAL of its own: only a change moves it)
    sql(pg, f"SELECT pg_drop_replication_slot('{gone}')", "UPDATE s7.a SET v = 99 WHERE id = 3")
    run(spark, s, "s7")
    assert tidemark(s, "cdc", "resume", "r_s7.s7__a", env=env).returncode == 0
    run(spark, s, "s7")
    status = tidemark(s, "cdc", "status", env=env).stdout
    assert "no longer kept by the server" in status and "--resync" in status, status
    assert (3, 99) not in replica(spark, s, "r_s7.s7__a", "id,v")
    assert tidemark(s, "cdc", "resume", "r_s7.s7__a", "--resync", env=env).returncode == 0
    run(spark, s, "s7")
    assert replica(spark, s, "r_s7.s7__a", "id,v,note") == sorted(query(pg, "SELECT id, v, note FROM s7.a"))
    # parked, then its table dropped in the source: the parked slot goes, the replica is kept and marked dropped
    assert tidemark(s, "cdc", "pause", "r_s7.s7__a", env=env).returncode == 0
    run(spark, s, "s7")
    sql(pg, "DROP TABLE s7.a", "INSERT INTO s7.b VALUES (20003, 3)")
    run(spark, s, "s7")
    assert _slots(pg, "tidemark_s7_p_%") == {}
    status = tidemark(s, "cdc", "status", env=env).stdout
    assert any("r_s7.s7__a" in line and "DROPPED" in line for line in status.splitlines()), status
    assert len(replica(spark, s, "r_s7.s7__b", "id")) == 20_003


def _random_dml(pg: str, schema: str, seed: int, txs: int, stop: threading.Event | None = None, *,
                keyed_only: bool = False) -> None:
    """Random transactions on ``schema.k`` (keyed) and ``schema.m`` (no key, TRUNCATEs); ``keyed_only``:
    on ``k`` alone."""
    rnd = random.Random(seed)
    with psycopg.connect(pg, autocommit=True) as conn:
        for _ in range(txs):
            if stop is not None and stop.is_set():
                return
            with conn.transaction():
                for _ in range(rnd.randint(1, 6)):
                    k = rnd.randint(1, 60)
                    op = rnd.random()
                    if op < 0.35:
                        conn.execute(f"INSERT INTO {schema}.k VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET v = EXCLUDED.v",
                                     (k, rnd.randint(0, 9)))
                        if not keyed_only:
                            conn.execute(f"INSERT INTO {schema}.m VALUES (%s)", (rnd.randint(0, 5),))
                    elif op < 0.6:
                        conn.execute(f"UPDATE {schema}.k SET v = v + 1 WHERE id = %s", (k,))
                        if not keyed_only:
                            conn.execute(f"UPDATE {schema}.m SET x = x + 1 WHERE ctid IN (SELECT ctid FROM {schema}.m "
                                     f"WHERE x = %s LIMIT 1)", (rnd.randint(0, 5),))
                    elif op < 0.75:  # key change (skipped when the new key is taken)
                        conn.execute(f"UPDATE {schema}.k SET id = %s WHERE id = %s AND NOT EXISTS "
                                     f"(SELECT 1 FROM {schema}.k WHERE id = %s)", (k + 100, k, k + 100))
                    elif op < 0.97:
                        conn.execute(f"DELETE FROM {schema}.k WHERE id = %s", (k,))
                        if not keyed_only:
                            conn.execute(f"DELETE FROM {schema}.m WHERE ctid IN (SELECT ctid FROM {schema}.m WHERE x = %s "
                                     f"LIMIT 1)", (rnd.randint(0, 5),))
                    elif not keyed_only:
                        conn.execute(f"TRUNCATE {schema}.m")


def _equal(spark: Any, s: Settings, pg: str, schema: str) -> None:
    _equal_k(spark, s, pg, schema)
    got = Counter(r[0] for r in replica(spark, s, f"r_{schema}.{schema}__m", "x"))
    assert got == Counter(r[0] for r in query(pg, f"SELECT x FROM {schema}.m"))



def test_a_numeric_nan_pauses_only_its_replica_naming_the_column(spark, settings: Settings, tmp_path: Path, pg: str) -> None:
    """PostgreSQL ``numeric`` holds NaN and Infinity; a Delta decimal cannot. A change carrying one
    pauses its replica with the column and value named (before: every unit of the replicator ended
    in a bare ``ArrowInvalid``, forever); a new table holding one at its copy pauses alike; the
    other replicas go on."""
    sql(pg, "CREATE SCHEMA s9", "CREATE TABLE s9.a (id int PRIMARY KEY, v numeric(10,2), w numeric)",
        "CREATE TABLE s9.b (id int PRIMARY KEY, v int)", "INSERT INTO s9.a VALUES (1, 1.5, 2.5)", "INSERT INTO s9.b VALUES (1, 1)")
    s = setup(settings, tmp_path, pg, "s9")
    run(spark, s, "s9")
    sql(pg, "INSERT INTO s9.a VALUES (2, 'NaN', 2)", "INSERT INTO s9.b VALUES (2, 2)")
    [res, *_] = run(spark, s, "s9")
    why = res.paused["r_s9.s9__a"]
    assert "column v (decimal(10,2))" in why and "NaN" in why and "tidemark cdc resume r_s9.s9__a" in why, why
    assert res.tables["r_s9.s9__b"]["inserts"] == 1
    sql(pg, "INSERT INTO s9.b VALUES (3, 3)", "CREATE TABLE s9.c (id int PRIMARY KEY, v numeric)",
        "INSERT INTO s9.c VALUES (1, 'Infinity')")
    results = run(spark, s, "s9")
    paused = {k: v for r in results for k, v in r.paused.items()}
    assert "s9.c.v (" in paused.get("r_s9.s9__c", "") and "copying it failed" in paused["r_s9.s9__c"], paused
    assert replica(spark, s, "r_s9.s9__b", "id,v") == [(1, 1), (2, 2), (3, 3)]
    assert replica(spark, s, "r_s9.s9__a", "id") == [(1,)]  # nothing after the refused change applied

@pytest.mark.slow
def test_random_dml_concurrent_with_the_snapshot_ends_equal(spark, settings: Settings, tmp_path: Path, pg: str) -> None:
    seed = int(os.environ.get("TIDEMARK_CDC_SEED", random.randrange(10_000)))
    print(f"seed {seed}")
    sql(pg, "CREATE SCHEMA s3", "CREATE TABLE s3.k (id int PRIMARY KEY, v int)", "CREATE TABLE s3.m (x int)",
        "ALTER TABLE s3.m REPLICA IDENTITY FULL")
    _random_dml(pg, "s3", seed, 40)
    s = setup(settings, tmp_path, pg, "s3", maxstep=60)  # about 5 units: unit boundaries inside the concurrent DML
    stop = threading.Event()
    writer = threading.Thread(target=_random_dml, args=(pg, "s3", seed + 1, 200, stop))
    writer.start()
    try:
        run(spark, s, "s3", until_caught_up=False)  # the snapshot while the writer commits
    finally:
        writer.join()
    _random_dml(pg, "s3", seed + 2, 60)
    run(spark, s, "s3")
    _equal(spark, s, pg, "s3")


@pytest.mark.slow
def test_sigkill_between_the_delta_commit_and_the_slot_ack(settings: Settings, tmp_path: Path, pg: str, spark, cli_spark) -> None:
    sql(pg, "CREATE SCHEMA s4", "CREATE TABLE s4.k (id int PRIMARY KEY, v int)", "CREATE TABLE s4.m (x int)",
        "ALTER TABLE s4.m REPLICA IDENTITY FULL")
    s = setup(settings, tmp_path, pg, "s4", maxstep=40)
    env = {"TM_TEST_DSN": pg}
    first = tidemark(s, "cdc", "run", "s4", env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    rnd = random.Random(4)
    kills = 0
    # each point once (each kill costs a process, ~20 s in CI); the columnar test below
    # kills keyed replicas at the same points again
    for i, point in enumerate(["cdc-committed", "cdc-written", "cdc-planned"]):
        _random_dml(pg, "s4", 100 + i, 20)
        crashed = tidemark(s, "cdc", "run", "s4", env={**env, "TIDEMARK_CRASH_AT": point})
        # a run that redoes the unit a previous kill left planned passes no "cdc-planned" point: it may finish
        assert crashed.returncode in (0, -signal.SIGKILL), (point, crashed.stdout, crashed.stderr[-2000:])
        kills += crashed.returncode == -signal.SIGKILL
        if rnd.random() < 0.5:
            _random_dml(pg, "s4", 200 + i, 5)
    assert kills >= 2  # the run after cdc-written may redo that unit and pass no cdc-planned point
    done = tidemark(s, "cdc", "run", "s4", "--until-caught-up", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    _equal(spark, s, pg, "s4")
    slot = query(pg, "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'tidemark_s4'")[0][0]
    assert slot is not None  # acknowledged after the last commit


@pytest.mark.slow
def test_keyed_replicas_take_the_columnar_path_and_end_equal_after_sigkills(settings: Settings, tmp_path: Path, pg: str,
                                                                           spark, monkeypatch: pytest.MonkeyPatch, cli_spark) -> None:
    """Keyed tables only: units read as Arrow columns (``read_columns``) and reduced on columns, with
    key changes, also spilled to Parquet and reduced in Spark (``TIDEMARK_CDC_SPILL_ROWS``); killed at
    each crash point of a unit, spilling or not, then run to the end: equal to the source."""
    from lineage.cdc import columns as cdc_columns
    from platform_assets.cdc import scd1 as cdc_scd1

    sql(pg, "CREATE SCHEMA s8", "CREATE TABLE s8.k (id int PRIMARY KEY, v int)")
    s = setup(settings, tmp_path, pg, "s8", maxstep=30)
    env = {"TM_TEST_DSN": pg}
    assert tidemark(s, "cdc", "run", "s8", env=env).returncode == 0  # the snapshot
    calls = {"reduce_scd1": 0, "apply_scd1_spilled": 0, "apply_scd1": 0}
    for module, name in ((cdc_columns, "reduce_scd1"), (cdc_scd1, "apply_scd1_spilled"), (cdc_scd1, "apply_scd1")):
        monkeypatch.setattr(module, name, _counted(getattr(module, name), name, calls))
    _random_dml(pg, "s8", 80, 40, keyed_only=True)
    run(spark, s, "s8")
    assert calls["reduce_scd1"] >= 3 and calls["apply_scd1_spilled"] == calls["apply_scd1"] == 0  # never the Python path
    _equal_k(spark, s, pg, "s8")
    monkeypatch.setenv("TIDEMARK_CDC_SPILL_ROWS", "10")
    _random_dml(pg, "s8", 81, 40, keyed_only=True)
    run(spark, s, "s8")
    assert calls["apply_scd1_spilled"] >= 3  # units past 10 changes: reduced in Spark from the spilled Parquet
    assert calls["apply_scd1"] == 0
    _equal_k(spark, s, pg, "s8")
    assert not (Path(s.warehouse) / "_tidemark_spill" / "s8").exists()  # removed after each unit
    kills = 0
    for i, (point, spill) in enumerate([("cdc-planned", "10"), ("cdc-written", "10"), ("cdc-committed", "10"),
                                        ("cdc-written", "1000000")]):
        _random_dml(pg, "s8", 300 + i, 25, keyed_only=True)
        crashed = tidemark(s, "cdc", "run", "s8", env={**env, "TIDEMARK_CRASH_AT": point, "TIDEMARK_CDC_SPILL_ROWS": spill})
        assert crashed.returncode in (0, -signal.SIGKILL), (point, crashed.stdout, crashed.stderr[-2000:])
        kills += crashed.returncode == -signal.SIGKILL
        if point == "cdc-written":  # the redone unit finds its write landed; --until-caught-up goes on past it
            done = tidemark(s, "cdc", "run", "s8", "--until-caught-up", env={**env, "TIDEMARK_CDC_SPILL_ROWS": spill})
            assert done.returncode == 0, done.stderr[-3000:]
            _equal_k(spark, s, pg, "s8")
    assert kills >= 3
    done = tidemark(s, "cdc", "run", "s8", "--until-caught-up", env={**env, "TIDEMARK_CDC_SPILL_ROWS": "10"})
    assert done.returncode == 0, done.stderr[-3000:]
    _equal_k(spark, s, pg, "s8")


def _counted(f: Any, name: str, calls: dict[str, int]) -> Any:
    def counted(*a: Any, **kw: Any) -> Any:
        calls[name] += 1
        return f(*a, **kw)

    return counted


def _equal_k(spark: Any, s: Settings, pg: str, schema: str) -> None:
    assert replica(spark, s, f"r_{schema}.{schema}__k", "id,v") == sorted(query(pg, f"SELECT id, v FROM {schema}.k"))


def test_replicas_are_dagster_assets_run_by_the_slot_sensor_with_metadata_and_checks(spark, settings: Settings, tmp_path: Path,
                                                                                       pg: str, dagster_storage) -> None:
    import dagster as dg

    from platform_assets.dagster.cdc import pending
    from platform_assets.dagster.definitions import build_definitions
    from platform_assets.dagster.local_daemon import run_until_idle

    sql(pg, "CREATE SCHEMA s5", "CREATE TABLE s5.t (id int PRIMARY KEY, v int)", "INSERT INTO s5.t VALUES (1, 1)",
        "CREATE TABLE s5.u (id int PRIMARY KEY)")  # (untouched below: its checks are still reported)
    s = setup(settings, tmp_path, pg, "s5")
    run(spark, s, "s5")  # the first copy (its replica is then known to the code location)
    with dg.instance_for_test(overrides=dagster_storage) as instance:
        defs = build_definitions(s)
        assert defs.resolve_assets_def(dg.AssetKey(["r_s5", "s5__t"])) is not None
        # Caught up: no run. The server writes WAL of its own too (a checkpoint's full-page images,
        # autovacuum); when that lands between the copy and the tick, the sensor may start a run,
        # which must then apply nothing and move the slot on so the next tick stays idle.
        for _ in range(3):
            runs, why = run_until_idle(defs, instance, log_level="WARNING", sensor_name="tidemark_cdc")
            assert all(r.success and r.metadata.get("inserts", 0) == r.metadata.get("updates", 0) ==
                       r.metadata.get("deletes", 0) == 0 for r in runs), runs
            if not runs:
                break
        assert runs == [] and "s5: caught up" in why, why
        # WAL outside the selection: the sensor starts a run, which applies nothing, succeeds, and still
        # reports its replicas' checks. The server's own WAL (autovacuum of the dropped table's catalog
        # rows, a checkpoint) may land after that run moved the slot on: then the next tick starts
        # another such run, which must be as empty.
        sql(pg, "CREATE TABLE public.s5_noise AS SELECT g FROM generate_series(1, 5000) g", "DROP TABLE public.s5_noise")
        runs, why = run_until_idle(defs, instance, log_level="WARNING", sensor_name="tidemark_cdc")
        assert 1 <= len(runs) <= 3, runs
        assert all(r.success and r.checks == {"state": True, "lag": True} for r in runs), runs
        assert not any(r.metadata for r in runs), runs  # nothing materialized
        sql(pg, "INSERT INTO s5.t VALUES (2, 2)", "UPDATE s5.t SET v = 5 WHERE id = 1")
        assert pending(s, load_lineage(s.lineage).replicators["s5"])[0]
        runs, why = run_until_idle(defs, instance, log_level="WARNING", sensor_name="tidemark_cdc")
        assert 1 <= len(runs) <= 3 and all(r.success for r in runs), runs  # (then empty runs, as above)
        assert (runs[0].metadata["inserts"], runs[0].metadata["updates"]) == (1, 1)
        assert not any(r.metadata for r in runs[1:]), runs
        assert all(r.checks == {"state": True, "lag": True} for r in runs), runs
        sql(pg, "ALTER TABLE s5.t ALTER COLUMN v TYPE text", "UPDATE s5.t SET v = 'x'")
        runs, _ = run_until_idle(defs, instance, log_level="WARNING", sensor_name="tidemark_cdc")
        assert runs and runs[0].checks["state"] is False  # paused: the alert sensor alerts on it
    assert replica(spark, s, "r_s5.s5__t", "id,v") == [(1, 5), (2, 2)]


def test_an_unreachable_source_is_retried_with_backoff_then_fails_clearly(settings: Settings, tmp_path: Path) -> None:
    from resources.state.local_pg import free_port

    s = setup(settings, tmp_path, f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere", "s6")
    eng = Engine(s, load_lineage(s.lineage))
    waits: list[float] = []
    try:
        with pytest.raises(Exception, match="cannot connect to PostgreSQL") as err:
            list(run_replicator(eng, eng.lineage.replicators["s6"], retries=3, sleep=waits.append))
        assert waits == [2.0, 4.0, 8.0]
        assert "Fix:" in str(err.value)
        rec = eng.store.get("cdc:s6")
        assert rec is not None and rec.state.startswith("failing: cannot connect")
    finally:
        eng.close()
