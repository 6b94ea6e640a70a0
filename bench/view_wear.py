"""A row-wise view under a stream of small reference changes: what each unit rewrites and costs
while the MERGEs wear the view's clustering, and what ``tidemark maintain`` gives back.

    .venv/bin/python bench/view_wear.py --orders 10000000 --rounds 10
    .venv/bin/python bench/view_wear.py --orders 10000000 --rounds 10 --maintain-every 5

Builds ``mart.orders_wide`` of ``bench/view_scaling.py`` (a row-wise view of orders joined to 200,000
customers, built in files of ~25,000 rows clustered by ``customer_id``) over ``--orders`` orders,
then runs ``--rounds`` units, each after ``--changes`` customers changed their country (one
``deltalake`` MERGE of ``dim.customers``). Per unit it prints the seconds, which engine MERGEd into the
view (``deltalake`` from the driver, ``+sort`` where the files it packed were sorted again
by ``platform_assets.core.merge_layout``, or Spark), the rows that MERGE rewrote (copied unchanged), the
files it removed, and the view's largest file. A ``deltalake`` MERGE packs the rows it rewrote into
one or two files whose statistics span the ranges of every file they came from, so later units'
filters leave those files too (docs/views.md), unless they are sorted again (``--no-resort``: they
are not, as before stop 84). ``--maintain-every N`` runs ``tidemark maintain``'s
table maintenance of the view after every N units (0: never), which clusters it again once a file
is over 4x its target. At the end, the view is compared with the plain rebuild of its SQL, row for
row, and the rebuild's time printed for scale."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.reverse_join import compare as compare_tables  # noqa: E402
from bench.reverse_join import full_rebuild  # noqa: E402
from bench.shared import BenchError, close_run  # noqa: E402
from bench.view_scaling import CUSTOMERS, KEYED, ORDERS, make_lineage, write_sources  # noqa: E402
from resources.core.settings import Settings  # noqa: E402
from resources.spark.session import cached_delta_jars  # noqa: E402

COUNTRIES = ("DE", "FR", "NL", "PL", "SE", "US", "BR", "JP")


def change_countries(path: str, ids: list[int], round_no: int) -> None:
    """``ids``' country changed, in one ``deltalake`` MERGE of the reference table."""
    import pyarrow as pa
    from deltalake import DeltaTable

    src = pa.table({"id": pa.array(ids, pa.int64()),
                    "country": pa.array([COUNTRIES[(i + round_no + 3) % len(COUNTRIES)] for i in ids])})
    (DeltaTable(path).merge(src, "t.id = s.id", source_alias="s", target_alias="t")
     .when_matched_update({"country": "s.country"}).execute())


