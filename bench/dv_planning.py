"""JVM-free planning of a block on a source as Databricks writes it (deletion vectors and column
mapping on, rows deleted and updated in place) against the same rows in a plain table, in one run.

    .venv/bin/python bench/dv_planning.py                 # 10,000,000 rows in 20 commits
    .venv/bin/python bench/dv_planning.py --rows 1000000  # a quick look

Both tables are written by Spark (``local[2]``) with the same rows ``(pos, id, customer_id,
amount, note)``, two rows per ``pos``: ``--commits`` appends, then ``DELETE ... WHERE id % 10 = 0``
and ``UPDATE ... SET amount = -amount WHERE id % 100 = 1`` (the ``dv`` table: deletion vectors on
every file; the ``plain`` one: copy-on-write, every file rewritten), ``note`` renamed to ``memo``
on the ``dv`` table (column mapping), then one new block of ``--block`` rows appended to both.
Writing is untimed (its time is printed).

Timed, best of ``--repeat`` rounds (the two tables interleaved, the order alternating, after an
untimed warm-up), each step on a fresh snapshot as the planner takes it, no JVM:

* ``plan``: what a planner tick reads for a step topic whose ``last`` is the end of the table
  before the new block: the snapshot (``TableSnapshot.open``), the newest position
  (``table_mark``), the null-position rows (``bad_position_rows``), the late rows in the commit
  since (``late_rows``) and the block's end (``find_block_end``, maxstep = the block).
* ``read``: every row's ``id`` the way pandas and polars users read the table
  (``delta_read.read_rows``: deltalake's pyarrow dataset for the plain table, its DataFusion
  reader for the other), and the row count.

The answers of the two tables must be equal (else exit 1). Target (issue 56): ``plan`` on the
``dv`` table at most 1.2x the plain table's. A miss is printed as MISS; the script exits 0.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lineage.core.positions import Position  # noqa: E402
from resources.core.settings import Settings  # noqa: E402

TARGET = 1.2
T0_SECONDS = 1_767_225_600  # 2026-01-01 00:00:00 UTC
FEATURES = ("'delta.enableDeletionVectors' = 'true', 'delta.columnMapping.mode' = 'name', "
            "'delta.minReaderVersion' = '3', 'delta.minWriterVersion' = '7'")


def rows_sql(first: int, n: int) -> str:
    return (f"SELECT timestamp_seconds({T0_SECONDS} + div(id, 2)) AS pos, id, CAST(id % 10000 AS INT) AS customer_id, "
            f"CAST(id % 997 AS DOUBLE) AS amount, concat('n', id % 1000) AS note FROM range({first}, {first + n})")


def write_tables(spark: Any, root: Path, rows: int, commits: int, block: int) -> tuple[dict[str, str], dict[str, int]]:
    """The two tables; and each one's version before the new block."""
    paths = {"plain": str(root / "plain"), "dv": str(root / "dv")}
    before = {}
    cols = "pos TIMESTAMP, id BIGINT, customer_id INT, amount DOUBLE, note STRING"
    for name, path in paths.items():
        props = FEATURES if name == "dv" else "'delta.enableDeletionVectors' = 'false'"
        spark.sql(f"CREATE TABLE delta.`{path}` ({cols}) USING delta TBLPROPERTIES ({props})")
        per = rows // commits
        for c in range(commits):
            spark.sql(f"INSERT INTO delta.`{path}` {rows_sql(c * per, per)}")
        spark.sql(f"DELETE FROM delta.`{path}` WHERE id % 10 = 0")
        spark.sql(f"UPDATE delta.`{path}` SET amount = -amount WHERE id % 100 = 1")
        if name == "dv":
            spark.sql(f"ALTER TABLE delta.`{path}` RENAME COLUMN note TO memo")
        before[name] = int(spark.sql(f"DESCRIBE HISTORY delta.`{path}` LIMIT 1").collect()[0]["version"])
        spark.sql(f"INSERT INTO delta.`{path}` {rows_sql(commits * per, block)}")
    return paths, before


def plan(path: str, after_version: int, last: Position, block: int) -> tuple[Any, ...]:
    from resources.storage import delta_meta

    snap = delta_meta.TableSnapshot.open(path)
    mark = delta_meta.table_mark(snap)
    bad = delta_meta.bad_position_rows(snap).num_rows
    late = delta_meta.late_rows(snap, after_version, last).rows.num_rows
    end = delta_meta.find_block_end(snap, last, mark.max_position.pos if mark.max_position else last.pos, block)
    return mark.max_position, bad, late, end.end, end.rows


def read(path: str) -> tuple[int, int]:
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    from resources.storage import delta_read

    table = DeltaTable(path)
    ids = delta_read.read_rows(table, ["id"])["id"]
    return delta_read.count_rows(table), int(pc.sum(ids).as_py() or 0)


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - started, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--commits", type=int, default=20)
    ap.add_argument("--block", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = ap.parse_args(argv)

    from resources.spark.session import build_spark_session

    root = Path(tempfile.mkdtemp(prefix="tidemark-dv-planning-"))
    try:
        settings = Settings.from_env({}, home=root / "home", spark_master="local[2]")
        spark = build_spark_session(settings, app_name="bench-dv-planning")
        spark.conf.set("spark.sql.shuffle.partitions", "4")
        started = time.perf_counter()
        paths, before = write_tables(spark, root, args.rows, args.commits, args.block)
        print(f"wrote 2 tables of {args.rows:,} rows in {args.commits} commits, deleted 10 %, updated 1 %, "
              f"appended a block of {args.block:,}: {time.perf_counter() - started:.0f}s (untimed)")
        spark.stop()  # nothing below uses a JVM
        per = args.rows // args.commits
        last_id = args.commits * per - 1
        last = Position(_pos(last_id), last_id)
        best: dict[tuple[str, str], float] = {}
        answers: dict[tuple[str, str], Any] = {}
        for rnd in range(args.repeat + 1):
            order = ["plain", "dv"] if rnd % 2 == 0 else ["dv", "plain"]
            for name in order:
                for what, fn, fargs in (("plan", plan, (paths[name], before[name], last, args.block)),
                                        ("read", read, (paths[name],))):
                    secs, out = timed(fn, *fargs)
                    answers[(name, what)] = out
                    if rnd:  # (round 0 warms up)
                        best[(name, what)] = min(best.get((name, what), secs), secs)
        bad = [w for w in ("plan", "read") if answers[("plain", w)] != answers[("dv", w)]]
        print(f"\n{'step':<6} {'plain ms':>10} {'dv ms':>10} {'dv/plain':>9}  target  verdict   answer")
        for what in ("plan", "read"):
            p, d = best[("plain", what)] * 1000, best[("dv", what)] * 1000
            ratio = d / p if p else float("inf")
            target = f"{TARGET:.1f}x" if what == "plan" else "-"
            verdict = ("ok" if ratio <= TARGET else "MISS") if what == "plan" else "-"
            print(f"{what:<6} {p:>10.1f} {d:>10.1f} {ratio:>8.2f}x  {target:>6}  {verdict:<8}  {answers[('dv', what)]}")
        if bad:
            print(f"\nERROR: the two tables answer differently for {bad}: plain {[answers[('plain', w)] for w in bad]}, "
                  f"dv {[answers[('dv', w)] for w in bad]}")
            return 1
        return 0
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _pos(row_id: int) -> Any:
    import datetime as dt

    return dt.datetime(2026, 1, 1) + dt.timedelta(seconds=row_id // 2)


if __name__ == "__main__":
    sys.exit(main())
