"""Shared fixtures: ONE local SparkSession with Delta for the whole test session, and helpers
to build settings and engines on temporary warehouses."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from resources.core.settings import Settings
from tests.pg import PostgresUnavailable, find_bindir, running_postgres

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from tests.s3 import S3Server

ROOT = Path(__file__).resolve().parents[1]


def interpreted_conf() -> dict[str, str]:
    """Spark settings of the JVMs that live for the whole test run in process (the tests' session,
    the kill tests' shared Connect server): expressions evaluated interpreted, no code generated
    and compiled per query shape. The tests' tables hold tens of rows, so compiling code costs the
    two cores far more than it saves: measured 20-23 % off the view tests' time (two files side
    by side). Spark falls back to the same interpreted path wherever code generation fails; the
    result is the same. Code generation, Spark's default and the product's, is still what the
    Connect pass of ``scripts/test.sh``, every CLI process with a JVM of its own, every Dagster run
    and the demo use. ``TIDEMARK_TEST_CODEGEN=on``: code generation here too."""
    if os.environ.get("TIDEMARK_TEST_CODEGEN", "off") == "on":
        return {}
    return {"spark.sql.codegen.factoryMode": "NO_CODEGEN", "spark.sql.codegen.wholeStage": "false"}


@pytest.fixture(scope="session")
def spark_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spark-home")


@pytest.fixture(scope="session")
def spark(spark_home: Path) -> Iterator[SparkSession]:
    """The one SparkSession of the test run: local[2], Delta enabled, UI off, UTC.

    ``TIDEMARK_TEST_SPARK=connect``: a Spark Connect session instead, to a local server (with
    Delta, local[2]) started for the run under the session's temp home and stopped at its end."""
    from resources.spark.session import build_spark_session

    os.environ.setdefault("TIDEMARK_DRIVER_MEMORY", "2g")
    mode = os.environ.get("TIDEMARK_TEST_SPARK", "local")
    if mode not in ("local", "connect"):
        pytest.fail(f"TIDEMARK_TEST_SPARK={mode!r}: use 'local' (default) or 'connect'", pytrace=False)
    if mode == "local":
        settings = Settings.from_env({}, home=spark_home, spark_master="local[2]")
        session = build_spark_session(settings.with_(spark_conf={**settings.spark_conf, **interpreted_conf()}),
                                      app_name="tidemark-tests")
        yield session
        session.stop()
        return
    from resources.spark import server as spark_server

    server = spark_server.start(spark_home, port=spark_server.free_port(), master="local[2]")
    try:
        settings = Settings.from_env({}, home=spark_home, spark_master=server.url)
        session = build_spark_session(settings, app_name="tidemark-tests")
        yield session
        session.stop()
    finally:
        spark_server.stop(spark_home)


@pytest.fixture(scope="session")
def cli_spark_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of one Spark Connect server (Delta, local[2]) that the ``tidemark`` subprocesses of
    the kill tests share, started on first use and stopped at the session's end: a killed and
    restarted process then connects in about a second instead of starting and warming a JVM of
    its own (about 12 s each). ``TIDEMARK_TEST_CLI_SPARK=local``: no server; every process starts
    its own local[2] JVM (what the kill tests did before, and still a supported mode)."""
    mode = os.environ.get("TIDEMARK_TEST_CLI_SPARK", "connect")
    if mode not in ("local", "connect"):
        pytest.fail(f"TIDEMARK_TEST_CLI_SPARK={mode!r}: use 'connect' (default) or 'local'", pytrace=False)
    if mode == "local":
        yield "local[2]"
        return
    from resources.spark import server as spark_server

    home = tmp_path_factory.mktemp("cli-spark-home")
    server = spark_server.start(home, port=spark_server.free_port(), master="local[2]", driver_memory="2g",
                                extra_conf=interpreted_conf())
    try:
        yield server.url
    finally:
        spark_server.stop(home)


@pytest.fixture
def cli_spark(cli_spark_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """For the test's duration, ``tests.platform_assets.shop.tidemark`` subprocesses run on the
    session's shared Spark Connect server (fixture ``cli_spark_server``); its catalog is emptied
    after the test (Tidemark refuses a name that another home registered there, as it should)."""
    monkeypatch.setenv("TIDEMARK_TEST_CLI_MASTER", cli_spark_server)
    yield cli_spark_server
    from tests.platform_assets.shop import reset_cli_catalog

    reset_cli_catalog()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Settings on a fresh temporary home, warehouse and SQLite offset store."""
    home = tmp_path / "home"
    return Settings.from_env({}, home=home, lineage=tmp_path / "lineage", spark_master="local[2]")


def throwaway_postgres() -> Iterator[str]:
    """URL of a throw-away PostgreSQL server with an empty database ``tidemark``, stopped after.
    Fails (never skips) when PostgreSQL is not installed."""
    try:
        bindir = find_bindir()
    except PostgresUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    with running_postgres(bindir) as url:
        yield url


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A server shared by the session's tests."""
    yield from throwaway_postgres()


