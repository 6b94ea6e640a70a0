"""``tidemark follow`` (issue 55): one resident process runs every unit the moment it is due, on real
Spark + Delta, through the same commit protocol and lease lock as ``tidemark run``: rows appended
while it follows land once, views equal their recompute, a reload follows its base; two followers,
or a follower and a run, share the topics; SIGKILLed at 20 random moments and restarted while orders,
a PostgreSQL source and a real collector write, nothing is lost or doubled."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from lineage.core.errors import TidemarkError
from lineage.spec.loader import load_lineage
from platform_assets.follow.loop import Event, Follower
from resources.core.settings import Settings
from tests.platform_assets.shop import tidemark
from tests.platform_assets.test_cleanup import (
    COUNTRIES,
    DAILY,
    FACT,
    WIDE,
    assert_equals_recompute,
    customers,
    make_engine,
    orders,
)

pytestmark = pytest.mark.spark

TOPICS = ("fact.orders", "mart.wide", "mart.daily")


def _exact(eng, total: int) -> None:  # noqa: ANN001
    assert assert_equals_recompute(eng, "fact.orders") == total
    assert assert_equals_recompute(eng, "mart.wide") == total
    assert assert_equals_recompute(eng, "mart.daily") == 5
    countries = sorted((r["country"], r["n"]) for r in DeltaTable(eng.path("dim.countries")).to_pyarrow_table().to_pylist())
    assert countries == [("C0", 2), ("C1", 2), ("XX", 1)]


@pytest.mark.fast
def test_a_follower_runs_every_unit_as_rows_arrive_and_ends_exact(spark, settings: Settings, tmp_path: Path) -> None:
    eng, _ = make_engine(spark, settings, tmp_path, FACT + WIDE + DAILY + COUNTRIES)
    customers(eng)
    orders(eng, [(i, i) for i in range(1, 21)])
    events: list[Event] = []
    follower = Follower(eng.settings, eng.lineage, spark=spark, report=events.append)
    stop = threading.Event()
    done: list[int] = []
    runner = threading.Thread(target=lambda: done.append(follower.run(stop, until_idle_s=5, max_seconds=240)))
    runner.start()
    try:
        for batch in range(3):  # rows and a customer change arrive while it follows
            time.sleep(1.5)
            orders(eng, [(i, i) for i in range(21 + 10 * batch, 31 + 10 * batch)])
        DeltaTable(eng.path("dim.customers")).update(predicate="id = 2", updates={"country": "'XX'"})
        runner.join(timeout=300)
    finally:
        stop.set()
        runner.join()
        follower.close()
    assert done and done[0] >= 5, [(e.work, e.wait, e.error) for e in events]
    assert not [e for e in events if e.error is not None], [(e.work, e.error) for e in events if e.error]
    worked = {e.work for e in events if e.result is not None}
    assert worked >= {"fact.orders", "mart.wide", "mart.daily", "dim.countries"}
    _exact(eng, 50)
    eng.close()


def _follow(s: Settings, *extra: str) -> subprocess.Popen:
    return tidemark(s, "follow", "--interval", "0.3", *extra, wait=False)


#: The harness's CDC source: a keyed table and a keyless one (``REPLICA IDENTITY FULL``).
CDC_SQL = ("CREATE SCHEMA fk", "CREATE TABLE fk.acct (id int PRIMARY KEY, v int)",
           "CREATE TABLE fk.bag (x int, y text)", "ALTER TABLE fk.bag REPLICA IDENTITY FULL",
           "INSERT INTO fk.acct SELECT g, 0 FROM generate_series(1, 50) g")
INTAKE = """\
collector: {port: 0, rotate_minutes: 0.02, fsync_group_ms: 1}
tokens:
  - {id: web, kind: browser, secret_env: T_WEB}
destinations:
  - id: main
    table_name_template: "events_{{ event_type }}"
