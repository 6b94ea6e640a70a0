"""Running a replicator: its source (PostgreSQL logical replication or Debezium JSON files) and its
units one after the other, retrying failures that may pass by themselves (issue 10)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from lineage.core.errors import TidemarkError, first_line
from lineage.spec.model import Replicator
from platform_assets.cdc.replicator import ReplicatorUnit, retryable
from platform_assets.cdc.units import CdcResult, ColumnarSource

if TYPE_CHECKING:
    from platform_assets.core.context import UnitContext

log = logging.getLogger(__name__)


def unconfigured(rep: Replicator) -> str | None:
    """Why the replicator's source cannot be opened for want of configuration (a PostgreSQL source
    whose connection string's environment variable is not set), else None."""
    import os

    spec = rep.spec
    if spec.source == "debezium" or spec.dsn or os.environ.get(spec.dsn_env or ""):
        return None
    return (f"replicator '{spec.name}' ({rep.where}): environment variable {spec.dsn_env} is not set; "
            f"export it with the source's connection string, e.g. postgresql://user@host:5432/db")


def open_source(rep: Replicator) -> ColumnarSource:
    """The replicator's source: PostgreSQL logical replication, or Debezium JSON files."""
    import os
    from pathlib import Path

    spec = rep.spec
    if spec.source == "debezium":
        from resources.cdc.debezium import DebeziumFileSource

        path = Path(spec.path or ".")
        return DebeziumFileSource(path if path.is_absolute() else rep.file.parent / path, name=spec.name,
                                  selects=spec.selects)
    missing = unconfigured(rep)
    if missing:
        raise TidemarkError(missing)
    dsn = spec.dsn or os.environ.get(spec.dsn_env or "", "")
    from resources.cdc.postgres import PostgresSource

    return PostgresSource(dsn, name=spec.name, tables=spec.tables, exclude=spec.exclude)


def run_replicator(engine: UnitContext, rep: Replicator, *, until_caught_up: bool = False, retries: int = 4,
                   backoff_s: float = 2.0, sleep: Callable[[float], None] = time.sleep,
                   positions_every_s: float = 0.0) -> Iterator[CdcResult]:
    """Units of one replicator: one, or until a unit finds nothing to do (a unit redone after a crash
    does not count as finding nothing). A retryable failure (the
    source unreachable) is retried ``retries`` times with exponential backoff (2, 4, 8, 16 s); the
    replicator's state says ``failing: ...`` meanwhile, and the last failure is raised.
    ``positions_every_s``: idle units write the replicator's positions table at most this often
    (:class:`platform_assets.cdc.positions.Positions`; 0: whenever they must)."""
    source = open_source(rep)
    try:
        attempt = 0
        while True:
            try:
                result = ReplicatorUnit(engine, rep, source, positions_every_s=positions_every_s).run_once()
            except Exception as exc:
                if attempt >= retries or not retryable(exc):
                    raise
                attempt += 1
                log.warning("replicator %s: %s; retry %d of %d in %.0f s", rep.name, first_line(exc), attempt,
                            retries, backoff_s * 2 ** (attempt - 1))
                sleep(backoff_s * 2 ** (attempt - 1))
                continue
            attempt = 0
            yield result
            if not until_caught_up or not (result.processed or result.redone) or result.paused:
                return  # (a unit redone after a crash may find its writes landed: more may wait behind it)
    finally:
        source.close()
