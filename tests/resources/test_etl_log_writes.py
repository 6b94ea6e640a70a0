"""etl.log appends from threads of one process and after a lost commit (the JVM-free writer)."""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path

import pytest

from resources.core.settings import Settings
from resources.storage import meta_tables
from resources.storage.meta_tables import LogEntry, read_etl_log, write_etl_log


def entry(topic: str, seq: int = 1) -> LogEntry:
    return LogEntry(topic=topic, ts=dt.datetime(2026, 1, 1), rows=1, max_id=None, min_ts=None, max_ts=None, nulls={},
                    run_id="r", processor="cdc", seq=seq, last="0", next="1", base_rows=1, bad_rows=0,
                    delta_version=0, duration_s=0.0)


def test_threads_appending_to_an_etl_log_that_does_not_exist_yet_all_land(tmp_path: Path) -> None:
    """A unit's replicas log from threads; the first appends create the table (``deltalake`` refuses
    all but one of several concurrent creations)."""
    settings = Settings.from_env({}, home=tmp_path / "home")
    go = threading.Barrier(4, timeout=60)
    errors: list[BaseException] = []

    def log(i: int) -> None:
        go.wait()
        try:
            write_etl_log(settings, entry(f"replica.t{i}"))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=log, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(e["topic"] for e in read_etl_log(settings, limit=10)) == [f"replica.t{i}" for i in range(4)]


def test_an_append_that_lost_to_another_commit_is_tried_again_once_landed(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from deltalake.exceptions import CommitFailedError

    settings = Settings.from_env({}, home=tmp_path / "home")
    append = meta_tables._append_etl_log
    calls: list[str] = []

    def losing_once(s: Settings, e: LogEntry) -> bool:
        calls.append(e.topic)
        if len(calls) == 1:
            raise CommitFailedError("Metadata changed since last commit")
        return append(s, e)

    monkeypatch.setattr(meta_tables, "_append_etl_log", losing_once)
    assert write_etl_log(settings, entry("replica.a")) is True
    assert write_etl_log(settings, entry("replica.a")) is False  # the row's txn: never twice
    assert [e["topic"] for e in read_etl_log(settings, limit=10)] == ["replica.a"]
    monkeypatch.setattr(meta_tables, "_append_etl_log", lambda s, e: (_ for _ in ()).throw(ValueError("bad row")))
    with pytest.raises(ValueError, match="bad row"):  # any other failure is not retried
        write_etl_log(settings, entry("replica.b"))