"""


def _cdc_changes(pg: str, n: int) -> None:
    """Round ``n`` of the source's transactions: updates, a key moved, inserts and deletes."""
    from tests.platform_assets.test_cdc_postgres import sql

    sql(pg, f"UPDATE fk.acct SET v = v + {n} WHERE id % 7 = {n % 7}",
        f"UPDATE fk.acct SET id = {1000 + n} WHERE id = (SELECT min(id) FROM fk.acct WHERE id < 1000)",
        f"INSERT INTO fk.acct VALUES ({2000 + n}, {n})", f"INSERT INTO fk.bag VALUES ({n}, 'p'), ({n}, 'p'), ({n}, 'q')",
        f"DELETE FROM fk.bag WHERE x = {n} AND y = 'q'", f"DELETE FROM fk.acct WHERE id = {2000 + n - 5}")


@pytest.mark.slow
@pytest.mark.postgres
def test_sigkilled_20_times_while_orders_a_cdc_source_and_the_collector_write_nothing_is_lost_or_doubled(
        spark, settings: Settings, tmp_path: Path, cli_spark, pg: str, monkeypatch) -> None:  # noqa: ANN001
    """Issue 55's harness: the follower SIGKILLed at 20 random moments and restarted, while orders are
    appended, a PostgreSQL source commits transactions and a real collector takes events over HTTP;
    beside it a second follower the whole time and, once, a ``tidemark run``. At the end every fact
    holds each row once, every view equals its recompute, the replicas equal their tables, and every
    event the collector accepted is in its stage table once."""
    import httpx

    from tests.platform_assets.test_cdc_postgres import query, replica, sql
    from tests.resources.test_collector import Collector

    eng, _ = make_engine(spark, settings, tmp_path, FACT + WIDE + DAILY + COUNTRIES)
    s = eng.settings
    with s.lineage.open("a") as f:
        f.write("cdc:\n  - name: fk\n    dsn_env: TM_TEST_DSN\n    tables: [fk.*]\n    schema: r_fk\n")
    monkeypatch.setenv("TM_TEST_DSN", pg)
    intake = tmp_path / "intake.yaml"
    intake.write_text(INTAKE)
    monkeypatch.setenv("TIDEMARK_INTAKE", str(intake))
    sql(pg, *CDC_SQL)
    customers(eng)
    orders(eng, [(i, i) for i in range(1, 11)])
    collector = Collector(s.home, intake, env={"T_WEB": "web-secret-Zq81"})
    rnd = random.Random(55)
    procs: list[subprocess.Popen] = []
    accepted: list[int] = []

    def post(first: int, n: int) -> None:
        batch = [{"event_type": "pv", "n": i} for i in range(first, first + n)]
        r = httpx.post(f"{collector.url}/api/v1/event?token=web-secret-Zq81", json=batch, timeout=10)
        assert r.status_code == 200, r.text
        accepted.extend(range(first, first + n))

    try:
        other = _follow(s)  # a second follower on the same store the whole time
        procs.append(other)
        next_id = 11
        for kill in range(20):
            p = _follow(s)
            procs.append(p)
            for _ in range(2):
                time.sleep(rnd.uniform(0.3, 2.5))
                orders(eng, [(i, i) for i in range(next_id, next_id + 5)])
                _cdc_changes(pg, next_id)
                post(next_id, 5)
                next_id += 5
            if kill == 10:  # a run beside them: it runs what it can take, names what another holds
                run = tidemark(s, "run", "--until-caught-up")
                assert run.returncode == 0 or "is being processed by" in run.stderr, (run.stdout, run.stderr[-2000:])
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        DeltaTable(eng.path("dim.customers")).update(predicate="id = 2", updates={"country": "'XX'"})
        # a graceful stop (uvicorn re-raises the SIGTERM after it) closes its open file: every event is in a ready file
        assert collector.stop() == -signal.SIGTERM
        other.send_signal(signal.SIGTERM)  # stops after the units running now
        out, err = other.communicate(timeout=120)
        assert other.returncode == 0, err[-3000:]
        assert "stopped after" in out, out[-2000:]
        t = time.monotonic()
        last = _follow(s, "--until-idle", "8", "--max-seconds", "240")
        procs.append(last)
        out, err = last.communicate(timeout=300)
        assert last.returncode == 0 and "stopped after" in out, (out[-4000:], err[-3000:])
        assert time.monotonic() - t < 230, f"never idle:\n{out[-4000:]}"
    finally:
        collector.stop(signal.SIGKILL)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    _exact(eng, next_id - 1)
    assert replica(spark, s, "r_fk.fk__acct", "id,v") == sorted(query(pg, "SELECT id, v FROM fk.acct"))
    bag = sorted(query(pg, "SELECT x, y FROM fk.bag"))
    assert replica(spark, s, "r_fk.fk__bag", "x,y") == bag and len(bag) == 2 * 20 * 2
    got = sorted(r["n"] for r in DeltaTable(s.table_path("stage.events_pv")).to_pyarrow_table(columns=["n"]).to_pylist())
    assert got == sorted(accepted) and len(accepted) == 200  # every accepted event once
    eng.close()


