"""A throw-away PostgreSQL server for tests: Debian's binaries on a temp data dir and a free
loopback port, trust auth, a database ``tidemark``.

``initdb`` and ``pg_ctl`` refuse to run as root, so as root they run as the ``postgres`` user
(``runuser``) on a data dir owned by it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg

INSTALL_HINT = "install PostgreSQL's server binaries with: apt-get install postgresql"


class PostgresUnavailable(RuntimeError):
    """The PostgreSQL server binaries are missing or the server did not start."""


def find_bindir() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl`` (``pg_config --bindir``, else the newest
    ``/usr/lib/postgresql/*/bin``)."""
    candidates: list[str] = []
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        candidates.append(subprocess.run(["pg_config", "--bindir"], check=True, capture_output=True,
                                         text=True).stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                         key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
                         reverse=True)
    for cand in candidates:
        if cand and (Path(cand) / "initdb").is_file() and (Path(cand) / "pg_ctl").is_file():
            return Path(cand)
    raise PostgresUnavailable(f"PostgreSQL server binaries (initdb, pg_ctl) not found in {candidates or 'PATH'}; "
                              f"{INSTALL_HINT}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: list[str], cwd: Path) -> None:
    """Run a server binary, as the ``postgres`` user when we are root."""
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PostgresUnavailable(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")


@contextlib.contextmanager
def running_postgres(bindir: Path | None = None) -> Iterator[str]:
    """Start a server, yield ``postgresql://postgres@127.0.0.1:<port>/tidemark``, stop it and
    remove its files."""
    bindir = bindir or find_bindir()
    root = Path(tempfile.mkdtemp(prefix="tidemark-pg-"))
    os.chmod(root, 0o755)
    home = root / "pg"  # data dir, socket and log; owned by the user running the server
    home.mkdir()
    if os.geteuid() == 0:
        shutil.chown(home, "postgres", "postgres")
    data, port = home / "data", free_port()
    try:
        _run([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
              "--no-locale", "--no-sync"], cwd=home)
        options = (f"-c port={port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={home} "
                   f"-c wal_level=logical -c fsync=off")
        try:
            _run([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(home / "server.log"), "-w", "-t", "60",
                  "-o", options, "start"], cwd=home)
        except PostgresUnavailable as exc:
            log = (home / "server.log").read_text(errors="replace") if (home / "server.log").exists() else ""
            raise PostgresUnavailable(f"{exc}\nserver log:\n{log[-4000:]}") from None
        try:
            with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", autocommit=True) as conn:
                conn.execute("CREATE DATABASE tidemark")
            yield f"postgresql://postgres@127.0.0.1:{port}/tidemark"
        finally:
            _run([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"], cwd=home)
    finally:
        shutil.rmtree(root, ignore_errors=True)
