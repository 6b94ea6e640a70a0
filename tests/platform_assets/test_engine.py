"""The step and reload processors on real Spark + Delta (the session-scoped ``spark``)."""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from lineage.core.errors import OffsetError, ProcessingError, TopicLockedError
from lineage.core.positions import Position
from lineage.spec.loader import load_lineage
from platform_assets.core import faults
from platform_assets.engine import runner as engine_mod
from platform_assets.engine.runner import Engine, data_app_id
from resources.core.settings import Settings
from resources.state.offset_sql import open_offset_store
from resources.storage.meta_tables import read_etl_log
from tests.platform_assets.shop import (
    T0,
    full_recompute,
    make_events,
    table_rows,
    write_lineage,
    write_rows,
    write_users,
)

pytestmark = pytest.mark.spark


def _engine(spark, settings: Settings, root: Path, now: dt.datetime | None = None, **lineage_kw) -> Engine:
    lin = write_lineage(root, **lineage_kw)
    settings = settings.with_(lineage=lin)
    clock = (lambda: now) if now else engine_mod.utcnow
    return Engine(settings, load_lineage(lin), spark=spark, clock=clock)


def _rows(spark, path: str) -> list[tuple]:
    return table_rows(spark, path)


def _full_recompute(spark, eng: Engine) -> list[tuple]:
    """The transform applied once to every valid row of the base table."""
    return full_recompute(spark, eng.settings)


def test_incremental_equals_full_recompute_with_ties(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path, maxstep=237)
    write_users(eng.settings)
    first = make_events(1500, distinct_pos=30, seed=3)
    write_rows(eng.settings, "stage.events", first)
    results = eng.run_until_caught_up()
    blocks = [r for r in results if r.processed]
    assert len(blocks) >= 1500 // 237  # small maxstep: many blocks
    assert all(r.base_rows >= 1 for r in blocks)
    # A second batch arrives, partly tying with the newest pos already processed.
    last_pos = first[-1]["pos"]
    second = make_events(700, start_id=1501, start=last_pos, distinct_pos=10, seed=4)
    second[:50] = [{**r, "pos": last_pos} for r in second[:50]]
    write_rows(eng.settings, "stage.events", second)
    eng.run_until_caught_up()

    dest = eng.path("fact.events")
    assert _rows(spark, dest) == _full_recompute(spark, eng)
    rec = eng.store.get("fact.events")
    assert rec is not None and rec.next is None and rec.last == Position(second[-1]["pos"], 2200)
    # Blocks are contiguous: each block's last is the previous block's next.
    log = sorted(read_etl_log(eng.settings, "fact.events", limit=1000), key=lambda r: r["seq"])
    assert [r["seq"] for r in log] == list(range(1, len(log) + 1))
    assert all(a["next"] == b["last"] for a, b in zip(log, log[1:], strict=False))
    assert sum(r["base_rows"] for r in log) == 2200


@pytest.mark.fast
def test_block_respects_maxstep_and_records_offsets(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path, maxstep=40)
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(100, distinct_pos=100, micro=True, seed=9))
    r = eng.run_topic("fact.events")
    assert r.processed and r.block is not None and r.block.seq == 1 and r.base_rows == 40
    assert r.block.last.is_zero()
    rec = eng.store.get("fact.events")
    assert rec.last == r.block.next and rec.seq == 1 and rec.state == "committed"
    hist = eng.store.history("fact.events")
    assert [h.action for h in hist[:2]] == ["commit", "plan"]


