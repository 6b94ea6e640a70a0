"""The demo's source data: a small shop's stage layer, appended in ``(pos, id)`` order as an
OLTP loader would (written with ``deltalake``; the pipeline itself runs on Spark)."""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from resources.core.settings import Settings
from resources.storage.delta_log import open_table
from resources.storage.warehouse import storage_options

COUNTRIES = ["DE", "FR", "NL", "PL", "ES", "IT", "SE"]
SEGMENTS = ["consumer", "business", "vip"]
_TS = pa.timestamp("us", tz="UTC")


@dataclass
class ShopFeeder:
    """Appends customers, orders and order lines; ids continue from what the tables hold."""

    settings: Settings
    seed: int = 7

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def _next_ids(self, table: str, key: str) -> tuple[int, int]:
        t = open_table(self.settings.table_path(table))
        if t is None:
            return 1, 1
        data = t.to_pyarrow_table(columns=["id", key])
        ids = [v for v in data.column("id").to_pylist() if v is not None]
        keys = [v for v in data.column(key).to_pylist() if v is not None]
        return (max(ids) + 1 if ids else 1), (max(keys) + 1 if keys else 1)

    def _write(self, table: str, rows: list[dict], schema: pa.Schema) -> None:
        from deltalake import write_deltalake

        for r in rows:
            if r["pos"] is not None:
                r["pos"] = r["pos"].replace(tzinfo=dt.UTC)
        path = self.settings.table_path(table)
        write_deltalake(path, pa.Table.from_pylist(rows, schema=schema), mode="append", storage_options=storage_options(path))

    def append(self, *, orders: int, start: dt.datetime, end: dt.datetime, new_customers: int = 0,
               bad_rows: int = 0, late: int = 0) -> dict[str, int]:
        """Append ``orders`` orders (2-3 lines each) with positions spread over ``[start, end]``
        (several rows share a timestamp, as bursts do), ``new_customers`` customers,
        ``bad_rows`` orders with a null ``pos``, and ``late`` orders whose position lies an hour
        before ``start`` (out of order: both kinds end up in etl.quarantine)."""
        rng = self.rng
        cust_id, next_customer = self._next_ids("stage.customers", "customer_id")
        order_row, next_order = self._next_ids("stage.orders", "order_id")
        item_row, _ = self._next_ids("stage.order_items", "order_id")
        customers = []
        for i in range(new_customers):
            customers.append({"pos": start - dt.timedelta(minutes=5) + dt.timedelta(seconds=i), "id": cust_id + i,
                              "customer_id": next_customer + i, "name": f"customer {next_customer + i}",
                              "country": rng.choice(COUNTRIES), "segment": rng.choice(SEGMENTS)})
        known_customers = max(1, next_customer - 1 + new_customers)
        # The CRM feed is live: a customer changes at the batch's newest instant, so the
        # customer dimension is fresh up to the orders that reference it (fact.orders waits
        # for dim.customers to be fresh up to each block's end).
        customers.append({"pos": end, "id": cust_id + new_customers, "customer_id": rng.randint(1, known_customers),
                          "name": "updated", "country": rng.choice(COUNTRIES), "segment": rng.choice(SEGMENTS)})
        span = (end - start).total_seconds()
        # Bursts: timestamps are drawn at 1-second granularity, so many orders share one.
        stamps = sorted(start + dt.timedelta(seconds=int(rng.random() * span)) for _ in range(orders))
        stamps = [start - dt.timedelta(hours=1)] * late + stamps
        orders += late
        order_rows: list[dict[str, Any]] = []
        item_rows: list[dict[str, Any]] = []
        for n, pos in enumerate(stamps):
            oid = next_order + n
            order_rows.append({"pos": pos, "id": order_row + n, "order_id": oid,
                               "customer_id": rng.randint(1, known_customers), "status": rng.choice(["paid", "paid", "new", "shipped"])})
            for _ in range(rng.randint(2, 3)):
                item_rows.append({"pos": pos + dt.timedelta(milliseconds=rng.randint(1, 900)), "id": 0, "order_id": oid,
                                  "sku": f"SKU-{rng.randint(1, 300):04d}", "qty": rng.randint(1, 4),
                                  "price": round(rng.uniform(2, 120), 2)})
        item_rows.sort(key=lambda r: r["pos"])
        for k, r in enumerate(item_rows):
            r["id"] = item_row + k
        for b in range(bad_rows):
            order_rows.append({"pos": None, "id": order_row + orders + b, "order_id": next_order + orders + b,
                               "customer_id": 1, "status": "broken"})
        if customers:
            self._write("stage.customers", customers, pa.schema([("pos", _TS), ("id", pa.int64()), ("customer_id", pa.int64()),
                                                                 ("name", pa.string()), ("country", pa.string()), ("segment", pa.string())]))
        self._write("stage.orders", order_rows, pa.schema([("pos", _TS), ("id", pa.int64()), ("order_id", pa.int64()),
                                                          ("customer_id", pa.int64()), ("status", pa.string())]))
        self._write("stage.order_items", item_rows, pa.schema([("pos", _TS), ("id", pa.int64()), ("order_id", pa.int64()),
                                                              ("sku", pa.string()), ("qty", pa.int32()), ("price", pa.float64())]))
        return {"customers": new_customers, "customer_changes": len(customers) - new_customers, "orders": orders - late, "order_items": len(item_rows),
                "null_pos_orders": bad_rows, "late_orders": late}
