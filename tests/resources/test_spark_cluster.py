"""The local Spark standalone cluster manager (``resources.spark.cluster``), its pure parts and
its refusals before any JVM starts. The cluster itself is started by
``tests/platform_assets/test_cluster.py``, which runs the demo lineage on it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from platform_assets.cli.main import main
from resources.spark import cluster as spark_cluster
from resources.spark import server as spark_server
from resources.spark.cluster import ClusterState, Daemon, SparkClusterError, parse_master_json
from resources.spark.server import SparkServerError

#: A master's /json as Spark 4.2 writes it (trimmed): one worker alive, one dead, the Connect app.
MASTER_JSON = {
    "url": "spark://127.0.0.1:7077",
    "workers": [
        {"id": "worker-1", "host": "127.0.0.1", "port": 39063, "webuiaddress": "http://127.0.0.1:18081", "cores": 1,
         "coresused": 1, "coresfree": 0, "memory": 1024, "memoryused": 512, "memoryfree": 512, "state": "ALIVE"},
        {"id": "worker-0", "host": "127.0.0.1", "port": 39000, "webuiaddress": "http://127.0.0.1:18082", "cores": 2,
         "coresused": 0, "memory": 2048, "memoryused": 0, "state": "DEAD"},
    ],
    "aliveworkers": 1,
    "activeapps": [{"id": "app-1", "name": "tidemark-connect", "cores": 1, "memoryperexecutor": 512,
                    "memoryperslave": 512, "state": "RUNNING"}],
    "completedapps": [],
    "status": "ALIVE",
}


def test_master_json_is_parsed_into_workers_and_apps():
    view = parse_master_json(json.dumps(MASTER_JSON))
    assert view.url == "spark://127.0.0.1:7077" and view.status == "ALIVE"
    assert [(w.id, w.state, w.cores, w.cores_used, w.memory_mb, w.memory_used_mb) for w in view.workers] == [
        ("worker-1", "ALIVE", 1, 1, 1024, 512), ("worker-0", "DEAD", 2, 0, 2048, 0)]
    assert [w.id for w in view.alive_workers] == ["worker-1"]
    assert [(a.name, a.state, a.cores, a.memory_per_executor_mb) for a in view.active_apps] == [("tidemark-connect", "RUNNING", 1, 512)]
    assert view.completed_apps == ()


@pytest.mark.parametrize("text", ["<html>not json</html>", "[]", '{"status": "ALIVE"}'])
def test_a_page_that_is_not_a_master_state_is_refused(text):
    with pytest.raises(ValueError):
        parse_master_json(text)


def _state(tmp_path: Path, pids: tuple[int, int, int]) -> ClusterState:
    master = Daemon("master", pids[0], tmp_path / "master.log", 18080, 17077)
    workers = (Daemon("worker-1", pids[1], tmp_path / "worker-1.log", 18081),
               Daemon("worker-2", pids[2], tmp_path / "worker-2.log", 18082))
    return ClusterState(master, workers, 15002)


def test_state_file_round_trips(tmp_path):
    state = _state(tmp_path, (11, 12, 13))
    assert ClusterState.from_json(state.to_json()) == state
    assert state.master_url == "spark://127.0.0.1:17077" and state.webui_url == "http://127.0.0.1:18080"
    assert [d.markers for d in state.daemons] == [(spark_cluster.MASTER_CLASS.encode(),), *[(spark_cluster.WORKER_CLASS.encode(),)] * 2]


def test_missing_or_corrupt_state_is_no_cluster(tmp_path):
    assert spark_cluster.read_state(tmp_path) is None
    folder = spark_cluster.cluster_dir(tmp_path)
    folder.mkdir(parents=True)
    (folder / "cluster.json").write_text('{"master": {"pid": "x"}}')
    assert spark_cluster.read_state(tmp_path) is None
    assert spark_cluster.status(tmp_path) is None


def test_stale_state_is_no_cluster_and_is_removed(tmp_path):
    """Dead pids, and a live pid that is no Spark daemon (a reused pid), are not a cluster."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    other = subprocess.Popen(["sleep", "30"])
    try:
        folder = spark_cluster.cluster_dir(tmp_path)
        folder.mkdir(parents=True)
        (folder / "cluster.json").write_text(_state(folder, (dead.pid, other.pid, dead.pid)).to_json())
        assert spark_cluster.status(tmp_path) is None
        assert not (folder / "cluster.json").exists()
        (folder / "cluster.json").write_text(_state(folder, (dead.pid, other.pid, dead.pid)).to_json())
        assert spark_cluster.down(tmp_path) == []
        assert not (folder / "cluster.json").exists()
        assert other.poll() is None  # down() never signals a process that is not its daemon
    finally:
        other.kill()
        other.wait()


