"""Pieces the end-to-end benchmarks share (``vs_sdp.py``, ``reverse_join.py``): the orders
generator, running a command in its own process group with its output in a log, and a Spark
Declarative Pipelines project run by a fresh ``spark-pipelines run``."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from resources.spark.session import DELTA_CONF, LOCAL_CONF, cached_delta_jars  # noqa: E402

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


class BenchError(Exception):
    """A side failed or the results differ: the script exits 1 with this message."""


# ------------------------------------------------------------------ data


def close_run(engine: Any, spark: Any, work: Path, *, keep: bool, drop: tuple[str, ...] = ()) -> None:
    """A benchmark's end, also when it failed: its engine closed, the catalog tables ``drop`` dropped
    (external: their files stay) and its Spark session stopped (either may be None), and its work
    dir removed unless ``keep``."""
    if engine is not None:
        engine.close()
    if spark is not None:
        for table in drop:
            if spark.catalog.tableExists(table):
                spark.sql(f"DROP TABLE {table}")
        spark.stop()
    if not keep:
        shutil.rmtree(work, ignore_errors=True)


def spark_job_mark(spark: Any) -> int | None:
    """The newest Spark job id so far (-1: none yet), to count the jobs a step starts; None on a
    Spark Connect session (no status tracker). Tidemark sets no job group, so every job is in the
    tracker's group None; ids are sequential, so the count survives ``spark.ui.retainedJobs``."""
    try:
        tracker = spark.sparkContext.statusTracker()
    except Exception:  # noqa: BLE001 - Connect: no SparkContext
        return None
    return max(tracker.getJobIdsForGroup(None), default=-1)


