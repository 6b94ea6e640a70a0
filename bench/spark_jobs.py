"""Where a benchmark's Spark jobs and seconds go, by the line of Tidemark that started them.

    .venv/bin/python bench/spark_jobs.py bench/view_scaling.py --sizes 1000000 --changes 10 --strategy incremental

Runs another benchmark script (any arguments after it are its own) in this process, with every
Spark action of the classic PySpark session wrapped: ``DataFrame.collect``, ``count``,
``isEmpty``, ``localCheckpoint`` and the like, ``DataFrameWriter.save``, ``SparkSession.sql``
(a MERGE runs there) and delta-spark's ``DeltaMergeBuilder.execute``. An action called from
Tidemark's code (``platform_assets``, ``resources``, ``lineage``) prints a line as it ends::

    JOBS  2.03 s  +8  DataFrame.localCheckpoint  platform_assets/views/row_wise.py:72 <- platform_assets/views/merge.py:266

its wall time, the Spark jobs it started (the status tracker's newest job id before and after:
with adaptive query execution every shuffle stage is a job of its own, and a broadcast is one
too), the action, and the Tidemark lines that called it (innermost first). An action inside
another (a ``sql`` whose plan collects) is counted in both. At the end: the actions by line,
with their total seconds and jobs. Only in this process: the benchmark's own Spark session
(``local[...]``); a Spark Connect session has no status tracker and prints nothing.
"""

from __future__ import annotations

import collections
import functools
import runpy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OURS = tuple(f"/{d}/" for d in ("platform_assets", "resources", "lineage"))
SKIP = ("lineage/core/retry.py",)  # wrappers that say nothing of where an action comes from
ACTIONS = ("collect", "count", "isEmpty", "localCheckpoint", "checkpoint", "take", "first", "head", "toPandas",
           "toArrow", "toLocalIterator")

totals: collections.Counter[str] = collections.Counter()
jobs: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


def _tracker() -> Any | None:
    from pyspark.sql import SparkSession

    session = SparkSession._instantiatedSession  # the units run in threads: no active session there
    return None if session is None else session.sparkContext.statusTracker()


def _newest_job() -> int | None:
    tracker = _tracker()
    return None if tracker is None else max(tracker.getJobIdsForGroup(None), default=-1)


def _caller() -> str | None:
    frames = [f for f in traceback.extract_stack()[:-2]
              if any(d in f.filename for d in OURS) and not f.filename.endswith(SKIP)]
    if not frames:
        return None
    return " <- ".join(f"{Path(f.filename).resolve().relative_to(ROOT)}:{f.lineno}" for f in frames[-2:][::-1])


def _wrap(cls: type, name: str) -> None:
    if name not in cls.__dict__:
        return
    original = cls.__dict__[name]

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        before, started = _newest_job(), time.monotonic()
        try:
            return original(*args, **kwargs)
        finally:
            after, took = _newest_job(), time.monotonic() - started
            where = _caller()
            if where is not None and before is not None and after is not None:
                label = f"{cls.__name__}.{name:<16} {where}"
                print(f"JOBS {took:5.2f} s {'+' + str(after - before):>4}  {label}", file=sys.stderr, flush=True)
                totals[label] += took
                jobs[label] += after - before
                calls[label] += 1

    setattr(cls, name, wrapped)


def install() -> None:
    from pyspark.sql import DataFrameWriter, SparkSession
    from pyspark.sql.classic.dataframe import DataFrame

    for name in ACTIONS:
        _wrap(DataFrame, name)
    _wrap(DataFrameWriter, "save")
    _wrap(SparkSession, "sql")
    try:
        from delta.tables import DeltaMergeBuilder
    except ImportError:
        return
    _wrap(DeltaMergeBuilder, "execute")


def summary() -> None:
    print("\nSpark actions called by Tidemark, by line (seconds, jobs, calls; an action inside another counts in both):",
          file=sys.stderr)
    for label, took in totals.most_common():
        print(f"  {took:8.2f} s {jobs[label]:6} jobs {calls[label]:5}x  {label}", file=sys.stderr)


def main(argv: list[str]) -> int:
    if not argv or not argv[0].endswith(".py"):
        print(__doc__, file=sys.stderr)
        return 2
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    install()
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        summary()
        return int(exc.code or 0) if not isinstance(exc.code, str) else 1
    summary()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
