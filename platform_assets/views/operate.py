"""Operating merge topics (materialized views) without running them: what the next unit would do
(``tidemark explain``) and taking over a view built elsewhere (``tidemark offsets adopt``,
Datapipe's ``initialize_offsets``). All JVM-free: the offset store and the Delta logs (how old
every input's offset is, ``offset_age_seconds``, is :func:`platform_assets.core.blocks.offset_ages`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lineage.core.errors import ProcessingError, TidemarkError
from lineage.core.positions import Position
from lineage.spec.model import LateRows, Topic
from lineage.views.refresh import Sizes, Strategy, choose
from platform_assets.core import protocol
from platform_assets.views import driver_unit, indexes
from platform_assets.views.merge import MergeLook, MergeProcessor
from resources.storage import delta_meta, delta_read

if TYPE_CHECKING:
    from platform_assets.core.context import TopicContext
    from resources.state.offsets import OffsetRecord


def explain(engine: TopicContext, topic: Topic, *, keys: int = 0) -> list[str]:
    """What the next unit would do, without running it or starting Spark; with ``keys`` (> 0) also
    the view keys it would re-derive, by where they come from (up to ``keys`` of each; this
    starts Spark and evaluates the transform, writing nothing)."""
    from lineage.views.refresh import RefreshRefused

    eng, spec = engine, topic.spec
    rec = eng.ensure_offsets(topic)
    lines = [f"topic {topic.name} (merge into {spec.destination}, key {', '.join(spec.key)}, refresh {spec.refresh.value})",
             f"  base {spec.base}: last {rec.last.label()}" + (f", version {rec.inputs[spec.base]} applied"
                                                                 if spec.base in rec.inputs else "")]
    if rec.pending:
        return [*lines, f"  unit {rec.seq} is pending ({rec.last.label()} .. {rec.next.label() if rec.next else ''}): "
                        f"the next run redoes exactly it"]
    try:
        look = MergeProcessor(eng).look(topic, rec)
    except TidemarkError as exc:
        return [*lines, f"  cannot plan the next unit: {exc}"]
    lines.append(f"  new base rows: {look.base_rows}" + (f" up to {look.end.label()}" if look.end > rec.last else
                                                        f" ({look.decision.reason})"))
    if spec.late_rows is LateRows.REDERIVE:
        lines.append(f"  late base rows to re-derive: {look.late.rows.num_rows}")
    for c in look.changes:
        how = ("reverse join on " + ", ".join(f"{v}={i}" for v, i in spec.join_keys[c.table].items())
               if c.table in spec.join_keys else "no join_keys: a change means a full recompute")
        state = (f"only compacted ({c.versions}: the same rows, no unit due)" if c.rewrites_only else
                 f"changed ({c.versions}, {'?' if c.changed_rows is None else c.changed_rows} rows of "
                 f"{'?' if c.table_rows is None else c.table_rows})" if c.changed else f"unchanged at version {c.new}")
        lines.append(f"  input {c.table}: {state}; {how}" + (f"; change feed: {c.problem}" if c.problem else ""))
    lines += indexes.explained(eng, topic, look.base)
    if not look.ready:
        return [*lines, f"  nothing to do: {look.reason}"]
    view = delta_meta.TableSnapshot.open(eng.path(spec.destination))
    built = bool(rec.inputs) and view.version is not None
    try:
        sizes = delta_meta.unit_sizes(look.base, view, look.changes, spec) if built else None
        s = choose(spec, built=built, base_rows=look.base_rows, base_columns=look.base.columns,
                   late_rows=look.late.rows.num_rows, changes=look.changes, python_transform=topic.python, sizes=sizes)
    except RefreshRefused as exc:
        return [*lines, f"  strategy: REFUSED: {exc}"]
    lines.append(f"  strategy: {s.reason}" if s.incremental else f"  strategy: full: {s.reason}")
    if built and (look.end > rec.last or any(c.changed for c in look.changes)):
        lines.append(_driver_line(eng, topic, look, view, s, sizes))
    if keys > 0 and s.incremental:
        lines += affected_keys(eng, topic, rec, look, limit=keys)
    return lines


def _driver_line(eng: TopicContext, topic: Topic, look: MergeLook, view: delta_meta.TableSnapshot, s: Strategy,
                 sizes: Sizes | None) -> str:
    """Where the next unit's transform would run: in the driver by DuckDB (a small unit of an
    additive or row-wise view whose SQL translates; :mod:`platform_assets.views.driver_unit`) or in
    Spark, and why. A full recompute the estimate chose runs incrementally in the driver when it can
    (``sizes``: what the estimate priced, :func:`delta_meta.unit_sizes`)."""
    spec = topic.spec
    alt = s
    if not s.incremental and s.estimate is not None:
        alt = choose(spec, built=True, base_rows=look.base_rows, base_columns=look.base.columns,
                     late_rows=look.late.rows.num_rows, changes=look.changes, python_transform=topic.python,
                     sizes=sizes, by_cost=False)
    if not alt.incremental:
        return "  transform: in Spark (a full recompute)"
    inputs = {c.table: delta_meta.TableSnapshot.open(eng.path(c.table), c.new) for c in look.changes if c.new is not None}
    why = driver_unit.prospect(topic, look.base_rows, look.late.rows.num_rows, look.base, inputs, view)
    if why is not None:
        return f"  transform: in Spark ({why})"
    instead = "" if alt is s else f", incremental instead of the full recompute the estimate chose ({alt.reason})"
    return (f"  transform: in the driver by DuckDB, no Spark job{instead}; the unit still hands it to Spark if its rows "
            f"call for it (a key given twice, a value Spark computes otherwise)")


def affected_keys(engine: TopicContext, topic: Topic, rec: OffsetRecord, look: MergeLook, *, limit: int) -> list[str]:
    """The keys the next unit of merge topic ``topic`` would re-derive, by where they come from
    (the unit is derived as :meth:`MergeProcessor.derive` would, on the inputs as they are now;
    nothing is planned or written)."""
    import dataclasses

    from lineage.core.positions import Block
    from platform_assets.core.protocol import Planned

    eng, spec = engine, topic.spec
    inputs: dict[str, int] = {c.table: c.new for c in look.changes if c.new is not None}
    if look.base.version is not None:
        inputs[spec.base] = look.base.version
    planned = Planned(Block(topic.name, rec.seq + 1, rec.last, look.end, may_be_empty=True), "explain",
                      base_rows=look.base_rows, source_version=look.base.version)
    _, work = MergeProcessor(eng).derive(topic, dataclasses.replace(rec, inputs_next=inputs), planned)
    try:
        if not work.strategy.incremental:
            return [f"  affected keys: every key ({work.strategy.reason})"]
        if work.contributions:  # an additive view: each source's groups with what it adds (or subtracts)
            out = [f"  affected groups by the delta rule ({', '.join(spec.key)}), with their contributions:"]
            for label, sign, df in work.contributions:
                rows = sorted((r.asDict() for r in df.limit(limit + 1).collect()), key=repr)
                out += _shown(f"{'added' if sign > 0 else 'subtracted'}: {label}", rows, limit, "group(s)")
            return out
        out = [f"  affected keys by the delta rule ({', '.join(spec.key)}):"]
        for label, df in work.affected:
            rows = sorted((r.asDict() for r in df.distinct().limit(limit + 1).collect()), key=repr)
            out += _shown(f"from {label}", rows, limit, "key(s)")
        return out
    finally:
        for view in work.views:
            eng.spark.catalog.dropTempView(view)


def _shown(title: str, rows: list[dict[str, Any]], limit: int, what: str) -> list[str]:
    more = f", showing {limit}" if len(rows) > limit else ""
    return [f"    {title}: {len(rows) if not more else f'more than {limit}'} {what}{more}",
            *("      " + ", ".join(f"{k}={v!r}" for k, v in r.items()) for r in rows[:limit])]


def adopt(engine: TopicContext, topic: Topic, *, dry_run: bool) -> list[str]:
    """Take over an existing view without reprocessing it (Datapipe's ``initialize_offsets``):
    ``last`` from the view's own newest ``(pos, id)`` when it has them, else the base's newest
    position; every input's offset at its current version. The view is assumed current as of
    those; later changes are applied incrementally."""
    import pyarrow.compute as pc

    eng, spec = engine, topic.spec
    dest = eng.path(spec.destination)
    view = delta_meta.TableSnapshot.open(dest)
    if view.version is None or view.table is None:
        raise ProcessingError(f"topic '{topic.name}': nothing to adopt: no Delta table at {dest} ({spec.destination})")
    rec = eng.store.get(topic.name)
    if rec is not None and (rec.seq or rec.inputs):
        raise ProcessingError(f"topic '{topic.name}' has offsets already (unit {rec.seq}); adopt is for a view built "
                              f"outside Tidemark. To restate a range use: tidemark offsets reset {topic.name} --to POSITION --reason '...'")
    missing = [k for k in spec.key if k not in view.columns]
    if missing:
        raise ProcessingError(f"topic '{topic.name}': {spec.destination} has no column {', '.join(missing)} of the key "
                              f"({', '.join(spec.key)}); it cannot be adopted as this view")
    keys = delta_read.read_rows(view.table, list(spec.key))  # (deletion vectors, column mapping: deltalake's DataFusion reader)
    dups = keys.group_by(list(spec.key)).aggregate([([], "count_all")]).filter(pc.field("count_all") > 1).num_rows
    base = delta_meta.TableSnapshot.open(eng.path(spec.base))
    if base.version is None:
        raise ProcessingError(f"topic '{topic.name}': base {spec.base} does not exist at {eng.path(spec.base)}")
    if {"pos", "id"} <= view.columns:
        last, source = delta_meta.table_mark(view).max_position or Position.zero(), f"the newest (pos, id) in {spec.destination}"
    else:
        last, source = delta_meta.table_mark(base).max_position or Position.zero(), f"the newest (pos, id) in {spec.base} now"
    inputs = {spec.base: base.version}
    for t in spec.depends_on[1:]:
        v = delta_meta.TableSnapshot.open(eng.path(t)).version
        if v is None:
            raise ProcessingError(f"topic '{topic.name}': input {t} does not exist at {eng.path(t)}")
        inputs[t] = v
    lines = [f"topic {topic.name}: adopt {spec.destination} version {view.version} ({view.files.num_rows} files) as it is",
             f"  last = {last.label()} ({source})",
             *(f"  input {t}: offset = version {v}" for t, v in inputs.items()),
             f"  key ({', '.join(spec.key)}): " + (f"{dups} duplicate keys -- fix the table before adopting"
                                                  if dups else "unique")]
    if dups:
        raise ProcessingError("\n".join([*lines, f"topic '{topic.name}': refused: the key is not unique in {spec.destination}"]))
    if dry_run:
        return [*lines, "dry run: nothing was set (run again without --dry-run)"]
    seq = protocol.recorded_seq(dest, topic.name)
    if rec is None:
        eng.store.init(topic.name, last, spec.processor.value, who=eng.owner, note=f"adopt: {source}", seq=seq)
    with eng.locked(topic) as locked_rec:
        eng.store.plan(topic.name, eng.owner, last=locked_rec.last, next=max(last, locked_rec.last), seq=max(seq, locked_rec.seq) + 1,
                       source_version=base.version, inputs_next=inputs)
        eng.store.commit(topic.name, eng.owner, seq=max(seq, locked_rec.seq) + 1, last=locked_rec.last,
                         next=max(last, locked_rec.last), rows=0, note=f"adopt {spec.destination} version {view.version}")
    return [*lines, "adopted: the next unit applies only what changes from here"]