def append_orders(path: str, start_id: int, n: int, customers: int, t0: dt.datetime, span: float = 1.05,
                  step_us: int = 10_000) -> None:
    """``n`` orders ``(pos, id, customer_id, amount)`` with ids from ``start_id``, in (pos, id)
    order; two orders share each ``pos`` (ties), ``step_us`` apart; customer ids are drawn from ``[0, customers *
    span]``, so with ids ``0 .. customers-1`` present ~5 % have no customer (the left join's nulls)."""
    import numpy as np
    import pyarrow as pa
    from deltalake import write_deltalake

    if n == 0:
        return
    ids = np.arange(start_id, start_id + n, dtype=np.int64)
    base = np.datetime64(t0.replace(tzinfo=None), "us")
    pos = base + (ids // 2) * np.timedelta64(step_us, "us")
    rng = np.random.default_rng(start_id)
    table = pa.table({"pos": pa.array(pos).cast(pa.timestamp("us", tz="UTC")), "id": ids,
                      "customer_id": rng.integers(0, int(customers * span) + 1, n, dtype=np.int64),
                      "amount": np.round(rng.uniform(1, 500, n), 2)})
    write_deltalake(path, table, mode="append")


# ------------------------------------------------------------------ processes


def run_logged(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, what: str,
               timeout: float = 3600) -> float:
    """Run ``cmd`` in its own process group, output to ``log``; seconds from start to exit.
    The group is killed if this process is interrupted or the command times out."""
    with open(log, "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except BaseException:
            _kill_group(proc)
            raise
        took = time.monotonic() - t0
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise BenchError(f"{what} failed (exit {code}); log {log}, last lines:\n{tail}")
    return took


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ------------------------------------------------------------------ SDP


def make_sdp_project(base: Path, name: str, transformation: str, driver_memory: str) -> tuple[Path, Path]:
    """A pipeline project ``name`` whose one transformation file holds ``transformation``
    (Python), and its SPARK_CONF_DIR; returns both."""
    project, conf = base / "project", base / "conf"
    (project / "transformations").mkdir(parents=True)
    conf.mkdir()
    (project / "spark-pipeline.yml").write_text(textwrap.dedent(f"""\
        name: {name}
        storage: file://{base / 'storage'}
        libraries:
          - glob:
              include: transformations/**
        """))
    (project / "transformations" / f"{name}.py").write_text(transformation)
    settings = {
        "spark.driver.memory": driver_memory,
        "spark.jars": ",".join(j.removeprefix("file://") for j in cached_delta_jars()),
        **DELTA_CONF,
        **LOCAL_CONF,  # the same tuning as Tidemark's server (UTC, small shuffles, 2 snapshot partitions)
        # A table's format: spark.sql.sources.default, not @dp.table(format="delta"), with which
        # the second run fails (SDP re-applies "provider" as a table property: DELTA_CANNOT_CHANGE_PROVIDER).
        "spark.sql.sources.default": "delta",
        # The catalog must outlive the process, or the second run finds the table's folder but no
        # table (DELTA_CREATE_TABLE_WITH_NON_EMPTY_LOCATION).
        "spark.sql.catalogImplementation": "hive",
        "spark.sql.warehouse.dir": str(base / "warehouse"),
        "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={base / 'metastore_db'};create=true",
        "spark.ui.enabled": "false",
    }
    (conf / "spark-defaults.conf").write_text("".join(f"{k} {v}\n" for k, v in settings.items()))
    return project, conf


def sdp_table_path(base: Path, table: str) -> Path:
    """Where SDP's table ``table`` of the project under ``base`` lives (checked to be Delta)."""
    path = base / "warehouse" / table
    if not (path / "_delta_log").is_dir():
        raise BenchError(f"SDP's table {table} is not a Delta table at {path}")
    return path


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d): (.*)$")


def sdp_phases(log: Path, started: float, total: float) -> dict[str, float]:
    """Where an SDP run's time went, from the CLI's timestamped lines (1 s resolution)."""
    stamps: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = _STAMP.match(line)
        if not m:
            continue
        at = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
        for key, prefix in (("session", "Creating Spark session"), ("graph", "Creating dataflow graph"),
                            ("run", "Starting run"), ("done", "Run is COMPLETED")):
            if m.group(2).startswith(prefix):
                stamps.setdefault(key, at)
    if not {"graph", "run", "done"} <= stamps.keys():
        return {}
    return {"start": stamps["graph"] - started, "graph": stamps["run"] - stamps["graph"],
            "flow": stamps["done"] - stamps["run"], "exit": started + total - stamps["done"]}


def sdp_update(base: Path, project: Path, conf: Path, master: str, n: int,
               timeout: float = 3600) -> tuple[float, dict[str, float]]:
    """One fresh ``spark-pipelines run`` of ``project``: (wall seconds, phases); killed after
    ``timeout`` seconds (``subprocess.TimeoutExpired``)."""
    env = {**os.environ, "SPARK_CONF_DIR": str(conf), "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable}
    env.pop("SPARK_HOME", None)
    log = base / f"run{n}.log"
    started = time.time()
    # The master goes on the command line: spark-pipelines always runs a local Connect server
    # (--remote), and spark.master in spark-defaults.conf is refused next to it.
    cmd = [str(Path(sys.executable).parent / "spark-pipelines"), "--remote", master, "run"]
    took = run_logged(cmd, env, project, log, f"spark-pipelines run #{n}", timeout=timeout)
    return took, sdp_phases(log, started, took)


# ------------------------------------------------------------------ compare


def diff_counts(a: DataFrame, b: DataFrame, columns: list[str]) -> tuple[int, int, int, int]:
    """(rows of a, rows of b, rows only in a, rows only in b) over ``columns``, by ``exceptAll``
    both ways; a missing column raises BenchError."""
    for which, df in (("first", a), ("second", b)):
        if sorted(df.columns) != sorted(columns):
            raise BenchError(f"columns differ: the {which} table has {df.columns}, expected {columns}")
    a, b = a.select(*columns), b.select(*columns)
    return a.count(), b.count(), a.exceptAll(b).count(), b.exceptAll(a).count()


@contextlib.contextmanager
def throwaway_postgres(prefix: str, *, keep: bool = False, options: dict[str, str] | None = None) -> Iterator[tuple[Path, Any]]:
    """A temp directory and a PostgreSQL started in its ``pg`` folder (``wal_level=logical`` plus
    ``options``): ``(base, server)``; stopped, and the directory removed unless ``keep``, after."""
    from resources.state import local_pg

    base = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(base, 0o755)  # as root, the server's user must be able to enter it
    pg_home = base / "pg"
    pg_home.mkdir()
    os.chmod(pg_home, 0o755)
    server = local_pg.start(pg_home, port=local_pg.free_port(), options={"wal_level": "logical", **(options or {})})
    try:
        yield base, server
    finally:
        local_pg.stop(pg_home)
        if not keep:
            shutil.rmtree(base, ignore_errors=True)


def observed_replicator(settings: Any, name: str, spark: Any, owner: str) -> tuple[Any, Any, Any, list[Any]]:
    """An engine on ``settings`` (``spark``), its replicator ``name`` and that replicator's source
    whose reads are observed: every transaction a unit reads is appended to the returned list (from
    a columnar read, an object with its ``lsn`` and ``commit_time``)."""
    from lineage.spec.loader import load_lineage
    from platform_assets.cdc.run import open_source
    from platform_assets.engine.runner import Engine

    engine = Engine(settings, load_lineage(settings.lineage), spark=spark, owner=owner)
    rep = engine.lineage.replicators[name]
    source = open_source(rep)
    read = source.read
    seen: list[Any] = []

    def observed(*a: Any, **kw: Any) -> Any:  # the transactions each unit applies
        txs = read(*a, **kw)
        known = {x.lsn for x in seen}  # (a unit whose columnar read fell back reads the same span again)
        seen.extend(tx for tx in txs if tx.lsn not in known)
        return txs

    source.read = observed  # type: ignore[method-assign]
    read_columns = getattr(source, "read_columns", None)
    if read_columns is not None:
        @functools.wraps(read_columns)
        def observed_columns(*a: Any, **kw: Any) -> Any:  # the same, from a columnar read: (lsn, commit time) per transaction
            import numpy as np
            import pyarrow as pa
            import pyarrow.compute as pc
            import pyarrow.parquet as pq

            from lineage.cdc import columns as cc

            cols = read_columns(*a, **kw)
            if cols is not None:
                tables = list(cols.by_table().values())
                for s in (cols.spilled or {}).values():
                    rows = pq.read_table(s.path, columns=[cc.ROW, cc.LSN, cc.TIME])
                    tables.append(rows.filter(pc.less(rows[cc.ROW], s.rows_below)))
                txs: dict[int, Any] = {}
                for part in tables:
                    lsns, first = np.unique(part[cc.LSN].to_numpy(), return_index=True)
                    times = part[cc.TIME].take(pa.array(first))
                    for lsn, ts in zip(lsns.tolist(), times.to_pylist(), strict=True):
                        txs.setdefault(lsn, ts.replace(tzinfo=None) if ts.tzinfo else ts)
                seen.extend(SimpleNamespace(lsn=lsn, commit_time=ts) for lsn, ts in sorted(txs.items()))
            return cols

        source.read_columns = observed_columns  # type: ignore[attr-defined]
    return engine, rep, source, seen