def last_merge(view: str) -> tuple[str, int | None, int | None, int, int]:
    """The view's newest commit but a re-sort of its files (``merge_layout``): (engine, rows copied,
    files removed, files, rows of the largest file); the engine is "deltalake+sort" when a re-sort
    followed it."""
    import pyarrow as pa
    from deltalake import DeltaTable

    from platform_assets.core.merge_layout import is_resort, newest_unit_commit

    table = DeltaTable(view)
    resorted = is_resort(table.history(1)[0])
    m = newest_unit_commit(table).get("operationMetrics") or {}
    engine = ("deltalake+sort" if resorted else "deltalake") if "num_target_rows_copied" in m else "spark"
    copied = m.get("num_target_rows_copied", m.get("numTargetRowsCopied"))
    removed = m.get("num_target_files_removed", m.get("numTargetFilesRemoved"))
    adds = pa.table(table.get_add_actions(flatten=True))
    return (engine, None if copied is None else int(copied), None if removed is None else int(removed), adds.num_rows,
            max(adds["num_records"].to_pylist() or [0]))


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--orders", type=int, default=10_000_000, help="orders (base rows)")
    p.add_argument("--customers", type=int, default=200_000, help="rows of the reference table")
    p.add_argument("--rounds", type=int, default=10, help="units, each after --changes changed customers")
    p.add_argument("--changes", type=int, default=10, help="customers changed before each unit")
    p.add_argument("--maintain-every", type=int, default=0, help="run table maintenance of the view every N units (0: never)")
    p.add_argument("--filtered-rows", type=int, default=None,
                   help="keyed_merge.FILTERED_VIEW_ROWS for this run (1000000: the bound before stop 83, where Spark "
                        "MERGEd a view whose filter left files of more than 1,000,000 rows)")
    p.add_argument("--no-resort", action="store_true",
                   help="leave the files deltalake's MERGE packed as it wrote them (merge_layout.MAX_ROWS = 0: "
                        "the behaviour before stop 84)")
    p.add_argument("--driver-memory", default="6g", help="driver memory of the Spark driver")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (data, logs)")
    args = p.parse_args(argv)
    if min(args.orders, args.customers, args.rounds, args.changes) <= 0 or args.maintain_every < 0:
        p.error("--orders, --customers, --rounds and --changes must be positive, --maintain-every at least 0")
    if not cached_delta_jars():
        print("error: no cached Delta jars; start Spark once first (e.g. ./scripts/setup.sh or `tidemark spark up`)",
              file=sys.stderr)
        return 1

    os.environ["TIDEMARK_DRIVER_MEMORY"] = args.driver_memory
    root = Path(tempfile.mkdtemp(prefix="tidemark-view-wear-"))
    print(f"work dir {root}; {args.orders:,} orders, {args.customers:,} customers; {args.rounds} units of "
          f"{args.changes} changed customers; maintenance every {args.maintain_every or 'never'}", flush=True)
    from lineage.spec.loader import load_lineage
    from platform_assets.core import keyed_merge, merge_layout
    from platform_assets.engine.runner import Engine
    from platform_assets.maintenance import tables as maint
    from resources.spark.session import build_spark_session

    if args.filtered_rows is not None:
        keyed_merge.FILTERED_VIEW_ROWS = args.filtered_rows
    if args.no_resort:
        merge_layout.MAX_ROWS = 0
    print(f"keyed_merge.FILTERED_VIEW_ROWS {keyed_merge.FILTERED_VIEW_ROWS:,}; the files a MERGE packed are "
          f"{'left as written' if args.no_resort else 'sorted again (merge_layout)'}", flush=True)
    settings = Settings.from_env({}, home=root / "home", lineage=make_lineage(root / "tidemark", 100_000_000),
                                 spark_master="local[2]")
    spark = build_spark_session(settings, app_name="tidemark-bench-view-wear")
    engine = None
    try:
        orders, refs, view = (settings.table_path(t) for t in (ORDERS, CUSTOMERS, KEYED.topic))
        write_sources(spark, orders, refs, args.orders, args.customers)
        engine = Engine(settings, load_lineage(settings.lineage), spark=spark, owner="bench-view-wear")
        t = time.monotonic()
        engine.run_until_caught_up([KEYED.topic])
        _, _, _, files, largest = last_merge(view)
        print(f"built {KEYED.topic} in {time.monotonic() - t:.1f} s: {files:,} files, the largest of {largest:,} rows",
              flush=True)
        engine.run_until_caught_up([KEYED.topic])  # warm: the process's first unit pays its imports
        ids = list(range(args.customers))
        rng = random.Random(83)
        took: list[float] = []
        print(f"\n{'unit':>4} {'seconds':>8}  {'engine':<14} {'rows rewritten':>14} {'files removed':>13} "
              f"{'files':>6} {'largest file':>12}", flush=True)
        for r in range(1, args.rounds + 1):
            change_countries(refs, rng.sample(ids, args.changes), r)
            t = time.monotonic()
            done = [u for u in engine.run_until_caught_up([KEYED.topic]) if u.processed]
            took.append(time.monotonic() - t)
            if len(done) != 1 or done[0].stats.get("strategy") != "incremental":
                raise BenchError(f"unit {r}: expected one incremental unit, got "
                                 f"{[(u.stats.get('strategy'), u.stats.get('strategy_reason')) for u in done]}")
            engine_name, copied, removed, files, largest = last_merge(view)
            print(f"{r:>4} {took[-1]:>8.2f}  {engine_name:<14} {_n(copied):>14} {_n(removed):>13} {files:>6,} "
                  f"{largest:>12,}", flush=True)
            if args.maintain_every and r % args.maintain_every == 0:
                t = time.monotonic()
                reports = maint.run(engine, [KEYED.topic], maint.Options(writers_idle=True))
                what = "; ".join(f"{rep.compacted.get('numFilesRemoved', 0)} files rewritten into "
                                 f"{rep.compacted.get('numFilesAdded', 0)}, clustered by {list(rep.clustered_by) or '-'}"
                                 for rep in reports)
                _, _, _, files, largest = last_merge(view)
                print(f"     maintenance {time.monotonic() - t:.1f} s: {what}; now {files:,} files, the largest of "
                      f"{largest:,} rows", flush=True)
        full_path = str(root / "full")
        full_s = full_rebuild(spark, orders, full_path, KEYED.sql)
        equal = compare_tables(spark, {"Tidemark": view, "full rebuild": full_path}, args.orders, list(KEYED.columns))
        print(f"\nunits: median {statistics.median(took):.2f} s, first {took[0]:.2f} s, last {took[-1]:.2f} s, "
              f"slowest {max(took):.2f} s; the plain rebuild of the view took {full_s:.1f} s\nequal: {equal}")
    except BenchError as exc:
        print(f"\nFAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        close_run(engine, spark, root, keep=args.keep, drop=(ORDERS, CUSTOMERS, KEYED.topic))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
