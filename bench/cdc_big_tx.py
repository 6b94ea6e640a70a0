"""One big source transaction through the cdc processor: peak memory of the replicating process (issue 19, part 2).

A throw-away PostgreSQL (``wal_level=logical``) with one keyed table of ``--rows`` rows (``id bigint``
primary key, ``v bigint``, ``note text``, ``at timestamptz``), copied by the snapshot of one
replicator per path (untimed). Then ONE transaction updates every row (and moves ``--key-changes``
of them to new keys). Each path's replicator then applies it, in a process of its own, so the
figure is that process's own peak resident memory (``getrusage`` ``ru_maxrss``; the Spark JVM is
another process, bounded by its heap, ``--driver-memory``):

* ``columns``: pgoutput decoded into Arrow columns (``PostgresSource.read_columns``), reduced on
  columns, one MERGE; past ``TIDEMARK_CDC_SPILL_ROWS`` changes (default 1M) spilled to Parquet as
  they stream and reduced by Spark (the ``landed`` column says which: ``spilled`` or ``in memory``);
* ``python``: the change-by-change path (a ``RowChange`` object per row), as before issue 19.

Every replica is then compared with the table (row count and checksums) through the ``deltalake``
reader, JVM-free; exit 1 if any differs. Target (issue 19): a 3M-row transaction replicated, equal
to the source, with peak RSS under 1.5 GB.

    PYTHONPATH=. .venv/bin/python bench/cdc_big_tx.py [--rows 3000000] [--paths columns,python]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.shared import throwaway_postgres  # noqa: E402
from resources.core.settings import Settings  # noqa: E402

TARGET_MB = 1536
CHECK = "count(*), sum(id), sum(v), sum(length(note))"


def settings_of(base: Path) -> Settings:
    return Settings.from_env({}, home=base / "home", lineage=base / "lineage.yaml", spark_master="local[2]")


def _noting(f: Any, how: str, landed: list[str]) -> Any:
    def wrapped(*a: Any, **kw: Any) -> Any:
        landed.append(how)
        return f(*a, **kw)

    return wrapped


def child(base: Path, name: str, path: str) -> None:
    """Run replicator ``name`` until caught up on ``path``; print its figures as one JSON line."""
    from lineage.spec.loader import load_lineage
    from platform_assets.cdc import scd1 as cdc_scd1
    from platform_assets.cdc.run import run_replicator
    from platform_assets.engine.runner import Engine
    from resources.cdc.postgres import PostgresSource
    from resources.spark.session import build_spark_session

    if path == "python":
        PostgresSource.read_columns = None  # type: ignore[assignment,method-assign]
    landed: list[str] = []  # which MERGE landed each replica's unit
    for fn, how in (("apply_scd1_spilled", "spilled"), ("apply_scd1_columns", "memory"), ("apply_scd1", "python")):
        setattr(cdc_scd1, fn, _noting(getattr(cdc_scd1, fn), how, landed))
    settings = settings_of(base)
    spark = build_spark_session(settings, app_name=f"tidemark-bench-big-tx-{path}")
    spark.range(1).count()
    before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    engine = Engine(settings, load_lineage(settings.lineage), spark=spark)
    t = time.monotonic()
    try:
        results = [r for r in run_replicator(engine, engine.lineage.replicators[name], until_caught_up=True) if r.processed]
    finally:
        engine.close()
    seconds = time.monotonic() - t
    print(json.dumps({"seconds": seconds, "units": len(results), "landed": ",".join(sorted(set(landed))), "changes": sum(r.changes for r in results),
                      "rss_before_mb": before_mb, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    spark.stop()


def run_child(base: Path, name: str, path: str, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", str(base), name, path], env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the {path} replicator failed (rc {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rows", type=int, default=3_000_000)
    p.add_argument("--key-changes", type=float, default=0.05, help="share of the rows the transaction moves to a new key")
    p.add_argument("--paths", default="columns,python", help="columns and/or python")
    p.add_argument("--driver-memory", default="4g")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(Path(args.child[0]), args.child[1], args.child[2])
        return 0
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not set(paths) <= {"columns", "python"}:
        p.error("--paths: columns and/or python")

    import psycopg
    from deltalake import DeltaTable

    from resources.storage import delta_read

    with throwaway_postgres("tidemark-bench-big-tx-", keep=args.keep) as (base, server):
        env = {**os.environ, "TIDEMARK_BENCH_CDC_DSN": server.url, "TIDEMARK_DRIVER_MEMORY": args.driver_memory,
               "PYTHONPATH": str(ROOT)}
        failed = False
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA bx")
            conn.execute("CREATE TABLE bx.t (id bigint PRIMARY KEY, v bigint, note text, at timestamptz)")
            conn.execute("INSERT INTO bx.t SELECT g, g %% 1000, 'row ' || g, now() - g * interval '1 second' "
                         "FROM generate_series(1, %s) g", (args.rows,))
        (base / "lineage.yaml").write_text("cdc:\n" + "".join(
            f"  - name: bx{path[0]}\n    dsn_env: TIDEMARK_BENCH_CDC_DSN\n    tables: [bx.*]\n    schema: r_{path}\n"
            for path in paths))
        t = time.monotonic()
        for path in paths:
            run_child(base, f"bx{path[0]}", path, env)
        print(f"snapshot: {args.rows:,} rows per replica in {time.monotonic() - t:.1f} s (untimed)", flush=True)
        moved = int(args.rows * args.key_changes)
        t = time.monotonic()
        with psycopg.connect(server.url) as conn:  # ONE transaction
            conn.execute("UPDATE bx.t SET v = v + 1, note = note || ' x', at = at + interval '1 day'")
            conn.execute("UPDATE bx.t SET id = id + %s WHERE id <= %s", (args.rows, moved))
        print(f"source: one transaction of {args.rows + moved:,} row changes ({moved:,} key changes) "
              f"committed in {time.monotonic() - t:.1f} s", flush=True)
        with psycopg.connect(server.url) as conn:
            want = conn.execute(f"SELECT {CHECK} FROM bx.t").fetchone()
        settings = settings_of(base)
        print(f"{'path':<8} {'landed':<10} {'seconds':>8} {'units':>6} {'changes':>10} {'RSS before':>11} {'peak RSS':>9}  replica",
              flush=True)
        for path in paths:
            fig = run_child(base, f"bx{path[0]}", path, env)
            import pyarrow.compute as pc

            # deltalake's DataFusion reader where needed: new replicas have deletion vectors
            rows = delta_read.read_rows(DeltaTable(settings.table_path(f"r_{path}.bx__t")), ["id", "v", "note"])
            got = (rows.num_rows, pc.sum(rows["id"]).as_py(), pc.sum(rows["v"]).as_py(),
                   pc.sum(pc.utf8_length(rows["note"])).as_py())
            same = want is not None and tuple(int(x) for x in want) == tuple(int(x) for x in got)
            failed = failed or not same
            print(f"{path:<8} {fig['landed']:<10} {fig['seconds']:>8.1f} {fig['units']:>6} {fig['changes']:>10,} {fig['rss_before_mb']:>8,.0f} MB "
                  f"{fig['peak_rss_mb']:>6,.0f} MB  {'equal to the source' if same else f'DIFFERS: {got} != {want}'}"
                  + (f"; target < {TARGET_MB:,} MB: {'MET' if fig['peak_rss_mb'] < TARGET_MB else 'MISSED'}"
                     if path == "columns" else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
