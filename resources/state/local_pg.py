"""A local PostgreSQL server under the state dir, for the production profile on one machine
(``scripts/dev.sh --profile prod``) and for the tests: Debian's server binaries, a data dir
``<home>/postgres/data``, trust auth on a loopback port, a database ``tidemark``.

``initdb`` and ``pg_ctl`` refuse to run as root, so as root they run as the ``postgres`` user
(``runuser``) on a folder owned by it. ``pg_ctl`` detaches the server in its own session, so a
Ctrl-C in the caller's terminal does not reach it; :func:`stop` does.
``tidemark postgres up|down|status`` is the command-line face of this module.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lineage.core.errors import TidemarkError
from resources.core.processes import log_tail, port_taken, process_alive

DEFAULT_PORT = 15432
DATABASE = "tidemark"
INSTALL_HINT = "install PostgreSQL's server binaries with: apt-get install postgresql (./scripts/setup.sh does)"


class LocalPostgresError(TidemarkError):
    """The local PostgreSQL server binaries are missing, or the server did not start or stop."""


@dataclass(frozen=True)
class PostgresInfo:
    """A running local server: its postmaster pid, port, folder and database."""

    pid: int
    port: int
    folder: Path
    database: str = DATABASE

    @property
    def url(self) -> str:
        """The database's URL (psycopg, libpq): what to export as ``TIDEMARK_OFFSETS_URL``."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{self.database}"

    @property
    def dagster_url(self) -> str:
        """The same database for Dagster (SQLAlchemy, driver spelled out): what to export as
        ``TIDEMARK_DAGSTER_PG_URL``."""
        return dagster_url(self.url)

    @property
    def log(self) -> Path:
        return self.folder / "server.log"


def dagster_url(url: str) -> str:
    """``postgresql://…`` as Dagster's storage needs it: ``postgresql+psycopg2://…``
    (SQLAlchemy 2.1 maps a bare ``postgresql://`` to psycopg 3, which dagster-postgres 0.29
    does not support: its NOTIFY fails)."""
    return url.replace("postgresql://", "postgresql+psycopg2://", 1)


def server_dir(home: Path) -> Path:
    """Where the server's data dir and log live: ``<home>/postgres``."""
    return home / "postgres"


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
    raise LocalPostgresError(f"PostgreSQL server binaries (initdb, pg_ctl) not found in {candidates or 'PATH'}; "
                             f"{INSTALL_HINT}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(home: Path, database: str = DATABASE) -> PostgresInfo | None:
    """The server whose data dir is under ``home`` if it runs (from its ``postmaster.pid``)."""
    folder = server_dir(home)
    try:
        lines = (folder / "data" / "postmaster.pid").read_text().splitlines()
        pid, port = int(lines[0]), int(lines[3])
    except (OSError, ValueError, IndexError):
        return None
    return PostgresInfo(pid, port, folder, database) if _alive(pid) else None


def start(home: Path, *, port: int | None = None, database: str = DATABASE, options: Mapping[str, str] | None = None,
          bindir: Path | None = None, timeout: int = 60) -> PostgresInfo:
    """Start the server under ``home`` on ``127.0.0.1:port`` (default 15432), creating its data
    dir on first use (kept across restarts) and the database ``database`` if missing.
    A server already running under ``home`` is returned as is (unless it listens on another
    port than the one asked for). ``options``: extra server settings (``-c key=value``)."""
    running = status(home, database)
    if running is not None:
        if port is not None and running.port != port:
            raise LocalPostgresError(f"the PostgreSQL server of {home} already runs on port {running.port} "
                                     f"(pid {running.pid}); use {running.url}, or stop it first: tidemark postgres down")
        _create_database(running)
        return running
    port = DEFAULT_PORT if port is None else port
    bindir = bindir or find_bindir()
    _check_port_free(port)
    folder = server_dir(home)
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        try:
            shutil.chown(folder, "postgres", "postgres")
        except LookupError as exc:
            raise LocalPostgresError(f"running as root, the server must run as the user 'postgres', which does not "
                                     f"exist ({exc}); {INSTALL_HINT}, or run as an ordinary user") from None
    data = folder / "data"
    if not (data / "PG_VERSION").exists():
        _run([str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
              "--no-locale", *(["--no-sync"] if (options or {}).get("fsync") == "off" else [])], folder)
    # TCP on loopback only; no Unix socket (its path could pass the 107-byte limit under a deep home).
    settings = {"port": str(port), "listen_addresses": "127.0.0.1", "unix_socket_directories": "''", **(options or {})}
    log = folder / "server.log"
    try:
        _run([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", str(timeout),
              "-o", " ".join(f"-c {k}={v}" for k, v in settings.items()), "start"], folder)
    except LocalPostgresError as exc:
        raise LocalPostgresError(f"{exc}\nserver log {log}, last lines:\n{log_tail(log)}") from None
    server = status(home, database)
    if server is None:
        raise LocalPostgresError(f"pg_ctl started the PostgreSQL server of {home} but it is not running; "
                                 f"server log {log}, last lines:\n{log_tail(log)}")
    try:
        _create_database(server)
    except BaseException:
        stop(home, bindir=bindir)
        raise
    return server


def stop(home: Path, *, bindir: Path | None = None, timeout: int = 20) -> PostgresInfo | None:
    """Stop the server under ``home`` (fast shutdown: open sessions are ended, committed data
    is kept; immediate shutdown if that takes longer than ``timeout`` seconds). Returns what
    was stopped (None if nothing ran)."""
    server = status(home)
    if server is None:
        return None
    bindir = bindir or find_bindir()
    data = str(server.folder / "data")
    try:
        _run([str(bindir / "pg_ctl"), "-D", data, "-m", "fast", "-w", "-t", str(timeout), "stop"], server.folder)
    except LocalPostgresError:
        _run([str(bindir / "pg_ctl"), "-D", data, "-m", "immediate", "-w", "-t", str(timeout), "stop"], server.folder)
    return server


def admin_url(server: PostgresInfo) -> str:
    """A URL of the server's maintenance database ``postgres`` (to create databases)."""
    return f"postgresql://postgres@127.0.0.1:{server.port}/postgres"


def create_database(server: PostgresInfo, name: str) -> str:
    """Create the database ``name`` on ``server`` if it is missing; returns its URL."""
    import psycopg

    with psycopg.connect(admin_url(server), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql://postgres@127.0.0.1:{server.port}/{name}"


# --------------------------------------------------------------------- helpers


def _create_database(server: PostgresInfo) -> None:
    create_database(server, server.database)


def _run(cmd: list[str], cwd: Path) -> None:
    """Run a server binary, as the ``postgres`` user when we are root."""
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        hint = (f"\n(as root the server runs as the user 'postgres': it must be able to enter every folder "
                f"above {cwd})" if os.geteuid() == 0 and "ermission denied" in done.stderr + done.stdout else "")
        raise LocalPostgresError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}{hint}")


def _check_port_free(port: int) -> None:
    reason = port_taken(port)
    if reason is not None:
        raise LocalPostgresError(f"port {port} on 127.0.0.1 is in use ({reason}); another program (or another "
                                 f"PostgreSQL) listens there. Fix: pick a free port with --port, or stop "
                                 f"that program")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs and is a PostgreSQL server (not a pid reused after a crash)."""
    return process_alive(pid, (b"postgres",))
