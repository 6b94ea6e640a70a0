"""The cdc processor end to end on real Spark + Delta, fed by the Debezium JSON file source: the
seed's examples, transactions never split, a lost offset store, SIGKILL between the Delta commit
and the offset commit. (The PostgreSQL source runs the same processor in test_cdc_postgres.py.)"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lineage.spec.loader import load_lineage
from platform_assets.cdc.run import run_replicator
from platform_assets.engine.runner import Engine
from resources.core.settings import Settings
from resources.storage.meta_tables import read_etl_log
from tests.platform_assets.shop import tidemark

pytestmark = pytest.mark.spark
MS = 1_767_225_600_000  # 2026-01-01


def event(table: str, op: str, tx: int, *, after: dict | None = None, before: dict | None = None,
          key: dict | None = None) -> str:
    payload = {"op": op, "before": before, "after": after, "ts_ms": MS + tx * 1000,
               "source": {"connector": "postgresql", "schema": "public", "table": table, "txId": tx, "lsn": tx * 100}}
    return json.dumps({"key": key, "value": {"payload": payload}} if key is not None else {"payload": payload})


def customers_events() -> list[str]:
    """The seed's 'with primary key' example as Debezium writes it (key changes: delete + create)."""
    k = lambda i: {"id": i}  # noqa: E731
    return [event("customers", "c", 1, after={"id": 0, "name": "alice"}, key=k(0)),
            event("customers", "u", 2, before={"id": 0, "name": "alice"}, after={"id": 1, "name": "alice"}, key=k(1)),
            event("customers", "u", 3, before={"id": 1, "name": "alice"}, after={"id": 2, "name": "alice"}, key=k(2)),
            event("customers", "d", 4, before={"id": 2, "name": "alice"}, key=k(2)),
            event("customers", "c", 5, after={"id": 0, "name": "Alice"}, key=k(0)),
            event("customers", "c", 5, after={"id": 1, "name": "blob"}, key=k(1)),
            event("customers", "u", 6, before={"id": 1, "name": "blob"}, after={"id": 1, "name": "Bob"}, key=k(1))]


def names_events() -> list[str]:
    """The seed's 'without primary key' example (REPLICA IDENTITY FULL: whole old rows)."""
    u = lambda tx, a, b: event("names", "u", tx, before={"name": a}, after={"name": b})  # noqa: E731
    return [event("names", "c", 10, after={"name": "alice"}), event("names", "c", 10, after={"name": "alice"}),
            event("names", "c", 10, after={"name": "Bob"}), u(11, "alice", "Alyce"), u(11, "alice", "Alyce"),
            u(12, "Alyce", "Alice"), u(12, "Alyce", "Alice"), event("names", "d", 13, before={"name": "Alice"}),
            event("names", "d", 13, before={"name": "Alice"})]


def setup(settings: Settings, root: Path, *, maxstep: int = 1000) -> Settings:
    (root / "events").mkdir(parents=True, exist_ok=True)
    lineage = root / "lineage.yaml"
    lineage.write_text(f"cdc:\n  - name: shop\n    source: debezium\n    path: events\n    tables: [public.*]\n"
                       f"    maxstep: {maxstep}\n    options:\n      public.customers: {{key: [id]}}\n")
    return settings.with_(lineage=lineage)


def write_events(root: Path, name: str, lines: list[str]) -> None:
    (root / "events" / name).write_text("".join(line + "\n" for line in lines))


def engine(spark: Any, settings: Settings) -> Engine:
    return Engine(settings, load_lineage(settings.lineage), spark=spark)


