"""Exactly-once across real crashes: a ``tidemark run`` subprocess is killed with SIGKILL at
each point of a step, then resumed; and two processes race for one topic."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from lineage.core.errors import TopicLockedError
from platform_assets.engine.runner import data_app_id
from resources.core.settings import Settings
from resources.state.offset_sql import local_owner_is_dead, make_owner, open_offset_store
from resources.state.offsets import utcnow
from resources.storage.meta_tables import read_etl_log
from tests.platform_assets.shop import full_recompute, seeded, sorted_rows
from tests.platform_assets.shop import tidemark as _tidemark

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _sorted_rows(df) -> list[tuple]:
    return sorted_rows(df)


def _expected(spark, settings: Settings) -> list[tuple]:
    return full_recompute(spark, settings)


@pytest.fixture
def crash_settings(settings: Settings, tmp_path: Path) -> Settings:
    return seeded(settings, tmp_path, maxstep=120, events=600, distinct_pos=25, seed=11)


def test_sigkill_at_every_point_then_resume_lands_each_row_once(spark, crash_settings, cli_spark):
    s = crash_settings
    dest = s.table_path("fact.events")
    store = open_offset_store(s.offsets_url)
    seen_seq = 0
    for point in ["planned", "transformed", "written", "logged", "committed"]:
        proc = _tidemark(s, "run", "fact.events", "--until-caught-up", env={"TIDEMARK_CRASH_AT": point})
        assert proc.returncode == -9, f"expected SIGKILL at {point}: rc={proc.returncode}\n{proc.stderr[-3000:]}"
        rec = store.get("fact.events")
        assert rec is not None and rec.owner != ""  # the dead process still "holds" the lock
        recorded = DeltaTable(dest).transaction_version(data_app_id("fact.events")) if DeltaTable.is_deltatable(dest) else None
        if point in ("planned", "transformed"):
            assert rec.pending and rec.seq == seen_seq + 1 and (recorded or 0) == seen_seq  # nothing landed
        elif point in ("written", "logged"):
            assert rec.pending and recorded == rec.seq  # landed, offset behind: the retry must not write again
        else:
            assert not rec.pending and recorded == rec.seq
        seen_seq = rec.seq if not rec.pending else rec.seq - (0 if point in ("written", "logged") else 1)
        if point in ("written", "logged"):
            seen_seq = rec.seq
    # Resume: the dead holder is detected (same host, no such pid), the pending block redone.
    proc = _tidemark(s, "run", "fact.events", "--until-caught-up")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "block" in proc.stdout
    got = _sorted_rows(spark.read.format("delta").load(dest))
    assert got == _expected(spark, s)
    log = read_etl_log(s, "fact.events", limit=1000)
    assert sorted(r["seq"] for r in log) == list(range(1, len(log) + 1))  # one log row per block
    assert sum(r["base_rows"] for r in log) == 600
    history = store.history("fact.events", limit=1000)
    assert [h.action for h in history].count("steal") == 5  # each resume took the dead process's lock, logged
    # After the kill at "written", the next two runs found block 1 already in the Delta log and
    # skipped the write; the first was killed at "logged" before committing, the second
    # committed (then was killed at "committed"): one recovered commit, no second data commit.
    assert sum("recovered after crash" in h.note for h in history if h.action == "commit") == 1


def test_a_killed_run_that_cannot_be_proven_dead_is_taken_over_when_its_lease_expires(spark, crash_settings, cli_spark):
    """"Container gone": the killed run's owner names another host (as a run in a container that
    no longer exists does), so no pid check can prove it dead. Its heartbeats kept a 3 s lease
    alive until its write; after the kill the lease runs out and the next run takes the
    topic over by itself (no `offsets unlock`), logged as a steal."""
    s = crash_settings
    store = open_offset_store(s.offsets_url)
    proc = _tidemark(s, "run", "fact.events", "--until-caught-up",
                     env={"TIDEMARK_CRASH_AT": "written", "TIDEMARK_OWNER_HOST": "gone-container", "TIDEMARK_LOCK_LEASE": "3s"})
    assert proc.returncode == -9, f"expected SIGKILL: rc={proc.returncode}\n{proc.stderr[-3000:]}"
    rec = store.get("fact.events")
    assert rec is not None and rec.pending and rec.owner.startswith("gone-container:") and not local_owner_is_dead(rec.owner)
    # The run took far longer than 3 s to reach its write: only heartbeats can have kept the lease alive.
    with pytest.raises(TopicLockedError, match="Its lease expires at"):
        store.acquire("fact.events", make_owner())
    dead = rec.owner
    time.sleep(max(0.0, (rec.lease_until - utcnow()).total_seconds()) + 0.5)
    proc = _tidemark(s, "run", "fact.events", "--until-caught-up")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _sorted_rows(spark.read.format("delta").load(s.table_path("fact.events")))
    assert got == _expected(spark, s)
    history = store.history("fact.events", limit=1000)
    [steal] = [h for h in history if h.action == "steal"]
    assert dead in steal.note and "its lease expired at" in steal.note
    assert not any(h.action == "unlock" for h in history)
    assert sum("recovered after crash" in h.note for h in history if h.action == "commit") == 1  # landed once
    log = read_etl_log(s, "fact.events", limit=1000)
    assert sorted(r["seq"] for r in log) == list(range(1, len(log) + 1)) and sum(r["base_rows"] for r in log) == 600
    rec = store.get("fact.events")
    assert (rec.owner, rec.lease_until, rec.pending) == ("", None, False)


def test_two_processes_one_topic_the_second_fails_naming_the_holder(spark, crash_settings, cli_spark):
    s = crash_settings
    store = open_offset_store(s.offsets_url)
    first = _tidemark(s, "run", "fact.events", env={"TIDEMARK_PAUSE_AT": "transformed:30"}, wait=False)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            rec = store.get("fact.events")
            if rec is not None and rec.owner and rec.pending:
                break
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            time.sleep(0.5)
        else:
            pytest.fail("first run never took the lock")
        holder = store.get("fact.events").owner
        second = _tidemark(s, "run", "fact.events")
        assert second.returncode == 1
        assert f"topic 'fact.events' is being processed by '{holder}'" in second.stderr
        assert "tidemark offsets unlock fact.events" in second.stderr
    finally:
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    rec = store.get("fact.events")
    assert rec.seq == 1 and not rec.pending and rec.owner == ""
    assert DeltaTable(s.table_path("fact.events")).version() == 0  # one data commit, by the first run only
