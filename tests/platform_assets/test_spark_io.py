"""Where values cross into Spark: time zones, the session catalog, and a block's figures (real
Spark + Delta, the session-scoped ``spark``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lineage.spec.loader import load_lineage
from platform_assets.core.spark_io import epoch_micros
from platform_assets.engine.runner import Engine
from resources.core.settings import Settings
from resources.storage.meta_tables import read_etl_log
from tests.platform_assets.shop import make_events, write_lineage, write_rows, write_users

pytestmark = pytest.mark.spark


@contextmanager
def session_zone(spark, zone: str) -> Iterator[None]:
    """The shared session's time zone set to ``zone`` (as a user's TIDEMARK_SPARK_CONF or a host
    session would), restored afterwards."""
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", zone)
    try:
        yield
    finally:
        spark.conf.set("spark.sql.session.timeZone", before)


def _run_in_zone(spark, settings: Settings, root: Path, zone: str) -> tuple[list[tuple], list[tuple]]:
    """Process the same source in ``zone`` on a fresh warehouse: the destination's rows (``pos``
    as epoch microseconds, i.e. as a UTC instant) and each block's bounds and rows in etl.log."""
    from pyspark.sql import functions as F

    lin = write_lineage(root, maxstep=41)
    settings = settings.with_(home=root / "home", warehouse=str(root / "warehouse"), lineage=lin,
                              offsets_url=f"sqlite:///{root / 'offsets.db'}")
    write_users(settings)
    # Many rows share a pos (ties at block edges), with microseconds.
    write_rows(settings, "stage.events", make_events(240, distinct_pos=15, seed=11))
    eng = Engine(settings, load_lineage(lin), spark=spark)
    try:
        with session_zone(spark, zone):
            eng.run_until_caught_up()
            df = spark.read.format("delta").load(eng.path("fact.events"))
            rows = sorted(tuple(r) for r in df.select(F.unix_micros("pos"), "id", "user_id", "amount2", "kind", "country").collect())
    finally:
        eng.close()
    log = sorted((r["seq"], r["last"], r["next"], r["base_rows"], r["rows"]) for r in read_etl_log(settings, "fact.events", limit=1000))
    return rows, log


def test_block_bounds_select_the_same_rows_in_any_session_time_zone(spark, settings, tmp_path):
    utc_rows, utc_log = _run_in_zone(spark, settings, tmp_path / "utc", "UTC")
    assert len(utc_log) >= 240 // 41 and len(utc_rows) == sum(r[4] for r in utc_log) > 0
    assert sum(r[3] for r in utc_log) == 240  # every base row in exactly one block
    for zone in ("America/New_York", "Asia/Tokyo"):
        rows, log = _run_in_zone(spark, settings, tmp_path / zone.replace("/", "_"), zone)
        assert log == utc_log, zone
        assert rows == utc_rows, zone


def test_epoch_micros_is_utc_and_exact():
    assert epoch_micros(dt.datetime(1970, 1, 1)) == 0
    assert epoch_micros(dt.datetime(2026, 1, 1, 0, 0, 0, 7)) == 1_767_225_600_000_007
    assert epoch_micros(dt.datetime(2026, 1, 1, 9, tzinfo=dt.timezone(dt.timedelta(hours=9)))) == 1_767_225_600_000_000
    assert epoch_micros(dt.datetime(1, 1, 1)) == -62_135_596_800_000_000


def _shop_engine(spark, settings: Settings, root: Path, **lineage_kw) -> Engine:
    lin = write_lineage(root, **lineage_kw)
    return Engine(settings.with_(lineage=lin), load_lineage(lin), spark=spark)


def test_a_managed_table_with_a_lineage_tables_name_survives_a_run(spark, settings, tmp_path):
    from lineage.core.errors import ProcessingError

    eng = _shop_engine(spark, settings, tmp_path)
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(50, seed=2))
    spark.sql("DROP TABLE IF EXISTS dim.users")  # an earlier test's registration (this test owns the name now)
    spark.sql("CREATE SCHEMA IF NOT EXISTS dim")
    spark.sql("CREATE TABLE dim.users (user_id BIGINT, country STRING) USING delta")  # managed: DROP deletes its data
    spark.sql("INSERT INTO dim.users VALUES (1, 'user data')")
    try:
        # The transform reads dim.users by name: the run must not read the user's table in place
        # of the lineage's, nor drop it; it stops and says what to do.
        with pytest.raises(ProcessingError, match=r"dim\.users.*MANAGED.*never drops.*RENAME") as err:
            eng.run_topic("fact.events")
        assert eng.path("dim.users") in str(err.value)
        assert spark.catalog.getTable("dim.users").tableType == "MANAGED"
        assert [tuple(r) for r in spark.table("dim.users").collect()] == [(1, "user data")]
        assert eng.store.get("fact.events").state.startswith("failed")
    finally:
        spark.sql("DROP TABLE IF EXISTS dim.users")
        eng.close()


