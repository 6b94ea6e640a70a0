"""Where the warehouse lives: a local directory, or an S3-compatible object store. ONE place
turns the object-store settings into what each side needs: ``fs.s3a.*`` settings and the
hadoop-aws jars for Spark, ``storage_options`` for ``deltalake``, a ``pyarrow`` file system for
the log and Parquet reads, and a check that the store answers before anything runs.

| variable | fallback | meaning |
|---|---|---|
| ``TIDEMARK_S3_ENDPOINT`` | ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` | ``http(s)://host:port`` of an S3-compatible store; unset: AWS S3. ``http://`` allows plain HTTP |
| ``TIDEMARK_S3_ACCESS_KEY`` | ``AWS_ACCESS_KEY_ID`` | access key; unset (with the secret): each library's default AWS credential chain |
| ``TIDEMARK_S3_SECRET_KEY`` | ``AWS_SECRET_ACCESS_KEY`` | secret key |
| ``TIDEMARK_S3_SESSION_TOKEN`` | ``AWS_SESSION_TOKEN`` | session token of temporary credentials |
| ``TIDEMARK_S3_REGION`` | ``AWS_REGION``, ``AWS_DEFAULT_REGION`` | region (default ``us-east-1``) |
| ``TIDEMARK_S3_PATH_STYLE`` | | ``true``: ``endpoint/bucket/key`` requests; ``false``: ``bucket.endpoint/key``. Default: true with an endpoint, false on AWS |

The warehouse is ``s3://bucket/prefix`` (``s3a://`` is accepted too). The same URI serves both
sides: Spark reads ``s3://`` through S3A (``fs.s3.impl``), ``deltalake`` and ``pyarrow`` read it
natively, so a table's location is one string everywhere (the Delta log holds relative paths).

Concurrent writers: Tidemark writes each table from one writer at a time (a topic's lock; the
meta tables are written by ``deltalake`` only). Spark's Delta uses its default S3 LogStore
(``S3SingleDriverLogStore``: safe for one driver per table); ``deltalake`` commits with a
conditional put (``If-None-Match: *``), so the store must support conditional writes, as AWS S3
(since 2024), MinIO, versitygw, Ceph RGW and R2 do. No unsafe rename, no DynamoDB lock.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from lineage.core.errors import ConfigError, TidemarkError

S3_SCHEMES = ("s3", "s3a")

#: The AWS SDK v2 release each hadoop-aws was built against (hadoop-project's
#: ``aws-java-sdk-v2.version``). S3A needs only the SDK's S3 client and transfer manager (~13 MB
#: with their dependencies) instead of the ``bundle`` jar hadoop-aws declares (~690 MB).
AWS_SDK_FOR_HADOOP = {"3.5.0": "2.35.4"}

#: Left out of the Ivy resolution: the bundle (replaced by the modules above), and what the
#: pyspark distribution already ships (netty, Apache HTTP client, codecs, slf4j).
JAR_EXCLUDES = ("software.amazon.awssdk:bundle", "io.netty:*", "org.apache.httpcomponents:*", "commons-codec:commons-codec",
                "commons-logging:commons-logging", "org.slf4j:slf4j-api")


class StorageError(TidemarkError):
    """The object store cannot be reached, refuses the credentials, or lacks the bucket."""


def is_object_store(uri: str) -> bool:
    """Whether ``uri`` is on an S3-compatible object store (``s3://`` or ``s3a://``)."""
    return urlsplit(uri).scheme.lower() in S3_SCHEMES


def local_dir(uri: str) -> Path | None:
    """The local directory a warehouse (or table) location names: a plain path, or a ``file:``
    URI (``file:///x``, ``file:/x``); None for any other scheme (an object store, HDFS...)."""
    parts = urlsplit(uri)
    if "://" not in uri and parts.scheme.lower() != "file":
        return Path(uri)
    if parts.scheme.lower() == "file" and parts.netloc in ("", "localhost"):
        return Path(unquote(parts.path))
    return None


@dataclass(frozen=True)
class S3Settings:
    """The object-store settings, from ``TIDEMARK_S3_*`` else the standard ``AWS_*`` variables."""

    endpoint: str = ""  # empty: AWS S3
    access_key: str = ""
    secret_key: str = ""
    session_token: str = ""
    region: str = "us-east-1"
    path_style: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Settings:
        env = os.environ if env is None else env

        def first(*names: str) -> str:
            return next((env[n].strip() for n in names if env.get(n, "").strip()), "")

        endpoint = first("TIDEMARK_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL").rstrip("/")
        if endpoint and urlsplit(endpoint).scheme not in ("http", "https"):
            raise ConfigError(f"TIDEMARK_S3_ENDPOINT={endpoint!r} is not a URL; write it as http://host:port or "
                              "https://host (http:// allows plain HTTP)")
        style = first("TIDEMARK_S3_PATH_STYLE").lower()
        if style not in ("", "true", "false", "1", "0"):
            raise ConfigError(f"TIDEMARK_S3_PATH_STYLE={style!r}: use true (endpoint/bucket/key) or false (bucket.endpoint/key)")
        access = first("TIDEMARK_S3_ACCESS_KEY", "AWS_ACCESS_KEY_ID")
        secret = first("TIDEMARK_S3_SECRET_KEY", "AWS_SECRET_ACCESS_KEY")
        if bool(access) != bool(secret):
            given, missing = ("TIDEMARK_S3_ACCESS_KEY", "TIDEMARK_S3_SECRET_KEY") if access else \
                ("TIDEMARK_S3_SECRET_KEY", "TIDEMARK_S3_ACCESS_KEY")
            raise ConfigError(f"{given} (or its AWS_* fallback) is set but {missing} is not; set both, or neither "
                              "to use the default AWS credential chain")
        return cls(endpoint=endpoint, access_key=access, secret_key=secret,
                   session_token=first("TIDEMARK_S3_SESSION_TOKEN", "AWS_SESSION_TOKEN"),
                   region=first("TIDEMARK_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1",
                   path_style=style in ("true", "1") if style else bool(endpoint))

    @property
    def allow_http(self) -> bool:
        return self.endpoint.startswith("http://")

    @property
    def where(self) -> str:
        return self.endpoint or f"AWS S3 ({self.region})"

    def spark_conf(self) -> dict[str, str]:
        """``fs.s3a.*`` settings (as ``spark.hadoop.*``) for this store; ``s3://`` goes through S3A too."""
        conf = {
            "fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
            "fs.AbstractFileSystem.s3.impl": "org.apache.hadoop.fs.s3a.S3A",
            "fs.s3a.endpoint.region": self.region,
            "fs.s3a.path.style.access": str(self.path_style).lower(),
            # A wrong endpoint or key fails in seconds, not after S3A's default minutes of retries.
            "fs.s3a.attempts.maximum": "3",
            "fs.s3a.retry.limit": "3",
            "fs.s3a.connection.establish.timeout": "5s",
        }
        if self.endpoint:
            conf["fs.s3a.endpoint"] = self.endpoint
            conf["fs.s3a.connection.ssl.enabled"] = str(not self.allow_http).lower()
        if self.access_key:
            conf["fs.s3a.access.key"] = self.access_key
            conf["fs.s3a.secret.key"] = self.secret_key
            if self.session_token:
                conf["fs.s3a.session.token"] = self.session_token
                conf["fs.s3a.aws.credentials.provider"] = "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
            else:
                conf["fs.s3a.aws.credentials.provider"] = "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"
        return {f"spark.hadoop.{k}": v for k, v in conf.items()}

    def storage_options(self) -> dict[str, str]:
        """``deltalake`` storage options for this store."""
        opts = {
            "AWS_REGION": self.region,
            "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": str(not self.path_style).lower(),
            # Commits are created with If-None-Match: *, never overwritten (see the module doc).
            "conditional_put": "etag",
        }
        if self.endpoint:
            opts["AWS_ENDPOINT_URL"] = self.endpoint
            opts["AWS_ALLOW_HTTP"] = str(self.allow_http).lower()
        if self.access_key:
            opts["AWS_ACCESS_KEY_ID"] = self.access_key
            opts["AWS_SECRET_ACCESS_KEY"] = self.secret_key
            if self.session_token:
                opts["AWS_SESSION_TOKEN"] = self.session_token
        return opts

    def arrow_filesystem(self) -> Any:
        """A ``pyarrow.fs.S3FileSystem`` for this store (paths are ``bucket/key``)."""
        import pyarrow.fs as pafs

        kwargs: dict[str, Any] = {"region": self.region, "force_virtual_addressing": not self.path_style,
                                  "connect_timeout": 5, "request_timeout": 30,
                                  "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3)}
        if self.endpoint:
            parts = urlsplit(self.endpoint)
            kwargs.update(endpoint_override=parts.netloc + parts.path, scheme=parts.scheme)
        if self.access_key:
            kwargs.update(access_key=self.access_key, secret_key=self.secret_key,
                          session_token=self.session_token or None)
        return pafs.S3FileSystem(**kwargs)


@functools.lru_cache(maxsize=8)
def _settings_for(key: tuple[tuple[str, str], ...]) -> S3Settings:
    return S3Settings.from_env(dict(key))


def current() -> S3Settings:
    """The settings of this process's environment (parsed once per distinct environment)."""
    keys = [k for k in os.environ if k.startswith(("TIDEMARK_S3_", "AWS_"))]
    return _settings_for(tuple(sorted((k, os.environ[k]) for k in keys)))


def storage_options(uri: str) -> dict[str, str] | None:
    """``deltalake``'s ``storage_options`` for a table at ``uri`` (None for a local path)."""
    return current().storage_options() if is_object_store(uri) else None


@functools.cache
def _local_fs() -> Any:
    """One local ``pyarrow`` file system for the process (it holds no state; making one per call
    cost a planner tick ~0.05 s for 200 topics)."""
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()


def arrow_filesystem(uri: str) -> tuple[Any, str]:
    """A ``pyarrow`` file system and the path inside it for ``uri`` (a local path, ``s3://``,
    ``s3a://``, or any other URI pyarrow knows)."""
    import pyarrow.fs as pafs

    if "://" not in uri:
        return _local_fs(), uri
    parts = urlsplit(uri)
    if parts.scheme.lower() in S3_SCHEMES:
        return _arrow_s3(current()), (parts.netloc + parts.path).rstrip("/")
    return pafs.FileSystem.from_uri(uri)


def remove_tree(uri: str) -> None:
    """Remove everything under ``uri`` (a table's folder), on local disk or in object storage; a
    path that is not there is no error."""
    import pyarrow.fs as pafs

    fs, path = arrow_filesystem(uri)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return
    # deepest first, one by one: an S3 server on a file system (versitygw) refuses to remove a
    # folder's marker before its contents, which a batched delete_dir may ask in either order
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    for info in sorted(infos, key=lambda i: i.path.count("/"), reverse=True):
        if info.type == pafs.FileType.Directory:
            fs.delete_dir(info.path)
        else:
            fs.delete_file(info.path)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)


def delta_tables(warehouse: str, schemas: list[str] | None = None) -> list[str]:
    """Every Delta table under ``warehouse`` (``<schema>/<table>`` with a ``_delta_log``), as
    ``schema.table``, sorted; only those of ``schemas`` when given."""
    import pyarrow.fs as pafs

    fs, root = arrow_filesystem(warehouse)
    out = []
    try:
        found = [i for i in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)) if i.type == pafs.FileType.Directory]
    except OSError:
        return []
    for schema in found:
        if schemas is not None and schema.base_name not in schemas:
            continue
        for table in fs.get_file_info(pafs.FileSelector(schema.path, allow_not_found=True)):
            if table.type != pafs.FileType.Directory:
                continue
            if fs.get_file_info(f"{table.path}/_delta_log").type == pafs.FileType.Directory:
                out.append(f"{schema.base_name}.{table.base_name}")
    return sorted(out)


