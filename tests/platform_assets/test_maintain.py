"""``tidemark maintain`` between units and beside them, on real Spark + Delta: it compacts, checkpoints
and cleans up every kind of table (sources, a fact, views, the meta tables), keeps what each topic
still needs, and the topics go on exactly and incrementally — a lagging view included."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from platform_assets.core import spark_io
from platform_assets.maintenance import tables as maintain
from resources.storage import delta_meta, maintenance
from tests.platform_assets.test_cleanup import (
    COUNTRIES,
    DAILY,
    FACT,
    WIDE,
    assert_equals_recompute,
    cli,
    customers,
    make_engine,
    orders,
    processed,
)

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[2]


def small_commits(eng, start: int, n: int) -> None:  # noqa: ANN001
    """``n`` one-row appends to stage.orders (ids and positions from ``start``): a table of small files."""
    for i in range(start, start + n):
        orders(eng, [(i, i)])


def files(eng, table: str) -> int:  # noqa: ANN001
    return len(DeltaTable(eng.path(table)).file_uris())


def test_maintain_keeps_what_a_lagging_view_needs_and_every_topic_goes_on_exactly(spark, settings, tmp_path, capsys):
    eng, args = make_engine(spark, settings, tmp_path, FACT + WIDE + DAILY + COUNTRIES)
    customers(eng)
    small_commits(eng, 1, 20)
    assert set(processed(eng.run_until_caught_up())) == {"fact.orders", "mart.wide", "mart.daily", "dim.countries"}
    # The views fall behind: new orders and a changed customer; only the fact runs.
    small_commits(eng, 21, 20)
    DeltaTable(eng.path("dim.customers")).update(predicate="id = 2", updates={"country": "'XX'"})
    assert processed([eng.run_topic("fact.orders")])
    wide_rec = eng.store.get("mart.wide")
    needs = maintain.consumer_needs(eng)
    assert maintenance.Need(wide_rec.inputs["dim.customers"], "mart.wide",
                            "input offset (the reverse join reads the rows up to it and the change feed after it)") \
        in needs["dim.customers"]
    # a lost store (no records): the same needs, from the destinations' Delta logs (issue 57)
    lost = maintain.consumer_needs(eng, records={})
    assert ({t: sorted((n.version, n.who) for n in ns) for t, ns in lost.items()}
            == {t: sorted((n.version, n.who) for n in ns) for t, ns in needs.items()})
    code, out = cli(args, capsys, "tables")
    assert code == 0 and "stage.orders" in out and "40 small files (compaction from 16)" in out

    # Maintenance with no retention at all: only what a consumer needs survives.
    code, out = cli(args, capsys, "maintain", "--retain-hours", "0", "--writers-idle")
    assert code == 0, out
    assert "stage.orders v39: 40 files, 40 small" in out and "compacted: 40 files -> 1 file(s), in pos order" in out, out
    assert f"kept versions from v{eng.store.get('mart.wide').source_version}" in out
    assert files(eng, "stage.orders") == 1
    assert "error" not in out.lower() and "Traceback" not in out

    # The lagging views go on incrementally (their old versions and the change feed were kept), exactly.
    units = processed(eng.run_until_caught_up())
    assert set(units) >= {"mart.wide", "mart.daily", "dim.countries"}
    for view in ("mart.wide", "mart.daily"):
        assert units[view].stats["strategy"] == "incremental", units[view].stats
        assert not units[view].stats.get("fallback")
    for topic in ("fact.orders", "mart.wide", "mart.daily"):
        assert assert_equals_recompute(eng, topic) == (40 if topic != "mart.daily" else 5)

    # Caught up: what nobody needs any more goes; the old files and log entries are removed.
    code, out = cli(args, capsys, "maintain", "--retain-hours", "0", "--writers-idle")
    assert code == 0 and "Traceback" not in out
    h = maintenance.health("stage.orders", eng.path("stage.orders"))
    assert h.oldest_log is not None and h.oldest_log > 1
    on_disk = list(Path(eng.path("stage.orders")).glob("*.parquet"))
    assert len(on_disk) == 1, on_disk  # the 40 small files are gone, the compacted one stays
    small_commits(eng, 41, 3)
    units = processed(eng.run_until_caught_up())
    assert units["mart.wide"].stats["strategy"] == "incremental"
    for topic in ("fact.orders", "mart.wide", "mart.daily"):
        assert assert_equals_recompute(eng, topic) == (43 if topic != "mart.daily" else 5)
    code, out = cli(args, capsys, "lag")
    assert code == 0 and "Traceback" not in out and "error" not in out


def test_maintain_purges_a_views_deletion_vectors_and_no_reader_runs_a_unit_for_it(spark, settings, tmp_path, capsys):
    eng, args = make_engine(spark, settings, tmp_path, FACT + WIDE + "  deletion_vectors: true\n")
    customers(eng)
    orders(eng, [(i, i) for i in range(1, 41)])
    assert set(processed(eng.run_until_caught_up())) == {"fact.orders", "mart.wide"}
    # two customers move: the view's MERGE marks their 16 old rows deleted (a vector) and appends them anew
    DeltaTable(eng.path("dim.customers")).update(predicate="id IN (1, 2)", updates={"country": "'XX'"})
    assert processed(eng.run_until_caught_up())["mart.wide"].stats["strategy"] == "incremental"
    h = maintenance.health("mart.wide", eng.path("mart.wide"))
    assert (h.deleted_rows, h.rows) == (16, 56) and h.vector_files >= 1 and h.purge_due, h
    code, out = cli(args, capsys, "tables", "mart.wide")
    assert code == 0 and "16 rows (29%) marked deleted by deletion vectors" in out, out
    code, out = cli(args, capsys, "maintain", "mart.wide", "--dry-run")
    assert code == 0 and "would purge deletion vectors" in out and "without 16 deleted rows" in out, out
    assert maintenance.health("mart.wide", eng.path("mart.wide")).version == h.version  # a dry run writes nothing

    code, out = cli(args, capsys, "maintain", "mart.wide")
    assert code == 0 and "purged deletion vectors:" in out and "without 16 deleted rows" in out, out
    assert "files with deletion vectors purged" in out, out
    after = maintenance.health("mart.wide", eng.path("mart.wide"))
    assert (after.deleted_rows, after.vector_files, after.rows) == (0, 0, 40) and not after.purge_due, after
    # the purge changed no row: a view reading mart.wide would run no unit for it
    assert delta_meta.input_change("mart.wide", eng.path("mart.wide"), h.version).rewrites_only
    assert assert_equals_recompute(eng, "mart.wide") == 40
    # and the view goes on incrementally from the purged files
    DeltaTable(eng.path("dim.customers")).update(predicate="id = 3", updates={"country": "'YY'"})
    assert processed(eng.run_until_caught_up())["mart.wide"].stats["strategy"] == "incremental"
    assert assert_equals_recompute(eng, "mart.wide") == 40
    code, out = cli(args, capsys, "maintain", "mart.wide", "--dry-run")
    assert code == 0 and "purge" in out and "Traceback" not in out  # 8 of 48 rows deleted: due again


def test_maintain_beside_running_units_never_fails_or_falls_back(spark, settings, tmp_path, caplog):
    """Maintenance runs in a thread while units append and MERGE: every table's maintenance, and a
    forced Z-order of the view the MERGEs write (its files are rewritten under the MERGE). No unit
    fails or recomputes fully because of it (a MERGE that loses to the compaction is tried again),
    and the results stay exact."""
    eng, _ = make_engine(spark, settings, tmp_path, FACT + WIDE)
    customers(eng)
    small_commits(eng, 1, 17)
    eng.run_until_caught_up()
    stop = threading.Event()
    reports: list[maintenance.Report] = []
    errors: list[BaseException] = []

    def maintainer() -> None:
        while not stop.is_set():
            try:
                reports.extend(maintain.run(eng, None, maintain.Options(retain_hours=1)))
                h = maintenance.health("mart.wide", eng.path("mart.wide"))
                reports.append(maintenance.maintain(h, force_compact=True, cluster_by=("id",), cleanup=False))
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                return

    worker = threading.Thread(target=maintainer, daemon=True)
    worker.start()
    try:
        for k in range(4):
            small_commits(eng, 18 + 6 * k, 6)
            DeltaTable(eng.path("dim.customers")).update(predicate=f"id = {k % 5}", updates={"country": f"'K{k}'"})
            for unit in processed(eng.run_until_caught_up()).values():
                assert not unit.stats.get("fallback"), unit.stats
    finally:
        stop.set()
        worker.join(timeout=300)
    assert not errors, errors
    assert any(r.clustered_by for r in reports), "the view was never Z-ordered while units ran"
    assert any(r.compacted for r in reports if r.table == "stage.orders")
    for topic in ("fact.orders", "mart.wide"):
        assert assert_equals_recompute(eng, topic) == 41
    retried = [r for r in caplog.records if "lost to a concurrent commit" in r.getMessage()]
    print(f"MERGE/overwrite writes retried after a concurrent compaction: {len(retried)}")


@pytest.mark.parametrize(("message", "conflict"), [
    ("[DELTA_CONCURRENT_DELETE_READ] ConcurrentDeleteReadException: This transaction attempted to read", True),
    ("io.delta.exceptions.ConcurrentAppendException: Files were added to the root of the table", True),
    ("[DELTA_CONCURRENT_DELETE_DELETE] ConcurrentDeleteDeleteException", True),
    # two first writes of one table at once (a killed client's write finishing on its Connect server)
    ("(io.delta.exceptions.ProtocolChangedException) [DELTA_PROTOCOL_CHANGED] ProtocolChangedException: The protocol "
     "version of the Delta table has been changed by a concurrent update.", True),
    ("[DELTA_MERGE_UNRESOLVED_EXPRESSION] Cannot resolve t.x", False),
    ("FileNotFoundException: part-00000.parquet", False),
])
def test_a_lost_commit_is_told_from_other_failures(message, conflict):
    assert spark_io.is_conflict(RuntimeError(message)) is conflict


def _maintain(args: list[str], env: dict[str, str] | None = None, kill_after: float | None = None) -> int:
    """``tidemark maintain --retain-hours 0 --writers-idle`` in its own process (JVM-free): its exit code
    (-9 when killed by ``TIDEMARK_CRASH_AT`` or after ``kill_after`` seconds)."""
    cmd = [sys.executable, "-m", "platform_assets.cli", *args, "maintain", "--retain-hours", "0", "--writers-idle"]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if kill_after is not None:
        time.sleep(kill_after)
        proc.kill()
    out, err = proc.communicate(timeout=300)
    assert "Traceback" not in err or proc.returncode == -9, err
    return proc.returncode


def test_maintenance_killed_at_any_point_leaves_every_table_readable_and_the_topics_exact(spark, settings, tmp_path):
    eng, args = make_engine(spark, settings, tmp_path, FACT + WIDE)
    customers(eng)
    small_commits(eng, 1, 17)
    eng.run_until_caught_up()
    seed = random.randrange(1_000_000)
    rnd = random.Random(seed)
    start = 18
    rounds = [*[{"TIDEMARK_CRASH_AT": p} for p in ("maintain:compacted", "maintain:checkpointed", "maintain:vacuumed",
                                                     "maintain:log-cleaning")], None]
    for env in rounds:
        small_commits(eng, start, 17)
        start += 17
        DeltaTable(eng.path("dim.customers")).update(predicate=f"id = {start % 5}", updates={"country": f"'C{start}'"})
        if env is not None:
            assert _maintain(args, env) == -9, env
        else:  # a SIGKILL at a random moment, in the middle of a compaction or elsewhere
            delay = rnd.uniform(0.5, 4.0)
            _maintain(args, kill_after=delay)
            print(f"random kill after {delay:.2f}s (seed {seed})")
        ids = sorted(DeltaTable(eng.path("stage.orders")).to_pyarrow_table(columns=["id"])["id"].to_pylist())
        assert ids == list(range(1, start)), env  # readable, every row once
        for unit in processed(eng.run_until_caught_up()).values():
            assert not unit.stats.get("fallback"), (env, unit.stats)
        for topic in ("fact.orders", "mart.wide"):
            assert assert_equals_recompute(eng, topic) == start - 1, (env, topic)
    assert _maintain(args) == 0  # after every kill, a whole run completes
    small_commits(eng, start, 2)
    units = processed(eng.run_until_caught_up())
    assert units["mart.wide"].stats["strategy"] == "incremental"
    for topic in ("fact.orders", "mart.wide"):
        assert assert_equals_recompute(eng, topic) == start + 1