def test_an_external_table_tidemark_did_not_register_is_not_repointed(spark, settings, tmp_path):
    from lineage.core.errors import ProcessingError

    eng = _shop_engine(spark, settings, tmp_path)
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(50, seed=2))
    elsewhere = str(tmp_path / "elsewhere" / "users")
    spark.createDataFrame([(7, "kept")], "user_id BIGINT, country STRING").write.format("delta").save(elsewhere)
    spark.sql("DROP TABLE IF EXISTS dim.users")
    spark.sql("CREATE SCHEMA IF NOT EXISTS dim")
    spark.sql(f"CREATE TABLE dim.users USING delta LOCATION '{elsewhere}'")
    try:
        with pytest.raises(ProcessingError, match=r"dim\.users.*EXTERNAL.*Tidemark did not register it"):
            eng.run_topic("fact.events")
        assert [tuple(r) for r in spark.table("dim.users").collect()] == [(7, "kept")]
    finally:
        spark.sql("DROP TABLE IF EXISTS dim.users")
        eng.close()


def test_tables_tidemark_registered_follow_the_engine_to_another_warehouse(spark, settings, tmp_path):
    """Two engines in one process on two warehouses (as the tests do): the names are re-pointed."""
    counts = []
    for name in ("one", "two"):
        root = tmp_path / name
        eng = _shop_engine(spark, settings.with_(warehouse=str(root / "warehouse")), root)
        write_users(eng.settings, n=3 if name == "one" else 5)
        try:
            eng.register_tables()
            counts.append(spark.table("dim.users").count())
        finally:
            eng.close()
    assert counts == [3, 5]


WIDE_SQL = "SELECT pos, id, " + ", ".join(
    "CASE WHEN id % 10 = 0 THEN id END AS c38" if i == 38 else f"id + {i} AS c{i}" for i in range(2, 40)
) + " FROM block"


def _wide_engine(spark, settings: Settings, root: Path) -> Engine:
    """A step topic whose destination has 40 columns; column 39 (``c38``) is null in 90% of rows."""
    import textwrap

    lin = root / "lineage"
    lin.mkdir(parents=True)
    (root / "wide.sql").write_text(WIDE_SQL)
    (lin / "wide.yaml").write_text(textwrap.dedent("""\
        sources:
          - table: stage.events
        topics:
          - table: fact.wide
            depends_on: [stage.events]
            transforms: [../wide.sql]
            maxstep: 100
            checks: {max_null_share: {c38: 0.1}}
        """))
    return Engine(settings.with_(lineage=lin), load_lineage(lin), spark=spark)


@pytest.mark.fast
def test_null_check_on_the_40th_column_can_fail(spark, settings, tmp_path, monkeypatch):
    from lineage.core.checks import evaluate_block
    from platform_assets.core import faults

    eng = _wide_engine(spark, settings, tmp_path)
    write_rows(eng.settings, "stage.events", make_events(200, distinct_pos=200, seed=4))
    checks = eng.lineage.topic("fact.wide").spec.checks
    try:
        r = eng.run_topic("fact.wide")
        assert r.processed and r.rows == 100
        assert len(spark.read.format("delta").load(eng.path("fact.wide")).columns) == 40
        # Delta's file statistics stop at the 32nd column: the count comes from the write itself.
        assert r.stats["nulls"]["c38"] == 90 and r.stats["nulls"]["c2"] == 0
        (entry,) = read_etl_log(eng.settings, "fact.wide")
        assert dict(entry["nulls"])["c38"] == 90 and len(entry["nulls"]) == 40
        nulls = {o.name: o for o in evaluate_block(checks, {**r.stats, "base_rows": r.base_rows})}["nulls"]
        assert not nulls.passed and nulls.description == "too many nulls: c38 90.0% > 10.0%"

        # A block whose data landed before a crash is not written again: no observation, so its
        # figures are read from the commit's Parquet footers, just as exact.
        def crash(point: str) -> None:
            if point == "written":
                raise RuntimeError("simulated crash after the Delta commit")

        monkeypatch.setattr(faults, "crashpoint", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            eng.run_topic("fact.wide")
        monkeypatch.undo()
        again = eng.run_topic("fact.wide")
        assert again.recovered and again.rows == 100
        assert again.stats["nulls"] == {**{f"c{i}": 0 for i in range(2, 40)}, "pos": 0, "id": 0, "c38": 90}
        assert not {o.name: o for o in evaluate_block(checks, {**again.stats, "base_rows": 100})}["nulls"].passed
    finally:
        eng.close()


def test_a_block_registers_only_the_tables_its_sql_names(tmp_path):
    from platform_assets.core.spark_io import tables_read

    extra = """\
        - table: fact.other
          depends_on: [stage.other]
          transforms: [../sql/other.sql]
          before: "DELETE FROM `FACT`.`Events` WHERE false"
        """
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "other.sql").write_text(
        "SELECT o.* FROM block o JOIN Dim.Users u ON u.user_id = o.user_id  -- stage.events_old is no table\n")
    lineage = load_lineage(write_lineage(tmp_path, extra_topic=extra))
    every = ["stage.events", "dim.users", "stage.other", "fact.events", "fact.other", "etl.log"]
    # the base is read as the view `block`, not by name
    assert tables_read(lineage.topic("fact.events"), every) == ["dim.users"]
    # any case, back-quoted, in before/after too; a longer name is not a match
    assert tables_read(lineage.topic("fact.other"), every) == ["dim.users", "fact.events"]


