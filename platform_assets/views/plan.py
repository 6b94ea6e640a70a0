"""A merge unit's planning, JVM-free: what changed in a topic's inputs (:class:`MergeLook`, also
for ``tidemark explain``, the sensors and the lag table) and, under the topic's lock, the next unit
fixed: the base block ``(last, next]`` and the Delta version of every input (the per-input
offsets). :class:`platform_assets.views.merge.MergeProcessor` plans through these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from lineage.core.positions import Block, Position
from lineage.planning.planner import Decision
from lineage.spec.model import LateRows, Topic
from lineage.views.refresh import InputChange
from platform_assets.core import blocks, protocol
from platform_assets.core.protocol import Planned
from resources.state.offsets import OffsetRecord
from resources.storage import delta_meta
from resources.storage.meta_tables import quarantine_rows

if TYPE_CHECKING:
    from platform_assets.core.context import UnitContext


@dataclass(frozen=True)
class MergeLook:
    """A merge topic's look at its inputs (JVM-free): the base decision, the block's end, late
    rows, and what changed in every other input."""

    rec: OffsetRecord
    decision: Decision
    base: delta_meta.TableSnapshot
    end: Position  # the block's end (== rec.last: no base rows)
    base_rows: int
    late: delta_meta.LateRows
    changes: tuple[InputChange, ...]

    @property
    def ready(self) -> bool:
        return self.end > self.rec.last or self.late.rows.num_rows > 0 or any(c.due for c in self.changes)

    @property
    def reason(self) -> str:
        if self.ready:
            parts = [f"{self.base_rows} new base rows" if self.end > self.rec.last else "",
                     f"{self.late.rows.num_rows} late rows" if self.late.rows.num_rows else "",
                     *(f"{c.table} changed ({c.versions})" for c in self.changes if c.due)]
            return "ready: " + ", ".join(p for p in parts if p)
        return self.decision.reason if not self.decision.ready else self.decision.limit


def merge_look(eng: UnitContext, topic: Topic, rec: OffsetRecord) -> MergeLook:
    """What changed in ``topic``'s inputs since ``rec`` (JVM-free): the base decision and block end,
    late rows, and every other input's change (a topic held by ``repeat`` sees none)."""
    spec = topic.spec
    base = delta_meta.TableSnapshot.open(eng.path(spec.base))
    decision, _ = eng.decide(topic, rec, mark=delta_meta.table_mark(base, newer_than=rec.last))
    end, rows = rec.last, 0
    empty = delta_meta.LateRows(pa.table({}))
    if rec.run is not None and spec.repeat and eng.clock() < rec.run + spec.repeat:  # repeat holds every input
        return MergeLook(rec, decision, base, end, rows, empty, ())
    if decision.ready and not decision.retry:
        found = eng.block_end(topic, rec, decision, base)
        if found.end is not None:
            end, rows = found.end, found.rows
    late = empty
    done = rec.inputs.get(spec.base)
    if spec.late_rows is LateRows.REDERIVE and done is not None and base.version is not None and not rec.last.is_zero():
        late = blocks.late_rows(topic, base, done, rec.last)
    changes = tuple(delta_meta.input_change(t, eng.path(t), rec.inputs.get(t)) for t in spec.depends_on[1:])
    return MergeLook(rec, decision, base, end, rows, late, changes)


def plan_locked(eng: UnitContext, topic: Topic, rec: OffsetRecord) -> Planned:
    """With the lock held: the pending unit, or fix the next one (bounds and every input's version)."""
    spec = topic.spec
    if rec.pending:
        return Planned(Block(topic.name, rec.seq, rec.last, rec.next, may_be_empty=True), f"retry unit {rec.seq}", retry=True,  # type: ignore[arg-type]
                       source_version=rec.source_version)
    look = merge_look(eng, topic, rec)
    if spec.late_rows is LateRows.REDERIVE:
        bad = delta_meta.bad_position_rows(look.base)
        bad_rows = quarantine_rows(eng.settings, topic.name, spec.base, bad, eng.clock()) if bad.num_rows else 0
        warnings: tuple[str, ...] = ((delta_meta.late_detection_warning(spec.base, look.late.unreadable),)
                                     if look.late.unreadable else ())
    else:
        bad_rows, warnings = blocks.quarantine(eng, topic, rec, look.base)
    if not look.ready or look.base.version is None:
        return Planned(None, look.reason, bad_rows=bad_rows, warnings=warnings)
    inputs = {spec.base: look.base.version, **{c.table: c.new for c in look.changes if c.new is not None}}
    seq = protocol.next_seq(rec, eng.path(spec.destination), topic.name)
    rec = eng.store.plan(topic.name, eng.owner, last=rec.last, next=look.end, seq=seq,
                         source_version=look.base.version, inputs_next=inputs)
    return Planned(Block(topic.name, seq, rec.last, look.end, may_be_empty=True), f"unit {seq}", base_rows=look.base_rows,
                   bad_rows=bad_rows, source_version=look.base.version, warnings=warnings)
