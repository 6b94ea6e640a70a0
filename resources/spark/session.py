"""Build the SparkSession Tidemark runs on: local by default, Delta enabled, UTC, small
shuffles. Built lazily (only when a processor needs it), never at import time."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

from resources.core.pidlock import PidFileLock
from resources.core.settings import Settings
from resources.storage.warehouse import S3Settings, StorageError, is_object_store, s3_packages

if TYPE_CHECKING:
    from dagster_pyspark import LazyPySparkResource
    from pyspark.sql import SparkSession

#: The resource key of the Spark session in Tidemark's Dagster definitions: dagster-pyspark's
#: documented key, the one Dagster users' assets ask for (``pyspark: LazyPySparkResource``).
PYSPARK_KEY = "pyspark"
log = logging.getLogger(__name__)

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
    # A version read from the files its log names (platform_assets.core.table_reads) gives Spark
    # up to 1,000 file paths: looked up on the driver, not by a listing job.
    "spark.sql.sources.parallelPartitionDiscovery.threshold": "1000",
}


def build_spark_session(settings: Settings, *, app_name: str = "tidemark", ui: bool = False) -> SparkSession:
    """Create (or return the running) SparkSession for ``settings``: the session of
    :func:`spark_config`, started the way ``dagster-pyspark``'s resources start theirs (the same
    configuration, one ``getOrCreate``), then :func:`session_started`.

    ``sc://`` masters use Spark Connect (the server must have Delta on its classpath); any
    other master is a classic session whose Delta jars come from Maven Central through
    ``spark.jars.packages`` (cached by Ivy under ``~/.ivy2``, then remembered).
    """
    from pyspark.sql import SparkSession

    conf = spark_config(settings, app_name=app_name, ui=ui)
    with ivy_resolution(conf):
        if "spark.jars.packages" in conf:  # another process may have resolved (and remembered) them while this one waited
            conf = spark_config(settings, app_name=app_name, ui=ui)
        builder = SparkSession.builder
        for k, v in conf.items():
            builder = builder.config(k, v)
        return session_started(builder.getOrCreate())


#: How long a process waits for another one resolving jars through Ivy before it gives up.
IVY_WAIT_S = 900.0


@contextmanager
def ivy_resolution(conf: dict[str, str] | None = None, *, wait_s: float = IVY_WAIT_S) -> Iterator[None]:
    """Held while a JVM this process starts resolves ``spark.jars.packages`` through Ivy (Delta's
    jars on first use, the S3A jars): one process at a time per user. Two JVMs resolving into one
    Ivy cache at once break each other's downloads (``impossible to move part file to definitive
    one`` and then ``UNRESOLVED DEPENDENCIES``: seen when two test workers, or two Dagster runs,
    start on a fresh machine). Nothing is held when ``conf`` has no packages to resolve. An
    :class:`~resources.core.pidlock.PidFileLock` on ``ivy.lock`` beside the remembered jar lists, so
    a process that dies holding it frees it (its file descriptor is not inherited by the JVM: PEP 446)."""
    if conf is not None and "spark.jars.packages" not in conf:
        yield
        return
    path = _jar_cache_file().parent / "ivy.lock"
    lock = PidFileLock(path, _IvyHeld)
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            lock.acquire()
            break
        except _IvyHeld as held:
            if time.monotonic() >= deadline:
                raise StorageError(f"another process (pid {held.pid}) has been resolving Spark jars through Ivy for over "
                                   f"{wait_s:.0f} s (it holds {path}); check network access to Maven Central") from None
            if not said:
                log.info("waiting for process %s, resolving Spark jars through Ivy (%s)", held.pid, path)
                said = True
            time.sleep(0.2)
    try:
        yield
    finally:
        lock.release()


class _IvyHeld(Exception):
    def __init__(self, pid: str) -> None:
        super().__init__(pid)
        self.pid = pid


def spark_config(settings: Settings, *, app_name: str = "tidemark", ui: bool = False,
                 resolve_s3: bool = True) -> dict[str, str]:
    """The whole configuration of Tidemark's SparkSession for ``settings``, as flat
    ``spark.*`` keys: what ``SparkSession.builder.config(k, v)...getOrCreate()`` needs (it is the
    ``spark_config`` of :func:`pyspark_resource`). Also sets the driver process's environment
    defaults (its Python for workers, a loopback address for local masters) and makes the scratch
    directory.

    A Spark Connect master (``sc://``) gets ``spark.remote`` and the session (SQL) settings only: a
    client cannot set the rest, the server was started with them. A classic master gets Delta, UTC,
    small shuffles, the driver's memory and the Delta jars (remembered ones, else
    ``spark.jars.packages``); with the warehouse on an object store also its settings and the S3A
    jars (remembered ones; else resolved in a child process when ``resolve_s3``, else
    ``spark.jars.packages`` for the session's own start to resolve). ``TIDEMARK_SPARK_CONF`` wins."""
    scratch = settings.home / "spark"
    scratch.mkdir(parents=True, exist_ok=True)
    if settings.spark_master.startswith("sc://"):
        session_conf = {k: v for k, v in LOCAL_CONF.items() if k.startswith(("spark.sql.", "spark.databricks."))}
        return {"spark.remote": settings.spark_master, "spark.app.name": app_name, **session_conf,
                **settings.spark_conf}
    os.environ.setdefault("PYSPARK_PYTHON", _python())
    if settings.spark_master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    conf = {
        "spark.master": settings.spark_master,
        "spark.app.name": app_name,
        **driver_conf(scratch / "catalog", ui=ui),
        "spark.driver.memory": driver_memory(),
        # PySpark's setLogLevel("ERROR") as a setting, so any builder of this config gets it.
        "spark.log.level": "ERROR",
        **settings.spark_conf,
    }
    jars: list[str] = []
    packages: list[str] = []
    if is_object_store(settings.warehouse):
        # The warehouse's store settings and the hadoop-aws jars, only when the warehouse is there.
        conf = {**S3Settings.from_env().spark_conf(), **conf}
        s3_jars = cached_s3_jars() or (resolve_s3_jars() if resolve_s3 else [])
        if s3_jars:
            jars += s3_jars
        else:
            s3, excludes = s3_packages()
            packages += s3
            conf["spark.jars.excludes"] = ",".join([*excludes, *filter(None, [conf.get("spark.jars.excludes")])])
    cached = cached_delta_jars()
    if cached and "spark.jars.packages" not in conf:
        jars += cached
    else:
        packages.append(delta_package())
    if jars:
        conf["spark.jars"] = ",".join([*jars, *filter(None, [conf.get("spark.jars")])])
    if packages:
        conf["spark.jars.packages"] = ",".join([*packages, *filter(None, [conf.get("spark.jars.packages")])])
    return conf


def session_started(spark: SparkSession) -> SparkSession:
    """What follows the start of a session built from :func:`spark_config`, by
    :func:`build_spark_session` or by ``dagster-pyspark``: remember the Delta jars Ivy resolved
    (later sessions start without Ivy), keep PySpark from logging every failed query as a JSON blob
    (Tidemark reports failures itself), and keep Delta from logging an ERROR line on every read of a
    table with deletion vectors (``Failed to translate filter EqualTo(__delta_internal_is_row_deleted,0)``:
    Delta does not push its own deleted-rows filter into Parquet, and says so; the read is exact).
    Cheap and idempotent; a Connect session needs nothing (the server logs to its own file)."""
    if not is_connect(spark) and not cached_delta_jars():
        s3 = set(cached_s3_jars())  # the S3A jars (hadoop-aws and the AWS SDK) are remembered apart
        jars = spark.sparkContext.getConf().get("spark.jars", "").split(",")
        _remember_delta_jars(",".join(j for j in jars if j not in s3 and
                                      not Path(j).name.startswith(("org.apache.hadoop_hadoop-aws", "software.amazon."))))
    if not is_connect(spark):
        try:
            log4j = spark._jvm.org.apache.logging.log4j  # type: ignore[union-attr]  # (classic: the driver's JVM)
            log4j.core.config.Configurator.setLevel(QUIET_DELTA_LOGGER, log4j.Level.FATAL)
        except Exception:  # noqa: BLE001 - a JVM without log4j's API (or a gateway that refuses it) keeps the line
            pass
    logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL)
    return spark