def replica(spark: Any, settings: Settings, table: str, *cols: str) -> list[tuple]:
    """The replica's rows through Spark, checked equal to what the JVM-free ``deltalake`` reader sees
    (its DataFusion reader when the replica has deletion vectors, as new replicas do)."""
    from deltalake import DeltaTable

    from resources.storage import delta_read

    rows = sorted(tuple(r) for r in spark.read.format("delta").load(settings.table_path(table)).select(*cols).collect())
    jvm_free = delta_read.read_rows(DeltaTable(settings.table_path(table)), cols).to_pylist()
    assert sorted((tuple(r[c] for c in cols) for r in jvm_free), key=repr) == sorted(rows, key=repr), table
    return rows


def run(spark: Any, settings: Settings) -> list[Any]:
    eng = engine(spark, settings)
    try:
        rep = eng.lineage.replicators["shop"]
        return list(run_replicator(eng, rep, until_caught_up=True))
    finally:
        eng.close()


def test_seed_examples_replicated_exactly_once_and_resumed(spark, settings: Settings, tmp_path: Path) -> None:
    s = setup(settings, tmp_path)
    write_events(tmp_path, "0001.json", customers_events() + names_events())
    results = run(spark, s)
    assert results[0].tables["replica.customers"]["inserts"] >= 3 and results[-1].processed is False
    assert replica(spark, s, "replica.customers", "id", "name") == [(0, "Alice"), (1, "Bob")]
    assert replica(spark, s, "replica.names", "name") == [("Bob",)]
    # nothing new: nothing applied again; then a new file: only its events
    assert not run(spark, s)[0].processed
    write_events(tmp_path, "0002.json", [event("names", "c", 20, after={"name": "Bob"}),
                                         event("customers", "d", 21, before={"id": 0, "name": "Alice"}, key={"id": 0})])
    run(spark, s)
    assert replica(spark, s, "replica.customers", "id", "name") == [(1, "Bob")]
    assert replica(spark, s, "replica.names", "name", "_copy") == [("Bob", 1), ("Bob", 2)]
    log = [e for e in read_etl_log(s, limit=50) if e["processor"] == "cdc"]
    assert {e["topic"] for e in log} == {"replica.customers", "replica.names"}
    # a lost offset store: the replicas' Delta logs say what landed; nothing is applied twice
    lost = s.with_(offsets_url=f"sqlite:///{tmp_path / 'fresh-offsets.db'}")
    assert not run(spark, lost)[0].processed
    write_events(tmp_path, "0003.json", [event("names", "c", 30, after={"name": "Cy"})])
    run(spark, lost)
    assert Counter(r[0] for r in replica(spark, s, "replica.names", "name")) == {"Bob": 2, "Cy": 1}
    seqs = [r[0] for r in replica(spark, s, "replica.names", "_sequence_num")]
    assert max(seqs) == 19  # numbered above every change the replicas recorded, though the store started empty


def test_a_unit_never_splits_a_transaction(spark, settings: Settings, tmp_path: Path) -> None:
    """The seed's Transactions example with a limit (3) that falls inside the first transaction."""
    s = setup(settings, tmp_path, maxstep=3)
    k = lambda i: {"id": i}  # noqa: E731
    write_events(tmp_path, "0001.json", [
        event("customers", "c", 123, after={"id": 0, "name": "alice"}, key=k(0)),
        event("customers", "c", 123, after={"id": 1, "name": "bob"}, key=k(1)),
        event("customers", "u", 123, after={"id": 0, "name": "Alice"}, key=k(0)),
        event("customers", "u", 123, after={"id": 1, "name": "Bob"}, key=k(1)),
        event("customers", "d", 456, before={"id": 1}, key=k(1)),
        event("customers", "c", 456, after={"id": 1, "name": "Bobby"}, key=k(1))])
    eng = engine(spark, s)
    try:
        units = run_replicator(eng, eng.lineage.replicators["shop"])
        first = next(units)
    finally:
        eng.close()
    assert first.transactions == 1 and first.changes == 4  # all of tx123, none of tx456
    assert replica(spark, s, "replica.customers", "id", "name") == [(0, "Alice"), (1, "Bob")]
    run(spark, s)
    assert replica(spark, s, "replica.customers", "id", "name") == [(0, "Alice"), (1, "Bobby")]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["cdc-written", "cdc-committed"])
