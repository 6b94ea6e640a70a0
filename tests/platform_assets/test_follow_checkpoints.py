"""The follower checkpoints the sources it reads once 10 commits follow their newest checkpoint
(JVM-free, ``deltalake``), as ``tidemark maintain`` does from 20: the table's rows stay the same,
a source its writer checkpointed is left alone, ``off`` turns it off, and a source that cannot be
checkpointed is said once and not tried again."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from lineage.core.errors import ConfigError
from platform_assets.follow.checkpoints import EVERY_ENV, SourceCheckpoints, every_setting
from resources.core.settings import Settings
from resources.storage import delta_log


def _source(settings: Settings, table: str, commits: int) -> str:
    path = settings.table_path(table)
    for i in range(commits):
        write_deltalake(path, pa.table({"id": pa.array([i], pa.int64())}), mode="append")
    return path


def _hint(path: str) -> int | None:
    return delta_log.last_checkpoint_hint(*delta_log.log_fs(path))


def _settle(cps: SourceCheckpoints) -> None:
    deadline = time.monotonic() + 30
    while cps._busy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not cps._busy


def test_a_source_ten_commits_past_its_checkpoint_is_checkpointed_and_reads_the_same(tmp_path: Path,
                                                                                      caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings.from_env({}, home=tmp_path)
    path = _source(settings, "stage.a", 12)  # versions 0..11, deltalake checkpoints every 100
    other = _source(settings, "stage.b", 12)
    assert _hint(path) is None
    cps = SourceCheckpoints({t: settings.table_path(t) for t in ("stage.a", "stage.c")}, 10)
    try:
        cps.saw({"stage.a": 11, "stage.b": 11})  # stage.b is not a source of this lineage: left alone
        _settle(cps)
        assert _hint(path) == 11 and _hint(other) is None and cps.written == {"stage.a": 1}
        rows = DeltaTable(path).to_pyarrow_table()["id"].to_pylist()
        assert sorted(rows) == list(range(12))
        _source(settings, "stage.a", 5)  # v16: 5 commits past it
        cps.saw({"stage.a": 16})
        _settle(cps)
        assert _hint(path) == 11 and cps.written == {"stage.a": 1}
        DeltaTable(path).create_checkpoint()  # its writer checkpoints it (v16) ...
        _source(settings, "stage.a", 9)  # ... v25: 9 past that one, 14 past the follower's
        cps.saw({"stage.a": 25})
        _settle(cps)
        assert _hint(path) == 16 and cps.written == {"stage.a": 1}  # the hint says 9: not yet
        _source(settings, "stage.a", 1)
        cps.saw({"stage.a": 26})
        _settle(cps)
        assert _hint(path) == 26 and cps.written == {"stage.a": 2}
        assert sorted(DeltaTable(path).to_pyarrow_table()["id"].to_pylist()) == sorted([*range(12), *range(5), *range(9), 0])

        # A source that cannot be checkpointed (here its _last_checkpoint is a directory): said once,
        # tried again only after RETRY_S.
        broken = _source(settings, "stage.c", 11)
        (Path(broken) / "_delta_log" / "_last_checkpoint").mkdir()
        with caplog.at_level("WARNING"):
            cps.saw({"stage.c": 10})
            _settle(cps)
            cps.saw({"stage.c": 30})
            _settle(cps)
        said = [r.getMessage() for r in caplog.records if "cannot checkpoint source stage.c" in r.getMessage()]
        assert len(said) == 1 and EVERY_ENV in said[0] and "stage.c" in cps._failed and cps.written == {"stage.a": 2}
        cps._failed["stage.c"] = (cps._failed["stage.c"][0], 0.0)  # its retry is due, and the cause is gone:
        (Path(broken) / "_delta_log" / "_last_checkpoint").rmdir()
        cps.saw({"stage.c": 31})
        _settle(cps)
        assert "stage.c" not in cps._failed and cps.written["stage.c"] == 1
        assert (Path(broken) / "_delta_log" / f"{10:020d}.checkpoint.parquet").exists()
    finally:
        cps.close()
    cps.saw({"stage.a": 99})  # closed: nothing more starts
    assert not cps._busy and cps.written["stage.a"] == 2


def test_the_checkpoint_setting_is_a_number_of_commits_or_off(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(EVERY_ENV, raising=False)
    assert every_setting() == 10
    monkeypatch.setenv(EVERY_ENV, "25")
    assert every_setting() == 25
    monkeypatch.setenv(EVERY_ENV, "off")
    assert every_setting() is None
    settings = Settings.from_env({}, home=tmp_path)
    path = _source(settings, "stage.a", 12)
    cps = SourceCheckpoints({"stage.a": path}, every_setting())
    cps.saw({"stage.a": 11})
    cps.close()
    assert _hint(path) is None
    monkeypatch.setenv(EVERY_ENV, "0")
    with pytest.raises(ConfigError, match=f"{EVERY_ENV}='0'"):
        every_setting()


def test_the_follower_looks_at_and_checkpoints_a_source_where_its_own_path_says(tmp_path: Path) -> None:
    """A source with a ``path`` of its own is watched and checkpointed there, as Engine.path reads it."""
    from lineage.spec.loader import load_lineage
    from platform_assets.follow.loop import Follower

    elsewhere = tmp_path / "lake" / "orders"
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "o.sql").write_text("SELECT * FROM block\n")
    lin = tmp_path / "lineage"
    lin.mkdir()
    (lin / "l.yaml").write_text(f"""sources:
  - table: stage.orders
    path: {elsewhere}
topics:
  - table: fact.orders
    depends_on: [stage.orders]
    transforms: [../sql/o.sql]
""")
    settings = Settings.from_env({}, home=tmp_path / "home", lineage=lin)
    for i in range(11):
        write_deltalake(str(elsewhere), pa.table({"id": pa.array([i], pa.int64())}), mode="append")
    follower = Follower(settings, load_lineage(settings.lineage))
    try:
        assert follower._paths["stage.orders"] == str(elsewhere) and follower.checkpoints.paths == {"stage.orders": str(elsewhere)}
        assert "stage.orders" in follower._changed_tables() and follower._versions["stage.orders"] == 10
        _settle(follower.checkpoints)
        assert _hint(str(elsewhere)) == 10
    finally:
        follower.close()
