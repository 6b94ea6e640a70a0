"""The CDC part of ``tidemark demo`` (issue 10): a throw-away PostgreSQL under the state dir,
a customers table replicated into ``crm.customers`` (snapshot, then the slot), inserts, updates
(one changes a key), deletes and an added column, and the replica compared with the source."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

DSN_ENV = "TIDEMARK_DEMO_CRM_DSN"


def run(engine: Any) -> bool:
    """Run the CDC demo on ``engine`` (its lineage has the ``crm`` replicator); True if the replica
    ends equal to the source."""
    import psycopg

    from platform_assets.cdc.run import run_replicator
    from resources.state import local_pg

    rep = engine.lineage.replicators.get("crm")
    if rep is None:
        print("   (the lineage has no 'crm' replicator: CDC demo skipped)")
        return True
    home = engine.settings.home / "cdc-demo"
    t0 = time.monotonic()
    local_pg.stop(home)  # a server a killed demo left behind
    shutil.rmtree(home, ignore_errors=True)  # throw-away: a fresh server every demo
    server = local_pg.start(home, port=local_pg.free_port(), options={"wal_level": "logical", "fsync": "off"})
    try:
        url = server.url
        os.environ[DSN_ENV] = url
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE customers (id int PRIMARY KEY, name text NOT NULL, country text)")
            conn.execute("INSERT INTO customers SELECT g, 'customer ' || g, (ARRAY['DE','FR','US'])[1 + g % 3] "
                         "FROM generate_series(1, 100) g")
        print(f"   PostgreSQL {url} (wal_level=logical): public.customers with 100 rows")

        def unit(what: str) -> None:
            for r in run_replicator(engine, rep, until_caught_up=True):
                if r.processed:
                    counts = "; ".join(f"{t}: " + ", ".join(f"{k} {v}" for k, v in c.items() if v) for t, c in r.tables.items())
                    snaps = "; ".join(f"{t}: snapshot of {n} rows" for t, n in r.snapshots.items())
                    print(f"   {what}: {r.reason} ({snaps or counts}, {r.duration_s:.1f}s)")

        unit("replicate")
        with psycopg.connect(url, autocommit=True) as conn:
            with conn.transaction():
                conn.execute("INSERT INTO customers VALUES (101, 'new customer', 'IT'), (102, 'another', 'ES')")
                conn.execute("UPDATE customers SET country = 'NL' WHERE id BETWEEN 1 AND 10")
            conn.execute("UPDATE customers SET id = 1001 WHERE id = 11")  # a key change
            conn.execute("DELETE FROM customers WHERE id IN (12, 13, 14)")
            conn.execute("ALTER TABLE customers ADD COLUMN tier int")  # captured in order with the data
            conn.execute("UPDATE customers SET tier = 1 WHERE country = 'NL'")
        print("   source changed: 2 inserts, 10 updates, 1 key change (11 -> 1001), 3 deletes, column 'tier' added")
        unit("apply")
        with psycopg.connect(url) as conn:
            source = sorted(conn.execute("SELECT id, name, country, tier FROM customers").fetchall())
        rows = engine.spark.read.format("delta").load(engine.settings.table_path("crm.customers"))
        replica = sorted(tuple(r) for r in rows.select("id", "name", "country", "tier").collect())
        same = source == replica
        print(f"check: crm.customers ({len(replica)} rows) {'equals' if same else 'DIFFERS FROM'} the source table "
              f"({len(source)} rows), id 11 moved to 1001: {any(r[0] == 1001 for r in replica)}, "
              f"tier replicated: {sum(r[3] == 1 for r in replica)} rows -> {'OK' if same else 'MISMATCH'} "
              f"({time.monotonic() - t0:.0f}s)")
        return same
    finally:
        local_pg.stop(home)
        shutil.rmtree(home, ignore_errors=True)
