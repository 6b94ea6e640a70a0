"""A long-lived local Spark Connect server with Delta, so runs, the CLI and tests connect with
``sc://127.0.0.1:PORT`` instead of starting (and warming) a JVM each.

Started from the installed ``pyspark`` distribution (``bin/spark-submit --class
...SparkConnectServer``) with the Delta jars ``resources.spark.session`` cached, detached in its own
process group; its pid file and log live under ``$TIDEMARK_HOME/spark-connect/``.
``tidemark spark up|down|status`` is the command-line face of this module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lineage.core.errors import TidemarkError
from resources.core.processes import log_tail, port_taken, process_alive, signal_group
from resources.core.settings import Settings
from resources.spark.session import cached_delta_jars, cached_s3_jars, driver_conf, resolve_s3_jars
from resources.spark.session import driver_memory as default_driver_memory
from resources.storage.warehouse import S3Settings, is_object_store

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
DEFAULT_PORT = 15002
SERVER_MARKERS = (SERVER_CLASS.encode(), b"spark-submit")  # in a server's command line (not a reused pid)


class SparkServerError(TidemarkError):
    """The local Spark Connect server could not be started, reached or stopped."""


@dataclass(frozen=True)
class ServerInfo:
    """A running server: its process (group leader) id, port and log."""

    pid: int
    port: int
    log: Path

    @property
    def url(self) -> str:
        """What to export as ``TIDEMARK_SPARK_MASTER``."""
        return f"sc://127.0.0.1:{self.port}"


def server_dir(home: Path) -> Path:
    """Where the server's pid file, log and catalog live: ``<home>/spark-connect``."""
    return home / "spark-connect"


