"""Test data and lineages for the engine tests: an ``events`` source with many rows sharing
a ``pos``, a small ``users`` dimension, and a step topic that joins them."""

from __future__ import annotations

import datetime as dt
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml

from resources.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
T0 = dt.datetime(2026, 1, 1, 0, 0, 0)
_TS = pa.timestamp("us", tz="UTC")
EVENTS_SCHEMA = pa.schema([("pos", _TS), ("id", pa.int64()), ("user_id", pa.int64()), ("amount", pa.float64()),
                           ("kind", pa.string())])

TRANSFORM_SQL = """
SELECT e.pos, e.id, e.user_id, e.amount * 2 AS amount2, upper(e.kind) AS kind, u.country
FROM block e LEFT JOIN dim.users u ON u.user_id = e.user_id
WHERE e.kind <> 'skip'
"""


def write_lineage(root: Path, *, maxstep: int = 100, delay: str = "0", repeat: str = "0", extra_topic: str = "",
                  before: str = "", after: str = "", deps: str = "[stage.events]") -> Path:
    """A lineage dir with sources stage.events and dim.users and the step topic fact.events."""
    lin = root / "lineage"
    (root / "sql").mkdir(parents=True, exist_ok=True)
    lin.mkdir(parents=True, exist_ok=True)
    (root / "sql" / "fact_events.sql").write_text(TRANSFORM_SQL)
    (lin / "events.yaml").write_text(textwrap.dedent(f"""\
        sources:
          - table: stage.events
          - table: dim.users
          - table: stage.other
        topics:
          - table: fact.events
            depends_on: {deps}
            transforms: [../sql/fact_events.sql]
            maxstep: {maxstep}
            delay: {delay}
            repeat: {repeat}
            before: {before!r}
            after: {after!r}
        """) + textwrap.indent(textwrap.dedent(extra_topic).strip("\n") + "\n", "  "))
    return lin


def seeded(settings: Settings, root: Path, *, maxstep: int, events: int, distinct_pos: int, seed: int) -> Settings:
    """``settings`` on the events lineage under ``root``, with ``dim.users`` and ``events`` rows
    in ``stage.events``."""
    out = settings.with_(lineage=write_lineage(root, maxstep=maxstep))
    write_users(out)
    write_rows(out, "stage.events", make_events(events, distinct_pos=distinct_pos, seed=seed))
    return out


def sorted_rows(df) -> list[tuple]:  # noqa: ANN001 - a Spark DataFrame
    """A DataFrame's rows, columns in name order, sorted: comparable whatever the write order."""
    return sorted((tuple(r) for r in df.select(*sorted(df.columns)).collect()), key=repr)


def table_rows(spark, path: str) -> list[tuple]:  # noqa: ANN001 - a SparkSession
    return sorted_rows(spark.read.format("delta").load(path))


def full_recompute(spark, settings: Settings, exclude_ids: frozenset[int] | set[int] = frozenset()) -> list[tuple]:  # noqa: ANN001
    """``fact.events`` as one run of the transform over every valid row of ``stage.events`` (less
    ``exclude_ids``, e.g. late rows that are quarantined instead)."""
    from lineage.spec.loader import load_lineage
    from platform_assets.engine.runner import Engine

    Engine(settings, load_lineage(settings.lineage), spark=spark).register_tables()
    base = spark.read.format("delta").load(settings.table_path("stage.events")).where("pos IS NOT NULL AND id IS NOT NULL")
    if exclude_ids:
        base = base.where(~base.id.isin(sorted(exclude_ids)))
    base.createOrReplaceTempView("block")
    return sorted_rows(spark.sql(TRANSFORM_SQL))


def write_rows(settings: Settings, table: str, rows: list[dict], schema: pa.Schema = EVENTS_SCHEMA) -> None:
    from deltalake import write_deltalake

    fixed = [{**r, "pos": r["pos"].replace(tzinfo=dt.UTC) if r.get("pos") is not None else None} for r in rows]
    write_deltalake(settings.table_path(table), pa.Table.from_pylist(fixed, schema=schema), mode="append")


def write_users(settings: Settings, n: int = 20) -> None:
    from deltalake import write_deltalake

    data = pa.table({"user_id": list(range(n)), "country": [["DE", "FR", None][i % 3] for i in range(n)]})
    write_deltalake(settings.table_path("dim.users"), data, mode="overwrite")


