"""End-to-end CDC throughput from PostgreSQL: writers at rising rates until the replicas' lag grows without bound (issue 19, part 5).

A throw-away PostgreSQL (``wal_level=logical``) with three pgbench-like tables (``accounts``,
``tellers``, ``history``), ``--rows`` rows each, copied by the cdc processor's snapshot (untimed).
Then writer threads commit transactions of ``--per-tx`` row changes: a third to each table; in
``accounts`` and ``tellers`` 30 % of the changes move a row to a new key and 70 % update it (20 % key
changes overall), ``history`` gets inserts. The rate steps up through ``--rates`` (changes/s, each
for ``--step-seconds``) while the replicator runs its units back to back (``maxstep`` changes each),
as ``tidemark cdc run`` does. Before the first step the writers run at the first rate for
``--warmup-seconds`` (30), not counted: a cold JVM's first MERGEs took up to 11 s, which in a 40 s
step decided its p95. ``TIDEMARK_CDC_APPLY_THREADS=1`` measures the replicas applied one after another.

``--mode runs`` (default) runs the units back to back in the bench's thread; ``--mode follow`` runs
them as ``tidemark follow`` does (issue 55): a :class:`~platform_assets.follow.loop.Follower` of the
replicator on the same Spark session, looking at the source's WAL position every 0.5 s and running
a unit when it moved, while the bench's thread only paces the writers.

Lag per source transaction: the end of the unit that applied it minus its commit time in the WAL
(an upper bound: the replica's Delta commit is a little earlier). Per step: the rate the writers
reached, the lag p50/p95/max of the transactions committed in it; a step whose lag p95 reaches 10 s
ends the climb (the lag grows without bound past it). At the end the writers stop, the replicator
drains, and every replica is compared with its table (row count and a checksum; exit 1 if any
differs). Targets (issue 19): at least 20,000 changes/s held with lag p95 < 10 s; at 5,000 changes/s
lag p95 < 5 s. On 2 cores the writers reach about 17,800 changes/s with 30-change transactions;
``--per-tx 90`` lets them offer more.

    PYTHONPATH=. .venv/bin/python bench/cdc_throughput.py [--rates 1000,2500,5000,10000,20000] [--step-seconds 45]
        [--mode runs|follow]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.shared import BenchError, observed_replicator, throwaway_postgres  # noqa: E402
from platform_assets.follow.loop import Follower  # noqa: E402
from resources.core.settings import Settings  # noqa: E402

TABLES = ("accounts", "tellers", "history")
KEYED = ("accounts", "tellers")  # updates and key changes; history takes inserts
HELD_P95_S = 10.0


@dataclass
class Pace:
    """The writers' target rate (changes/s), changed by the main thread step by step."""

    rate: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)
    written: int = 0
    txs: int = 0  # source transactions committed
    lock: threading.Lock = field(default_factory=threading.Lock)


