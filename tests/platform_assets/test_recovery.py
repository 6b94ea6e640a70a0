"""The Delta log is the only truth: an offset store that is restored from a backup, lost, or
some blocks behind is caught up from the destination's Delta log before anything is planned,
and where the log cannot answer the engine refuses instead of guessing.

Each scenario ends with the destination equal to the full recompute, and every base row either
written or quarantined, exactly once."""

from __future__ import annotations

import datetime as dt
import json
import sqlite3
from pathlib import Path

import pytest
from deltalake import DeltaTable

from lineage.core.errors import OffsetError
from lineage.core.positions import Position
from lineage.spec.loader import load_lineage
from platform_assets.engine.runner import Engine, data_app_id
from resources.core.settings import Settings
from resources.state.offsets import utcnow
from resources.storage.meta_tables import read_etl_log, record_reset
from tests.platform_assets.shop import (
    TRANSFORM_SQL,
    full_recompute,
    make_events,
    seeded,
    table_rows,
    write_lineage,
    write_rows,
    write_users,
)

pytestmark = pytest.mark.spark


def _engine(spark, settings: Settings) -> Engine:
    return Engine(settings, load_lineage(settings.lineage), spark=spark)


def _rows(spark, path: str) -> list[tuple]:
    return table_rows(spark, path)


def _full_recompute(spark, eng: Engine, exclude_ids: set[int] = frozenset()) -> list[tuple]:
    return full_recompute(spark, eng.settings, exclude_ids)


def _backup(db: Path, to: Path) -> None:
    """A consistent copy of a live SQLite store (as a nightly backup would take it)."""
    src, dst = sqlite3.connect(db), sqlite3.connect(to)
    with dst:
        src.backup(dst)
    src.close()
    dst.close()