#: Delta's logger that reports, at ERROR, a filter it does not push down on every read of a table
#: with deletion vectors (see :func:`session_started`). It logs nothing else at ERROR that a read
#: does not also raise: a failed read fails its query, which Tidemark reports.
QUIET_DELTA_LOGGER = "org.apache.spark.sql.delta.DeltaParquetFileFormat"


def running_sessions() -> list[SparkSession]:
    """The sessions this process has already, in any thread: classic PySpark's instantiated session
    and Spark Connect's default one. A session ``getOrCreate`` returns that is one of these was
    not created by the caller, which must then not stop it."""
    out: list[SparkSession] = []
    from pyspark.sql import SparkSession as Classic

    if (classic := getattr(Classic, "_instantiatedSession", None)) is not None:
        out.append(classic)
    try:
        from pyspark.sql.connect.session import SparkSession as Connect
    except ImportError:  # (Spark Connect's client dependencies not installed)
        return out
    if (default := getattr(Connect, "_default_session", None)) is not None:
        out.append(default)
    return out


def make_active(spark: SparkSession) -> None:
    """``spark`` the active session of this thread. Spark Connect's client binds what a command
    returns to the thread's active session: a ``localCheckpoint`` made on a sibling session
    (:func:`sibling_sessions`) in a thread where another session is active would name a cached
    relation the server keeps in the sibling, in a DataFrame of the other session, which then
    fails with ``DATAFRAME_NOT_FOUND``. Classic sessions bind results to themselves: nothing to do."""
    if is_connect(spark):
        type(spark)._active_session.session = spark  # type: ignore[attr-defined]  # (thread-local in pyspark)