def test_etl_log_carries_block_statistics(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path, maxstep=1000)
    write_users(eng.settings, n=10)  # user_ids 10..25 find no user: country null
    events = make_events(300, seed=5)
    write_rows(eng.settings, "stage.events", events)
    r = eng.run_topic("fact.events")
    out = spark.read.format("delta").load(eng.path("fact.events"))
    expected_rows = out.count()
    null_country = out.where("country IS NULL").count()
    (entry,) = read_etl_log(eng.settings, "fact.events")
    assert entry["rows"] == expected_rows == r.rows
    assert entry["max_id"] == out.agg({"id": "max"}).collect()[0][0]
    # Delta keeps timestamp statistics at millisecond precision (truncated).
    def ms(v: dt.datetime) -> dt.datetime:
        return v.replace(microsecond=v.microsecond // 1000 * 1000, tzinfo=None)

    assert entry["min_ts"].replace(tzinfo=None) == ms(out.agg({"pos": "min"}).collect()[0][0])
    assert entry["max_ts"].replace(tzinfo=None) == ms(out.agg({"pos": "max"}).collect()[0][0])
    assert dict(entry["nulls"])["country"] == null_country > 0
    assert entry["max_lag"] > 0 and entry["run_id"] == eng.run_id and entry["delta_version"] == 0
    assert entry["base_rows"] == 300
    assert set(r.stats["phases_s"]) >= {"lock", "plan", "transform", "write", "log", "commit"}


def test_null_positions_are_quarantined_and_counted(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path)
    write_users(eng.settings)
    rows = make_events(50, seed=6)
    rows[10] = {**rows[10], "pos": None}
    rows[20] = {**rows[20], "id": None}
    write_rows(eng.settings, "stage.events", rows)
    r = eng.run_topic("fact.events")
    assert r.processed and r.bad_rows == 2 and r.base_rows == 48
    written = spark.read.format("delta").load(eng.path("fact.events"))
    assert written.where("id IS NULL").count() == 0  # quarantined, not also written
    assert sorted(x.id for x in written.select("id").collect()) == sorted(
        x["id"] for x in rows if x["id"] is not None and x["pos"] is not None and x["kind"] != "skip")
    q = spark.read.format("delta").load(eng.path("etl.quarantine")).collect()
    assert sorted(x.reason for x in q) == ["null position: null id", "null position: null pos"]
    assert {json.loads(x.row)["user_id"] for x in q} == {rows[10]["user_id"], rows[20]["user_id"]}
    assert read_etl_log(eng.settings, "fact.events")[0]["bad_rows"] == 2
    # Counted once: the next block does not count them again.
    write_rows(eng.settings, "stage.events", make_events(10, start_id=100, start=T0 + dt.timedelta(hours=2)))
    assert eng.run_topic("fact.events").bad_rows == 0
    assert spark.read.format("delta").load(eng.path("etl.quarantine")).count() == 2
    # The newest rows have no id: the rows before them still make a block, the bad ones are held.
    more = make_events(10, start_id=200, start=T0 + dt.timedelta(hours=4), distinct_pos=10)
    more[-1] = {**more[-1], "id": None}
    write_rows(eng.settings, "stage.events", more)
    r = eng.run_topic("fact.events")
    assert r.processed and r.base_rows == 9 and r.bad_rows == 1
    assert r.block.next == Position(more[-2]["pos"], more[-2]["id"])


def test_second_run_of_a_topic_fails_naming_the_holder(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path)
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(20))
    eng.ensure_offsets(eng.lineage.topic("fact.events"))
    eng.store.acquire("fact.events", "otherhost:4242:cafe0001")
    with pytest.raises(TopicLockedError, match="otherhost:4242:cafe0001") as exc:
        eng.run_topic("fact.events")
    assert "tidemark offsets unlock fact.events" in str(exc.value)
    assert eng.store.unlock("fact.events", who="test") == "otherhost:4242:cafe0001"
    assert eng.run_topic("fact.events").processed


def test_an_open_block_keeps_its_lease_alive_until_finished(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path)
    eng.store.lease = dt.timedelta(seconds=1.5)  # heartbeat every 0.5 s
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(20))
    other = open_offset_store(eng.settings.offsets_url)
    try:
        opened = eng.open_block("fact.events")
        first = other.get("fact.events").lease_until
        time.sleep(3)  # two leases: without heartbeats the lock would have expired
        with pytest.raises(TopicLockedError, match="Its lease expires at"):
            other.acquire("fact.events", "elsewhere:1:cafe0001")
        assert other.get("fact.events").lease_until > first
        assert eng.finish(opened).processed
        rec = other.get("fact.events")
        assert (rec.owner, rec.lease_until) == ("", None)
        time.sleep(1)  # the keeper stopped: nothing writes the lease again
        assert other.get("fact.events") == rec and not eng._leases
    finally:
        other.close()


