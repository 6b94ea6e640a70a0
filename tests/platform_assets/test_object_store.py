"""The demo lineage end to end with the warehouse on a real S3-compatible server (versitygw on
loopback): sources seeded with deltalake, topics run by the engine on a Spark Connect server
that got the S3A jars and settings, then JVM-free checks (``tidemark lag``, late rows from the
Delta log). Every table equals the one a local-filesystem warehouse gets from the same data."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest

from resources.core.settings import Settings
from resources.spark import server as spark_server
from resources.storage import delta_log, delta_meta
from resources.storage.meta_tables import ETL_LOG, QUARANTINE
from tests.conftest import ROOT

TABLES = ("dim.customers", "fact.orders", "fact.order_items", "mart.daily_revenue")


def _rows(settings: Settings, table: str, drop: tuple[str, ...] = ()) -> list[tuple]:
    t = delta_log.open_table(settings.table_path(table))
    assert t is not None, f"{table} missing at {settings.table_path(table)}"
    data = t.to_pyarrow_table()
    data = data.select([c for c in data.column_names if c not in drop])
    return sorted(tuple(str(_exact(k, v)) for k, v in r.items()) for r in data.to_pylist())


def _exact(column: str, value: Any) -> Any:
    """An etl.log value without a view unit's size estimates: they are the inputs' file sizes,
    which a few bytes of compression change with the order of a block's rows (a shuffle's, not
    fixed between runs)."""
    if column == "changes" and value is not None:
        return [(k, v) for k, v in value if not k.startswith("estimate_")]
    if column == "detail" and isinstance(value, str):
        return re.sub(r" \(estimated [^()]*(\([^()]*\))?[^()]*\)", "", value)
    return value


def _tidemark(settings: Settings, spark_url: str, *args: str) -> str:
    """The CLI in a process of its own: one process cannot hold a local session (the tests'
    ``spark`` fixture) and a Spark Connect one (pyspark switches every function to Connect)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIDEMARK_DRIVER_MEMORY": "1g"}
    out = subprocess.run([sys.executable, "-m", "platform_assets.cli", "--home", str(settings.home), "--warehouse",
                          settings.warehouse, "--lineage", str(settings.lineage), "--spark-master", spark_url, *args],
                         capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert out.returncode == 0, f"tidemark {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _run_demo(settings: Settings, spark_url: str) -> None:
    """Seed the shop, run until caught up, append more rows (two late), run again (the shop's topics:
    fact.page_views reads the event intake's table, which ShopFeeder does not write)."""
    from platform_assets.demo.shop import ShopFeeder

    t0 = dt.datetime(2026, 1, 1, 12)
    feeder = ShopFeeder(settings)
    feeder.append(orders=80, start=t0, end=t0 + dt.timedelta(hours=1), new_customers=20, bad_rows=2)
    first = _tidemark(settings, spark_url, "run", "--until-caught-up", *TABLES)
    assert "block 1" in first, first
    feeder.append(orders=20, start=t0 + dt.timedelta(hours=1, minutes=1), end=t0 + dt.timedelta(hours=2),
                  new_customers=5, late=2)
    _tidemark(settings, spark_url, "run", "--until-caught-up", *TABLES)


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The process environment pointing at the test server (and at nothing else)."""
    for k in list(os.environ):
        if k.startswith(("TIDEMARK_S3_", "AWS_")):
            monkeypatch.delenv(k)
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.mark.fast
def test_spark_up_refuses_a_missing_bucket_before_a_jvm_starts(s3_env, tmp_path, capsys):
    from platform_assets.cli.main import main

    port = spark_server.free_port()
    code = main(["--home", str(tmp_path), "--warehouse", "s3://no-such-bucket/wh", "spark", "up", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 1
    assert "s3://no-such-bucket/wh" in err and "does not exist" in err and "TIDEMARK_WAREHOUSE" in err
    assert spark_server.status(tmp_path) is None


@pytest.mark.slow
def test_demo_lineage_on_object_store_equals_local_run(s3_env, tmp_path, capsys, cli_spark):
    lineage = ROOT / "demo" / "lineage"
    remote = Settings.from_env({}, home=tmp_path / "s3", warehouse="s3://tidemark/demo-wh", lineage=lineage)
    local = Settings.from_env({}, home=tmp_path / "local", lineage=lineage)

    server_home = tmp_path / "spark"
    t0 = time.monotonic()
    server = spark_server.start(server_home, port=spark_server.free_port(), master="local[2]",
                                warehouse=remote.warehouse, driver_memory="1g")
    try:
        t1 = time.monotonic()
        _run_demo(remote, server.url)
        t2 = time.monotonic()
        _run_demo(local, cli_spark)  # another server (the tests' shared one): this one's catalog names the S3 run's tables
        with capsys.disabled():  # the figures the README quotes
            print(f"\nserver start {t1 - t0:.0f}s, S3 run {t2 - t1:.0f}s, local run {time.monotonic() - t2:.0f}s")
    finally:
        spark_server.stop(server_home)

    assert not (tmp_path / "s3" / "warehouse").exists()  # nothing of the S3 run landed on local disk
    for table in TABLES:
        assert _rows(remote, table) == _rows(local, table), table
    volatile = ("ts", "run_id", "duration_s", "max_lag", "detected_at")
    assert _rows(remote, ETL_LOG, volatile) == _rows(local, ETL_LOG, volatile)
    assert _rows(remote, QUARANTINE, volatile) == _rows(local, QUARANTINE, volatile)
    reasons = [r for r in _rows(remote, QUARANTINE) if r[0] == "fact.orders"]
    assert sum("late" in r[2] for r in reasons) == 2 and sum("null" in r[2] for r in reasons) == 2

    # JVM-free readers on the store: the late rows from the commit files, and `tidemark lag`
    orders = remote.table_path("stage.orders")
    snap = delta_meta.TableSnapshot.open(orders)
    assert snap.version == 1
    from platform_assets.cli.main import main

    capsys.readouterr()
    assert main(["--home", str(remote.home), "--warehouse", remote.warehouse, "--lineage", str(lineage), "lag"]) == 0
    lag = capsys.readouterr().out
    for topic in TABLES:
        assert topic in lag
    assert "error" not in lag.lower()
