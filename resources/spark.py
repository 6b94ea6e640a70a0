"""Build the SparkSession Tidemark runs on: local by default, Delta enabled, UTC, small
shuffles. Built lazily (only when a processor needs it), never at import time."""

from __future__ import annotations

import logging
import os
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
        for k, v in {**LOCAL_CONF, **settings.spark_conf}.items():
            builder = builder.config(k, v)
        return builder.getOrCreate()

    from delta import configure_spark_with_delta_pip

    os.environ.setdefault("PYSPARK_PYTHON", os.environ.get("PYSPARK_PYTHON") or _python())
    builder = SparkSession.builder.master(settings.spark_master).appName(app_name)
    conf = {
        **DELTA_CONF,
        **LOCAL_CONF,
        "spark.ui.enabled": "true" if ui else "false",
        "spark.sql.warehouse.dir": str(scratch / "catalog"),
        "spark.local.dir": str(scratch / "tmp"),
        "spark.driver.memory": os.environ.get("TIDEMARK_DRIVER_MEMORY", "4g"),
        **settings.spark_conf,
    }
    for k, v in conf.items():
        builder = builder.config(k, v)
    spark = configure_spark_with_delta_pip(builder).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    # PySpark logs every failed query as a JSON blob; Tidemark reports failures itself.
    logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL)
    return spark


def _python() -> str:
    import sys

    return sys.executable