def test_worker_is_matched_to_the_masters_record_by_web_ui_port(tmp_path):
    state = _state(tmp_path, (1, 2, 3))
    found = spark_cluster.ClusterStatus(state, {"master": True, "worker-1": True, "worker-2": True},
                                        parse_master_json(json.dumps(MASTER_JSON)), None)
    w1 = found.worker_info(state.workers[0])
    w2 = found.worker_info(state.workers[1])
    assert w1 is not None and w1.id == "worker-1"
    assert w2 is not None and w2.state == "DEAD"
    assert not found.healthy  # a dead worker and no Connect server


def test_taken_master_port_is_refused_before_a_jvm_starts(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SparkServerError, match=rf"port {port} on 127.0.0.1 is in use.*--master-port"):
            spark_cluster.up(tmp_path, master_port=port, connect_port=spark_server.free_port())
        with pytest.raises(SparkServerError, match=rf"port {port} on 127.0.0.1 is in use.*pick a free port with --port"):
            spark_cluster.up(tmp_path, master_port=spark_server.free_port(), connect_port=port)
    assert spark_cluster.read_state(tmp_path) is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"workers": 0}, r"--workers 0: a cluster needs at least one worker"),
    ({"worker_cores": 0}, r"--worker-cores 0"),
    ({"worker_memory": "lots"}, r"--worker-memory 'lots': give a size like 512m or 1g"),
])
def test_bad_sizes_are_refused_naming_the_option(tmp_path, kwargs, message):
    with pytest.raises(SparkClusterError, match=message):
        spark_cluster.up(tmp_path, **kwargs)


def test_missing_java_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-jdk"))
    with pytest.raises(SparkServerError, match=r"Java is needed for the Spark standalone cluster.*no-jdk"):
        spark_cluster.up(tmp_path, master_port=spark_server.free_port(), connect_port=spark_server.free_port())


def test_a_daemon_exiting_while_starting_is_reported_with_its_log(tmp_path):
    log = tmp_path / "worker-1.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["sh", "-c", "echo 'Failed to bind: no such interface'; exit 3"], stdout=out)
    state = _state(tmp_path, (proc.pid, proc.pid, proc.pid))
    proc.wait()
    with pytest.raises(SparkClusterError, match=r"(?s)Spark master exited with code 3 while starting; log .*master\.log"):
        spark_cluster._wait(lambda: False, {d.name: proc for d in state.daemons}, state, time.monotonic() + 5, "x")
    one = ClusterState(Daemon("master", proc.pid, log, 1, 1), (), 1)
    with pytest.raises(SparkClusterError, match=r"(?s)exited with code 3.*Failed to bind"):
        spark_cluster._wait(lambda: False, {"master": proc}, one, time.monotonic() + 5, "x")


def test_a_daemon_that_never_gets_ready_times_out_with_the_logs(tmp_path):
    log = tmp_path / "master.log"
    log.write_text("waiting for leadership\n")
    proc = subprocess.Popen(["sleep", "30"])
    try:
        one = ClusterState(Daemon("master", proc.pid, log, 1, 1), (), 1)
        with pytest.raises(SparkClusterError, match=r"(?s)the master did not come up in time; stopped the cluster.*leadership"):
            spark_cluster._wait(lambda: False, {"master": proc}, one, time.monotonic() + 1, "the master did not come up")
    finally:
        proc.kill()
        proc.wait()


def test_cli_status_without_a_cluster_exits_1(tmp_path, capsys):
    assert main(["--home", str(tmp_path), "cluster", "status"]) == 1
    assert "no Spark cluster runs under" in capsys.readouterr().out
    assert main(["--home", str(tmp_path), "cluster", "down"]) == 0
    assert "no Spark cluster runs" in capsys.readouterr().out