def sibling_sessions(spark: SparkSession, settings: Settings, count: int) -> list[SparkSession]:
    """``count`` more sessions on ``spark``'s Spark, for work run concurrently from threads: each has
    its own SQL settings and temporary views, so settings a statement needs (a Delta write's
    ``txnAppId``/``txnVersion``) never leak between threads. Classic: ``spark.newSession()`` (the
    same SparkContext); Spark Connect: new server-side sessions on the server ``spark`` talks to
    (its address and parameters but its session id), with the session settings of
    :func:`spark_config`. Either way the SQL settings of ``spark`` that differ (set at run time) are
    copied at every call. Made once per session and kept while it lives (Connect ones are made again after
    :data:`SIBLING_IDLE_S` unused, before the server closes them as idle). One caller at a time."""
    have, used = _siblings.get(spark, ([], 0.0))
    now = time.monotonic()
    if is_connect(spark) and have and now - used > SIBLING_IDLE_S:
        have = []  # (left to the server's idle timeout: stopping one may stop a local server with it)
    while len(have) < count:
        if is_connect(spark):
            from pyspark.sql.connect.session import SparkSession as ConnectSession

            builder = ConnectSession.builder.remote(_connect_url(spark))
            session_conf = {k: v for k, v in LOCAL_CONF.items() if k.startswith(("spark.sql.", "spark.databricks."))}
            for k, v in {**session_conf, **settings.spark_conf}.items():
                builder = builder.config(k, v)
            sibling = cast("SparkSession", builder.create())
        else:
            sibling = spark.newSession()
        have.append(sibling)
    _siblings[spark] = (have, now)
    settings_now = spark.conf.getAll
    for sibling in have[:count]:
        _copy_sql_settings(settings_now, sibling)
    return have[:count]


def stop_siblings(spark: SparkSession) -> None:
    """Release and close the Spark Connect sibling sessions :func:`sibling_sessions` made for
    ``spark`` (when Tidemark stops ``spark``). A Connect client left open makes pyspark's exit
    handler call its server as the process ends, retrying for about 10 minutes when that server is
    gone; a collected session closes its client, but a stopped parent can stay referenced (pyspark
    keeps the session a thread last made active). Only the clients are closed: a sibling's
    ``stop()`` would also stop a ``remote("local")`` server. Classic siblings share the stopped
    SparkContext: nothing to do."""
    have, _ = _siblings.pop(spark, ([], 0.0))
    for sibling in have:
        client = getattr(sibling, "_client", None)
        if client is None or client.is_closed:
            continue
        for step in (client.release_session, client.close):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - best effort, as pyspark's own stop()
                log.debug("closing a sibling Spark Connect session: %s", exc)