def test_sigkill_after_the_delta_commit_neither_loses_nor_doubles(settings: Settings, tmp_path: Path, spark, point: str, cli_spark) -> None:
    s = setup(settings, tmp_path)
    write_events(tmp_path, "0001.json", customers_events() + names_events())
    crashed = tidemark(s, "cdc", "run", "shop", env={"TIDEMARK_CRASH_AT": point})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    done = tidemark(s, "cdc", "run", "shop", "--until-caught-up")
    assert done.returncode == 0, done.stderr[-3000:]
    assert replica(spark, s, "replica.customers", "id", "name") == [(0, "Alice"), (1, "Bob")]
    assert replica(spark, s, "replica.names", "name", "_copy") == [("Bob", 1)]
    status = tidemark(s, "cdc", "status")
    assert status.returncode == 0 and "REPLICATING" in status.stdout, status.stdout + status.stderr


def test_a_change_a_replica_cannot_take_pauses_only_that_replica(spark, settings: Settings, tmp_path: Path, cli_spark) -> None:
    s = setup(settings, tmp_path)
    write_events(tmp_path, "0001.json", [
        event("names", "c", 1, after={"name": "a"}),
        event("names", "u", 2, after={"name": "b"}),  # no old row: a table without a key cannot find its copy
        event("customers", "c", 3, after={"id": 1, "name": "x"}, key={"id": 1})])
    results = run(spark, s)
    assert "replica.names" in results[0].paused and "REPLICA IDENTITY FULL" in results[0].paused["replica.names"]
    assert replica(spark, s, "replica.customers", "id", "name") == [(1, "x")]  # the others go on
    status = tidemark(s, "cdc", "status")
    assert "PAUSED" in status.stdout and "tidemark cdc resume replica.names" in status.stdout, status.stdout


def test_change_feed_as_the_options_say_also_when_they_change(spark, settings: Settings, tmp_path: Path) -> None:
    """``change_feed: false`` makes replicas without Delta's Change Data Feed; set back to true, the
    next unit turns it on for the existing replica (a view joining it can read its changes again)."""
    from deltalake import DeltaTable

    def feed(s: Settings) -> str | None:
        return DeltaTable(s.table_path("replica.customers")).metadata().configuration.get("delta.enableChangeDataFeed")

    s = setup(settings, tmp_path)
    lineage = s.lineage.read_text()
    s.lineage.write_text(lineage.replace("    options:", "    change_feed: false\n    options:"))
    write_events(tmp_path, "0001.json", customers_events())
    run(spark, s)
    assert feed(s) == "false"
    assert replica(spark, s, "replica.customers", "id", "name") == [(0, "Alice"), (1, "Bob")]
    s.lineage.write_text(lineage)
    write_events(tmp_path, "0002.json", [event("customers", "c", 30, after={"id": 5, "name": "Cy"}, key={"id": 5})])
    run(spark, s)
    assert feed(s) == "true"
    assert replica(spark, s, "replica.customers", "id", "name") == [(0, "Alice"), (1, "Bob"), (5, "Cy")]