def test_a_block_whose_lock_was_taken_over_is_not_written(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path)
    eng.store.lease = dt.timedelta(seconds=0.6)  # heartbeat every 0.2 s
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(20))
    other = open_offset_store(eng.settings.offsets_url)
    try:
        opened = eng.open_block("fact.events")
        later = engine_mod.utcnow() + dt.timedelta(hours=1)
        other.clock = lambda: later  # for `other`, the lease ran out long ago: one atomic takeover
        other.acquire("fact.events", "elsewhere:1:cafe0001")
        assert other.history("fact.events")[0].action == "steal"
        time.sleep(1)  # the next heartbeat finds the lock taken over
        with pytest.raises(OffsetError, match="heartbeat by .* refused: the lock is held by 'elsewhere:1:cafe0001'"):
            eng.finish(opened)
        assert not DeltaTable.is_deltatable(eng.path("fact.events"))  # nothing written
        assert other.get("fact.events").owner == "elsewhere:1:cafe0001"  # and the new holder keeps it
    finally:
        other.close()


def test_crash_after_delta_commit_is_recovered_without_duplicates(spark, settings, tmp_path, monkeypatch):
    eng = _engine(spark, settings, tmp_path, maxstep=30)
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(100, distinct_pos=100, seed=8))

    def boom(point: str) -> None:
        if point == "written":
            raise RuntimeError("simulated crash after the Delta commit")

    monkeypatch.setattr(faults, "crashpoint", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        eng.run_topic("fact.events")
    rec = eng.store.get("fact.events")
    assert rec.pending and rec.seq == 1 and rec.owner == "" and rec.state.startswith("failed")
    assert DeltaTable(eng.path("fact.events")).transaction_version(data_app_id("fact.events")) == 1
    planned = (rec.last, rec.next)

    monkeypatch.setattr(faults, "crashpoint", lambda point: None)
    r = eng.run_topic("fact.events")
    assert r.recovered and (r.block.last, r.block.next) == planned
    assert DeltaTable(eng.path("fact.events")).version() == 0  # no second data commit
    eng.run_until_caught_up()
    assert _rows(spark, eng.path("fact.events")) == _full_recompute(spark, eng)


def test_failed_transform_keeps_the_block_and_names_the_topic(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path, before="SELECT * FROM no_such_table")
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(20))
    with pytest.raises(ProcessingError, match=r"topic 'fact.events' .*before statement 1 failed"):
        eng.run_topic("fact.events")
    rec = eng.store.get("fact.events")
    assert rec.pending and rec.seq == 1 and "ProcessingError" in rec.state


def test_delay_and_dependencies_hold_blocks_back(spark, settings, tmp_path):
    now = T0 + dt.timedelta(hours=1)
    eng = _engine(spark, settings, tmp_path, now=now, delay="10m", deps="[stage.events, stage.other]")
    write_users(eng.settings)
    events = [{"pos": T0 + dt.timedelta(minutes=m), "id": m + 1, "user_id": 1, "amount": 1.0, "kind": "a"} for m in range(60)]
    write_rows(eng.settings, "stage.events", events)
    assert eng.run_topic("fact.events").reason == "waiting for stage.other (no data yet)"
    write_rows(eng.settings, "stage.other", [{"pos": T0 + dt.timedelta(minutes=30), "id": 1, "user_id": 0, "amount": 0.0, "kind": "x"}])
    r = eng.run_topic("fact.events")  # limited by stage.other's freshness (00:30), not by the delay (00:50)
    assert r.processed and r.block.next == Position(T0 + dt.timedelta(minutes=30), 31)
    r = eng.run_topic("fact.events")
    assert not r.processed and r.reason.startswith("waiting for stage.other (at 2026-01-01 00:30")
    write_rows(eng.settings, "stage.other", [{"pos": T0 + dt.timedelta(hours=2), "id": 2, "user_id": 0, "amount": 0.0, "kind": "x"}])
    r = eng.run_topic("fact.events")  # now the delay is the limit
    assert r.processed and r.block.next == Position(T0 + dt.timedelta(minutes=50), 51)
    r = eng.run_topic("fact.events")
    assert not r.processed and r.reason.startswith("delay 10m")
    lag = {row.topic: row for row in eng.lag()}["fact.events"]
    assert lag.lag_s == 9 * 60 and lag.reason.startswith("delay")


