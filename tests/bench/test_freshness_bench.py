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
    assert set(fb.MODES) == {"runs", "follow", "dagster", "streaming", "streaming-wait", "streaming-naive"}
    assert set(fb.STREAMING_JOINS) == set(fb.MODES) - {"runs", "follow", "dagster"}
    joined = sc._stream_join_sql(5.0)  # the order lines meet fact.orders as a stream, within the delay
    assert "LEFT JOIN orders_stream o ON o.order_id = i.order_id\n  AND o.pos BETWEEN i.pos - INTERVAL 5 seconds " \
           "AND i.pos + INTERVAL 5 seconds" in joined and "fact.orders" not in joined


def test_the_lines_check_counts_order_lines_without_their_orders_customer(tmp_path: Path) -> None:
    from resources.core.settings import Settings

    fb = _bench()
    settings = Settings.from_env({}, home=tmp_path / "home")
    write_deltalake(settings.table_path("fact.orders"), pa.table({
        "order_id": pa.array([1, 2, 3], pa.int64()), "customer_id": pa.array([10, 20, None], pa.int64()),
        "country": pa.array(["DE", "FR", None])}))
    items = {"order_id": pa.array([1, 1, 2, 3, 4], pa.int64()), "customer_id": pa.array([10, 10, 20, None, None], pa.int64()),
             "country": pa.array(["DE", "DE", "FR", None, None])}
    write_deltalake(settings.table_path("fact.order_items"), pa.table(items))
    # (order 3 has no customer itself, order 4 never came: neither line is wrong)
    assert fb.lines_check(settings) == "fact.order_items: 5 order lines, each with its order's customer and country"
    wrong = {**items, "customer_id": pa.array([10, None, 20, None, None], pa.int64()),
             "country": pa.array(["DE", None, "XX", None, None])}
    write_deltalake(settings.table_path("fact.order_items"), pa.table(wrong), mode="overwrite")
    assert fb.lines_check(settings).startswith("fact.order_items: 5 order lines, 2 WITHOUT their order's customer")