def writer(url: str, w: int, writers: int, rows: int, per_tx: int, pace: Pace, errors: list[str]) -> None:
    """Transactions of ``per_tx`` changes on the keys ``id % writers == w`` (writers never touch one row)."""
    import psycopg

    rnd = random.Random(1000 + w)
    live = {t: [k for k in range(1, rows + 1) if k % writers == w] for t in KEYED}
    next_id = {t: rows + 1 + ((w - rows - 1) % writers) for t in (*KEYED, "history")}
    third = max(1, per_tx // 3)
    done = 0
    t_rate, rate_at = time.monotonic(), 0.0
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            while not pace.stop.is_set():
                rate = pace.rate / writers
                if rate <= 0:
                    time.sleep(0.05)
                    continue
                if rate != rate_at:  # a new step: pace from now
                    t_rate, rate_at, done = time.monotonic(), rate, 0
                if (wait := t_rate + done / rate - time.monotonic()) > 0:
                    time.sleep(min(wait, 0.2))
                    continue
                with conn.transaction():
                    for t in KEYED:
                        picked = rnd.sample(range(len(live[t])), third)
                        moves = [i for i in picked if rnd.random() < 0.3]
                        moved = set(moves)
                        updates = [live[t][i] for i in picked if i not in moved]
                        if updates:
                            conn.execute(f"UPDATE bt.{t} SET balance = balance + 1, note = 'u' WHERE id = ANY(%s)",
                                         (updates,))
                        if moves:
                            old = [live[t][i] for i in moves]
                            new = []
                            for i in moves:
                                new.append(next_id[t])
                                live[t][i] = next_id[t]
                                next_id[t] += writers
                            conn.execute(f"UPDATE bt.{t} SET id = m.new, note = 'k' FROM unnest(%s::bigint[], %s::bigint[]) "
                                         f"AS m(old, new) WHERE bt.{t}.id = m.old", (old, new))
                    ids = [next_id["history"] + j * writers for j in range(third)]
                    next_id["history"] += third * writers
                    conn.execute("INSERT INTO bt.history SELECT g, 1, 'h' FROM unnest(%s::bigint[]) g", (ids,))
                done += 3 * third
                with pace.lock:
                    pace.written += 3 * third
                    pace.txs += 1
    except Exception as exc:  # noqa: BLE001 - reported by the main thread
        errors.append(f"writer {w}: {type(exc).__name__}: {exc}")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rates", default="1000,2500,5000,10000,20000", help="changes/s, one step each, rising")
    p.add_argument("--step-seconds", type=float, default=45.0)
    p.add_argument("--warmup-seconds", type=float, default=30.0,
                   help="the first rate for this long before the first step, not counted (a cold JVM's first MERGEs)")
    p.add_argument("--rows", type=int, default=100_000, help="rows of each table before the load")
    p.add_argument("--per-tx", type=int, default=30, help="row changes per source transaction")
    p.add_argument("--writers", type=int, default=2, help="writer threads (connections)")
    p.add_argument("--maxstep", type=int, default=100_000, help="the replicator's maxstep (changes per unit)")
    p.add_argument("--driver-memory", default="4g")
    p.add_argument("--keep", action="store_true", help="keep the temp dir")
    p.add_argument("--mode", choices=("runs", "follow"), default="runs",
                   help="runs: units back to back in the bench's thread; follow: a Follower runs them as they are due")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    os.environ["TIDEMARK_DRIVER_MEMORY"] = args.driver_memory

    import psycopg

    from platform_assets.cdc.replicator import ReplicatorUnit
    from resources.spark.session import build_spark_session

    with throwaway_postgres("tidemark-bench-cdc-tp-", keep=args.keep) as (base, server):
        failed = False
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA bt")
            for tname in TABLES:
                conn.execute(f"CREATE TABLE bt.{tname} (id bigint PRIMARY KEY, balance bigint, note text)")
                conn.execute(f"INSERT INTO bt.{tname} SELECT g, 0, 'n' FROM generate_series(1, %s) g", (args.rows,))
        lineage = base / "lineage.yaml"
        lineage.write_text(f"cdc:\n  - name: bt\n    dsn_env: TIDEMARK_BENCH_CDC_DSN\n    tables: [bt.*]\n"
                           f"    schema: r_bt\n    maxstep: {args.maxstep}\n")
        os.environ["TIDEMARK_BENCH_CDC_DSN"] = server.url
        settings = Settings.from_env({}, home=base / "home", lineage=lineage, spark_master="local[2]")
        spark = build_spark_session(settings, app_name="tidemark-bench-cdc-throughput")
        engine, rep, source, seen = observed_replicator(settings, "bt", spark, "bench-throughput")
        lags: list[tuple[float, float]] = []  # (source commit time, lag s)
        landed: set[int] = set()  # the LSNs of the source transactions applied
        units: list[tuple[float, int]] = []  # (duration s, changes)

        def applied(result: Any, duration_s: float, now: float) -> None:
            if result.tables:
                units.append((duration_s, result.changes))
                for tx in seen:
                    c = tx.commit_time.replace(tzinfo=dt.UTC).timestamp()
                    lags.append((c, now - c))
                    landed.add(tx.lsn)
            seen.clear()

        def unit() -> bool:
            t = time.monotonic()
            result = ReplicatorUnit(engine, rep, source).run_once()
            applied(result, time.monotonic() - t, time.time())
            return result.processed

        follower: Follower | None = None
        follow_stop, follow_errors = threading.Event(), list[str]()
        busy = [time.monotonic()]  # when the follower's last unit that did work ended

        def followed(event: Any) -> None:
            if event.error is not None:
                follow_errors.append(f"{event.work}: {type(event.error).__name__}: {event.error}")
            elif event.result is not None:
                applied(event.result, event.result.duration_s, event.at)
                busy[0] = time.monotonic()

        def apply_for(seconds: float, start: float, stopped: Callable[[], bool]) -> None:
            """Units for ``seconds`` from ``start`` (epoch): back to back, or the follower's."""
            while time.time() - start < seconds and not stopped():
                if follower is not None:
                    time.sleep(0.2)
                    if follow_errors:
                        raise BenchError("follow: " + "; ".join(follow_errors))
                elif not unit():
                    time.sleep(0.2)

        def drain() -> None:
            if follower is None:
                while unit():
                    pass
                return
            # every transaction the writers committed applied (a unit still running when the follower
            # last reported has not reported them yet), then no work for 5 s
            deadline = time.monotonic() + 600
            while (len(landed) < pace.txs or time.monotonic() - busy[0] < 5.0) and time.monotonic() < deadline:
                if follow_errors:
                    raise BenchError("follow: " + "; ".join(follow_errors))
                time.sleep(0.2)

        try:
            t = time.monotonic()
            while unit():
                pass
            lags.clear()
            units.clear()
            landed.clear()
            print(f"snapshot: 3 tables of {args.rows:,} rows in {time.monotonic() - t:.1f} s (untimed)", flush=True)
            if args.mode == "follow":
                follower = Follower(settings, engine.lineage, names=["cdc:bt"], spark=spark, report=followed)
                follower._sources["cdc:bt"] = source  # the observed source (its reads give each unit's transactions)
                threading.Thread(target=follower.run, args=(follow_stop,), daemon=True, name="bench-follower").start()
                print(f"mode follow: a Follower of cdc:bt on the bench's Spark session ({follower.threads} thread(s), "
                      f"looks every {follower.interval_s} s)", flush=True)
            pace, errors = Pace(), list[str]()
            threads = [threading.Thread(target=writer, args=(server.url, w, args.writers, args.rows, args.per_tx, pace,
                                                             errors), daemon=True) for w in range(args.writers)]
            for th in threads:
                th.start()
            if args.warmup_seconds > 0 and rates:
                start, w0 = time.time(), pace.written
                pace.rate = rates[0]
                apply_for(args.warmup_seconds, start, lambda: bool(errors))
                print(f"warm-up: {pace.written - w0:,} changes at {rates[0]:,.0f}/s in {time.time() - start:.0f} s, "
                      f"{len(units)} units (not counted)", flush=True)
                units.clear()  # (a step counts the transactions committed in it: none of these)
            steps: list[tuple[float, float, float, float]] = []  # (rate, start, end, written)
            print(f"{'target/s':>9} {'written/s':>10} {'txs':>7} {'lag p50':>8} {'p95':>7} {'max':>7}  verdict", flush=True)
            try:
                for rate in rates:
                    start, w0 = time.time(), pace.written
                    pace.rate = rate
                    apply_for(args.step_seconds, start, lambda: bool(errors))
                    end = time.time()
                    steps.append((rate, start, end, pace.written - w0))
                    in_step = [lag for c, lag in lags if start <= c < end]
                    # transactions of this step still waiting count with their age so far
                    held = pct(in_step, 95) < HELD_P95_S if in_step else False
                    print(f"{rate:>9,.0f} {(pace.written - w0) / (end - start):>10,.0f} {len(in_step):>7,} "
                          f"{pct(in_step, 50):>7.1f}s {pct(in_step, 95):>6.1f}s {max(in_step, default=float('nan')):>6.1f}s  "
                          f"{'held' if held else 'NOT held (lag p95 >= 10 s or nothing applied)'}", flush=True)
                    if errors:
                        raise BenchError("; ".join(errors))
                    if not held:
                        break
            finally:
                pace.stop.set()
                for th in threads:
                    th.join()
            t = time.monotonic()
            drain()
            print(f"drained the rest in {time.monotonic() - t:.1f} s", flush=True)
            if follower is not None:
                follow_stop.set()
                time.sleep(1.0)  # (its loop ends within one look)
            # lags per step again, now that every transaction of every step is applied
            results = []
            for rate, start, end, written in steps:
                in_step = [lag for c, lag in lags if start <= c < end]
                results.append((rate, written / (end - start), pct(in_step, 95), len(in_step)))
            with psycopg.connect(server.url) as conn:
                for tname in TABLES:
                    src = conn.execute(f"SELECT count(*), coalesce(sum(id * 7 + balance), 0) FROM bt.{tname}").fetchone()
                    got = spark.read.format("delta").load(settings.table_path(f"r_bt.bt__{tname}")).selectExpr(
                        "count(*)", "coalesce(sum(id * 7 + balance), 0)").first()
                    same = src is not None and got is not None and (int(src[0]), int(src[1])) == (int(got[0]), int(got[1]))
                    print(f"replica r_bt.bt__{tname}: {int(got[0]) if got else 0:,} rows, "
                          + ("equal to the source" if same else f"DIFFERS from the source {src}"))
                    failed = failed or not same
            print(f"units: {len(units)}, changes per unit p50 {pct([c for _, c in units], 50):,.0f}, "
                  f"unit time p50 {pct([d for d, _ in units], 50):.1f} s, max {max((d for d, _ in units), default=0):.1f} s")
            ok = [r for r in results if r[2] < HELD_P95_S and r[1] >= 0.9 * r[0]]
            best = max(ok, key=lambda r: r[1], default=None)
            print("highest rate held with lag p95 < 10 s: "
                  + (f"{best[1]:,.0f} changes/s (step {best[0]:,.0f}/s, p95 {best[2]:.1f} s)" if best else "none")
                  + f" -> target 20,000: {'MET' if best and best[1] >= 20_000 else 'MISSED'}")
            at5k = next((r for r in results if r[0] == 5000), None)
            print("at 5,000 changes/s: " + (f"lag p95 {at5k[2]:.1f} s -> target < 5 s: "
                                            f"{'MET' if at5k[2] < 5 else 'MISSED'}" if at5k else "not reached"))
        finally:
            follow_stop.set()
            if follower is not None:
                follower._sources.clear()  # (the bench closes its source below)
                follower.close()
            source.close()
            engine.close()
            spark.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