def test_new_topic_starts_from_destination_newest_position(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path)
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(50, seed=2))
    eng.run_until_caught_up()
    last = eng.store.get("fact.events").last
    # A fresh offset store (e.g. lost SQLite file) starts where the destination ends.
    fresh = Engine(eng.settings.with_(offsets_url=f"sqlite:///{tmp_path / 'other.db'}"), eng.lineage, spark=spark)
    assert fresh.ensure_offsets(fresh.lineage.topic("fact.events")).last == last
    assert not fresh.run_topic("fact.events").processed


@pytest.mark.fast
def test_reload_rebuilds_atomically_and_only_when_the_base_changed(spark, settings, tmp_path):
    extra = """
      - table: mart.users_by_country
        depends_on: [dim.users]
        processor: reload
        transforms: [../sql/by_country.sql]
    """
    (tmp_path / "sql").mkdir(exist_ok=True)
    (tmp_path / "sql" / "by_country.sql").write_text("SELECT country, count(*) AS users FROM block GROUP BY country")
    eng = _engine(spark, settings, tmp_path, extra_topic=extra)
    write_users(eng.settings, n=9)
    r = eng.run_topic("mart.users_by_country")
    assert r.processed and r.rows == 3
    assert not eng.run_topic("mart.users_by_country").processed
    write_users(eng.settings, n=12)  # overwrite: a new version of dim.users
    r = eng.run_topic("mart.users_by_country")
    assert r.processed
    got = {row.country: row.users for row in spark.read.format("delta").load(eng.path("mart.users_by_country")).collect()}
    assert got == {"DE": 4, "FR": 4, None: 4}
    rec = eng.store.get("mart.users_by_country")
    assert rec.state == "reloaded" and rec.seq == 2 and rec.rows == 3
    hist = DeltaTable(eng.path("mart.users_by_country")).history()
    assert [h["operation"] for h in hist][:2] == ["WRITE", "WRITE"] or hist[0]["operation"].startswith("CREATE OR REPLACE")


def test_two_warehouses_in_one_session_do_not_mix(spark, settings, tmp_path):
    a = _engine(spark, settings, tmp_path / "a")
    b = _engine(spark, settings.with_(warehouse=str(tmp_path / "wb"), offsets_url=f"sqlite:///{tmp_path / 'b.db'}"), tmp_path / "b")
    for eng, n in ((a, 30), (b, 70)):
        write_users(eng.settings)
        write_rows(eng.settings, "stage.events", make_events(n, seed=n))
    a.run_until_caught_up()
    b.run_until_caught_up()
    a.run_until_caught_up()
    assert _rows(spark, a.path("fact.events")) == _full_recompute(spark, a)
    assert _rows(spark, b.path("fact.events")) == _full_recompute(spark, b)


def test_lineage_is_published_with_who_and_when(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path)
    assert eng.publish_lineage() is True
    assert eng.publish_lineage() is False  # unchanged: not rewritten
    rows = DeltaTable(eng.path("sch.lineage")).to_pyarrow_table().to_pylist()
    topic = next(r for r in rows if r["kind"] == "topic")
    assert topic["topic"] == "fact.events" and topic["depends_on"] == ["stage.events"] and topic["maxstep"] == 100
    assert topic["user"] and topic["updated_at"] is not None
    assert {r["table"] for r in rows if r["kind"] == "source"} == {"stage.events", "dim.users", "stage.other"}