@pytest.fixture(scope="module")
def pg() -> Iterator[str]:
    """A server of the module's own (the CDC sources' event triggers fire on every DDL of its database)."""
    yield from throwaway_postgres()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3-compatible server (versitygw, built into ~/.cache/tidemark/bin on first use) on a
    free loopback port, with an empty bucket ``tidemark``. Fails (never skips) when it cannot start."""
    from tests.s3 import S3Unavailable, running_s3

    try:
        with running_s3(tmp_path_factory.mktemp("s3")) as server:
            server.create_bucket("tidemark")
            yield server
    except S3Unavailable as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def dagster_pg_template(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A database ``dagster_template`` on the session's PostgreSQL holding Dagster's schema
    (created once, ~3 s): each test's instance database is a copy of it."""
    import dagster as dg
    import psycopg
    import yaml

    from resources.state.local_pg import dagster_url

    base = pg_url.rsplit("/", 1)[0]
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute("CREATE DATABASE dagster_template")
    home = tmp_path_factory.mktemp("dagster-template")
    storage = {"storage": {"postgres": {"postgres_url": dagster_url(f"{base}/dagster_template")}}}
    (home / "dagster.yaml").write_text(yaml.safe_dump({**storage, "telemetry": {"enabled": False}}))
    with dg.DagsterInstance.from_config(str(home)):
        pass  # opening it creates the tables
    return base


@pytest.fixture
def dagster_storage(request: pytest.FixtureRequest) -> dict[str, object]:
    """Instance settings of the test's Dagster storage, to merge into its dagster.yaml or pass
    to ``dg.instance_for_test(overrides=...)``: ``{}`` (SQLite in the instance's folder) by
    default; with ``TIDEMARK_TEST_DAGSTER=postgres`` a fresh PostgreSQL database (dagster-postgres,
    as the prod profile) on the session's server."""
    import psycopg

    from resources.state.local_pg import dagster_url

    mode = os.environ.get("TIDEMARK_TEST_DAGSTER", "sqlite")
    if mode not in ("sqlite", "postgres"):
        pytest.fail(f"TIDEMARK_TEST_DAGSTER={mode!r}: use 'sqlite' (default) or 'postgres'", pytrace=False)
    if mode == "sqlite":
        return {}
    base = request.getfixturevalue("dagster_pg_template")
    name = f"dagster_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE dagster_template")
    return {"storage": {"postgres": {"postgres_url": dagster_url(f"{base}/{name}")}}}


# ----------------------------------------------------------------------------- the fast tier
#: Fixtures that start something heavy (a JVM, a PostgreSQL server, an S3 server). A test using
#: none of them, and not marked slow or ui, belongs to the fast tier; a test that does use one
#: belongs to it only when marked ``@pytest.mark.fast`` (one real-engine test per module, picked
#: to cover it in seconds).
HEAVY_FIXTURES = frozenset({"spark", "spark_home", "pg", "pg_url", "s3_server", "dagster_pg_template", "cli_spark_server",
                            "cli_spark"})


def in_fast_tier(item: pytest.Item) -> bool:
    marks = {m.name for m in item.iter_markers()}
    if "fast" in marks:
        return True
    if marks & {"slow", "ui", "notfast"}:
        return False
    return not HEAVY_FIXTURES & set(getattr(item, "fixturenames", ()))


#: The slowest test files, slowest first (seconds each on 2 cores, from a whole run's ``--durations=0``
#: on 2026-12-02), collected first: the main pass's pytest-xdist workers take a file each in this
#: order (``--no-loadscope-reorder`` in scripts/test.sh), longest first, so they end together.
SLOWEST_FIRST = ("test_merge_property.py",  # 1353
                 "test_merge.py",  # 1129
                 "test_cdc_postgres.py",  # 929
                 "test_cdc_lost_store.py",  # 531
                 "test_crash.py",  # 521
                 "test_cluster.py",  # 464
                 "test_engine.py",  # 460
                 "test_merge_row_wise.py",  # 408
                 "test_browser.py",  # 371
                 "test_merge_additive.py",  # 344
                 "test_cdc_columns.py",  # 340
                 "test_cdc_apply.py",  # 304
                 "test_maintain.py",  # 272
                 "test_spark_io.py",  # 237
                 "test_cdc.py",  # 216
                 "test_intake_lock.py",  # 210
                 "test_follow.py",  # 203
                 "test_cdc_apply_bench.py",  # 196
                 "test_recovery.py",  # 185
                 "test_cdc_big_tx_bench.py",  # 178
                 "test_maintenance_bench.py",  # 174
                 "test_object_store.py",  # 173
                 "test_dagster_follow.py")  # ~160


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``-m fast`` selects the fast tier (``./scripts/test.sh --fast``): every light test plus the
    heavy ones marked ``fast``; a test marked ``notfast`` is light but too slow for it. The
    :data:`SLOWEST_FIRST` files go first (the order within a file stays)."""
    for item in items:
        if in_fast_tier(item):
            item.add_marker(pytest.mark.fast)

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable
