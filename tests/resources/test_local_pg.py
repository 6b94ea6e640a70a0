"""The local PostgreSQL of the prod profile (``resources.state.local_pg``, ``tidemark postgres``): a
real server under a state dir, its data kept across a restart, clear errors."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from platform_assets.cli.main import main
from resources.state import local_pg

pytestmark = pytest.mark.postgres


@pytest.fixture
def home() -> Iterator[Path]:
    """A state dir the ``postgres`` user can enter (pytest's tmp_path is private to root);
    any server left running is stopped."""
    root = Path(tempfile.mkdtemp(prefix="tidemark-home-"))
    os.chmod(root, 0o755)
    try:
        yield root
    finally:
        local_pg.stop(root)
        shutil.rmtree(root, ignore_errors=True)


def test_up_status_down_keeps_the_data_across_a_restart(home, capsys):
    port = local_pg.free_port()
    assert main(["--home", str(home), "postgres", "status"]) == 1
    assert "no PostgreSQL runs under" in capsys.readouterr().out
    assert main(["--home", str(home), "postgres", "up", "--port", str(port)]) == 0
    out = capsys.readouterr().out
    url = f"postgresql://postgres@127.0.0.1:{port}/tidemark"
    assert f"export TIDEMARK_OFFSETS_URL={url}\n" in out
    assert f"export TIDEMARK_DAGSTER_PG_URL=postgresql+psycopg2://postgres@127.0.0.1:{port}/tidemark\n" in out
    assert (home / "postgres" / "data" / "PG_VERSION").is_file()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (x int)")
        conn.execute("INSERT INTO kept VALUES (42)")
    # A second `up` finds it running; asking for another port names the running one.
    assert local_pg.start(home).port == port
    with pytest.raises(local_pg.LocalPostgresError, match=f"already runs on port {port}"):
        local_pg.start(home, port=local_pg.free_port())
    assert main(["--home", str(home), "postgres", "down"]) == 0
    assert "its data stays in" in capsys.readouterr().out
    assert local_pg.status(home) is None
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=2)
    server = local_pg.start(home, port=port)  # the same data dir again
    with psycopg.connect(server.url) as conn:
        assert conn.execute("SELECT x FROM kept").fetchall() == [(42,)]
    assert main(["--home", str(home), "postgres", "status"]) == 0
    assert f"export TIDEMARK_OFFSETS_URL={url}" in capsys.readouterr().out


def test_a_busy_port_is_named_before_anything_is_created(home):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(local_pg.LocalPostgresError, match=f"port {port} on 127.0.0.1 is in use.*--port"):
            local_pg.start(home, port=port)
    assert not (home / "postgres").exists()
