"""The ``tidemark`` commands that need no JVM, run through ``main`` on a temporary home."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lineage.core.positions import Position
from platform_assets.cli.main import main
from resources.state.offset_sql import open_offset_store
from tests.platform_assets.shop import make_events, write_lineage, write_rows

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def home_args(tmp_path: Path) -> list[str]:
    lin = write_lineage(tmp_path, maxstep=10)
    return ["--home", str(tmp_path / "home"), "--lineage", str(lin)]


def test_validate_demo_lineage(capsys):
    assert main(["--lineage", str(ROOT / "demo" / "lineage"), "lineage", "validate"]) == 0
    out = capsys.readouterr().out
    assert "OK: 5 topics, 4 sources in 2 file(s)" in out and "fact.order_items" in out and "5s" in out


def test_validate_bad_lineage_exits_2_naming_file_topic_field(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("topics:\n  - table: fact.x\n    depends_on: [stage.a]\n    transforms: [x.sql]\n    delay: soon\n")
    assert main(["--lineage", str(tmp_path), "lineage", "validate"]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml:5: topic 'fact.x': field 'delay': 'soon' is not a duration" in err


def test_offsets_init_show_reset_unlock_and_history(home_args, tmp_path, capsys):
    assert main([*home_args, "offsets", "init", "fact.events", "--start", "2026-01-01T00:10:00/5"]) == 0
    assert "last = 2026-01-01 00:10:00.000 #5" in capsys.readouterr().out
    store = open_offset_store(f"sqlite:///{tmp_path / 'home' / 'offsets.db'}")
    lease = store.acquire("fact.events", "elsewhere:1:abcd").lease_until
    assert main([*home_args, "offsets", "show"]) == 0
    header, _, row = capsys.readouterr().out.splitlines()
    assert header.split()[-2:] == ["lease", "until"]
    assert row.endswith(f"elsewhere:1:abcd  {lease:%Y-%m-%d %H:%M:%S.%f}"[:-3])
    assert main([*home_args, "offsets", "reset", "fact.events", "--to", "zero", "--reason", "rebuild"]) == 1
    err = capsys.readouterr().err
    assert "being processed by 'elsewhere:1:abcd'" in err
    assert f"Its lease expires at {lease:%Y-%m-%dT%H:%M:%S.%f} UTC; if that run is dead the lock is taken over then" in err
    assert main([*home_args, "offsets", "unlock", "fact.events"]) == 0
    assert "was held by elsewhere:1:abcd" in capsys.readouterr().out
    assert main([*home_args, "offsets", "reset", "fact.events", "--to", "zero"]) == 1  # a reason is required
    assert "--reason" in capsys.readouterr().err
    assert main([*home_args, "offsets", "reset", "fact.events", "--to", "zero", "--reason", "rebuild"]) == 0
    assert store.get("fact.events").last.is_zero()
    assert main([*home_args, "offsets", "show", "--history"]) == 0
    out = capsys.readouterr().out
    assert "reset" in out and "rebuild" in out and "unlock" in out and "init" in out


def test_unknown_topic_is_a_clear_error(home_args, capsys):
    assert main([*home_args, "offsets", "init", "fact.nope"]) == 1
    assert "unknown topic 'fact.nope' (known topics: fact.events)" in capsys.readouterr().err


def test_lag_without_a_jvm(home_args, tmp_path, capsys):
    from resources.core.settings import Settings

    settings = Settings.from_env({}, home=tmp_path / "home")
    write_rows(settings, "stage.events", make_events(25, distinct_pos=25))
    assert main([*home_args, "lag"]) == 0
    assert "not started" in capsys.readouterr().out
    assert main([*home_args, "offsets", "init", "fact.events"]) == 0
    capsys.readouterr()
    assert main([*home_args, "lag"]) == 0
    out = capsys.readouterr().out
    assert "ready: next block 10 rows up to" in out  # maxstep 10 of 25 eligible rows
    # In a fresh process, lag must not even import Spark's session module.
    code = ("import sys; from platform_assets.cli.main import main; rc = main(sys.argv[1:]); "
            "print('SPARK' if 'pyspark.sql.session' in sys.modules else 'NO-SPARK', rc)")
    proc = subprocess.run([sys.executable, "-c", code, *home_args, "lag"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split()[-2:] == ["NO-SPARK", "0"], proc.stderr


def test_run_on_a_missing_base_table_fails_and_an_empty_one_waits(home_args, tmp_path, capsys):
    from resources.core.settings import Settings
    from tests.platform_assets.shop import EVENTS_SCHEMA, write_rows

    settings = Settings.from_env({}, home=tmp_path / "home")
    path = settings.table_path("stage.events")
    assert main([*home_args, "run"]) == 1
    captured = capsys.readouterr()
    assert f"waits: stage.events does not exist at {path}; check the table name or the source's path" in captured.out
    assert f"error: stage.events does not exist at {path}" in captured.err
    assert main([*home_args, "run", "fact.events"]) == 1
    capsys.readouterr()
    write_rows(settings, "stage.events", [], EVENTS_SCHEMA)  # an empty table: a normal wait
    assert main([*home_args, "run"]) == 0
    assert "waits: no new rows (stage.events is empty)" in capsys.readouterr().out


def test_an_offsets_url_in_a_missing_folder_is_refused_not_created(tmp_path, capsys):
    lin = write_lineage(tmp_path)
    url = f"sqlite:///{tmp_path}/no/such/dir/x.db"
    assert main(["--home", str(tmp_path / "home"), "--lineage", str(lin), "--offsets-url", url, "lag"]) == 1
    assert f"error: offset store '{url}': the folder {tmp_path}/no/such/dir does not exist" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
    # The default store under a new state dir is created with its folder.
    assert main(["--home", str(tmp_path / "new" / "home"), "--lineage", str(lin), "lag"]) == 0
    assert (tmp_path / "new" / "home" / "offsets.db").is_file()


def test_validate_warns_where_a_topic_would_wait_for_ever(tmp_path, capsys):
    from resources.core.settings import Settings
    from tests.platform_assets.shop import write_users

    lin = write_lineage(tmp_path, deps="[stage.events, dim.users]")
    args = ["--home", str(tmp_path / "home"), "--lineage", str(lin), "lineage", "validate"]
    assert main(args) == 0
    out = capsys.readouterr().out
    path = Settings.from_env({}, home=tmp_path / "home").table_path("dim.users")
    assert f"topic 'fact.events': dependency dim.users does not exist at {path}; the topic waits until it does" in out
    assert "topic 'fact.events': base stage.events does not exist at" in out
    write_users(Settings.from_env({}, home=tmp_path / "home"))
    assert main(args) == 0
    assert "dependency dim.users" not in capsys.readouterr().out
    (lin / "events.yaml").write_text((lin / "events.yaml").read_text().replace(
        "  - table: stage.events\n", "  - table: stage.events\n    freshness: static\n"))
    assert main(args) == 0
    assert "its base stage.events is declared 'freshness: static' (never changes), so it never gets a block" in capsys.readouterr().out


def test_log_shows_the_columns_that_have_nulls(home_args, tmp_path, capsys):
    """etl.log counts every column's nulls (zeros too, so a missing column reads as unknown); the
    table a person reads lists only the columns that have some."""
    import datetime as dt

    from resources.core.settings import Settings
    from resources.storage.meta_tables import LogEntry, write_etl_log

    settings = Settings.from_env({}, home=tmp_path / "home")
    write_etl_log(settings, LogEntry(topic="fact.events", ts=dt.datetime(2026, 1, 1), rows=5, max_id=9, min_ts=None,
                                     max_ts=None, nulls={"amount": 0, "country": 3, "id": 0}, run_id="r", processor="step",
                                     seq=1, last="", next="", base_rows=5, bad_rows=0, delta_version=0, duration_s=1.0))
    assert main([*home_args, "log"]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert "country=3" in row and "amount" not in row and "id=0" not in row


def test_offsets_prune_and_maintain_prune_the_offset_log_history_only(home_args, tmp_path, capsys, monkeypatch):
    import datetime as dt

    (tmp_path / "home").mkdir()
    store = open_offset_store(f"sqlite:///{tmp_path / 'home' / 'offsets.db'}")
    long_ago = dt.datetime.now(dt.UTC).replace(tzinfo=None) - dt.timedelta(days=45)
    store.clock = lambda: long_ago
    for name in ("fact.events", "old.one", "old.two"):
        store.init(name, Position.parse("start"), "step", who="test")
    for _ in range(3):
        store.unlock("old.one", who="test")  # old.one: four old entries, of which the newest is kept
    store.clock = lambda: dt.datetime.now(dt.UTC).replace(tzinfo=None)
    store.unlock("fact.events", who="test")  # a new entry
    entries = len(store.history(limit=1000))
    monkeypatch.setenv("TIDEMARK_OFFSET_LOG_KEEP", "1")
    assert main([*home_args, "offsets", "prune", "--older-than", "60d"]) == 0
    assert capsys.readouterr().out.strip() == "offset log: 0 entries removed (entries older than 60d, each topic's newest 1 kept)"
    assert main([*home_args, "offsets", "prune", "--older-than", "30d", "--keep", "3", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("offset log: 1 entry would be removed")  # old.one's oldest
    assert main([*home_args, "offsets", "prune", "--dry-run"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == "offset log: 4 entries would be removed (entries older than 30d, each topic's newest 1 kept)", out
    assert len(store.history(limit=1000)) == entries
    assert main([*home_args, "maintain", "--dry-run"]) == 0
    assert "offset log: 4 entries would be removed" in capsys.readouterr().out
    assert main([*home_args, "offsets", "prune", "--older-than", "0"]) == 1
    assert "--older-than '0': give an age such as 30d" in capsys.readouterr().err
    monkeypatch.setenv("TIDEMARK_OFFSET_LOG_RETENTION", "forever")
    assert main([*home_args, "maintain"]) == 1  # refused before any table is touched
    assert "TIDEMARK_OFFSET_LOG_RETENTION: 'forever' is not a duration" in capsys.readouterr().err
    monkeypatch.setenv("TIDEMARK_OFFSET_LOG_RETENTION", "30d")
    assert main([*home_args, "maintain"]) == 0
    assert "offset log: 4 entries removed" in capsys.readouterr().out
    left = store.history(limit=1000)
    assert len(left) == entries - 4 and {e.topic for e in left} == {"fact.events", "old.one", "old.two"}
    assert [e.action for e in left if e.topic == "fact.events"] == ["unlock"]
    assert {r.topic for r in store.list()} >= {"fact.events", "old.one", "old.two"}
    monkeypatch.setenv("TIDEMARK_OFFSET_LOG_RETENTION", "0")
    assert main([*home_args, "maintain"]) == 0
    assert "offset log: nothing pruned (the offset log is kept whole: TIDEMARK_OFFSET_LOG_RETENTION=0)" in capsys.readouterr().out
    assert main([*home_args, "offsets", "prune"]) == 1  # by hand, an age is needed then
    assert "give --older-than AGE (e.g. 30d) to prune by hand" in capsys.readouterr().err
    assert main([*home_args, "offsets", "prune", "old.one", "--older-than", "30d"]) == 1  # never one topic's only
    assert "tidemark offsets prune takes no topic ('old.one')" in capsys.readouterr().err
    assert main([*home_args, "offsets", "prune", "--older-than", "30m"]) == 1
    assert "--older-than '30m': keep the offset log at least 1h" in capsys.readouterr().err
    assert len(store.history(limit=1000)) == entries - 4  # none of these removed anything


def test_maintain_reports_a_failed_pruning_after_the_tables_and_exits_1(home_args, tmp_path, capsys, monkeypatch):
    import sqlite3

    from resources.state.offsets import LogRetention

    def locked(self, store, *, dry_run=False):  # noqa: ANN001, ANN202
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(LogRetention, "prune", locked)
    assert main([*home_args, "maintain"]) == 1
    out = capsys.readouterr()
    assert "table(s):" in out.out and "offset log: FAILED: OperationalError: database is locked" in out.out
    assert "error: the offset log was not pruned (above)" in out.err
    assert main([*home_args, "offsets", "prune", "--older-than", "2d"]) == 1
    assert "error: the offset log was not pruned: OperationalError: database is locked" in capsys.readouterr().err
