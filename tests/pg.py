"""A throw-away PostgreSQL server for tests: ``resources.state.local_pg`` (Debian's binaries, trust
auth, a database ``tidemark``) on a temp dir and a free loopback port, with the settings the
tests need (``wal_level=logical`` for replication slots, ``fsync=off`` for speed)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from resources.state import local_pg
from resources.state.local_pg import INSTALL_HINT, find_bindir, free_port  # noqa: F401 - the tests' names
from resources.state.local_pg import LocalPostgresError as PostgresUnavailable

#: every CDC test's replicator keeps a slot (parked replicas one more) on the one server a worker shares
TEST_OPTIONS = {"wal_level": "logical", "fsync": "off", "max_replication_slots": "40", "max_wal_senders": "40"}


@contextlib.contextmanager
def running_postgres(bindir: Path | None = None, options: Mapping[str, str] | None = None) -> Iterator[str]:
    """Start a server, yield ``postgresql://postgres@127.0.0.1:<port>/tidemark``, stop it and
    remove its files. ``options``: server settings on top of :data:`TEST_OPTIONS`."""
    root = Path(tempfile.mkdtemp(prefix="tidemark-pg-"))
    os.chmod(root, 0o755)  # as root, the server's user must be able to enter it
    try:
        server = local_pg.start(root, port=free_port(), options={**TEST_OPTIONS, **(options or {})}, bindir=bindir)
        try:
            yield server.url
        finally:
            local_pg.stop(root, bindir=bindir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


__all__ = ["INSTALL_HINT", "PostgresUnavailable", "find_bindir", "free_port", "running_postgres"]