def test_deletion_vectors_unset_come_on_past_the_drivers_merge_dropped_when_turned_off(
        spark, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset, ``deletion_vectors`` is off for a replica the replicator creates, whose MERGEs run
    from the driver (``deltalake``) while it holds at most ``SMALL_REPLICA_ROWS`` rows: the pyarrow
    dataset path reads it. Past that, the next unit turns them on and Spark's MERGE marks replaced
    rows in deletion vectors: the DataFusion reader reads its rows exactly, the pyarrow dataset path
    refuses them. Set to false, the next unit drops the table feature and the replica reads through
    the pyarrow dataset again, its rows unchanged; unset again, a small replica stays without them."""
    from deltalake import DeltaTable

    from platform_assets.cdc import apply as cdc_apply

    def reader_features(s: Settings) -> list[str]:
        return DeltaTable(s.table_path("replica.customers")).protocol().reader_features or []

    def last_commit(path: str) -> dict[str, Any]:
        return DeltaTable(path).history(1)[0]

    s = setup(settings, tmp_path)
    lineage = s.lineage.read_text()
    assert "deletion_vectors" not in lineage
    more = [event("customers", "c", 7, after={"id": i, "name": f"n{i}"}, key={"id": i}) for i in range(10, 40)]
    write_events(tmp_path, "0001.json", customers_events() + more)
    run(spark, s)
    write_events(tmp_path, "0002.json", [event("customers", "u", 30, before={"id": 0, "name": "Alice"},
                                               after={"id": 0, "name": "Al"}, key={"id": 0})])
    run(spark, s)
    path = s.table_path("replica.customers")
    assert "deletionVectors" not in reader_features(s)
    small = last_commit(path)
    assert small["operation"] == "MERGE" and "delta-rs" in small.get("clientVersion", ""), small  # from the driver
    assert DeltaTable(path).to_pyarrow_table().num_rows == 32
    others = [(i, f"n{i}") for i in range(10, 40)]
    assert replica(spark, s, "replica.customers", "id", "name") == [(0, "Al"), (1, "Bob"), *others]

    monkeypatch.setattr(cdc_apply, "SMALL_REPLICA_ROWS", 10)  # the replica's 32 rows are past it now
    write_events(tmp_path, "0003.json", [event("customers", "u", 31, before={"id": 1, "name": "Bob"},
                                               after={"id": 1, "name": "Bo"}, key={"id": 1})])
    run(spark, s)
    assert "deletionVectors" in reader_features(s)
    metrics = spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").collect()[0]["operationMetrics"]
    assert int(metrics["numTargetDeletionVectorsAdded"]) > 0, metrics  # rows marked, not files rewritten
    with pytest.raises(Exception, match="deletionVectors"):
        DeltaTable(path).to_pyarrow_table()
    assert replica(spark, s, "replica.customers", "id", "name") == [(0, "Al"), (1, "Bo"), *others]

    s.lineage.write_text(lineage.replace("    options:", "    deletion_vectors: false\n    options:"))
    write_events(tmp_path, "0004.json", [event("customers", "c", 32, after={"id": 5, "name": "Cy"}, key={"id": 5}),
                                         event("customers", "d", 32, before={"id": 1, "name": "Bo"}, key={"id": 1})])
    run(spark, s)
    assert "deletionVectors" not in reader_features(s)
    assert DeltaTable(path).to_pyarrow_table().num_rows == 32
    assert replica(spark, s, "replica.customers", "id", "name") == [(0, "Al"), (5, "Cy"), *others]

    monkeypatch.undo()
    s.lineage.write_text(lineage)  # unset again, the replica small: no vectors come back
    write_events(tmp_path, "0005.json", [event("customers", "u", 33, before={"id": 5, "name": "Cy"},
                                               after={"id": 5, "name": "Cyd"}, key={"id": 5})])
    run(spark, s)
    assert "deletionVectors" not in reader_features(s)
    # (the dropped feature left the writer feature checkpointProtection, which deltalake does not
    # write: Spark MERGEs this replica from now on)
    assert "checkpointProtection" in (DeltaTable(path).protocol().writer_features or [])
    assert last_commit(path)["operation"] == "MERGE" and "clientVersion" not in last_commit(path)
    assert replica(spark, s, "replica.customers", "id", "name") == [(0, "Al"), (5, "Cyd"), *others]


@pytest.mark.parametrize("path", ["columns", "python"])
def test_the_replicas_of_a_unit_land_at_once_each_on_a_session_of_its_own(
        spark, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """One unit's replicas land concurrently (``TIDEMARK_CDC_APPLY_THREADS``, default 3), each thread on
    a Spark session of its own: three replicas pass a barrier only together, every replica's commits
    carry its own txn id, and the replicas equal those of a run that applies them one after another.
    ``columns``: keyed tables only (the columnar read); ``python``: with a table without a key."""
    import threading

    from lineage.core.errors import TidemarkError
    from platform_assets.cdc import apply as cdc_apply
    from platform_assets.cdc import scd1 as cdc_scd1
    from platform_assets.core import spark_io

    third = ("names", names_events()) if path == "python" else (
        "items", [event("items", "c", 8, after={"sku": i, "qty": i}, key={"sku": i}) for i in range(6)])
    orders = [event("orders", "c", 7, after={"oid": i, "total": i * 10}, key={"oid": i}) for i in range(5)]
    orders.append(event("orders", "u", 9, before={"oid": 2, "total": 20}, after={"oid": 2, "total": 21}, key={"oid": 2}))
    lines = customers_events() + orders + third[1]
    keys = "      public.orders: {key: [oid]}\n" + ("      public.items: {key: [sku]}\n" if path == "columns" else "")

    def home(name: str) -> Settings:
        s = setup(Settings.from_env({}, home=tmp_path / name / "home", spark_master="local[2]"), tmp_path / name)
        s.lineage.write_text(s.lineage.read_text() + keys)
        write_events(tmp_path / name, "0001.json", lines)
        return s

    def rows(s: Settings) -> dict[str, list[tuple]]:
        return {t: sorted(tuple(r) for r in spark.read.format("delta").load(s.table_path(f"replica.{t}"))
                          .drop("_sequence_num", "_commit_ts").collect())
                for t in ("customers", "orders", third[0])}

    barrier = threading.Barrier(3, timeout=120)
    sessions: list[Any] = []

    def spy(land: Any) -> Any:  # a replica's commit: its MERGE, or the append of a unit of new keys only
        def landing(session: Any, *args: Any, **kw: Any) -> None:
            sessions.append(session)  # the session each replica lands on
            if len(sessions) <= 3:
                barrier.wait()  # the three replicas of the first unit land at once, or BrokenBarrierError
            land(session, *args, **kw)
        return landing

    together = home("together")
    monkeypatch.setattr(cdc_apply, "SMALL_REPLICA_ROWS", -1)  # Spark's MERGEs (small replicas: the driver's, below)
    monkeypatch.setattr(spark_io, "run_merge", spy(spark_io.run_merge))
    monkeypatch.setattr(cdc_scd1, "append_new_keys", spy(cdc_scd1.append_new_keys))
    results = run(spark, together)
    monkeypatch.undo()
    assert not results[0].paused and results[0].changes == len(lines), results[0]
    assert len({id(x) for x in sessions[:3]}) == 3 and all(x is not spark for x in sessions[:3])
    for t in ("customers", "orders", third[0]):
        log_dir = Path(together.table_path(f"replica.{t}")) / "_delta_log"
        apps = {json.loads(line)["txn"]["appId"] for f in sorted(log_dir.glob("*.json"))
                for line in f.read_text().splitlines() if '"txn"' in line}
        assert apps == {f"tidemark:replica.{t}"}, (t, apps)

    monkeypatch.setenv("TIDEMARK_CDC_APPLY_THREADS", "1")
    one_by_one = home("one_by_one")  # and MERGEd from the driver
    run(spark, one_by_one)
    assert rows(together) == rows(one_by_one)
    assert rows(together)["orders"] == [(0, 0), (1, 10), (2, 21), (3, 30), (4, 40)]

    monkeypatch.setenv("TIDEMARK_CDC_APPLY_THREADS", "0")
    refused = home("refused")
    with pytest.raises(TidemarkError, match=r"TIDEMARK_CDC_APPLY_THREADS='0': expected a whole number of replicas >= 1"):
        run(spark, refused)
    assert not Path(refused.table_path("replica.customers")).exists()