def _restore(backup: Path, db: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    _backup(backup, db)


def _late_ids(spark, eng: Engine) -> set[int]:
    q = eng.path("etl.quarantine")
    if not DeltaTable.is_deltatable(q):
        return set()
    return {json.loads(r.row)["id"] for r in spark.read.format("delta").load(q).where("reason LIKE 'late%'").collect()}


@pytest.fixture
def s(settings: Settings, tmp_path: Path) -> Settings:
    return seeded(settings, tmp_path, maxstep=120, events=600, distinct_pos=200, seed=21)


def _db(settings: Settings) -> Path:
    return Path(settings.offsets_url.removeprefix("sqlite:///"))


def _append_after_newest(settings: Settings, n: int, start_id: int, seed: int) -> list[dict]:
    newest = DeltaTable(settings.table_path("stage.events")).to_pyarrow_table(columns=["pos"])["pos"]
    start = max(v for v in newest.to_pylist() if v is not None).replace(tzinfo=None) + dt.timedelta(seconds=1)
    rows = make_events(n, start_id=start_id, start=start, distinct_pos=80, seed=seed)
    write_rows(settings, "stage.events", rows)
    return rows


def test_restored_store_does_not_land_a_block_twice(spark, s, tmp_path):
    """The reported reproduction: back up the store, process 500 more rows, restore the backup, run
    again. Before: the 500 rows landed twice (the planner took ``last`` from the stale store)."""
    eng = _engine(spark, s)
    eng.run_until_caught_up()
    before = eng.store.get("fact.events")
    eng.close()
    _backup(_db(s), tmp_path / "nightly.db")

    _append_after_newest(s, 500, start_id=10_000, seed=22)
    eng = _engine(spark, s)
    eng.run_until_caught_up()
    ahead = eng.store.get("fact.events")
    assert ahead.seq > before.seq
    eng.close()

    _restore(tmp_path / "nightly.db", _db(s))
    eng = _engine(spark, s)
    assert eng.store.get("fact.events").seq == before.seq  # the stale record is really back
    lag = {r.topic: r for r in eng.lag()}["fact.events"]
    assert lag.reason == (f"offset store behind the Delta log: block {ahead.seq} landed, the store is at block "
                          f"{before.seq}; the next run catches it up (recover)")
    assert eng.store.get("fact.events").seq == before.seq  # lag only reads
    results = eng.run_until_caught_up()
    assert not [r for r in results if r.processed]  # nothing to do: every block had landed
    rec = eng.store.get("fact.events")
    assert (rec.last, rec.seq, rec.next) == (ahead.last, ahead.seq, None)
    assert rec.source_version is not None and rec.delta_version == DeltaTable(eng.path("fact.events")).version()
    recover = [h for h in eng.store.history("fact.events") if h.action == "recover"]
    assert recover and f"block {ahead.seq}" in recover[0].note and recover[0].new_last == ahead.last
    assert _rows(spark, eng.path("fact.events")) == _full_recompute(spark, eng)
    ids = [r.id for r in spark.read.format("delta").load(eng.path("fact.events")).select("id").collect()]
    assert len(ids) == len(set(ids))


def test_store_some_blocks_behind_is_caught_up_and_continues(spark, s, tmp_path):
    """A store N blocks behind, with a block pending in the copy (a PostgreSQL replica that lags):
    the engine catches up from the log and goes on with new rows."""
    eng = _engine(spark, s)
    for _ in range(2):
        assert eng.run_topic("fact.events").processed
    eng.plan_block("fact.events")  # block 3 planned, not landed, in the copy
    eng.close()
    _backup(_db(s), tmp_path / "replica.db")
    eng = _engine(spark, s)
    eng.run_until_caught_up()
    landed = eng.store.get("fact.events")
    assert landed.seq >= 5
    eng.close()

    _restore(tmp_path / "replica.db", _db(s))
    _append_after_newest(s, 300, start_id=20_000, seed=23)
    eng = _engine(spark, s)
    stale = eng.store.get("fact.events")
    assert stale.pending and stale.seq == 3
    eng.run_until_caught_up()
    rec = eng.store.get("fact.events")
    assert rec.seq > landed.seq and not rec.pending
    log = sorted(read_etl_log(eng.settings, "fact.events", limit=1000), key=lambda r: r["seq"])
    assert [r["seq"] for r in log] == list(range(1, rec.seq + 1))  # one log row per block, none twice
    assert all(a["next"] == b["last"] for a, b in zip(log, log[1:], strict=False))
    assert _rows(spark, eng.path("fact.events")) == _full_recompute(spark, eng)


@pytest.mark.postgres
def test_failover_to_a_postgresql_replica_that_lags_is_caught_up(spark, s, pg_url):
    """The offset store in PostgreSQL fails over to a replica that missed the last blocks (here:
    the table's rows put back as a lagging replica held them, a block pending in that copy)."""
    import uuid

    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    st = s.with_(offsets_url=f"{pg_url}?options=-csearch_path%3D{schema}")
    eng = _engine(spark, st)
    assert eng.run_topic("fact.events").processed
    eng.plan_block("fact.events")  # block 2 planned when the replica stopped replaying
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {schema}.replica AS SELECT * FROM {schema}.tidemark_offsets")
    eng.run_until_caught_up()
    primary = eng.store.get("fact.events")
    eng.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:  # the failover
        conn.execute(f"DELETE FROM {schema}.tidemark_offsets")
        conn.execute(f"INSERT INTO {schema}.tidemark_offsets SELECT * FROM {schema}.replica")
    _append_after_newest(st, 250, start_id=50_000, seed=27)

    eng = _engine(spark, st)
    stale = eng.store.get("fact.events")
    assert stale.pending and stale.seq == 2 < primary.seq
    eng.run_until_caught_up()
    rec = eng.store.get("fact.events")
    assert rec.seq > primary.seq and not rec.pending
    assert [h.action for h in eng.store.history("fact.events") if h.action == "recover"]
    log = sorted(read_etl_log(st, "fact.events", limit=1000), key=lambda r: r["seq"])
    assert [r["seq"] for r in log] == list(range(1, rec.seq + 1))
    assert _rows(spark, eng.path("fact.events")) == _full_recompute(spark, eng)
    eng.close()


def test_lost_store_rebuilds_every_field_and_keeps_detecting_late_rows(spark, s):
    """The reported reproduction: delete the store, append rows of which some lie at or before the
    destination's newest block end. Before: the late ones were neither written nor quarantined."""
    eng = _engine(spark, s)
    eng.run_until_caught_up()
    kept = eng.store.get("fact.events")
    eng.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{_db(s)}{suffix}").unlink(missing_ok=True)

    last = kept.last
    late = [{"pos": last.pos - dt.timedelta(minutes=m), "id": 30_000 + m, "user_id": 3, "amount": 1.0, "kind": "a"}
            for m in range(1, 6)]
    write_rows(s, "stage.events", late)
    _append_after_newest(s, 200, start_id=31_000, seed=24)

    eng = _engine(spark, s)
    rec = eng.ensure_offsets(eng.lineage.topic("fact.events"))
    assert (rec.last, rec.seq, rec.source_version) == (kept.last, kept.seq, kept.source_version)
    assert [h.action for h in eng.store.history("fact.events")][:2] == ["recover", "init"]
    eng.run_until_caught_up()
    assert _late_ids(spark, eng) == {r["id"] for r in late}
    got = _rows(spark, eng.path("fact.events"))
    assert got == _full_recompute(spark, eng, exclude_ids={r["id"] for r in late})


def test_a_reset_the_store_lost_before_the_next_block_is_applied_again_from_delta(spark, s):
    """``tidemark offsets reset`` moves an offset where the destination's log cannot show it: a store
    lost before the topic's next block would silently undo it. It is kept in ``etl.offset_resets``
    and applied again to the record rebuilt from the log; once a block landed after it, no more."""
    eng = _engine(spark, s)
    eng.run_until_caught_up()
    topic = eng.lineage.topic("fact.events")
    kept = eng.store.get("fact.events")
    back = Position(kept.last.pos - dt.timedelta(minutes=20), 0)
    eng.reset_offsets(topic, back, "re-process the last 20 minutes")
    eng.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{_db(s)}{suffix}").unlink(missing_ok=True)
    eng = _engine(spark, s)
    rec = eng.ensure_offsets(topic)
    assert rec.last == back and rec.seq == kept.seq, rec
    assert "applied again" in eng.store.history("fact.events")[0].note
    # a newer reset row from before the newest block landed (its seq below the log's): not applied
    record_reset(s, "fact.events", Position.zero().to_text(), kept.seq - 1, None, "test", "older than a block", utcnow())
    eng.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{_db(s)}{suffix}").unlink(missing_ok=True)
    eng = _engine(spark, s)
    rec = eng.ensure_offsets(topic)
    assert (rec.last, rec.seq) == (kept.last, kept.seq), rec
    eng.close()


def test_lost_store_of_a_reload_topic_keeps_its_sequence(spark, settings, tmp_path):
    extra = """
      - table: mart.users_by_country
        depends_on: [dim.users]
        processor: reload
        transforms: [../sql/by_country.sql]
    """
    lin = write_lineage(tmp_path, extra_topic=extra)
    (tmp_path / "sql" / "by_country.sql").write_text("SELECT country, count(*) AS users FROM block GROUP BY country")
    st = settings.with_(lineage=lin)
    write_users(st, n=9)
    eng = _engine(spark, st)
    assert eng.run_topic("mart.users_by_country").processed
    write_users(st, n=12)
    assert eng.run_topic("mart.users_by_country").processed
    kept = eng.store.get("mart.users_by_country")
    eng.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{_db(st)}{suffix}").unlink(missing_ok=True)
    eng = _engine(spark, st)
    # The rebuild of dim.users' current version landed: nothing to redo, the sequence goes on.
    r = eng.run_topic("mart.users_by_country")
    assert not r.processed, r.reason
    rec = eng.store.get("mart.users_by_country")
    assert (rec.seq, rec.source_version) == (kept.seq, kept.source_version)
    write_users(st, n=15)
    r = eng.run_topic("mart.users_by_country")
    assert r.processed and eng.store.get("mart.users_by_country").seq == kept.seq + 1
    assert [e["seq"] for e in read_etl_log(st, "mart.users_by_country")] == [kept.seq + 1, kept.seq, kept.seq - 1]


def test_commit_removed_by_log_retention_is_refused_not_guessed(spark, s):
    """The store is lost and the topic's newest commit is gone from the log (cleaned up after a
    checkpoint): the engine cannot know where the topic ended, so it refuses and says what to run."""
    eng = _engine(spark, s)
    eng.run_until_caught_up()
    eng.close()
    dest = s.table_path("fact.events")
    # Later commits by someone else (e.g. a backfill), then a checkpoint and log cleanup.
    from deltalake import write_deltalake

    table = DeltaTable(dest)
    for _ in range(3):
        write_deltalake(dest, table.to_pyarrow_table().slice(0, 1), mode="append")
    table = DeltaTable(dest)
    table.create_checkpoint()
    for f in (Path(dest) / "_delta_log").glob("*.json"):
        if int(f.stem) < table.version():
            f.unlink()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{_db(s)}{suffix}").unlink(missing_ok=True)
    assert DeltaTable(dest).transaction_version(data_app_id("fact.events")) >= 1  # the checkpoint kept the txn

    eng = _engine(spark, s)
    with pytest.raises(OffsetError, match=r"tidemark offsets init fact\.events --start") as exc:
        eng.run_topic("fact.events")
    assert "log retention" in str(exc.value)
    # The user decides: an explicit start is taken as given, and the sequence still continues.
    eng.ensure_offsets(eng.lineage.topic("fact.events"), Position.zero())
    rec = eng.store.get("fact.events")
    assert rec.last.is_zero() and rec.seq >= 1


@pytest.mark.fast
def test_destination_with_rows_but_no_block_of_the_topic_is_refused(spark, s):
    """Rows in the destination that no block of this topic wrote (another writer, a manual load):
    starting after its newest row would be a guess."""
    from deltalake import write_deltalake

    eng = _engine(spark, s)
    eng.register_tables()
    spark.read.format("delta").load(s.table_path("stage.events")).limit(5).createOrReplaceTempView("block")
    write_deltalake(s.table_path("fact.events"), spark.sql(TRANSFORM_SQL).toArrow())
    with pytest.raises(OffsetError, match=r"no block of topic 'fact\.events'.*tidemark offsets init fact\.events --start"):
        eng.run_topic("fact.events")


def test_late_rows_in_commits_removed_from_the_log_are_reported_not_skipped_silently(spark, s):
    """Late-row detection reads the base commits since the block's snapshot; where log cleanup
    removed them it cannot, and says so in the block's check figures and in ``tidemark lag``."""
    from lineage.core.checks import evaluate_block

    eng = _engine(spark, s)
    eng.run_until_caught_up()
    last = eng.store.get("fact.events").last
    late = [{"pos": last.pos - dt.timedelta(minutes=1), "id": 40_000, "user_id": 3, "amount": 1.0, "kind": "a"}]
    write_rows(s, "stage.events", late)
    _append_after_newest(s, 50, start_id=41_000, seed=25)
    _append_after_newest(s, 50, start_id=42_000, seed=26)
    base = s.table_path("stage.events")
    table = DeltaTable(base)
    table.create_checkpoint()
    for f in (Path(base) / "_delta_log").glob("*.json"):
        if int(f.stem) < table.version():
            f.unlink()

    lag = {r.topic: r for r in eng.lag()}["fact.events"]
    assert "late-row detection incomplete: stage.events" in lag.warning
    r = eng.run_topic("fact.events")
    assert r.processed and r.stats["warnings"] and "no longer in its Delta log" in r.stats["warnings"][0]
    check = {o.name: o for o in evaluate_block(eng.lineage.topic("fact.events").spec.checks, r.stats)}["late_rows"]
    assert not check.passed and "late-row detection incomplete" in check.description
