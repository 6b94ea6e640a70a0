"""A Spark standalone cluster on loopback (a master and N workers) with a Spark Connect server
pointed at it: the production shape of Spark (driver, executors, jars shipped to executors) on
one machine, for trying and testing it. ``tidemark cluster up|down|status`` is its face.

Started from the installed ``pyspark`` distribution (``bin/spark-class ...deploy.master.Master``
and ``...deploy.worker.Worker``), each daemon detached in its own process group; their logs,
the workers' work dirs (executor logs) and the state file ``cluster.json`` live under
``$TIDEMARK_HOME/spark-cluster/``. The Connect server is ``resources.spark.server`` started with
``master=spark://127.0.0.1:PORT`` and its state under ``spark-cluster/spark-connect/``, apart
from the local server of ``tidemark spark up``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lineage.core.errors import TidemarkError
from resources.core import processes
from resources.spark import server as spark_server
from resources.spark.server import ServerInfo

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
DEFAULT_MASTER_PORT = 7077
DEFAULT_WEBUI_PORT = 8080
_MEMORY = re.compile(r"^[1-9][0-9]*[mMgG]$")


class SparkClusterError(TidemarkError):
    """The local Spark standalone cluster could not be started, reached or stopped."""


@dataclass(frozen=True)
class Daemon:
    """A master or worker process this module started (the leader of its process group)."""

    name: str  # "master", "worker-1", ...
    pid: int
    log: Path
    webui_port: int
    port: int = 0  # the master's RPC port; workers pick their own

    @property
    def markers(self) -> tuple[bytes, ...]:
        """What its command line holds (so a reused pid is not taken for it)."""
        return ((MASTER_CLASS if self.name == "master" else WORKER_CLASS).encode(),)


@dataclass(frozen=True)
class ClusterState:
    """What ``cluster.json`` records: the daemons started and the Connect server's port."""

    master: Daemon
    workers: tuple[Daemon, ...]
    connect_port: int

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.master.port}"

    @property
    def webui_url(self) -> str:
        return f"http://127.0.0.1:{self.master.webui_port}"

    @property
    def daemons(self) -> tuple[Daemon, ...]:
        return (self.master, *self.workers)

    def to_json(self) -> str:
        def one(d: Daemon) -> dict[str, Any]:
            return {"name": d.name, "pid": d.pid, "log": str(d.log), "webui_port": d.webui_port, "port": d.port}

        return json.dumps({"master": one(self.master), "workers": [one(w) for w in self.workers],
                           "connect_port": self.connect_port}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        """Raises ``ValueError`` (or ``KeyError``/``TypeError``) on a malformed file."""
        data = json.loads(text)

        def one(d: dict[str, Any]) -> Daemon:
            return Daemon(str(d["name"]), int(d["pid"]), Path(d["log"]), int(d["webui_port"]), int(d.get("port", 0)))

        return cls(one(data["master"]), tuple(one(w) for w in data["workers"]), int(data["connect_port"]))


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as the master sees it."""

    id: str
    host: str
    state: str  # ALIVE, DEAD, DECOMMISSIONED, UNKNOWN
    cores: int
    cores_used: int
    memory_mb: int
    memory_used_mb: int
    webui: str


@dataclass(frozen=True)
class AppInfo:
    """An application (a driver, e.g. the Connect server) as the master sees it."""

    id: str
    name: str
    state: str
    cores: int  # granted to its executors right now
    memory_per_executor_mb: int


@dataclass(frozen=True)
class MasterView:
    """The master's ``/json`` page."""

    url: str
    status: str
    workers: tuple[WorkerInfo, ...]
    active_apps: tuple[AppInfo, ...]
    completed_apps: tuple[AppInfo, ...]

    @property
    def alive_workers(self) -> tuple[WorkerInfo, ...]:
        return tuple(w for w in self.workers if w.state == "ALIVE")


def parse_master_json(text: str) -> MasterView:
    """The master web UI's ``/json`` (Spark's ``JsonProtocol.writeMasterState``) as a ``MasterView``."""
    data = json.loads(text)
    if not isinstance(data, dict) or "workers" not in data:
        raise ValueError("not a Spark master's /json page (no 'workers')")

    def worker(w: dict[str, Any]) -> WorkerInfo:
        return WorkerInfo(str(w["id"]), str(w.get("host", "")), str(w.get("state", "UNKNOWN")), int(w.get("cores", 0)),
                          int(w.get("coresused", 0)), int(w.get("memory", 0)), int(w.get("memoryused", 0)),
                          str(w.get("webuiaddress", "")))

    def app(a: dict[str, Any]) -> AppInfo:
        return AppInfo(str(a["id"]), str(a.get("name", "")), str(a.get("state", "")), int(a.get("cores", 0)),
                       int(a.get("memoryperexecutor", a.get("memoryperslave", 0))))

    return MasterView(str(data.get("url", "")), str(data.get("status", "")), tuple(worker(w) for w in data["workers"]),
                      tuple(app(a) for a in data.get("activeapps", [])), tuple(app(a) for a in data.get("completedapps", [])))


def master_view(webui_url: str, timeout: float = 2.0) -> MasterView | None:
    """The master's view of the cluster, or None when its web UI does not answer."""
    try:
        with urllib.request.urlopen(f"{webui_url}/json/", timeout=timeout) as resp:  # noqa: S310 - our own loopback URL
            return parse_master_json(resp.read().decode())
    except (OSError, ValueError, urllib.error.URLError):
        return None


def cluster_dir(home: Path) -> Path:
    """Where the daemons' logs, work dirs and ``cluster.json`` live: ``<home>/spark-cluster``."""
    return home / "spark-cluster"


def read_state(home: Path) -> ClusterState | None:
    """The recorded cluster, alive or not (None without a readable ``cluster.json``)."""
    try:
        return ClusterState.from_json((cluster_dir(home) / "cluster.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class ClusterStatus:
    """A recorded cluster checked against its processes, its master and its Connect server."""

    state: ClusterState
    running: dict[str, bool]  # daemon name -> its process runs
    view: MasterView | None
    connect: ServerInfo | None

    @property
    def healthy(self) -> bool:
        """Every daemon runs, the master answers with every worker alive, the Connect server runs."""
        return (all(self.running.values()) and self.view is not None and self.connect is not None
                and len(self.view.alive_workers) >= len(self.state.workers))

    def worker_info(self, worker: Daemon) -> WorkerInfo | None:
        """The master's record of ``worker`` (matched by its web UI port), the newest if it re-registered."""
        if self.view is None:
            return None
        mine = [w for w in self.view.workers if w.webui.endswith(f":{worker.webui_port}")]
        alive = [w for w in mine if w.state == "ALIVE"]
        pick = alive or mine
        return pick[-1] if pick else None


def status(home: Path) -> ClusterStatus | None:
    """The cluster started under ``home``, or None when none of it runs (a stale state file is removed)."""
    state = read_state(home)
    if state is None:
        return None
    running = {d.name: processes.process_alive(d.pid, d.markers) for d in state.daemons}
    connect = spark_server.status(cluster_dir(home))
    if not any(running.values()) and connect is None:
        (cluster_dir(home) / "cluster.json").unlink(missing_ok=True)
        return None
    view = master_view(state.webui_url) if running["master"] else None
    return ClusterStatus(state, running, view, connect)


def up(home: Path, *, workers: int = 2, worker_cores: int = 1, worker_memory: str = "1g",
       master_port: int = DEFAULT_MASTER_PORT, connect_port: int = spark_server.DEFAULT_PORT,
       driver_memory: str | None = None, timeout: float = 120.0) -> ClusterStatus:
    """Start a master, ``workers`` workers and a Connect server on that master, under ``home``;
    return once every worker is registered and the Connect server serves sessions. A healthy
    cluster already running under ``home`` is returned as is."""
    running = status(home)
    if running is not None:
        if running.healthy and len(running.state.workers) == workers:
            return running
        raise SparkClusterError(f"a Spark cluster of {home} already runs, {'with other settings' if running.healthy else 'in part'} "
                                f"(master {running.state.master_url}); stop it first: tidemark cluster down")
    if workers < 1:
        raise SparkClusterError(f"--workers {workers}: a cluster needs at least one worker")
    if worker_cores < 1:
        raise SparkClusterError(f"--worker-cores {worker_cores}: each worker needs at least one core")
    if not _MEMORY.match(worker_memory):
        raise SparkClusterError(f"--worker-memory {worker_memory!r}: give a size like 512m or 1g")
    java = spark_server.find_java("the Spark standalone cluster")
    spark_server.check_port_free(master_port, "--master-port")
    spark_server.check_port_free(connect_port, "--port")
    folder = cluster_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    # Executor dirs of an earlier cluster (each holds a copy of the shipped jars); nothing runs now.
    shutil.rmtree(folder / "work", ignore_errors=True)
    env = _daemon_env(java)
    webui = DEFAULT_WEBUI_PORT if _port_free(DEFAULT_WEBUI_PORT) else spark_server.free_port()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        master, procs["master"] = _spawn(folder, "master", [MASTER_CLASS, "--host", "127.0.0.1", "--port", str(master_port),
                                                            "--webui-port", str(webui)], env, webui, master_port)
        state = ClusterState(master, (), connect_port)
        _write_state(home, state)
        deadline = time.monotonic() + timeout
        _wait(lambda: (v := master_view(state.webui_url)) is not None and v.status == "ALIVE", procs, state, deadline,
              f"the Spark master did not come up on {state.master_url} (web UI {state.webui_url})")
        for i in range(1, workers + 1):
            port = spark_server.free_port()
            worker, procs[f"worker-{i}"] = _spawn(
                folder, f"worker-{i}", [WORKER_CLASS, state.master_url, "--host", "127.0.0.1", "--cores", str(worker_cores),
                                        "--memory", worker_memory, "--webui-port", str(port), "--work-dir", str(folder / "work")],
                env, port)
            state = ClusterState(master, (*state.workers, worker), connect_port)
            _write_state(home, state)
        _wait(lambda: (v := master_view(state.webui_url)) is not None and len(v.alive_workers) >= workers, procs, state,
              deadline, f"not all {workers} workers registered with the master {state.master_url}")
        python = os.environ.get("PYSPARK_PYTHON", sys.executable)
        spark_server.start(folder, port=connect_port, master=state.master_url, driver_memory=driver_memory, timeout=timeout,
                           extra_conf={
                               # One executor per worker, sized to fit it (the default 1g would not fit a smaller worker).
                               "spark.executor.cores": str(worker_cores),
                               "spark.executor.memory": worker_memory,
                               # Python UDFs on executors run in the same interpreter as the client's.
                               "spark.executorEnv.PYSPARK_PYTHON": python,
                           })
    except BaseException:
        down(home)
        raise
    found = status(home)
    if found is None:
        raise SparkClusterError(f"the Spark cluster under {folder} stopped right after starting; see the logs there")
    return found


def down(home: Path, *, timeout: float = 20.0) -> list[str]:
    """Stop the Connect server, the workers and the master started under ``home`` (SIGTERM to
    each process group, SIGKILL after ``timeout`` s). Returns what was running and is stopped."""
    stopped = []
    server = spark_server.stop(cluster_dir(home), timeout=timeout)
    if server is not None:
        stopped.append(f"connect (pid {server.pid}, port {server.port})")
    state = read_state(home)
    if state is not None:
        for d in (*state.workers, state.master):  # workers first: a master gone first makes them retry and log
            if processes.process_alive(d.pid, d.markers):
                spark_server.terminate_group(d.pid, d.markers, timeout)
                stopped.append(f"{d.name} (pid {d.pid})")
    (cluster_dir(home) / "cluster.json").unlink(missing_ok=True)
    return stopped


# --------------------------------------------------------------------- helpers


def _daemon_env(java: str) -> dict[str, str]:
    env = {**os.environ, "SPARK_HOME": str(spark_server.pyspark_home()), "SPARK_LOCAL_IP": "127.0.0.1",
           "JAVA_HOME": os.environ.get("JAVA_HOME") or str(Path(java).resolve().parents[1]),
           "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
           # The daemons only schedule and launch executors: a small heap each.
           "SPARK_DAEMON_MEMORY": os.environ.get("SPARK_DAEMON_MEMORY", "512m")}
    # The master's REST submission server (port 6066) is not needed and would clash between clusters.
    env["SPARK_MASTER_OPTS"] = f"{os.environ.get('SPARK_MASTER_OPTS', '')} -Dspark.master.rest.enabled=false".strip()
    return env


def _spawn(folder: Path, name: str, args: list[str], env: dict[str, str], webui_port: int,
           port: int = 0) -> tuple[Daemon, subprocess.Popen[bytes]]:
    log = folder / f"{name}.log"
    cmd = [str(spark_server.pyspark_home() / "bin" / "spark-class"), *args]
    with open(log, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        out.flush()
        # Its own session: Ctrl-C in the caller's terminal does not reach it, and down() ends
        # the JVM with anything it forked (a worker's executors).
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=folder, start_new_session=True)
    return Daemon(name, proc.pid, log, webui_port, port), proc


def _write_state(home: Path, state: ClusterState) -> None:
    path = cluster_dir(home) / "cluster.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.to_json())
    tmp.replace(path)


def _wait(ready: Callable[[], bool], procs: dict[str, subprocess.Popen[bytes]], state: ClusterState, deadline: float, what: str) -> None:
    """Until ``ready()``; a daemon that exits meanwhile, or the deadline, is an error with its log."""
    while True:
        for d in state.daemons:
            code = procs[d.name].poll()
            if code is not None:
                raise SparkClusterError(f"the Spark {d.name} exited with code {code} while starting; log {d.log}, "
                                        f"last lines:\n{processes.log_tail(d.log)}")
        if ready():
            return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {d.log}:\n{processes.log_tail(d.log, 10)}" for d in state.daemons)
            raise SparkClusterError(f"{what} in time; stopped the cluster. Logs:\n{tails}")
        time.sleep(0.5)


def _port_free(port: int) -> bool:
    return processes.port_taken(port) is None
