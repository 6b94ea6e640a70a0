"""The demo lineage on a real Spark standalone cluster (a master and two workers on loopback,
``tidemark cluster up``) through its Spark Connect server gives the same tables as local mode,
and the work runs on the cluster's executors."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lineage.spec.loader import load_lineage
from platform_assets.demo.shop import ShopFeeder
from platform_assets.engine.runner import Engine
from platform_assets.maintenance.tables import jvm_free_reads
from resources.core.settings import Settings
from resources.spark import cluster as spark_cluster
from resources.spark import server as spark_server
from resources.storage.delta_log import open_table

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "demo" / "lineage"

#: Two passes, as in the demo: the first load, then an incremental one (fixed, past positions).
BATCHES = [
    {"orders": 400, "start": dt.datetime(2026, 1, 1, 8), "end": dt.datetime(2026, 1, 1, 10), "new_customers": 60, "bad_rows": 2},
    {"orders": 120, "start": dt.datetime(2026, 1, 1, 10, 0, 1), "end": dt.datetime(2026, 1, 1, 10, 30), "new_customers": 5, "late": 2},
]


def _tidemark(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIDEMARK_DRIVER_MEMORY": "1g"}
    return subprocess.run([sys.executable, "-m", "platform_assets.cli", "--home", str(home), "--lineage", str(DEMO), *args],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


def _tidemark_bg(home: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "platform_assets.cli", "--home", str(home), "--lineage", str(DEMO), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)


def _rows(settings: Settings, table: str) -> list[tuple[Any, ...]]:
    """Every row of a destination table, sorted (read with deltalake: no JVM involved)."""
    t = open_table(settings.table_path(table))
    assert t is not None, f"{table} was not written under {settings.warehouse}"
    rows = [tuple(r.values()) for r in t.to_pyarrow_table().to_pylist()]
    return sorted(rows, key=lambda r: [(v is None, str(v)) for v in r])


@pytest.mark.slow
@pytest.mark.spark
def test_demo_lineage_on_a_standalone_cluster_equals_local_mode(spark, tmp_path):
    lineage = load_lineage(DEMO)
    local = Settings.from_env({}, home=tmp_path / "local", lineage=DEMO, spark_master="local[2]")
    on_cluster = Settings.from_env({}, home=tmp_path / "cluster", lineage=DEMO)
    feeders = {"local": ShopFeeder(local), "cluster": ShopFeeder(on_cluster)}
    master_port, connect_port = spark_server.free_port(), spark_server.free_port()
    url = f"sc://127.0.0.1:{connect_port}"
    t0 = time.monotonic()
    try:
        up = _tidemark(on_cluster.home, "cluster", "up", "--workers", "2", "--worker-cores", "1", "--worker-memory", "512m",
                       "--master-port", str(master_port), "--port", str(connect_port))
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"export TIDEMARK_SPARK_MASTER={url}" in up.stdout
        print(f"cluster up: {time.monotonic() - t0:.0f}s")
        status = _tidemark(on_cluster.home, "cluster", "status")
        assert status.returncode == 0, status.stdout
        assert status.stdout.count("ALIVE, 1 cores") == 2 and f"spark://127.0.0.1:{master_port}" in status.stdout

        for n, batch in enumerate(BATCHES, 1):
            t1 = time.monotonic()
            for feeder in feeders.values():
                feeder.append(**batch)
            # The cluster's pass (a client process over Connect) and the local one side by side:
            # the cluster's spends much of its time waiting on its JVMs.
            shop = [t for t in lineage.topics if t != "fact.page_views"]  # its source comes from the event intake
            run = _tidemark_bg(on_cluster.home, "--spark-master", url, "run", "--until-caught-up", *shop)
            try:
                eng = Engine(local, lineage, spark=spark)
                try:
                    eng.publish_lineage()
                    eng.run_until_caught_up()
                finally:
                    eng.close()
                t_local = time.monotonic() - t1
                out, _ = run.communicate(timeout=600)
            finally:
                if run.poll() is None:
                    run.kill()
                    run.wait()
            assert run.returncode == 0, out
            print(f"pass {n}: local {t_local:.0f}s, cluster {time.monotonic() - t1:.0f}s (side by side)")

        for topic in lineage.topics.values():
            if topic.name == "fact.page_views":
                continue  # its source is written by the event intake, not by ShopFeeder
            table = topic.spec.destination
            expected = _rows(local, table)
            assert expected, f"{table}: the local run wrote no rows"
            assert _rows(on_cluster, table) == expected, f"{table} differs between the cluster and local mode"
        # every table the run wrote (facts, views, Tidemark's own) opens in the JVM-free deltalake
        # reader with Spark's row count (issue 19: no reader feature it lacks unless a user opts in)
        eng = Engine(local, lineage, spark=spark)
        try:
            reads = jvm_free_reads(eng)
        finally:
            eng.close()
        assert len(reads) > len(lineage.topics) and all(a == b for _, a, b in reads), reads

        # The work ran on the cluster: the master granted the Connect app one core per worker,
        # and each worker's executor ran tasks (its log, in the worker's work dir, says so).
        state = spark_cluster.read_state(on_cluster.home)
        assert state is not None
        view = spark_cluster.master_view(state.webui_url)
        assert view is not None
        assert [(a.name, a.cores) for a in view.active_apps] == [("tidemark-connect", 2)]
        assert all(w.cores_used == 1 for w in view.alive_workers) and len(view.alive_workers) == 2
        executor_logs = sorted((spark_cluster.cluster_dir(on_cluster.home) / "work").glob("app-*/*/stderr"))
        finished = [log.read_text(errors="replace").count("Finished task") for log in executor_logs]
        assert len(finished) == 2 and all(n > 0 for n in finished), f"tasks finished per executor: {finished}"
    finally:
        down = _tidemark(on_cluster.home, "cluster", "down")
    assert down.returncode == 0, down.stderr
    assert spark_cluster.status(on_cluster.home) is None
    assert spark_server.status(spark_cluster.cluster_dir(on_cluster.home)) is None