def test_late_rows_are_quarantined_once_and_never_written(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path, maxstep=1000)
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(200, distinct_pos=50, seed=12))
    eng.run_until_caught_up()
    last = eng.store.get("fact.events").last
    # Three rows arrive out of order (positions at or before last), with two in order.
    late = [{"pos": last.pos - dt.timedelta(minutes=m), "id": 1000 + m, "user_id": 1, "amount": 1.0, "kind": "a"} for m in (1, 2)]
    late.append({"pos": last.pos, "id": last.id - 1, "user_id": 1, "amount": 1.0, "kind": "a"})
    fresh = [{"pos": last.pos + dt.timedelta(minutes=1), "id": 2000 + i, "user_id": 1, "amount": 1.0, "kind": "a"} for i in range(2)]
    write_rows(eng.settings, "stage.events", late + fresh)
    r = eng.run_topic("fact.events")
    assert r.processed and r.bad_rows == 3 and r.base_rows == 2
    q = spark.read.format("delta").load(eng.path("etl.quarantine")).where("reason LIKE 'late%'").collect()
    assert sorted(json.loads(x.row)["id"] for x in q) == sorted([1001, 1002, last.id - 1])
    ids = {row.id for row in spark.read.format("delta").load(eng.path("fact.events")).select("id").collect()}
    assert not ids & {1001, 1002} and {2000, 2001} <= ids
    assert not eng.run_topic("fact.events").processed  # nothing new: not counted again
    assert spark.read.format("delta").load(eng.path("etl.quarantine")).count() == 3


def test_a_retried_block_reads_the_snapshot_it_was_planned_on(spark, settings, tmp_path, monkeypatch):
    eng = _engine(spark, settings, tmp_path, maxstep=1000)
    write_users(eng.settings)
    events = make_events(100, distinct_pos=100, seed=13)
    write_rows(eng.settings, "stage.events", events)

    def boom(point: str) -> None:
        if point == "planned":
            raise RuntimeError("simulated crash after planning")

    monkeypatch.setattr(faults, "crashpoint", boom)
    with pytest.raises(RuntimeError):
        eng.run_topic("fact.events")
    planned = eng.store.get("fact.events")
    # A row lands inside the planned range before the retry: it is late, not part of the block.
    intruder = {"pos": events[50]["pos"], "id": 5000, "user_id": 1, "amount": 1.0, "kind": "a"}
    write_rows(eng.settings, "stage.events", [intruder])
    monkeypatch.setattr(faults, "crashpoint", lambda point: None)
    r = eng.run_topic("fact.events")
    assert r.processed and (r.block.last, r.block.next) == (planned.last, planned.next) and r.base_rows == 100
    ids = {row.id for row in spark.read.format("delta").load(eng.path("fact.events")).select("id").collect()}
    assert 5000 not in ids
    assert eng.run_topic("fact.events").bad_rows == 1  # the next look quarantines it


def test_plan_block_without_spark_then_run_exactly_that_block(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path, maxstep=40)
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(100, distinct_pos=100, seed=14))
    planner = Engine(eng.settings, eng.lineage)  # no SparkSession: planning must not need one
    p1 = planner.plan_block("fact.events")
    assert p1.block is not None and p1.block.seq == 1 and p1.base_rows == 40 and planner._spark is None
    assert planner.plan_block("fact.events").block == p1.block  # pending: the same block again
    with pytest.raises(ProcessingError, match=r"block 2 is not planned \(block 1 pending\).*tidemark plan fact.events"):
        eng.run_block("fact.events", 2)
    r = eng.run_block("fact.events", 1)
    assert r.processed and r.block == p1.block and r.base_rows == 40
    assert not r.recovered  # planned ahead, but nothing had landed: a normal first write
    again = eng.run_block("fact.events", 1)
    assert not again.processed and "already committed" in again.reason
    assert eng.store.get("fact.events").owner == ""
    with pytest.raises(ProcessingError, match="only step topics have blocks"):
        Engine(eng.settings, load_lineage(write_lineage(tmp_path / "r", extra_topic="""
          - table: mart.x
            depends_on: [dim.users]
            processor: reload
            transforms: [../sql/fact_events.sql]
        """)), spark=spark).plan_block("mart.x")