def status(home: Path) -> ServerInfo | None:
    """The server started under ``home`` if it is still running (a stale pid file is removed)."""
    pid_file = server_dir(home) / "server.json"
    try:
        info = json.loads(pid_file.read_text())
        server = ServerInfo(int(info["pid"]), int(info["port"]), Path(info["log"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if _alive(server.pid):
        return server
    pid_file.unlink(missing_ok=True)
    return None


def start(home: Path, *, port: int = DEFAULT_PORT, master: str = "local[*]", driver_memory: str | None = None,
          extra_conf: dict[str, str] | None = None, timeout: float = 180.0, warehouse: str | None = None) -> ServerInfo:
    """Start the server under ``home`` on ``127.0.0.1:port`` and wait until it serves a Connect
    session. A server already running under ``home`` on that port is returned as is.

    ``warehouse`` (default: ``TIDEMARK_WAREHOUSE``): on object storage, the server gets the S3A
    jars and the store's settings (``resources.storage.warehouse``), as an in-process session would."""
    running = status(home)
    if running is not None:
        if running.port == port:
            return running
        raise SparkServerError(f"a Spark Connect server of {home} already runs on port {running.port} (pid {running.pid}); "
                               f"use {running.url}, or stop it first: tidemark spark down")
    java = find_java()
    check_port_free(port)
    jars = _delta_jars(home)
    warehouse = warehouse or Settings.from_env(home=home).warehouse
    store_conf: dict[str, str] = {}
    if is_object_store(warehouse):
        jars = [*jars, *(cached_s3_jars() or resolve_s3_jars())]
        store_conf = S3Settings.from_env().spark_conf()
    folder = server_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "server.log"
    conf = {
        **driver_conf(folder / "catalog", ui=False),
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        **(extra_conf or {}),
    }
    memory = driver_memory or default_driver_memory()
    cmd = [str(pyspark_home() / "bin" / "spark-submit"), "--class", SERVER_CLASS, "--name", "tidemark-connect",
           "--master", master, "--driver-memory", memory, "--jars", ",".join(jars)]
    for k, v in conf.items():
        cmd += ["--conf", f"{k}={v}"]
    if store_conf:
        # In a file only its owner reads: the store's keys stay off the command line and the log.
        props = folder / "object-store.properties"
        props.touch(mode=0o600)
        props.chmod(0o600)
        props.write_text("".join(f"{k}={_escape_property(v)}\n" for k, v in store_conf.items()))
        cmd += ["--properties-file", str(props)]
    env = {**os.environ, "SPARK_HOME": str(pyspark_home()), "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
           "JAVA_HOME": os.environ.get("JAVA_HOME") or str(Path(java).resolve().parents[1])}
    with open(log, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        out.flush()
        # Its own session (process group): Ctrl-C in the caller's terminal does not reach it,
        # and stop() can end the JVM together with anything it forked.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=folder, start_new_session=True)
    server = ServerInfo(proc.pid, port, log)
    (folder / "server.json").write_text(json.dumps({"pid": proc.pid, "port": port, "log": str(log)}))
    try:
        _wait_ready(proc, server, timeout)
    except BaseException:
        stop(home)
        raise
    return server


def stop(home: Path, *, timeout: float = 20.0) -> ServerInfo | None:
    """Stop the server under ``home``: SIGTERM to its process group, SIGKILL after ``timeout``
    seconds. Returns what was stopped (None if nothing ran)."""
    server = status(home)
    if server is None:
        return None
    terminate_group(server.pid, SERVER_MARKERS, timeout)
    (server_dir(home) / "server.json").unlink(missing_ok=True)
    return server


def terminate_group(pid: int, markers: tuple[bytes, ...], timeout: float) -> None:
    """SIGTERM to the process group of ``pid`` (a process started in its own session), SIGKILL
    after ``timeout`` seconds; returns once it is gone (or 10 s after the SIGKILL)."""
    signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while process_alive(pid, markers) and time.monotonic() < deadline:
        time.sleep(0.2)
    if process_alive(pid, markers):
        signal_group(pid, signal.SIGKILL)
        while process_alive(pid, markers) and time.monotonic() < deadline + 10:
            time.sleep(0.2)


# --------------------------------------------------------------------- helpers


def _wait_ready(proc: subprocess.Popen[bytes], server: ServerInfo, timeout: float) -> None:
    """Until the port serves a Connect session: the port opens only after the server's
    SparkContext is up, and one query proves the session works."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise SparkServerError(f"the Spark Connect server exited with code {code} while starting; "
                                   f"log {server.log}, last lines:\n{log_tail(server.log)}")
        if port_open(server.port):
            _probe(server.url)
            return
        time.sleep(0.5)
    raise SparkServerError(f"the Spark Connect server did not accept connections on port {server.port} within "
                           f"{timeout:.0f}s; stopped it. Log {server.log}, last lines:\n{log_tail(server.log)}")


def _probe(url: str) -> None:
    """One query on a fresh Connect session. Through the Connect builder itself: pyspark's
    generic builder marks the whole process as a Connect client (``SPARK_CONNECT_MODE_ENABLED``),
    which would turn a local session's functions in this process into Connect ones."""
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

    had = "SPARK_CONNECT_MODE_ENABLED" in os.environ
    session = RemoteSparkSession.builder.remote(url).create()
    try:
        session.sql("SELECT 1").collect()
    finally:
        session.stop()
        if not had:
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)


def _delta_jars(home: Path) -> list[str]:
    """The cached Delta jars; resolved once through a local session build (Ivy, Maven Central)
    when the cache is missing."""
    jars = cached_delta_jars()
    if jars:
        return jars
    from resources.spark.session import build_spark_session

    session = build_spark_session(Settings.from_env({}, home=home, spark_master="local[1]"), app_name="tidemark-resolve-delta")
    session.stop()
    jars = cached_delta_jars()
    if not jars:
        raise SparkServerError("could not resolve the Delta jars (io.delta:delta-spark) through a local Spark session; "
                               "check network access to Maven Central, or set spark.jars.packages in TIDEMARK_SPARK_CONF")
    return jars


def _escape_property(value: str) -> str:
    """``value`` as a Java properties value (backslash, newline, `:` and `=` escaped)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace(":", "\\:").replace("=", "\\=")


def find_java(purpose: str = "the Spark Connect server") -> str:
    """The ``java`` binary (``$JAVA_HOME/bin/java``, else on PATH); a clear error without one."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).is_file():
        where = f"JAVA_HOME={java_home} has no bin/java" if java_home else "no `java` on PATH"
        raise SparkServerError(f"Java is needed for {purpose} ({where}). Fix: install Java 17 "
                               "(./scripts/setup.sh does) or set JAVA_HOME")
    return java


def pyspark_home() -> Path:
    """The installed pyspark distribution (``bin/spark-submit``, ``bin/spark-class``, ``jars/``)."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def check_port_free(port: int, flag: str = "--port") -> None:
    """Refuse (naming ``flag``, the option that picks another port) when ``port`` is taken."""
    reason = port_taken(port)
    if reason is not None:
        raise SparkServerError(f"port {port} on 127.0.0.1 is in use ({reason}); another program (or "
                               f"another Spark server) listens there. Fix: pick a free port with "
                               f"{flag}, or stop that program")


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    """A port on 127.0.0.1 free right now (for tests and benchmarks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    return process_alive(pid, SERVER_MARKERS)

