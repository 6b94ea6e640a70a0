"""bench/freshness.py's reading of the Delta logs (JVM-free, deltalake): rows by id, a hop by the
base version each destination unit read, and a chain that follows both."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, write_deltalake

ROOT = Path(__file__).resolve().parents[2]


def _bench():  # noqa: ANN202 - the bench script as a module
    spec = importlib.util.spec_from_file_location("freshness_bench", ROOT / "bench" / "freshness.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _unit(path: Path, ids: list[int], base: str, read: int) -> None:
    meta = json.dumps({"topic": "t", "base": base, "source_version": read, "seq": 1})
    write_deltalake(str(path), pa.table({"id": pa.array(ids, pa.int64())}), mode="append",
                    commit_properties=CommitProperties(custom_metadata={"userMetadata": meta}))


def test_rows_hops_and_a_chain_from_the_delta_logs(tmp_path: Path) -> None:
    fb = _bench()
    src, fact, mart = tmp_path / "src", tmp_path / "fact", tmp_path / "mart"
    for ids in ([1, 2], [3], [4]):  # source versions 0, 1, 2
        write_deltalake(str(src), pa.table({"id": pa.array(ids, pa.int64())}), mode="append")
    _unit(fact, [1, 2, 3], "stage.src", 1)  # fact v0: read the source at v1 (rows 1-3)
    _unit(fact, [4], "stage.src", 2)  # fact v1
    _unit(mart, [0], "fact.x", 0)  # mart v0: read fact v0
    _unit(mart, [0], "other.table", 5)  # another input's unit: not a unit of this hop

    rows = fb.landed_at(str(fact), 0)
    assert {i: v for i, (_, v) in rows.items()} == {1: 0, 2: 0, 3: 0, 4: 1}
    commits = fb.data_commits(str(fact), 0)
    assert [c.version for c in commits] == [0, 1] and commits[0].meta["source_version"] == 1
    reach = fb.reached_version("stage.src", commits)
    assert [reach(v)[1] if reach(v) else None for v in (0, 1, 2, 3)] == [0, 0, 1, None]
    follow = fb.reached_version("fact.x", fb.data_commits(str(mart), 0))
    assert follow(0)[1] == 0 and follow(1) is None  # fact v1 (row 4) has not reached the mart yet
    assert fb.data_commits(str(tmp_path / "none"), 0) == []
    assert fb.data_commits(str(src), 10**15) == []  # the window starts after every commit


def test_the_streaming_baseline_runs_the_demos_own_sql_on_delta_paths() -> None:
    spec = importlib.util.spec_from_file_location("streaming_chain", ROOT / "bench" / "streaming_chain.py")
    assert spec and spec.loader
    sc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sc)
    paths = {"dim.customers": "/w/dim/customers", "fact.orders": "/w/fact/orders"}
    orders = sc._sql("fact_orders.sql", paths)
    assert "LEFT JOIN delta.`/w/dim/customers` c ON" in orders and "dim.customers c" not in orders
    assert "LEFT JOIN delta.`/w/fact/orders` o ON" in sc._sql("fact_order_items.sql", paths)
    assert json.loads(sc._meta("fact.order_items", 7)) == {"base": "fact.order_items", "source_version": 7}
    fb = _bench()
    assert set(fb.MODES) == {"runs", "follow", "dagster", "streaming"}
