"""``tidemark follow`` (issue 55): one resident process runs every unit the moment it is due, on real
Spark + Delta, through the same commit protocol and lease lock as ``tidemark run``: rows appended
while it follows land once, views equal their recompute, a reload follows its base; two followers,
or a follower and a run, share the topics; SIGKILLed at random moments and restarted, nothing is
lost or doubled."""

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


@pytest.mark.slow
def test_sigkilled_at_random_moments_beside_a_second_follower_and_a_run_nothing_is_lost_or_doubled(
        spark, settings: Settings, tmp_path: Path, cli_spark) -> None:
    eng, _ = make_engine(spark, settings, tmp_path, FACT + WIDE + DAILY + COUNTRIES)
    s = eng.settings
    customers(eng)
    orders(eng, [(i, i) for i in range(1, 11)])
    rnd = random.Random(55)
    procs: list[subprocess.Popen] = []
    try:
        other = _follow(s)  # a second follower on the same store the whole time
        procs.append(other)
        next_id = 11
        for kill in range(5):
            p = _follow(s)
            procs.append(p)
            for _ in range(2):
                time.sleep(rnd.uniform(0.5, 3.0))
                orders(eng, [(i, i) for i in range(next_id, next_id + 5)])
                next_id += 5
            if kill == 2:  # a run beside them: it runs what it can take, names what another holds
                run = tidemark(s, "run", "--until-caught-up")
                assert run.returncode == 0 or "is being processed by" in run.stderr, (run.stdout, run.stderr[-2000:])
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        DeltaTable(eng.path("dim.customers")).update(predicate="id = 2", updates={"country": "'XX'"})
        other.send_signal(signal.SIGTERM)  # stops after the units running now
        out, err = other.communicate(timeout=120)
        assert other.returncode == 0, err[-3000:]
        assert "stopped after" in out, out[-2000:]
        last = tidemark(s, "follow", "--until-idle", "8", "--max-seconds", "240")
        assert last.returncode == 0, last.stderr[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    _exact(eng, next_id - 1)
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
