"""Reads of a topic's base table that the step and merge processors share, as functions of the
unit's context (:class:`platform_assets.core.context.UnitContext`): the rows no block can take
(quarantined), late rows, a block's rows and every row up to a position at a planned snapshot,
whether a planned snapshot can still be read, and how old each input's offset is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lineage.core.errors import ProcessingError
from lineage.core.positions import Block, Position
from lineage.spec.model import Topic
from platform_assets.core import spark_io, table_reads
from platform_assets.core.protocol import Planned
from resources.state.offsets import OffsetRecord
from resources.storage import delta_log, delta_meta
from resources.storage.meta_tables import quarantine_rows

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from platform_assets.core.context import UnitContext


def quarantine(ctx: UnitContext, topic: Topic, rec: OffsetRecord, base: delta_meta.TableSnapshot) -> tuple[int, tuple[str, ...]]:
    """Quarantine rows of the ``base`` snapshot no block can take: null ``pos``/``id``, and
    rows added since the last planned snapshot with a position at or before ``last`` (late,
    out of order). Returns how many rows are newly quarantined, and a warning when late rows
    could not be looked for in commits the log no longer holds."""
    added = 0
    bad = delta_meta.bad_position_rows(base)
    if bad.num_rows:
        added += quarantine_rows(ctx.settings, topic.name, topic.spec.base, bad, ctx.clock())
    warnings: tuple[str, ...] = ()
    if rec.source_version is not None and not rec.last.is_zero():
        late = late_rows(topic, base, rec.source_version, rec.last)
        if late.rows.num_rows:
            added += quarantine_rows(ctx.settings, topic.name, topic.spec.base, late.rows, ctx.clock(),
                                     after_version=rec.source_version)
        if late.unreadable:
            warnings = (delta_meta.late_detection_warning(topic.spec.base, late.unreadable),)
    return added, warnings


def late_rows(topic: Topic, base: delta_meta.TableSnapshot, after_version: int, last: Position) -> delta_meta.LateRows:
    """Late rows of ``topic``'s base (see :func:`resources.storage.late_rows.late_rows`). Where the
    files or commits that would tell were removed and no other route is exact, this topic stops
    (its error says what was removed and what to run); other topics go on."""
    try:
        return delta_meta.late_rows(base, after_version, last)
    except delta_meta.RemovedDataError as exc:
        raise ProcessingError(
            f"topic '{topic.name}': {exc}. Rows of {topic.spec.base} added after version {after_version} at or before the "
            f"topic's last ({last.to_text()}) would be late rows, and Tidemark does not guess which they are. To go on "
            f"without looking for them (any such row stays in {topic.spec.base}, neither processed nor quarantined), run: "
            f"tidemark offsets reset {topic.name} --to {last.to_text()} --late-from-now --reason '...'"
        ) from None


def require_snapshot(ctx: UnitContext, topic: Topic, planned: Planned) -> None:
    """For a unit planned earlier that reads its base snapshot whole (a merge unit): stop this
    topic, saying what to run, when files of that snapshot were deleted by VACUUM since."""
    block = planned.block
    if block is None or planned.source_version is None:
        return
    try:
        route = delta_meta.snapshot_read(ctx.path(topic.spec.base), planned.source_version, None, block.next)
        problem = "its data files were compacted and then deleted by VACUUM" if route.rerouted else ""
    except delta_meta.RemovedDataError as exc:
        problem = str(exc)
    if problem:
        raise ProcessingError(
            f"topic '{topic.name}': unit {block.seq} was planned on {topic.spec.base} version {planned.source_version} and "
            f"cannot be read as planned: {problem}. Nothing of it was written. To plan it again on the inputs as they "
            f"are now, run: tidemark offsets reset {topic.name} --to {block.last.to_text()} --reason '...'")


def block_df(ctx: UnitContext, base: str, block: Block, version: int | None,
             snapshot: delta_meta.SnapshotRead | None = None) -> DataFrame:
    """Rows of ``base`` inside ``(last, next]``, registered as the temp view ``block``.

    The block reads the snapshot it was planned on (Delta time travel to ``version``), so a
    retry sees exactly the same rows and a row that lands later in an already-planned range
    is detected as late instead of silently joining or missing a block. The plain range on
    ``pos`` lets Delta skip files by statistics; the tuple comparison cuts exactly. ``snapshot``:
    that version's files were compacted and deleted by VACUUM, so its rows are read from a newer
    version by id (:func:`resources.storage.history.snapshot_read`)."""
    from pyspark.sql import functions as F

    spark = ctx.spark  # F.lit needs an active session
    # Bounds as epoch microseconds: the same instants whatever the session's time zone.
    lp, li = spark_io.ts_literal(block.last.pos), F.lit(block.last.id).cast("bigint")
    np_, ni = spark_io.ts_literal(block.next.pos), F.lit(block.next.id).cast("bigint")
    pos, id_ = F.col("pos"), F.col("id")
    if snapshot is not None:
        version = snapshot.read_version
    rows = table_reads.read_version(spark, ctx.path(base), version, low=block.last.pos, high=block.next.pos)
    df = (rows
          .where((pos >= lp) & (pos <= np_) & id_.isNotNull())  # a row without an id is quarantined instead
          .where(((pos > lp) | (id_ > li)) & ((pos < np_) | (id_ <= ni))))
    if snapshot is not None and snapshot.max_id is not None:
        df = df.where(id_ <= F.lit(snapshot.max_id).cast("bigint"))
    df.createOrReplaceTempView("block")
    return df


def rows_upto(spark: SparkSession, path: str, end: Position, version: int | None) -> DataFrame:
    """The rows of the table at ``path`` (at Delta ``version``; None: the newest) whose ``(pos, id)``
    is at most ``end``: unfiltered where that is every row of the version (statistics and newest rows,
    :func:`~resources.storage.delta_meta.every_row_upto`; only at a given version, which a later commit
    cannot change), so that a query reading neither ``pos`` nor ``id`` does not read them."""
    rows = table_reads.read_version(spark, path, version, high=end.pos)
    if version is not None and delta_meta.every_row_upto(delta_meta.TableSnapshot.open(path, version), end):
        return rows
    return upto(rows, end)


def upto(rows: DataFrame, end: Position) -> DataFrame:
    """The rows of ``rows`` whose ``(pos, id)`` is at most ``end`` (a null ``id`` never is)."""
    from pyspark.sql import functions as F

    np_, ni = spark_io.ts_literal(end.pos), F.lit(end.id).cast("bigint")
    pos, id_ = F.col("pos"), F.col("id")
    return rows.where((pos <= np_) & id_.isNotNull()).where((pos < np_) | (id_ <= ni))


def offset_ages(ctx: UnitContext, topic: Topic, last: Position, inputs: dict[str, int]) -> dict[str, float | None]:
    """Seconds since the newest data each input's offset covers (Datapipe's ``offset_age_seconds``):
    the base by its ``last`` position, every other input by the commit time of its applied version."""
    spec = topic.spec
    now = ctx.clock()
    out: dict[str, float | None] = {spec.base: None if last.is_zero() else round((now - last.pos).total_seconds(), 3)}
    for table in spec.depends_on[1:]:
        version = inputs.get(table)
        at = None if version is None else delta_log.commit_time(ctx.path(table), version)
        out[table] = None if at is None else round((now - at).total_seconds(), 3)
    return out
