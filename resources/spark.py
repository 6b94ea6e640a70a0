"""Build the SparkSession Tidemark runs on: local by default, Delta enabled, UTC, small
shuffles. Built lazily (only when a processor needs it), never at import time."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from resources.settings import Settings
from resources.storage import S3Settings, StorageError, is_object_store, s3_packages

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}

LOCAL_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "4",
    "spark.databricks.delta.snapshotPartitions": "2",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.adaptive.enabled": "true",
    # Delta's automatic checkpoints every 10 commits keep the log cheap to read for any reader.
    "spark.databricks.delta.properties.defaults.checkpointInterval": "10",
}


def build_spark_session(settings: Settings, *, app_name: str = "tidemark", ui: bool = False) -> SparkSession:
    """Create (or return the running) SparkSession for ``settings``.

    ``sc://`` masters use Spark Connect (the server must have Delta on its classpath); any
    other master is a classic session whose Delta jars come from Maven Central through
    ``spark.jars.packages`` (cached by Ivy under ``~/.ivy2``).
    """
    from pyspark.sql import SparkSession

    scratch = settings.home / "spark"
    scratch.mkdir(parents=True, exist_ok=True)
    if settings.spark_master.startswith("sc://"):
        builder = SparkSession.builder.remote(settings.spark_master).appName(app_name)
        # Only session (SQL) settings can be set by a client; the server was started with the rest.
        session_conf = {k: v for k, v in LOCAL_CONF.items() if k.startswith(("spark.sql.", "spark.databricks."))}
        for k, v in {**session_conf, **settings.spark_conf}.items():
            builder = builder.config(k, v)
        return builder.getOrCreate()

    os.environ.setdefault("PYSPARK_PYTHON", _python())
    if settings.spark_master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.master(settings.spark_master).appName(app_name)
    conf = {
        **driver_conf(scratch / "catalog", ui=ui),
        "spark.driver.memory": driver_memory(),
        **settings.spark_conf,
    }
    s3_jars: list[str] = []
    if is_object_store(settings.warehouse):
        # The warehouse's store settings and the hadoop-aws jars, only when the warehouse is there.
        conf = {**S3Settings.from_env().spark_conf(), **conf}
        s3_jars = cached_s3_jars() or resolve_s3_jars()
        conf["spark.jars"] = ",".join([*s3_jars, *filter(None, [conf.get("spark.jars")])])
    cached = cached_delta_jars()
    if cached and "spark.jars.packages" not in conf:
        conf["spark.jars"] = ",".join([*cached, *filter(None, [conf.get("spark.jars")])])
    for k, v in conf.items():
        builder = builder.config(k, v)
    if not cached:
        from delta import configure_spark_with_delta_pip

        builder = configure_spark_with_delta_pip(builder)
    spark = builder.getOrCreate()
    if not cached:
        jars = spark.sparkContext.getConf().get("spark.jars", "")
        _remember_delta_jars(",".join(j for j in jars.split(",") if j not in s3_jars))
    spark.sparkContext.setLogLevel("ERROR")
    # PySpark logs every failed query as a JSON blob; Tidemark reports failures itself.
    logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL)
    return spark


def driver_conf(catalog: Path, *, ui: bool) -> dict[str, str]:
    """The settings of a Spark driver Tidemark starts (in-process or a Connect server): Delta, UTC,
    small shuffles, the catalog under ``catalog``."""
    return {**DELTA_CONF, **LOCAL_CONF, "spark.ui.enabled": "true" if ui else "false",
            "spark.sql.warehouse.dir": str(catalog)}


def driver_memory() -> str:
    return os.environ.get("TIDEMARK_DRIVER_MEMORY", "4g")


def _jar_cache_file() -> Path:
    """Where the Delta jars Ivy resolved are remembered, per pyspark/delta-spark versions."""
    from importlib.metadata import version

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tidemark"
    return base / f"delta-jars-spark{version('pyspark')}-delta{version('delta-spark')}.txt"


def _read_jar_list(path: Path) -> list[str]:
    """The jars listed in ``path`` (one per line), if all still exist; else []."""
    try:
        jars = [j for j in path.read_text().split() if j]
    except OSError:
        return []
    ok = jars and all(Path(j.removeprefix("file:")).is_file() for j in jars)
    return jars if ok else []


def _write_jar_list(path: Path, jars: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(jars) + "\n")


def cached_delta_jars() -> list[str]:
    """Jars of an earlier Ivy resolution, if all still exist: later sessions start without
    Ivy (quiet, and without reaching Maven Central again)."""
    return _read_jar_list(_jar_cache_file())


def _remember_delta_jars(spark_jars: str) -> None:
    jars = [j for j in spark_jars.split(",") if j.endswith(".jar")]
    if not any("delta-spark" in j for j in jars):
        return
    _write_jar_list(_jar_cache_file(), jars)


def _s3_jar_cache_file() -> Path:
    """Where the hadoop-aws jars Ivy resolved are remembered, per pyspark version."""
    from importlib.metadata import version

    return _jar_cache_file().parent / f"s3a-jars-spark{version('pyspark')}.txt"


def cached_s3_jars() -> list[str]:
    """The hadoop-aws (S3A) jars of an earlier resolution, if all still exist; else []."""
    return _read_jar_list(_s3_jar_cache_file())


def resolve_s3_jars(timeout: float = 900.0) -> list[str]:
    """Resolve the S3A jars matching pyspark's Hadoop (:func:`resources.storage.s3_packages`)
    from Maven Central through Spark's Ivy, remember them, and return their paths.

    In a child process: Spark resolves ``spark.jars.packages`` only when a JVM is launched, and
    this process may already run one (a session without the S3A jars)."""
    import json
    import subprocess
    import sys

    packages, excludes = s3_packages()
    code = ("import json,sys\nfrom pyspark import SparkConf\nfrom pyspark.java_gateway import launch_gateway\n"
            "conf = SparkConf().set('spark.jars.packages', sys.argv[1]).set('spark.jars.excludes', sys.argv[2])\n"
            "gw = launch_gateway(conf)\nprint('JARS=' + json.dumps(gw.jvm.System.getProperty('spark.jars')))\n"
            "gw.shutdown()\n")
    env = {**os.environ, "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1")}
    try:
        out = subprocess.run([sys.executable, "-c", code, ",".join(packages), ",".join(excludes)], env=env,
                             capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise StorageError(f"resolving the S3A jars ({', '.join(packages)}) took over {timeout:.0f}s; check network "
                           "access to Maven Central") from exc
    line = next((x for x in out.stdout.splitlines() if x.startswith("JARS=")), "")
    jars = [j for j in (json.loads(line[5:]) or "").split(",") if j.endswith(".jar")] if line else []
    if out.returncode != 0 or not jars:
        tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-15:])
        raise StorageError(f"could not resolve the S3A jars ({', '.join(packages)}) from Maven Central (the warehouse "
                           f"is on object storage). Check network access to Maven Central, or put the jars in "
                           f"spark.jars via TIDEMARK_SPARK_CONF. Spark said:\n{tail}")
    _write_jar_list(_s3_jar_cache_file(), jars)
    return jars


def _python() -> str:
    import sys

    return sys.executable
