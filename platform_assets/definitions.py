"""The Dagster code location built from the lineage (``workspace.yaml`` loads it).

* every source table is an external asset, so the graph shows where data comes from;
* every destination table is an asset (key ``[schema, table]``, group per schema, kinds
  spark/delta). A table built by step topics is partitioned by block, with dynamic partitions
  whose keys name the block (``00000012``). A materialization processes exactly the planned
  ``(last, next]`` of that block, and redoing a committed block is a no-op. Tables built by
  reload topics are unpartitioned;
* the ``tidemark_planner`` sensor plans blocks and requests their runs;
* a concurrency pool per table (``tidemark/<table>``; ``dagster.yaml`` limits each to 1).

Nothing heavy happens at import: the lineage loader is pure Python, and Spark starts only
inside a materialization.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from lineage.loader import load_lineage
from lineage.partitions import parse_block_key, partitions_name
from lineage.spec import Lineage, Processor
from platform_assets.sensors import build_planner_sensor
from resources.settings import Settings


def asset_key(table: str) -> dg.AssetKey:
    return dg.AssetKey(table.split(".", 1))


def _block_metadata(r: Any) -> dict[str, Any]:
    stats = r.stats or {}
    meta: dict[str, Any] = {
        "rows": r.rows, "base_rows": r.base_rows, "bad_rows": r.bad_rows,
        "delta_version": r.delta_version, "duration_s": round(r.duration_s, 3),
        "recovered": r.recovered,
    }
    if r.block is not None:
        meta.update({"block": r.block.seq, "last": r.block.last.to_text(), "next": r.block.next.to_text()})
    for k in ("min_ts", "max_ts"):
        if stats.get(k) is not None:
            meta[k.replace("ts", "pos")] = stats[k].isoformat()
    if stats.get("max_lag") is not None:
        meta["lag_s"] = float(stats["max_lag"])
    return meta


def _step_compute(settings: Settings, lineage: Lineage, topics: list[str]) -> Any:
    def compute(context):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202 - Dagster inspects the signature
        from platform_assets.engine import Engine

        topic, seq = parse_block_key(context.partition_key)
        topic = topic or topics[0]
        engine = Engine(settings, lineage)
        try:
            r = engine.run_block(topic, seq)
        finally:
            engine.close()
        if not r.processed:
            context.log.info(f"{topic}: {r.reason}")
            return dg.MaterializeResult(metadata={"topic": topic, "block": seq, "note": r.reason})
        context.log.info(f"{topic}: block {seq} wrote {r.rows} rows (Delta version {r.delta_version})")
        return dg.MaterializeResult(metadata={"topic": topic, **_block_metadata(r)})

    return compute


def _reload_compute(settings: Settings, lineage: Lineage, topic: str) -> Any:
    def compute(context):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202 - Dagster inspects the signature
        from platform_assets.engine import Engine

        engine = Engine(settings, lineage)
        try:
            r = engine.run_topic(topic)
        finally:
            engine.close()
        context.log.info(f"{topic}: {r.reason}")
        return dg.MaterializeResult(metadata={"topic": topic, "note": r.reason, **(_block_metadata(r) if r.processed else {})})

    return compute


def build_definitions(settings: Settings | None = None) -> dg.Definitions:
    settings = settings or Settings.from_env()
    lineage = load_lineage(settings.lineage)
    sources = [
        dg.AssetSpec(asset_key(s.name), group_name=s.name.split(".")[0], kinds={"delta"},
                     description=s.spec.comment or f"source table {s.name}")
        for s in lineage.sources.values()
    ]
    by_table: dict[str, list[str]] = {}
    for t in lineage.topics.values():
        by_table.setdefault(t.spec.destination, []).append(t.name)
    assets = []
    for table, topics in by_table.items():
        specs = [lineage.topic(n).spec for n in topics]
        step = specs[0].processor is Processor.STEP
        deps = sorted({d for sp in specs for d in sp.depends_on})
        assets.append(dg.asset(
            key=asset_key(table),
            deps=[asset_key(d) for d in deps],
            group_name=table.split(".")[0],
            kinds={"spark", "delta"},
            description="; ".join(sp.comment for sp in specs if sp.comment) or f"built by {', '.join(topics)}",
            metadata={"topics": ", ".join(topics), "processor": specs[0].processor.value,
                      "location": settings.table_path(table)},
            partitions_def=dg.DynamicPartitionsDefinition(name=partitions_name(table)) if step else None,
            pool=f"tidemark/{table}",
        )(_step_compute(settings, lineage, topics) if step else _reload_compute(settings, lineage, topics[0])))
    return dg.Definitions(assets=[*sources, *assets], sensors=[build_planner_sensor(settings, lineage)])


defs = build_definitions()
