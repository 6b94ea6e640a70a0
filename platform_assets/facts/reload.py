"""The reload processor: a topic's destination rebuilt whole, in one atomic Delta overwrite, when
its base table's Delta version changed (and ``repeat`` allows).

A rebuild reads the base at the version the decision was made on, and lands through the same
protocol as a block: its number is the commit's ``txnVersion`` (never skipped: every rebuild gets
a new number), its ``userMetadata`` names the base version it read, ``etl.log`` is written before
the offset commit. A lost store is rebuilt from the log, so an unchanged base is not rebuilt again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from lineage.core.errors import ProcessingError
from lineage.core.positions import Position
from lineage.spec.model import Topic
from platform_assets.core import driver_writes, faults, protocol, spark_io, table_reads
from platform_assets.core.protocol import OpenBlock, Planned, StepResult, data_app_id
from resources.state.offsets import OffsetRecord
from resources.storage import delta_log, delta_meta
from resources.storage.meta_tables import write_etl_log

if TYPE_CHECKING:
    from platform_assets.core.context import UnitContext


class ReloadProcessor:
    """Opens and lands the rebuilds of reload topics for one engine (its :class:`UnitContext`)."""

    def __init__(self, engine: UnitContext) -> None:
        self.engine = engine

    def open(self, topic: Topic, rec: OffsetRecord, seq: int | None = None) -> OpenBlock | StepResult:
        """The rebuild's output over the base at the decided version (``seq`` is not used: a
        rebuild always takes the next number)."""
        eng = self.engine
        started = time.monotonic()
        decision, base = eng.decide(topic, rec)
        if not decision.ready:
            return StepResult(topic.name, False, decision.reason)
        with eng.phases.timed("transform"):
            eng.register_tables(topic)
            base_df = table_reads.read_version(eng.spark, eng.path(topic.spec.base), base.version)
            base_df.createOrReplaceTempView("block")
            spark_io.run_statements(eng.spark, topic, "before")
            out = spark_io.transform(eng.spark, topic, base_df, paths={t: eng.path(t) for t in topic.spec.depends_on})
        number = protocol.next_seq(rec, eng.path(topic.spec.destination), topic.name)
        counted = None if base.version is None else delta_meta.TableSnapshot.open(eng.path(topic.spec.base), base.version).row_count
        rows = -1 if counted is None else counted  # (rows before deletions, with deletion vectors: at least as many)
        return OpenBlock(topic, Planned(None, f"reload {number}", base_rows=rows, source_version=base.version), started, number,
                         out=out, base_mark=base.max_position or Position.zero())

    def finish(self, opened: OpenBlock) -> StepResult:
        eng = self.engine
        topic, seq = opened.topic, opened.seq
        dest = eng.path(topic.spec.destination)
        if opened.out is None:
            raise ProcessingError(f"topic '{topic.name}': reload {seq} has no output to write")
        source_version = opened.planned.source_version
        mark = opened.base_mark or Position.zero()
        meta = protocol.commit_metadata(topic, seq, next_=None if mark.is_zero() else mark, source_version=source_version,
                                        run_id=eng.run_id, owner=eng.owner)
        app_id = data_app_id(topic.name)
        with eng.phases.timed("write"):
            observed = driver_writes.write_unit(opened.out, dest, mode="overwrite", options={"overwriteSchema": "true"},
                                                input_rows=opened.planned.base_rows, app_id=app_id, seq=seq, meta=meta)
            eng.register(topic.spec.destination)
            committed = delta_log.find_txn_commit(dest, app_id, seq)
        if committed is None:
            raise ProcessingError(f"topic '{topic.name}': reload {seq} was written but its commit is not in {dest}/_delta_log")
        faults.crashpoint("written")
        with eng.phases.timed("log"):
            entry = protocol.log_entry(topic, seq, "", "" if mark.is_zero() else mark.to_text(), committed, base_rows=-1,
                                       bad_rows=0, duration=time.monotonic() - opened.started,
                                       figures=protocol.block_figures(dest, committed, observed, eng.run_id),
                                       run_id=eng.run_id, now=eng.clock())
            write_etl_log(eng.settings, entry)  # statistics before the offset commit, as a step's
        if topic.spec.after:
            with eng.phases.timed("after"):
                spark_io.run_statements(eng.spark, topic, "after")
        with eng.phases.timed("commit"):
            eng.store.commit_reload(topic.name, eng.owner, seq=seq, mark=mark, rows=committed.rows,
                                    source_version=source_version,
                                    note=f"rows={committed.rows} delta_version={committed.version}",
                                    delta_version=committed.version)
        return StepResult(topic.name, True, f"reload {seq}", rows=committed.rows, delta_version=committed.version,
                          duration_s=time.monotonic() - opened.started, stats=protocol.stats_dict(entry))
