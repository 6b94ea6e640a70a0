"""Build the SparkSession Tidemark runs on: local by default, Delta enabled, UTC, small
shuffles. Built lazily (only when a processor needs it), never at import time."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from resources.settings import Settings

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
        _remember_delta_jars(spark.sparkContext.getConf().get("spark.jars", ""))
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


def cached_delta_jars() -> list[str]:
    """Jars of an earlier Ivy resolution, if all still exist: later sessions start without
    Ivy (quiet, and without reaching Maven Central again)."""
    try:
        jars = [j for j in _jar_cache_file().read_text().split() if j]
    except OSError:
        return []
    ok = jars and all(Path(j.removeprefix("file:")).is_file() for j in jars)
    return jars if ok else []


def _remember_delta_jars(spark_jars: str) -> None:
    jars = [j for j in spark_jars.split(",") if j.endswith(".jar")]
    if not any("delta-spark" in j for j in jars):
        return
    path = _jar_cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(jars) + "\n")


def _python() -> str:
    import sys

    return sys.executable