def test_a_reference_table_without_pos_is_fresh_as_of_its_newest_commit(spark, settings, tmp_path):
    eng = _engine(spark, settings, tmp_path, deps="[stage.events, dim.users]", maxstep=1000)
    write_users(eng.settings, n=1000)  # a reference table: no pos column
    write_rows(eng.settings, "stage.events", make_events(300, distinct_pos=50))
    committed = DeltaTable(eng.path("dim.users")).history(1)[0]["timestamp"]
    assert eng.freshness("dim.users") == dt.datetime.fromtimestamp(committed / 1000, dt.UTC).replace(tzinfo=None)
    r = eng.run_topic("fact.events")
    assert r.processed and r.base_rows == 300, r.reason
    assert {row[1] for row in _rows(spark, eng.path("fact.events"))} >= {"DE", "FR"}  # country, joined from dim.users
    # Rows newer than the reference table's newest commit wait for it.
    late = T0.replace(year=2100)
    write_rows(eng.settings, "stage.events", make_events(5, start_id=301, start=late, distinct_pos=5))
    r = eng.run_topic("fact.events")
    assert not r.processed and r.reason.startswith("waiting for dim.users (at "), r.reason


def test_a_static_source_is_always_fresh_and_a_missing_one_never(settings, tmp_path):
    lin = write_lineage(tmp_path, deps="[stage.events, dim.users]")
    text = (lin / "events.yaml").read_text().replace("  - table: dim.users\n", "  - table: dim.users\n    freshness: static\n")
    (lin / "events.yaml").write_text(text)
    eng = Engine(settings.with_(lineage=lin), load_lineage(lin))
    try:
        assert eng.freshness("dim.users") == dt.datetime.max  # no table at all, yet declared static
        assert eng.freshness("stage.other") is None  # missing: nothing yet
    finally:
        eng.close()


@pytest.mark.fast
def test_an_engine_never_stops_a_session_it_did_not_start(spark, settings, tmp_path):
    """An engine given no session, in a thread of a process that has one (a Dagster op's worker
    thread, the follower's): getOrCreate hands it that session, and closing the engine leaves it
    running for everyone else."""
    import threading

    from resources.spark.session import _connect_url, is_connect

    lin = write_lineage(tmp_path)
    # the engine's settings name the Spark the process has, as a host's would (a Connect server's URL)
    master = _connect_url(spark) if is_connect(spark) else settings.spark_master
    seen: dict[str, object] = {}

    def in_a_thread() -> None:
        eng = Engine(settings.with_(lineage=lin, spark_master=master), load_lineage(lin))
        try:
            seen["session"] = eng.spark
        finally:
            eng.close()

    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join()
    assert seen["session"] is spark
    assert spark.range(3).count() == 3  # still running


def _files_added(path: str, version: int) -> int:
    commit = Path(path) / "_delta_log" / f"{version:020d}.json"
    return sum(1 for line in commit.read_text().splitlines() if json.loads(line).get("add"))


def test_a_small_block_from_several_base_files_lands_as_one_file(spark, settings, tmp_path, monkeypatch):
    """A block of a few rows read from three base files (three feeder commits) adds one file to its
    destination; above ``SMALL_BLOCK_ROWS`` base rows the output keeps its partitions."""
    from platform_assets.core import spark_io

    eng = _engine(spark, settings, tmp_path, maxstep=1000)
    write_users(eng.settings)
    events = make_events(90, distinct_pos=90, micro=True, seed=4)
    for part in (events[:30], events[30:60], events[60:]):
        write_rows(eng.settings, "stage.events", part)
    r = eng.run_topic("fact.events")
    assert r.processed and r.base_rows == 90 and r.rows > 1
    assert _files_added(eng.path("fact.events"), r.delta_version) == 1

    monkeypatch.setattr(spark_io, "SMALL_BLOCK_ROWS", 10)
    more = make_events(90, start_id=1000, start=T0 + dt.timedelta(hours=2), distinct_pos=90, micro=True, seed=5)
    for part in (more[:30], more[30:60], more[60:]):
        write_rows(eng.settings, "stage.events", part)
    r = eng.run_topic("fact.events")
    assert r.processed and r.base_rows == 90
    assert _files_added(eng.path("fact.events"), r.delta_version) > 1
    assert sorted(_rows(spark, eng.path("fact.events"))) == sorted(_full_recompute(spark, eng))
