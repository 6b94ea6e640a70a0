"""resources.storage.warehouse: one set of object-store settings for Spark, deltalake and pyarrow; the
checks that name what to fix; JVM-free reads and writes against a real S3 server (versitygw)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from lineage.core.errors import ConfigError
from lineage.core.positions import Position
from resources.core.settings import Settings
from resources.storage import delta_log, delta_meta
from resources.storage import warehouse as storage
from resources.storage.warehouse import S3Settings, StorageError


def test_settings_from_tidemark_variables_win_over_aws_ones():
    s = S3Settings.from_env({"TIDEMARK_S3_ENDPOINT": "http://127.0.0.1:9000/", "AWS_ENDPOINT_URL": "https://other",
                             "TIDEMARK_S3_ACCESS_KEY": "k", "TIDEMARK_S3_SECRET_KEY": "s", "AWS_ACCESS_KEY_ID": "aws",
                             "AWS_SECRET_ACCESS_KEY": "awss", "AWS_REGION": "eu-west-1"})
    assert (s.endpoint, s.access_key, s.secret_key, s.region, s.path_style, s.allow_http) == \
        ("http://127.0.0.1:9000", "k", "s", "eu-west-1", True, True)
    aws = S3Settings.from_env({"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "AWS_DEFAULT_REGION": "us-west-2"})
    assert (aws.endpoint, aws.access_key, aws.region, aws.path_style, aws.allow_http) == ("", "a", "us-west-2", False, False)
    assert S3Settings.from_env({"TIDEMARK_S3_ENDPOINT": "https://s3.example", "TIDEMARK_S3_PATH_STYLE": "false"}).path_style is False


def test_spark_and_deltalake_get_the_same_store():
    s = S3Settings.from_env({"TIDEMARK_S3_ENDPOINT": "http://127.0.0.1:9000", "TIDEMARK_S3_ACCESS_KEY": "k",
                             "TIDEMARK_S3_SECRET_KEY": "s", "TIDEMARK_S3_REGION": "eu-central-1"})
    spark, delta = s.spark_conf(), s.storage_options()
    assert spark["spark.hadoop.fs.s3a.endpoint"] == delta["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    assert spark["spark.hadoop.fs.s3a.access.key"] == delta["AWS_ACCESS_KEY_ID"] == "k"
    assert spark["spark.hadoop.fs.s3a.secret.key"] == delta["AWS_SECRET_ACCESS_KEY"] == "s"
    assert spark["spark.hadoop.fs.s3a.endpoint.region"] == delta["AWS_REGION"] == "eu-central-1"
    assert spark["spark.hadoop.fs.s3a.path.style.access"] == "true" and delta["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] == "false"
    assert spark["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false" and delta["AWS_ALLOW_HTTP"] == "true"
    # s3:// is read through S3A, so a table's location is the same string on both sides
    assert spark["spark.hadoop.fs.s3.impl"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"
    assert delta["conditional_put"] == "etag"
    assert "AWS_S3_ALLOW_UNSAFE_RENAME" not in delta
    # no keys: each library's default AWS credential chain
    bare = S3Settings.from_env({})
    assert "spark.hadoop.fs.s3a.access.key" not in bare.spark_conf() and "AWS_ACCESS_KEY_ID" not in bare.storage_options()


@pytest.mark.parametrize(("env", "names"), [
    ({"TIDEMARK_S3_ENDPOINT": "127.0.0.1:9000"}, "TIDEMARK_S3_ENDPOINT"),
    ({"TIDEMARK_S3_ACCESS_KEY": "k"}, "TIDEMARK_S3_SECRET_KEY"),
    ({"AWS_SECRET_ACCESS_KEY": "s"}, "TIDEMARK_S3_ACCESS_KEY"),
    ({"TIDEMARK_S3_PATH_STYLE": "yes"}, "TIDEMARK_S3_PATH_STYLE"),
])
def test_bad_settings_name_the_variable(env, names):
    with pytest.raises(ConfigError, match=names):
        S3Settings.from_env(env)


def test_only_object_store_uris_get_options():
    assert storage.is_object_store("s3://b/p") and storage.is_object_store("s3a://b/p")
    assert not storage.is_object_store("/tmp/wh") and not storage.is_object_store("file:///tmp/wh")
    assert storage.storage_options("/tmp/wh/stage/orders") is None
    storage.check_warehouse("/nonexistent/warehouse")  # a local path is never checked here


def test_local_dir_is_the_directory_of_a_path_or_file_uri_and_none_elsewhere():
    """Where a CDC read spills: a plain path and a file: URI are local directories (a file:// warehouse
    used to be taken for a remote one, so its big reads were held in memory); object stores are not."""
    assert storage.local_dir("/tmp/wh") == Path("/tmp/wh")
    assert storage.local_dir("file:///tmp/w%20h") == Path("/tmp/w h")
    assert storage.local_dir("file:/tmp/wh") == Path("/tmp/wh")
    assert storage.local_dir("file://localhost/tmp/wh") == Path("/tmp/wh")
    for remote in ("s3://b/p", "s3a://b/p", "hdfs://nn/p", "file://otherhost/p"):
        assert storage.local_dir(remote) is None, remote


def test_s3a_jars_match_pyspark_hadoop_without_the_bundle():
    hadoop = storage.pyspark_hadoop_version()
    packages, excludes = storage.s3_packages()
    assert f"org.apache.hadoop:hadoop-aws:{hadoop}" in packages
    if hadoop in storage.AWS_SDK_FOR_HADOOP:
        assert "software.amazon.awssdk:bundle" in excludes
        assert any(p.startswith("software.amazon.awssdk:s3:") for p in packages)


# ----------------------------------------------------------------- against a real server


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith(("TIDEMARK_S3_", "AWS_")):
            monkeypatch.delenv(k)
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


def test_check_warehouse_names_url_and_setting(s3_env, monkeypatch):
    storage.check_warehouse("s3://tidemark/wh")  # reachable, keys accepted, bucket there
    with pytest.raises(StorageError, match=r"s3://nobucket/wh.*bucket 'nobucket' does not exist.*TIDEMARK_WAREHOUSE"):
        storage.check_warehouse("s3://nobucket/wh")
    monkeypatch.setenv("TIDEMARK_S3_SECRET_KEY", "wrong")
    with pytest.raises(StorageError, match=r"s3://tidemark/wh.*refused the credentials.*TIDEMARK_S3_SECRET_KEY"):
        storage.check_warehouse("s3://tidemark/wh")
    monkeypatch.setenv("TIDEMARK_S3_SECRET_KEY", s3_env.secret_key)
    closed = s3_env.endpoint.rsplit(":", 1)[0] + ":1"
    monkeypatch.setenv("TIDEMARK_S3_ENDPOINT", closed)
    with pytest.raises(StorageError, match=rf"s3://tidemark/wh on {closed}: cannot reach.*TIDEMARK_S3_ENDPOINT"):
        storage.check_warehouse("s3://tidemark/wh")


def test_engine_refuses_an_unreachable_store_before_anything_runs(s3_env, tmp_path, monkeypatch):
    from lineage.spec.loader import load_lineage
    from platform_assets.engine.runner import Engine
    from tests.conftest import ROOT

    settings = Settings.from_env({}, home=tmp_path, warehouse="s3://missing-bucket/wh", lineage=ROOT / "demo" / "lineage")
    with pytest.raises(StorageError, match="missing-bucket"):
        Engine(settings, load_lineage(settings.lineage))
    assert not (tmp_path / "offsets.db").exists()  # nothing was opened or written


@pytest.mark.fast
def test_jvm_free_reads_and_writes_on_the_store(s3_env, tmp_path):
    """deltalake writes (with storage options), then the Delta-log readers that sensors use:
    table marks, block ends, late rows from the commit files, Parquet footers."""
    from deltalake import write_deltalake

    path = "s3://tidemark/jvmfree/stage/orders"
    t0 = dt.datetime(2026, 1, 1)
    schema = pa.schema([("pos", pa.timestamp("us", tz="UTC")), ("id", pa.int64()), ("v", pa.string())])

    def rows(ids, minutes):
        return pa.table({"pos": [(t0 + dt.timedelta(minutes=m)).replace(tzinfo=dt.UTC) for m in minutes],
                         "id": ids, "v": [None if i % 2 else "x" for i in ids]}, schema=schema)

    write_deltalake(path, rows([1, 2, 3], [1, 2, 3]), mode="append", storage_options=storage.storage_options(path))
    write_deltalake(path, rows([4], [0]), mode="append", storage_options=storage.storage_options(path))  # late
    mark = delta_meta.table_mark(path)
    assert (mark.version, mark.max_position) == (1, Position(t0 + dt.timedelta(minutes=3), 3))
    late = delta_meta.late_rows(path, after_version=0, last=Position(t0 + dt.timedelta(minutes=3), 3))
    assert late.rows.column("id").to_pylist() == [4] and late.unreadable == ()
    stats = delta_log.last_commit_stats(path)
    assert delta_log.commit_null_counts(path, stats) == (1, {"pos": 0, "id": 0, "v": 0})
    end = delta_meta.find_block_end(path, Position(t0, 0), t0 + dt.timedelta(hours=1), maxstep=2)
    assert (end.end, end.rows) == (Position(t0 + dt.timedelta(minutes=1), 1), 2)  # the late row (t0, 4) is first


@pytest.mark.fast
def test_a_replicators_positions_table_on_the_store_is_written_read_and_dropped_whole(s3_env, tmp_path):
    """``etl.cdc_positions__<name>`` on object storage: ``cdc delete`` (drop of every replica)
    removes the table's objects, not only its rows; dropping one replica keeps the others."""
    from resources.storage import cdc_positions

    settings = Settings.from_env({}, home=tmp_path, warehouse="s3://tidemark/positions-wh")
    cdc_positions.write(settings, "crm", {"public.a": (10, ""), "public.b": (20, "paused: x")}, unit=3, changes=7)
    rec = cdc_positions.read(settings, "crm")
    assert (rec.lsn, rec.state["public.b"], rec.unit, rec.changes) == ({"public.a": 10, "public.b": 20}, "paused: x", 3, 7)
    cdc_positions.drop(settings, "crm", ["public.a"])
    assert cdc_positions.read(settings, "crm").lsn == {"public.b": 20}
    path = settings.table_path(cdc_positions.table_name("crm"))
    fs, inside = storage.arrow_filesystem(path)
    assert fs.get_file_info(pafs.FileSelector(inside, recursive=True))
    cdc_positions.drop(settings, "crm")
    assert fs.get_file_info(pafs.FileSelector(inside, recursive=True, allow_not_found=True)) == []
    assert cdc_positions.read(settings, "crm").lsn == {}
    cdc_positions.drop(settings, "crm")  # nothing left: no error