@functools.lru_cache(maxsize=8)
def _arrow_s3(settings: S3Settings) -> Any:
    return settings.arrow_filesystem()


def bucket_of(uri: str) -> str:
    return urlsplit(uri).netloc


def check_warehouse(uri: str, settings: S3Settings | None = None) -> None:
    """Before anything runs: the store at ``uri`` answers, accepts the credentials and has the
    bucket. Raises :class:`StorageError` naming the URL and the setting to fix. A local path passes."""
    if not is_object_store(uri):
        return
    import pyarrow.fs as pafs

    s = settings or current()
    bucket = bucket_of(uri)
    if not bucket:
        raise StorageError(f"TIDEMARK_WAREHOUSE={uri}: no bucket; write it as s3://bucket/prefix")
    try:
        info = s.arrow_filesystem().get_file_info(bucket)
    except OSError as exc:
        raise StorageError(_explain(uri, s, str(exc))) from exc
    if info.type == pafs.FileType.NotFound:
        raise StorageError(f"warehouse {uri}: bucket {bucket!r} does not exist at {s.where}. Fix: create it "
                           f"(e.g. aws s3 mb s3://{bucket} --endpoint-url {s.endpoint or '<endpoint>'}) or point "
                           "TIDEMARK_WAREHOUSE at an existing bucket")


