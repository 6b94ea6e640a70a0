"""Fixtures of the resources tests: a real PostgreSQL server for the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from tests.pg import PostgresUnavailable, find_bindir, running_postgres  # noqa: E402


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """URL of a throw-away PostgreSQL server with an empty database ``tidemark``. Fails (never
    skips) when PostgreSQL is not installed."""
    try:
        bindir = find_bindir()
    except PostgresUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    with running_postgres(bindir) as url:
        yield url