def test_sql_literal_text_reads_back_as_the_same_value_in_any_session_time_zone(spark):
    """Key values a view unit narrows its re-derivation by, as literal text: each reads back
    exactly; types whose text could shift (timestamps, floats) or need escapes beyond quotes
    get None (the unit then relies on its semi join alone)."""
    import decimal

    from platform_assets.core.spark_io import sql_literal

    values = [0, -7, 2**62, True, False, decimal.Decimal("-123.4500"), decimal.Decimal("1E+3"),
              dt.date(1969, 12, 31), dt.date(2026, 2, 28), "", "plain", "it's", "back\\slash", "a 'q' \\' mix"]
    for zone in ("UTC", "America/Los_Angeles"):
        with session_zone(spark, zone):
            texts = [sql_literal(v) for v in values]
            assert None not in texts
            got = spark.sql("SELECT " + ", ".join(f"{t} AS c{i}" for i, t in enumerate(texts))).collect()[0]
            assert list(got) == values
    for unsafe in (dt.datetime(2026, 1, 1, 12), 1.5, "line\nbreak", "ünïcode", b"\x00", decimal.Decimal("NaN"), [1]):
        assert sql_literal(unsafe) is None, unsafe


def test_sibling_sessions_keep_their_own_settings_and_copy_the_parents(spark, settings):
    """Sessions for threads (the CDC replicas of a unit): distinct, made once, each with its own SQL
    settings (a Delta write's txn settings stay in the session that set them), with the parent's
    settings set at run time copied at every call, also over Spark Connect."""
    from resources.spark.session import _connect_url, is_connect, sibling_sessions

    if is_connect(spark):
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        parent = ConnectSession.builder.remote(_connect_url(spark)).create()
    else:
        parent = spark.newSession()
    parent.conf.set("spark.sql.shuffle.partitions", "3")
    sibs = sibling_sessions(parent, settings, 2)
    assert len({id(s) for s in sibs}) == 2 and all(s is not parent for s in sibs)
    assert [s.conf.get("spark.sql.shuffle.partitions") for s in sibs] == ["3", "3"]
    sibs[0].conf.set("spark.databricks.delta.write.txnAppId", "tidemark:a")
    assert sibs[1].conf.get("spark.databricks.delta.write.txnAppId", None) is None
    assert parent.conf.get("spark.databricks.delta.write.txnAppId", None) is None
    parent.conf.set("spark.sql.shuffle.partitions", "5")
    again = sibling_sessions(parent, settings, 3)
    assert again[:2] == sibs and [s.conf.get("spark.sql.shuffle.partitions") for s in again] == ["5", "5", "5"]
    assert [r[0] for r in again[2].sql("SELECT 1 + 1").collect()] == [2]


