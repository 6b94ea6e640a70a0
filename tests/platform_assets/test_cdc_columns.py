"""The cdc processor's columnar path (the source's ``read_columns`` and :mod:`lineage.cdc.columns`)
lands what the change-by-change path lands: the same replica rows, sequence numbers, commit times,
counts and units, on random Debezium events over keyed tables, in several units."""

from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Any

import pytest

from lineage.cdc import columns as cdc_columns
from resources.cdc.debezium import DebeziumFileSource
from resources.core.settings import Settings
from tests.platform_assets.shop import tidemark
from tests.platform_assets.test_cdc import event, replica, run, write_events

pytestmark = pytest.mark.spark


def random_events(rng: random.Random, n: int) -> list[str]:
    """Inserts, updates (same key, key changes with before-images), deletes and tombstones over two
    keyed tables (one with a two-column key) with small key spaces, in transactions of 1-4 events."""
    lines: list[str] = []
    live: dict[str, set[tuple]] = {"orders": set(), "lines": set()}
    tx = 1
    for i in range(n):
        table = rng.choice(["orders", "lines"])
        cols = ("id",) if table == "orders" else ("order_id", "line")

        def key() -> tuple:
            return (rng.randrange(30),) if table == "orders" else (rng.randrange(8), rng.choice("abc"))  # noqa: B023

        def row(k: tuple) -> dict[str, Any]:
            return {**dict(zip(cols, k, strict=True)), "note": rng.choice(["x", "y", None]),  # noqa: B023
                    "amount": rng.randrange(1000) / 4}  # never null: a first null makes the column a string (no schema)

        op = rng.random()
        if op < 0.35 or not live[table]:
            k = key()
            lines.append(event(table, "c", tx, after=row(k), key=dict(zip(cols, k, strict=True))))
            live[table].add(k)
        elif op < 0.8:
            old = rng.choice(sorted(live[table]))
            new = key() if rng.random() < 0.25 else old
            lines.append(event(table, "u", tx, before=dict(zip(cols, old, strict=True)) if rng.random() < 0.7 or new != old
                               else None, after=row(new), key=dict(zip(cols, new, strict=True))))
            live[table] = (live[table] - {old}) | {new}
        else:
            old = rng.choice(sorted(live[table]))
            lines.append(event(table, "d", tx, before=dict(zip(cols, old, strict=True)), key=dict(zip(cols, old, strict=True))))
            if rng.random() < 0.5:
                lines.append('{"key": {"id": 0}, "value": null}')  # a tombstone after a delete
            live[table].discard(old)
        if rng.random() < 0.4 or i == n - 1:
            tx += 1
    return lines


def lineage(settings: Settings, root: Path, maxstep: int) -> Settings:
    (root / "events").mkdir(parents=True, exist_ok=True)
    path = root / "lineage.yaml"
    path.write_text(f"cdc:\n  - name: shop\n    source: debezium\n    path: events\n    tables: [public.*]\n"
                    f"    maxstep: {maxstep}\n    options:\n      public.orders: {{key: [id]}}\n"
                    f"      public.lines: {{key: [order_id, line]}}\n")
    # a home of its own (warehouse, offset store, etl.log), as a `tidemark` process started on it sees it
    return Settings.from_env({}, home=root / "home", lineage=path, spark_master=settings.spark_master)


def test_the_columnar_path_lands_what_the_change_by_change_path_lands(spark, settings: Settings, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(190)
    files = [random_events(rng, 120) for _ in range(3)]
    calls = {"columns": 0}
    reduce = cdc_columns.reduce_scd1

    def counted(*a: Any, **kw: Any) -> Any:
        calls["columns"] += 1
        return reduce(*a, **kw)

    monkeypatch.setattr(cdc_columns, "reduce_scd1", counted)
    got: dict[str, Any] = {}
    for path in ("columns", "python"):
        root = tmp_path / path
        s = lineage(settings, root, maxstep=70)
        if path == "python":
            monkeypatch.setattr(DebeziumFileSource, "read_columns", None)
        units = []
        for i, lines in enumerate(files):  # files arrive one by one: several runs, several units each
            write_events(root, f"{i:04}.json", lines)
            units += [(r.unit, r.transactions, r.changes, r.tables) for r in run(spark, s) if r.processed]
        got[path] = (units, {t: (replica(spark, s, t, *cols, "_sequence_num"),  # also what deltalake reads
                                 sorted(tuple(r) for r in spark.read.format("delta").load(s.table_path(t))
                                        .select(*cols, "_commit_ts").collect()))
                             for t, cols in (("replica.orders", ("id", "note", "amount")),
                                             ("replica.lines", ("order_id", "line", "note", "amount")))})
        if path == "columns":
            assert calls["columns"] >= 2 * len(files)  # it took the columnar path
    assert got["columns"] == got["python"]
    assert len(got["columns"][0]) > len(files)  # several units


@pytest.mark.slow
@pytest.mark.parametrize("point", ["cdc-planned", "cdc-written"])  # a replay read as columns; a landed unit found
def test_sigkill_on_the_columnar_path_neither_loses_nor_doubles(settings: Settings, tmp_path: Path, spark,
                                                                 point: str, cli_spark) -> None:
    """Keyed tables only (the columnar path): killed at a crash point of the unit, then run to the end;
    the replicas equal what one uninterrupted change-by-change run lands."""
    lines = random_events(random.Random(7), 150)
    got = {}
    for path in ("crashed", "reference"):
        s = lineage(settings, tmp_path / path, maxstep=40)
        write_events(tmp_path / path, "0001.json", lines)
        if path == "crashed":
            crashed = tidemark(s, "cdc", "run", "shop", env={"TIDEMARK_CRASH_AT": point})
            assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
            done = tidemark(s, "cdc", "run", "shop", "--until-caught-up")
            assert done.returncode == 0, done.stderr[-3000:]
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(DebeziumFileSource, "read_columns", None)
                run(spark, s)
        got[path] = [sorted(tuple(r) for r in spark.read.format("delta").load(s.table_path(t)).collect())
                     for t in ("replica.orders", "replica.lines")]
    assert got["crashed"] == got["reference"]
