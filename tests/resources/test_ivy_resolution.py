"""One process at a time resolves Spark jars through Ivy (``resources.spark.session.ivy_resolution``).

Two JVMs resolving into one Ivy cache at once break each other's downloads: on a fresh machine two
pytest workers (or two Dagster runs) starting Spark together failed with ``impossible to move part
file to definitive one`` and ``UNRESOLVED DEPENDENCIES``. The lock's contract between processes,
then the real thing: two processes building Tidemark's session at once on an empty Ivy cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from resources.spark.session import ivy_resolution
from resources.storage.warehouse import StorageError

ROOT = Path(__file__).resolve().parents[2]

HOLD = textwrap.dedent("""
    import sys, time
    from resources.spark.session import ivy_resolution
    with ivy_resolution():
        print("held", flush=True)
        time.sleep(float(sys.argv[1]))
""")


def _holder(env: dict[str, str], seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(seconds)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_a_second_process_waits_for_the_first_to_finish_resolving(cache_env: dict[str, str]) -> None:
    proc = _holder(cache_env, 2.0)
    try:
        started = time.monotonic()
        with ivy_resolution():
            waited = time.monotonic() - started
        assert waited > 1.0, f"the lock was taken after {waited:.2f} s while another process held it for 2 s"
    finally:
        proc.kill()
        proc.wait()


def test_a_holder_that_dies_frees_the_lock(cache_env: dict[str, str]) -> None:
    proc = _holder(cache_env, 600.0)
    proc.kill()
    proc.wait()
    with ivy_resolution(wait_s=5.0):
        pass


def test_waiting_too_long_says_who_holds_what(cache_env: dict[str, str], tmp_path: Path) -> None:
    proc = _holder(cache_env, 600.0)
    try:
        with pytest.raises(StorageError, match=r"another process \(pid \d+\) has been resolving Spark jars through Ivy for over 1 s .*ivy\.lock"):
            with ivy_resolution(wait_s=1.0):
                pass
    finally:
        proc.kill()
        proc.wait()


def test_nothing_is_held_when_there_is_nothing_to_resolve(cache_env: dict[str, str]) -> None:
    proc = _holder(cache_env, 600.0)
    try:
        with ivy_resolution({"spark.jars": "/some/delta.jar"}, wait_s=1.0):
            pass
    finally:
        proc.kill()
        proc.wait()


START = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from resources.core.settings import Settings
    from resources.spark.session import build_spark_session
    home = Path(sys.argv[1])
    spark = build_spark_session(Settings.from_env(dict(os.environ), home=home, spark_master="local[1]"), app_name="ivy-race")
    path = str(home / "t")
    spark.range(3).write.format("delta").save(path)
    print(json.dumps({"rows": spark.read.format("delta").load(path).count()}), flush=True)
    spark.stop()
""")


@pytest.mark.slow
def test_two_sessions_started_at_once_on_an_empty_ivy_cache_both_start(tmp_path: Path) -> None:
    """The real race: two processes build Tidemark's session at the same moment with nothing
    resolved (an empty Ivy cache of their own, no remembered jars). Both start and write Delta."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "TIDEMARK_SPARK_CONF": f"spark.jars.ivy={tmp_path / 'ivy'}", "TIDEMARK_DRIVER_MEMORY": "1g"}
    procs = []
    for i in range(2):
        home = tmp_path / f"home{i}"
        home.mkdir()
        procs.append(subprocess.Popen([sys.executable, "-c", START, str(home)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, err[-3000:]
            assert json.loads(out.strip().splitlines()[-1]) == {"rows": 3}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert (tmp_path / "ivy" / "jars").is_dir()
