"""The local Spark Connect server manager (``resources.spark.server``) and ``tidemark spark``:
clear errors before any JVM starts, a server that dies while starting reported with its log,
and a real server's life cycle through the CLI (it outlives the ``up`` command)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resources.spark import server as spark_server
from resources.spark.server import SparkServerError

ROOT = Path(__file__).resolve().parents[2]


def test_port_in_use_is_refused_before_a_jvm_starts(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SparkServerError, match=rf"port {port} on 127.0.0.1 is in use.*--port"):
            spark_server.start(tmp_path, port=port)
    assert spark_server.status(tmp_path) is None


def test_missing_java_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-jdk"))
    with pytest.raises(SparkServerError, match=r"Java is needed.*no-jdk has no bin/java.*JAVA_HOME"):
        spark_server.start(tmp_path, port=spark_server.free_port())


def test_stale_pid_file_is_no_server(tmp_path):
    folder = spark_server.server_dir(tmp_path)
    folder.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / "server.json").write_text(f'{{"pid": {dead.pid}, "port": 1, "log": "x"}}')
    assert spark_server.status(tmp_path) is None
    assert not (folder / "server.json").exists()
    assert spark_server.stop(tmp_path) is None


@pytest.mark.slow
def test_server_dying_while_starting_reports_its_log_tail(tmp_path):
    with pytest.raises(SparkServerError, match=r"(?s)exited with code \d+ while starting; log .*server\.log.*nonsense"):
        spark_server.start(tmp_path, port=spark_server.free_port(), master="nonsense://x", timeout=120)
    assert spark_server.status(tmp_path) is None


def _tidemark(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIDEMARK_DRIVER_MEMORY": "1g"}
    return subprocess.run([sys.executable, "-m", "platform_assets.cli", "--home", str(home), "spark", *args],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def _gone(pid: int) -> bool:
    """No such process, or only a zombie (its parent, the ``up`` command, exited; a container's
    init may never reap it)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "State:\tZ" in state


@pytest.mark.slow
def test_cli_spark_up_status_down(tmp_path):
    """``up`` returns once the server serves Connect sessions and leaves it running after the
    command exits; ``status`` finds it; ``down`` stops it within seconds; a second ``up`` on a
    taken port fails naming the port."""
    home, port = tmp_path / "home", spark_server.free_port()
    up = _tidemark(home, "up", "--port", str(port), "--master", "local[1]")
    try:
        assert up.returncode == 0, up.stderr
        assert f"export TIDEMARK_SPARK_MASTER=sc://127.0.0.1:{port}" in up.stdout
        server = spark_server.status(home)
        assert server is not None and server.port == port
        st = _tidemark(home, "status")
        assert st.returncode == 0 and f"sc://127.0.0.1:{port}" in st.stdout
        other = _tidemark(tmp_path / "other", "up", "--port", str(port))
        assert other.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in other.stderr
        t0 = time.monotonic()
        down = _tidemark(home, "down")
        assert down.returncode == 0 and f"pid {server.pid}" in down.stdout
        assert time.monotonic() - t0 < 30
        assert spark_server.status(home) is None
        assert _gone(server.pid)
        assert _tidemark(home, "status").returncode == 1
    finally:
        spark_server.stop(home)
