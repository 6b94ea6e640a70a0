"""The planner: offsets + source marks + the clock + the rules -> the next block, or why a
topic waits. The seed's ``SCH.LagLive`` as a pure function.

The planner only sees cheap facts (high-water marks, offsets, the time): it decides whether a
topic may run and the upper bound (``cutoff``) of the positions its next block may take. The
exact ``next`` (the ``maxstep``-th eligible row) is found afterwards from the data by
:mod:`resources.storage.positions`; when that finds no row, the planner's ``limit`` says why.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from lineage.core.durations import format_duration
from lineage.core.positions import Block, Position, format_ts
from lineage.spec.model import Processor, TopicSpec


@dataclass(frozen=True)
class TopicState:
    """What the offset store knows of a topic (a subset of ``OffsetRecord``)."""

    last: Position
    next: Position | None = None
    seq: int = 0
    run: dt.datetime | None = None
    source_version: int | None = None


@dataclass(frozen=True)
class TableMark:
    """Cheap facts about a table: its newest position and its Delta version."""

    max_position: Position | None  # None: the table is empty or does not exist
    version: int | None = None
    exists: bool = True  # False: there is no Delta table at ``location``
    location: str = ""
    #: The newest version that changed data, when the versions after it only compacted or cleaned up
    #: (``dataChange: false``); None: ``version`` itself (or not looked at).
    data_version: int | None = None


@dataclass(frozen=True)
class Decision:
    topic: str
    ready: bool
    reason: str  # why it waits, or what it will do
    cutoff: dt.datetime | None = None  # newest pos the next block may include
    limit: str = ""  # what bounds the cutoff (shown when no row is eligible)
    retry: Block | None = None  # a planned block that must be processed again as it is
    facts: dict[str, str] = field(default_factory=dict)


def _ts(value: dt.datetime) -> str:
    return format_ts(value).replace("T", " ").removesuffix(".000000")


def plan_topic(
    spec: TopicSpec,
    state: TopicState,
    base: TableMark,
    dependencies: dict[str, dt.datetime | None],
    now: dt.datetime,
    *,
    base_produced: bool = False,
) -> Decision:
    """Decide whether ``spec`` may run now.

    ``dependencies`` maps every ``depends_on`` table except the base to the position that
    table is fresh up to (its producers' offsets or its source mark; ``None`` if nothing yet).
    ``base_produced``: a topic of the lineage writes the base table (so a missing base is one
    not written yet, not a wrong name or path).
    """
    name = spec.name
    if state.next is not None:
        block = Block(name, state.seq, state.last, state.next)
        return Decision(name, True, f"retry block {state.seq} {state.last}..{state.next}", retry=block, cutoff=state.next.pos)
    if state.run is not None and spec.repeat and now < state.run + spec.repeat:
        return Decision(name, False, f"repeat: next run after {_ts(state.run + spec.repeat)}")

    if not base.exists:
        return Decision(name, False, missing_reason(spec.base, base, base_produced))
    if spec.processor is Processor.RELOAD:
        if base.version is None:
            return Decision(name, False, f"waiting for {spec.base} (table missing)")
        if state.seq == 0:
            return Decision(name, True, "first reload")
        if base.data_version is not None and state.source_version is not None:
            changed = base.data_version > state.source_version  # later versions may only have compacted
        else:
            changed = base.version != state.source_version
        if changed:
            return Decision(name, True, f"{spec.base} changed (version {state.source_version} -> {base.version})")
        since = ("" if base.data_version in (None, base.version)
                 else f"; versions up to {base.version} only compacted or cleaned up")
        return Decision(name, False, f"no new rows ({spec.base} unchanged since version {state.source_version}{since})")

    if base.max_position is None:
        return Decision(name, False, f"no new rows ({spec.base} is empty)")
    if base.max_position <= state.last:
        return Decision(name, False, "no new rows")

    cutoff = now - spec.delay
    limit = f"delay {format_duration(spec.delay)}: newest eligible row at {_ts(cutoff)}" if spec.delay else ""
    for table, fresh in dependencies.items():
        if fresh is None:
            return Decision(name, False, f"waiting for {table} (no data yet)")
        if fresh < cutoff:
            cutoff, limit = fresh, f"waiting for {table} (at {_ts(fresh)})"
    if cutoff < state.last.pos:
        return Decision(name, False, limit or f"no eligible rows: last {state.last} is after the cutoff {_ts(cutoff)}")
    # With no delay and nothing to wait for, a block finds no row only when the rows after
    # ``last`` are dated after now (a source clock ahead, client event times): the clock ends that.
    return Decision(name, True, "new rows", cutoff=cutoff, limit=limit or "no eligible rows before now")


def missing_reason(table: str, mark: TableMark, produced: bool) -> str:
    """Why a topic waits on a base table that does not exist."""
    at = f" at {mark.location}" if mark.location else ""
    if produced:
        return f"no new rows ({table} not written yet by its topic; no Delta table{at})"
    return f"{table} does not exist{at}; check the table name or the source's path"


def lag_seconds(last: Position, source_max: Position | None) -> float:
    """How far a topic is behind its base table, in seconds of ``pos`` (0 when caught up)."""
    if source_max is None:
        return 0.0
    if last.is_zero():
        return float("inf")
    return max(0.0, (source_max.pos - last.pos).total_seconds())