def make_events(n: int, *, start_id: int = 1, start: dt.datetime = T0, distinct_pos: int = 40, seed: int = 1,
                micro: bool = True) -> list[dict]:
    """``n`` events in (pos, id) order; only ``distinct_pos`` distinct timestamps, so most
    rows tie on ``pos`` (with microseconds when ``micro``)."""
    rng = random.Random(seed)
    stamps = sorted(start + dt.timedelta(seconds=rng.randint(0, 3600), microseconds=rng.randint(0, 999_999) if micro else 0)
                    for _ in range(distinct_pos))
    pos = sorted(rng.choice(stamps) for _ in range(n))
    return [{"pos": p, "id": start_id + i, "user_id": rng.randint(0, 25), "amount": round(rng.uniform(0, 100), 2),
             "kind": rng.choice(["a", "b", "skip"])} for i, p in enumerate(pos)]


def cli_master(local: str = "local[2]") -> str:
    """The Spark master of the test's subprocesses: the session's shared Spark Connect server when
    the test uses fixture ``cli_spark`` (``TIDEMARK_TEST_CLI_MASTER``), else ``local`` (a JVM of
    each process's own)."""
    return os.environ.get("TIDEMARK_TEST_CLI_MASTER") or local


def materialize_command(settings: Settings, dagster_home: Path, table_key: str, partition: str, *,
                        master: str | None = None, **env: str) -> tuple[list[str], dict[str, str]]:
    """``dagster asset materialize`` of one block partition in a fresh process, on ``settings``
    and the instance at ``dagster_home``: the command and its environment (``env``: extra
    variables, e.g. ``TIDEMARK_CRASH_AT``). ``master``: default :func:`cli_master`."""
    master = master or cli_master()
    cmd = [str(Path(sys.executable).parent / "dagster"), "asset", "materialize", "-m", "platform_assets.dagster.definitions",
           "--select", table_key, "--partition", partition]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "TIDEMARK_HOME": str(settings.home),
                "TIDEMARK_LINEAGE": str(settings.lineage), "TIDEMARK_SPARK_MASTER": master,
                "TIDEMARK_DRIVER_MEMORY": "1g", "DAGSTER_HOME": str(dagster_home), **env}
    return cmd, full_env


def dagster_yaml(storage: dict[str, object], text: str = "telemetry:\n  enabled: false\n") -> str:
    """``text`` (a dagster.yaml) with the test's Dagster storage (fixture ``dagster_storage``) added."""
    return text + ("\n" + yaml.safe_dump(storage) if storage else "")


def tidemark(settings: Settings, *args: str, env: dict[str, str] | None = None,
             wait: bool = True) -> Any:  # CompletedProcess, or Popen when not ``wait``
    """``tidemark ARGS`` on ``settings`` in a fresh process: finished (``wait``) or still running.
    ``env``: extra variables, e.g. ``TIDEMARK_CRASH_AT``. Its Spark: :func:`cli_master` (a local
    JVM has a 1 GB driver)."""
    cmd = [sys.executable, "-m", "platform_assets.cli", "--home", str(settings.home), "--lineage", str(settings.lineage),
           "--spark-master", cli_master(), *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "TIDEMARK_DRIVER_MEMORY": "1g", **(env or {})}
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300)


#: Drops every table registered in a Connect server's catalog (external tables: their files stay).
#: Run in a process of its own: a test process holds a local session, and pyspark cannot hold both.
_RESET_CATALOG = """
import sys
from pyspark.sql import SparkSession
spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
for db in spark.catalog.listDatabases():
    if db.name != "default":
        spark.sql(f"DROP DATABASE `{db.name}` CASCADE")
for t in spark.catalog.listTables("default"):
    if not t.isTemporary:
        spark.sql(f"DROP TABLE IF EXISTS `default`.`{t.name}`")
"""


def reset_cli_catalog(master: str | None = None) -> None:
    """Empty the catalog of the Connect server that ``tidemark`` subprocesses share (fixture
    ``cli_spark``; ``master``: default :func:`cli_master`), so the next home may use the same table
    names at other paths: Tidemark refuses a name another home registered there, as it should.
    Nothing to do when they run local JVMs."""
    master = master or cli_master()
    if not master.startswith("sc://"):
        return
    done = subprocess.run([sys.executable, "-c", _RESET_CATALOG, master], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"emptying the Connect server's catalog ({master}) failed:\n{done.stderr[-2000:]}"
