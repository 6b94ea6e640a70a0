"""What the processors use of the Engine (docs/layout.md, "The narrow context"): two protocols the
:class:`platform_assets.engine.runner.Engine` satisfies structurally, so the processors (step, reload,
merge), the views' operations and ``verify`` import this module instead of the Engine, and the
Engine imports them without a circle. Tests may pass a small fake with these members.

``decide`` and ``block_end`` stay Engine methods: they need the whole lineage (dependencies'
freshness, producers), and the processors see only the answers.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from lineage.core.positions import Position
    from lineage.planning.planner import Decision, TableMark
    from lineage.spec.model import Lineage, Topic
    from platform_assets.core.protocol import Phases
    from resources.core.settings import Settings
    from resources.state.offsets import OffsetRecord, OffsetStore
    from resources.storage import delta_meta


class UnitContext(Protocol):
    """What a unit's work uses: the processors (step, reload, merge), the shared base-table reads
    (:mod:`platform_assets.core.blocks`) and ``verify`` (merge's ``exact`` check calls it inside a unit)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def store(self) -> OffsetStore: ...

    @property
    def spark(self) -> SparkSession: ...

    @property
    def owner(self) -> str: ...

    @property
    def run_id(self) -> str: ...

    @property
    def clock(self) -> Callable[[], dt.datetime]: ...

    @property
    def phases(self) -> Phases: ...

    def path(self, table: str) -> str: ...

    def register(self, table: str) -> None: ...

    def register_tables(self, topic: Topic | None = None) -> None: ...

    def decide(self, topic: Topic, rec: OffsetRecord | None = None, now: dt.datetime | None = None,
               mark: TableMark | None = None) -> tuple[Decision, TableMark]: ...

    def block_end(self, topic: Topic, rec: OffsetRecord, decision: Decision,
                  base: delta_meta.TableSnapshot | None = None) -> delta_meta.BlockEnd: ...


class TopicContext(UnitContext, Protocol):
    """What the work done outside a unit uses (the views' operations: explain, adopt; table
    maintenance): a unit's context, the lineage, and a topic's offsets and lock."""

    @property
    def lineage(self) -> Lineage: ...


    def ensure_offsets(self, topic: Topic, start: Position | None = None) -> OffsetRecord: ...

    def locked(self, topic: Topic, *, record_failure: bool = True) -> AbstractContextManager[OffsetRecord]: ...