def _explain(uri: str, s: S3Settings, error: str) -> str:
    low = error.lower()
    if any(w in low for w in ("accessdenied", "access denied", "access_denied", "invalidaccesskeyid", "signaturedoesnotmatch", "forbidden",
                              "403", "credentials")):
        fix = ("the store refused the credentials. Fix: TIDEMARK_S3_ACCESS_KEY / TIDEMARK_S3_SECRET_KEY "
               "(or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
    elif any(w in low for w in ("connect", "resolve", "timed out", "timeout", "refused", "unreachable", "curl")):
        fix = (f"cannot reach {s.where}. Fix: TIDEMARK_S3_ENDPOINT (http(s)://host:port of the store; "
               "unset for AWS S3), and check that the store runs")
    else:
        fix = ("check TIDEMARK_S3_ENDPOINT, TIDEMARK_S3_REGION, TIDEMARK_S3_PATH_STYLE and the credentials "
               "(TIDEMARK_S3_ACCESS_KEY / TIDEMARK_S3_SECRET_KEY)")
    return f"warehouse {uri} on {s.where}: {fix}. The store said: {error.strip()}"


# --------------------------------------------------------------------- Spark jars


def pyspark_hadoop_version() -> str:
    """The Hadoop version of the installed pyspark distribution (from its hadoop-client-api jar)."""
    import pyspark

    jars = Path(pyspark.__file__).resolve().parent / "jars"
    for jar in sorted(jars.glob("hadoop-client-api-*.jar")):
        return jar.name.removeprefix("hadoop-client-api-").removesuffix(".jar")
    raise StorageError(f"no hadoop-client-api-*.jar in {jars}: cannot tell which hadoop-aws matches this pyspark; "
                       "reinstall pyspark, or set spark.jars.packages in TIDEMARK_SPARK_CONF")


def s3_packages(hadoop: str | None = None) -> tuple[list[str], list[str]]:
    """Maven coordinates (for ``spark.jars.packages``) and exclusions (``spark.jars.excludes``)
    of S3A for the pyspark distribution's Hadoop. An unknown Hadoop version gets hadoop-aws with
    the SDK bundle it declares (correct, only larger)."""
    hadoop = hadoop or pyspark_hadoop_version()
    sdk = AWS_SDK_FOR_HADOOP.get(hadoop)
    if sdk is None:
        return [f"org.apache.hadoop:hadoop-aws:{hadoop}"], []
    return ([f"org.apache.hadoop:hadoop-aws:{hadoop}", f"software.amazon.awssdk:s3:{sdk}",
             f"software.amazon.awssdk:s3-transfer-manager:{sdk}"], list(JAR_EXCLUDES))