def test_follow_names_an_unknown_topic_before_anything_runs(settings: Settings, tmp_path: Path) -> None:
    from lineage.core.errors import TidemarkError

    lineage = tmp_path / "lineage.yaml"
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "fact.sql").write_text("SELECT * FROM block\n")
    lineage.write_text("sources:\n  - table: stage.orders\ntopics:\n  - table: fact.orders\n    depends_on: [stage.orders]\n"
                       "    transforms: [sql/fact.sql]\n")
    with pytest.raises(TidemarkError, match="unknown topic or replicator fact.ordrs"):
        Follower(settings.with_(lineage=lineage), load_lineage(lineage), names=["fact.ordrs"])


def test_the_follower_lands_the_collectors_ready_files_as_they_come(spark, settings: Settings, tmp_path: Path) -> None:
    import datetime as dt

    from lineage.intake.config import load_intake
    from resources.intake.incoming_log import iter_ready_files
    from tests.platform_assets.shop import write_lineage
    from tests.platform_assets.test_events import config, rows, write_file

    t0 = dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC)
    s = settings.with_(lineage=write_lineage(tmp_path))
    intake = load_intake(config(tmp_path), secrets=False)
    events: list[Event] = []
    follower = Follower(s, load_lineage(s.lineage), names=["events"], intake=intake, spark=spark, report=events.append)
    assert list(follower.works) == ["events"]
    write_file(s, "web", t0, [{"event_type": "pv", "n": 1}, {"event_type": "pv", "n": 2}])
    stop = threading.Event()
    runner = threading.Thread(target=lambda: follower.run(stop, until_idle_s=3, max_seconds=120))
    runner.start()
    try:
        time.sleep(2.0)  # a file the collector rotates while it follows
        write_file(s, "web", t0 + dt.timedelta(minutes=5), [{"event_type": "pv", "n": 3}])
        runner.join(timeout=150)
    finally:
        stop.set()
        runner.join()
        follower.close()
    assert not [e for e in events if e.error is not None], [(e.work, e.error) for e in events if e.error]
    got = rows(s, "stage.events_pv")
    assert sorted(r["n"] for r in got) == [1, 2, 3] and len({r["id"] for r in got}) == 3
    units = [r for e in events if e.result is not None for r in e.result.results]
    assert sum(u.files for u in units) == 2 and sum(u.written for u in units) == 3
    assert not iter_ready_files(s.events_dir())
    with pytest.raises(TidemarkError, match="and events, the intake"):
        Follower(s, load_lineage(s.lineage), names=["event"], intake=intake)


def test_following_everything_leaves_out_a_replicator_whose_source_is_not_set_up_and_says_why(
        settings: Settings, monkeypatch) -> None:  # noqa: ANN001
    demo = Path(__file__).resolve().parents[2] / "demo" / "lineage"
    lineage = load_lineage(demo)
    (rep,) = lineage.replicators.values()
    monkeypatch.delenv(rep.spec.dsn_env, raising=False)
    s = settings.with_(lineage=demo)
    everything = Follower(s, lineage)
    assert f"cdc:{rep.name}" not in everything.works and set(lineage.topics) <= set(everything.works)
    assert f"environment variable {rep.spec.dsn_env} is not set" in everything.left_out[f"cdc:{rep.name}"]
    named = Follower(s, lineage, names=[f"cdc:{rep.name}"])  # asked for by name: followed, and its units say why they fail
    assert list(named.works) == [f"cdc:{rep.name}"] and not named.left_out
    monkeypatch.setenv(rep.spec.dsn_env, "postgresql://nobody@127.0.0.1:1/none")
    assert f"cdc:{rep.name}" in Follower(s, lineage).works