def test_a_commit_through_spark_connect_has_the_server_compute_the_next_writes_txn_lookup(cli_spark_server, settings, tmp_path):
    """After a unit's commit over Spark Connect, a background ``DESCRIBE DETAIL`` has the server
    compute the table's state (the next write's ``txnAppId`` lookup) without writing anything; a
    look-ahead of a missing table creates nothing; a session stopped while one runs stops after it,
    its sibling sessions with it."""
    from deltalake import DeltaTable
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    from platform_assets.core import spark_io
    from resources.spark.session import sibling_sessions

    session = ConnectSession.builder.remote(cli_spark_server).create()
    path = str(tmp_path / "t")
    spark_io.as_unit(session.range(5).write.format("delta"), app_id="tidemark:t", seq=1, meta="{}").save(path)
    thread = spark_io.look_ahead_txn_state(session, path)
    assert thread is not None
    thread.join(120)
    assert not thread.is_alive()
    assert DeltaTable(path).version() == 0 and len(DeltaTable(path).history()) == 1
    missing = tmp_path / "missing"
    lost = spark_io.look_ahead_txn_state(session, str(missing))
    assert lost is not None
    lost.join(120)
    assert not lost.is_alive() and not missing.exists()
    siblings = sibling_sessions(session, settings, 2)  # what a CDC unit makes on the engine's session
    running = spark_io.look_ahead_txn_state(session, path)
    assert running is not None
    spark_io.stop_session(session)
    spark_io._await_look_aheads(120)
    assert not running.is_alive() and session.is_stopped
    # no client left open, and finished look-aheads hold no session: pyspark's exit handler calls the
    # server of every open Connect client, retrying for minutes once that server is gone
    assert session.client.is_closed and all(s.client.is_closed for s in siblings)
    assert thread.session is None and lost.session is None and running.session is None
    # the next unit's write, from a new session, lands after the look-ahead as before
    again = ConnectSession.builder.remote(cli_spark_server).create()
    try:
        spark_io.as_unit(again.range(3).write.format("delta").mode("append"), app_id="tidemark:t", seq=2, meta="{}").save(path)
        spark_io.as_unit(again.range(3).write.format("delta").mode("append"), app_id="tidemark:t", seq=2, meta="{}").save(path)
        assert DeltaTable(path).version() == 1 and DeltaTable(path).to_pyarrow_table().num_rows == 8
    finally:
        again.stop()


def test_a_classic_session_looks_nothing_ahead(spark, tmp_path):
    """A classic session's JVM ends with its process: nothing to compute ahead for a next process."""
    from platform_assets.core import spark_io
    from resources.spark.session import is_connect

    assert (spark_io.look_ahead_txn_state(spark, str(tmp_path / "t")) is None) == (not is_connect(spark))


def test_the_engine_looks_a_committed_tables_txn_state_ahead_when_its_next_unit_opens_or_it_closes(spark, settings, tmp_path,
                                                                                                  monkeypatch):
    """Over Spark Connect, each table a unit committed to is looked ahead once, when the engine's next
    unit opens (a loop) or the engine closes (a Dagster run), never at the commit itself; a classic
    session never."""
    from platform_assets.core import spark_io
    from resources.spark.session import is_connect

    started: list[str] = []
    threads: list[spark_io.LookAhead] = []
    real = spark_io.look_ahead_txn_state

    def spy(session, dest):
        started.append(dest)
        thread = real(session, dest)
        threads.extend([thread] if thread is not None else [])
        return thread

    monkeypatch.setattr(spark_io, "look_ahead_txn_state", spy)
    eng = _shop_engine(spark, settings, tmp_path, maxstep=50)
    write_users(eng.settings)
    write_rows(eng.settings, "stage.events", make_events(120, distinct_pos=120, seed=5))
    dest = eng.path("fact.events")
    try:
        first = eng.run_topic("fact.events")
        assert first.delta_version is not None and started == []  # not at the commit
        second = eng.run_topic("fact.events")  # its open starts the look-ahead of the first's commit
        assert second.delta_version is not None and started == [dest]
    finally:
        eng.close()  # the second's
    assert started == [dest, dest]
    spark_io._await_look_aheads(120)
    assert all(not t.is_alive() and t.session is None for t in threads)
    assert bool(threads) == is_connect(spark)


def test_a_units_jobs_are_in_its_job_group_and_the_threads_group_is_restored(spark) -> None:
    """``job_group``: what a follower's unit runs is in ``tidemark:<topic>`` (the Spark UI's job group,
    what ``bench/event_log.py`` sums by); the thread's group before is back after (Connect: nothing)."""
    from resources.spark.session import is_connect, job_group

    if is_connect(spark):
        with job_group(spark, "tidemark:t"):
            assert spark.range(3).count() == 3
        return
    sc = spark.sparkContext
    before = set(sc.statusTracker().getJobIdsForGroup("tidemark:t"))
    with job_group(spark, "tidemark:t"):
        assert spark.range(3).count() == 3
    assert set(sc.statusTracker().getJobIdsForGroup("tidemark:t")) - before
    assert sc.getLocalProperty("spark.jobGroup.id") is None
    after = set(sc.statusTracker().getJobIdsForGroup("tidemark:t"))
    spark.range(2).count()
    assert set(sc.statusTracker().getJobIdsForGroup("tidemark:t")) == after
