"""The one configuration of Tidemark's SparkSession (``resources.spark.session.spark_config``), shared by
``build_spark_session`` and the ``dagster-pyspark`` resource the Dagster definitions bind. No JVM:
these only build dictionaries. That a session built from it runs units is the Spark tests' part
(every Spark test's session comes from ``build_spark_session``; the IO manager test takes the
resource's session in a user's asset)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dagster_pyspark import LazyPySparkResource

from resources.core.settings import Settings
from resources.spark.session import DELTA_CONF, PYSPARK_KEY, delta_package, pyspark_resource, spark_config


@pytest.fixture
def no_jar_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No remembered Delta or S3A jars (a machine where Ivy never ran)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_a_local_session_gets_delta_utc_quiet_logs_and_the_delta_jars(tmp_path, no_jar_cache):
    s = Settings.from_env({"TIDEMARK_SPARK_CONF": "spark.sql.shuffle.partitions=7;spark.executor.memory=3g"},
                          home=tmp_path, spark_master="local[2]")
    conf = spark_config(s, app_name="t")
    assert conf["spark.master"] == "local[2]" and conf["spark.app.name"] == "t" and "spark.remote" not in conf
    assert DELTA_CONF.items() <= conf.items()
    assert conf["spark.sql.session.timeZone"] == "UTC" and conf["spark.log.level"] == "ERROR"
    assert conf["spark.ui.enabled"] == "false"
    assert conf["spark.sql.warehouse.dir"] == str(tmp_path / "spark" / "catalog")
    # the user's TIDEMARK_SPARK_CONF wins over Tidemark's defaults, and adds to them
    assert conf["spark.sql.shuffle.partitions"] == "7" and conf["spark.executor.memory"] == "3g"
    # no remembered jars: Ivy resolves the Delta jars matching the installed delta-spark and pyspark
    assert conf["spark.jars.packages"] == delta_package() and "spark.jars" not in conf
    assert delta_package().startswith("io.delta:delta-spark_4.")
    assert os.environ["SPARK_LOCAL_IP"] and os.environ["PYSPARK_PYTHON"]


def test_user_packages_are_kept_beside_delta(tmp_path, no_jar_cache):
    s = Settings.from_env({"TIDEMARK_SPARK_CONF": "spark.jars.packages=org.example:x:1.0"}, home=tmp_path,
                          spark_master="local[1]")
    assert spark_config(s)["spark.jars.packages"].split(",") == [delta_package(), "org.example:x:1.0"]


def test_a_connect_session_gets_only_what_a_client_may_set(tmp_path):
    s = Settings.from_env({"TIDEMARK_SPARK_CONF": "spark.sql.shuffle.partitions=3"}, home=tmp_path,
                          spark_master="sc://127.0.0.1:15002")
    conf = spark_config(s, app_name="t")
    assert conf["spark.remote"] == "sc://127.0.0.1:15002" and "spark.master" not in conf
    rest = {k for k in conf if k not in ("spark.remote", "spark.app.name")}
    assert rest and all(k.startswith(("spark.sql.", "spark.databricks.")) for k in rest)  # no jars, no driver settings
    assert conf["spark.sql.shuffle.partitions"] == "3"


def test_an_object_store_warehouse_leaves_uncached_s3a_jars_to_the_sessions_start(tmp_path, no_jar_cache):
    s = Settings.from_env({}, home=tmp_path, warehouse="s3a://bucket/wh", spark_master="local[1]")
    conf = spark_config(s, resolve_s3=False)  # never a child process resolving jars while definitions load
    packages = conf["spark.jars.packages"].split(",")
    assert any(p.startswith("org.apache.hadoop:hadoop-aws:") for p in packages) and delta_package() in packages
    assert conf["spark.hadoop.fs.s3.impl"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"


def test_the_dagster_resource_is_dagster_pysparks_lazy_resource_on_the_same_config(tmp_path, no_jar_cache):
    s = Settings.from_env({}, home=tmp_path, spark_master="local[2]")
    res = pyspark_resource(s)
    assert isinstance(res, LazyPySparkResource) and PYSPARK_KEY == "pyspark"
    assert res.spark_config == spark_config(s, resolve_s3=False)
