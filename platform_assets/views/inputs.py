"""The inputs of a merge topic's transform pinned at given Delta versions, as temporary views: what
a unit re-derives over (:mod:`platform_assets.views.merge`) and what ``verify`` recomputes over
(:mod:`platform_assets.views.verify`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lineage.spec.model import Topic
from platform_assets.core import spark_io

if TYPE_CHECKING:
    from platform_assets.core.context import UnitContext


def pin_inputs(ctx: UnitContext, topic: Topic, versions: dict[str, int], prefix: str, views: list[str]) -> dict[str, str]:
    """Temporary views of the inputs ``topic``'s SQL reads, each at the given Delta version:
    lineage table -> view name (for :func:`spark_io.transform`'s ``tables``); the names are added
    to ``views`` (to drop when done). None for a Python transform: it reads what it names
    (:func:`lineage.views.refresh.inexact` says what that costs)."""
    out: dict[str, str] = {}
    if topic.python:
        return out
    for i, table in enumerate(spark_io.tables_read(topic, versions)):
        name = f"{prefix}_{i}"
        ctx.spark.read.format("delta").option("versionAsOf", versions[table]).load(ctx.path(table)) \
            .createOrReplaceTempView(name)
        views.append(name)
        out[table] = name
    return out