#: Seconds a Spark Connect sibling session may stay unused before it is made again (the server
#: closes a session idle for ``spark.connect.session.manager.defaultSessionTimeout``, 60 min).
SIBLING_IDLE_S = 30 * 60


def _copy_sql_settings(parent: dict[str, str], child: SparkSession) -> None:
    """The SQL settings ``parent`` (a session's) that ``child`` lacks or has otherwise (those set at
    run time), but a Delta write's txn and commit metadata; settings a session cannot change are left."""
    have = child.conf.getAll
    for k, v in parent.items():
        if have.get(k) == v or not k.startswith(("spark.sql.", "spark.databricks.")) or k in WRITE_SCOPED:
            continue
        try:
            child.conf.set(k, v)
        except Exception:  # noqa: BLE001 - a static setting: the same Spark, so the same value already
            log.debug("sibling session: %s not copied", k)


#: Session settings a Delta write sets for itself (platform_assets.core.spark_io.run_merge).
WRITE_SCOPED = frozenset({"spark.databricks.delta.write.txnAppId", "spark.databricks.delta.write.txnVersion",
                          "spark.databricks.delta.commitInfo.userMetadata"})


def _connect_url(spark: SparkSession) -> str:
    """The connection string of a Spark Connect session's server, without its session id."""
    channel = spark._client._builder  # type: ignore[attr-defined]
    params = {k: v for k, v in getattr(channel, "_params", {}).items() if k != "session_id"}
    return f"sc://{channel.endpoint}/" + "".join(f";{k}={v}" for k, v in params.items())


#: The sessions :func:`sibling_sessions` made, per session they serve.
_siblings: weakref.WeakKeyDictionary[SparkSession, tuple[list[SparkSession], float]] = weakref.WeakKeyDictionary()


@contextmanager
def job_group(spark: SparkSession, group: str) -> Iterator[None]:
    """The Spark jobs this thread starts meanwhile belong to job group ``group`` (the Spark UI's and
    the event log's ``spark.jobGroup.id``: ``bench/event_log.py`` sums a unit's jobs by it). A
    classic session only (a thread-local property of the driver); on Spark Connect, nothing."""
    if is_connect(spark):
        yield
        return
    sc = spark.sparkContext
    before = sc.getLocalProperty("spark.jobGroup.id")
    sc.setLocalProperty("spark.jobGroup.id", group)
    try:
        yield
    finally:
        sc.setLocalProperty("spark.jobGroup.id", before)  # type: ignore[arg-type]  # (None unsets it)


def is_connect(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect client session (its catalog is the server's)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def delta_package() -> str:
    """Maven coordinates of the Delta jars matching the installed delta-spark and pyspark (what
    ``delta.configure_spark_with_delta_pip`` adds)."""
    from importlib.metadata import version

    spark = ".".join(version("pyspark").split(".")[:2])
    return f"io.delta:delta-spark_{spark}_2.13:{version('delta-spark')}"


def pyspark_resource(settings: Settings, *, app_name: str = "tidemark") -> LazyPySparkResource:
    """``dagster-pyspark``'s ``LazyPySparkResource`` holding Tidemark's session for ``settings``
    (local, Spark Connect or a cluster): nothing starts until an asset first asks for
    ``.spark_session``. Tidemark's Dagster definitions bind it under :data:`PYSPARK_KEY`, so a
    user's own assets get the same session as Tidemark's units. The S3A jars, when not remembered,
    are left to the session's own start (never resolved while definitions load)."""
    from dagster_pyspark import LazyPySparkResource

    return LazyPySparkResource(spark_config=spark_config(settings, app_name=app_name, resolve_s3=False))


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
    """Resolve the S3A jars matching pyspark's Hadoop (:func:`resources.storage.warehouse.s3_packages`)
    from Maven Central through Spark's Ivy, remember them, and return their paths.

    In a child process: Spark resolves ``spark.jars.packages`` only when a JVM is launched, and
    this process may already run one (a session without the S3A jars). One process at a time
    (:func:`ivy_resolution`)."""
    with ivy_resolution():
        jars = cached_s3_jars()  # resolved by another process while this one waited
        return jars or _resolve_s3_jars(timeout)


def _resolve_s3_jars(timeout: float) -> list[str]:
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
