"""What a paused replica costs the others' reads of a PostgreSQL source, parked or not (issue 19, part 3).

A source of two tables: ``a`` is paused (its replica stopped at a position), ``b`` goes on. While
paused, ``--rows`` rows are written to both (WAL the pause holds). Then ``--units`` times a few new
rows are committed to ``b`` and read as a replicator unit of the others reads them:

- **held** (the design before parking): the main slot stays acknowledged at the paused replica's
  position, so every read makes the server decode all the WAL written since, from the slot's
  restart position;
- **parked**: the paused replica's place is a copy of the main slot (``PostgresSource.park``);
  the main slot is acknowledged past the backlog and each read decodes only what is new.

Prints the time per unit of each, their ratio, and the WAL each slot holds; then the parked
replica's catch-up read of its backlog. Source-level (no Spark): it measures the decoding the
replicator's reads pay, which is what parking changes.

    PYTHONPATH=. .venv/bin/python bench/cdc_paused.py [--rows 2000000] [--units 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import psycopg

from resources.cdc.postgres import PostgresSource
from resources.state import local_pg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rows", type=int, default=2_000_000, help="rows written to each table while paused")
    p.add_argument("--units", type=int, default=5, help="reads of the others after the backlog")
    args = p.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="tidemark-bench-paused-"))
    os.chmod(base, 0o755)  # as root, the server's user must be able to enter it
    server = local_pg.start(base, port=local_pg.free_port(), options={"wal_level": "logical", "fsync": "off"})
    try:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA bp")
            conn.execute("CREATE TABLE bp.a (id bigint PRIMARY KEY, v text)")
            conn.execute("CREATE TABLE bp.b (id bigint PRIMARY KEY, v text)")
        src = PostgresSource(server.url, name="bp", tables=["bp.*"])
        src.ensure_setup()
        others = lambda table, lsn: table != "bp.a"  # noqa: E731 - the replicator's wanted(): a is paused
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("INSERT INTO bp.a VALUES (0, 'x')")
            conn.execute("INSERT INTO bp.b VALUES (0, 'x')")
            first = src.read(0)
            paused_at = first.end
            src.ack(paused_at)
            t0 = time.monotonic()
            for table in ("a", "b"):
                conn.execute(f"INSERT INTO bp.{table} SELECT g, repeat('v', 40) || g FROM generate_series(1, %s) g",
                             (args.rows,))
            print(f"backlog: {args.rows:,} rows into each of a and b in {time.monotonic() - t0:.1f} s")
            t0 = time.monotonic()
            caught = src.read(paused_at, max_changes=10**12, wanted=others)  # b's backlog, applied by the others
            b_at = caught.end
            print(f"the others read b's backlog once: {sum(tx.rows for tx in caught):,} changes in "
                  f"{time.monotonic() - t0:.1f} s")
            del caught

            def units(after: int, offset: int, ack: bool = False) -> tuple[float, int]:
                took = []
                for n in range(args.units):
                    conn.execute("INSERT INTO bp.b VALUES (%s, 'new')", (10**12 + offset + n,))
                    t = time.monotonic()
                    got = src.read(after, wanted=others)
                    took.append(time.monotonic() - t)
                    assert sum(tx.rows for tx in got) == 1, got
                    after = got.end
                    if ack:
                        src.ack(after)
                return sum(took) / len(took), after

            # PostgreSQL moves a slot's restart position at the next running-transactions record
            # after its acknowledged one (every 15 s of activity, or a checkpoint); a long-lived
            # source has them, this short run asks for one
            conn.execute("CHECKPOINT")
            held_s, b_at = units(b_at, 0)  # the main slot held at the paused replica's position
            held_wal = src.position().retained_bytes
            assert src.park("bench.a", paused_at) is None
            src.ack(b_at)
            conn.execute("CHECKPOINT")
            _, b_at = units(b_at, 10 * args.units, ack=True)  # the first read past the checkpoint moves the restart position
            src.ack(b_at)
            parked_s, b_at = units(b_at, args.units, ack=True)
            slot = src.parked_slot("bench.a")
            pos, parked = src.position(), src.parked()[slot]
            print(f"per unit of the others, held:   {held_s * 1000:8.1f} ms  (main slot holds {held_wal:,} bytes of WAL)")
            print(f"per unit of the others, parked: {parked_s * 1000:8.1f} ms  (main slot holds {pos.retained_bytes:,} bytes; "
                  f"the parked slot {parked.retained_bytes:,})")
            print(f"ratio held/parked: {held_s / parked_s:.1f}x")
            t0 = time.monotonic()
            backlog = src.read(paused_at, slot=slot, max_changes=10**12, wanted=lambda table, lsn: table == "bp.a")
            print(f"the parked replica's catch-up read: {sum(tx.rows for tx in backlog):,} changes in "
                  f"{time.monotonic() - t0:.1f} s")
        src.drop()
    finally:
        local_pg.stop(base)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
