"""The Dagster code location built from the lineage (``workspace.yaml`` loads it).

Minimal wiring for now: source tables as external assets, one asset per destination table
whose materialization runs its topics until caught up through the same engine as the CLI, and
a concurrency pool per table. Block partitions, the offset IO manager, planner sensors and
asset checks come with the Dagster platform issue.

Nothing heavy happens at import: the lineage loader is pure Python; Spark starts only inside a
materialization.
"""

from __future__ import annotations

from typing import Any

import dagster as dg

from lineage.loader import load_lineage
from lineage.spec import Lineage
from resources.settings import Settings


def asset_key(table: str) -> dg.AssetKey:
    return dg.AssetKey(table.split(".", 1))


def _materialize(settings: Settings, lineage: Lineage, topics: list[str]) -> Any:
    def compute(context) -> dg.MaterializeResult:  # type: ignore[no-untyped-def]  # noqa: ANN001 - Dagster inspects it
        from platform_assets.engine import Engine

        engine = Engine(settings, lineage)
        try:
            results = engine.run_until_caught_up(topics, on_result=lambda r: context.log.info(f"{r.topic}: {r.reason}"))
        finally:
            engine.close()
        done = [r for r in results if r.processed]
        waits = {r.topic: r.reason for r in results if not r.processed}
        return dg.MaterializeResult(metadata={
            "blocks": len(done),
            "rows": sum(r.rows for r in done),
            "delta_version": next((r.delta_version for r in reversed(done)), None),
            "waits": dg.MetadataValue.json(waits),
        })

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
        deps = sorted({d for sp in specs for d in sp.depends_on})
        assets.append(dg.asset(
            key=asset_key(table),
            deps=[asset_key(d) for d in deps],
            group_name=table.split(".")[0],
            kinds={"spark", "delta"},
            description="; ".join(sp.comment for sp in specs if sp.comment) or f"built by {', '.join(topics)}",
            metadata={"topics": ", ".join(topics), "processor": specs[0].processor.value},
            pool=f"tidemark/{table}",
        )(_materialize(settings, lineage, topics)))
    return dg.Definitions(assets=[*sources, *assets])


defs = build_definitions()
