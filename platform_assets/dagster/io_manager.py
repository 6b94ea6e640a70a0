"""The offset IO manager: where a block's output is written, exactly once, and its offsets
committed.

A Tidemark asset's compute takes its topic's lock and prepares the block (``before`` SQL and the
transform, a lazy Spark DataFrame) and returns it as an :class:`~platform_assets.engine.runner.OpenBlock`.
``handle_output`` then does the rest of the core engine's step:

* one Delta append carrying ``txnAppId=tidemark:<topic>``/``txnVersion=<block seq>`` (a block
  whose data landed before a crash is recognised in the Delta log and not written again);
* the block's ``etl.log`` row, the ``after`` SQL, ``last := next`` in the offset store, and the
  lock's release;
* materialization metadata: rows, ``last``, ``next``, min/max ``pos``, lag, Delta version,
  duration (numbers, so the asset's Plots tab charts rows and lag over time), and the table's
  health after the unit (files, small files, bytes, commits since the last checkpoint, the oldest
  version a consumer needs, whether it needs maintenance: one read of the Delta log, no Spark; a
  read that fails is a warning in the run's log, never the unit's failure).

``load_input`` gives a downstream asset the rows of the upstream block (the files its Delta
commit added), or the whole table for an unpartitioned (reload) asset.

The manager owns one :class:`~platform_assets.engine.runner.Engine` per run: one SparkSession (local by
default; ``spark_master`` may name another master or a Spark Connect ``sc://`` URL), started on
first use and stopped when the run ends, unless the process already had an active session (a
host process such as the demo keeps its own). In Tidemark's definitions the session comes from
``dagster-pyspark``'s ``LazyPySparkResource`` (``pyspark``, bound under the same key for users'
assets), built from the same settings.
"""

from __future__ import annotations

import posixpath
from typing import TYPE_CHECKING, Any

import dagster as dg
from dagster_pyspark import LazyPySparkResource
from pydantic import Field, PrivateAttr

from lineage.core.errors import ProcessingError
from resources.core.settings import Settings
from resources.storage import delta_log, delta_meta

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import DataFrame, SparkSession

    from platform_assets.engine.runner import Engine, StepResult

#: The resource key Tidemark's assets use for this IO manager.
IO_MANAGER_KEY = "tidemark_io_manager"


class OffsetIOManager(dg.ConfigurableIOManager):
    """Writes each block once into its Delta table and commits its offsets; reads blocks back
    for downstream assets. Empty settings fall back to the ``TIDEMARK_*`` environment."""

    home: str = Field(default="", description=(
        "Tidemark's state directory (offset store, Dagster home, Spark scratch). Empty: TIDEMARK_HOME, "
        "else ./.tidemark."))
    warehouse: str = Field(default="", description=(
        "Root of the Delta tables (<root>/<schema>/<table>; a local path or an s3a:// / abfss:// URL). "
        "Empty: TIDEMARK_WAREHOUSE, else <home>/warehouse."))
    offsets_url: str = Field(default="", description=(
        "Offset store: sqlite:///path/offsets.db or postgresql://user@host/db. Empty: TIDEMARK_OFFSETS_URL, "
        "else sqlite:///<home>/offsets.db."))
    lineage: str = Field(default="", description=(
        "Lineage YAML file or directory. Empty: TIDEMARK_LINEAGE, else ./demo/lineage."))
    spark_master: str = Field(default="", description=(
        "Spark master URL (local[*], spark://host:7077, ...) or a Spark Connect sc://host:port URL. "
        "Empty: TIDEMARK_SPARK_MASTER, else local[*]."))

    pyspark: LazyPySparkResource | None = Field(default=None, description=(
        "dagster-pyspark's lazy Spark session resource to run units on (Tidemark's definitions pass "
        "the one they bind under the key 'pyspark'). None: a session built from spark_master."))

    _engine: Any = PrivateAttr(default=None)
    _run_id: str | None = PrivateAttr(default=None)

    def settings(self) -> Settings:
        return Settings.from_env(home=self.home or None, warehouse=self.warehouse or None,
                                 offsets_url=self.offsets_url or None, lineage=self.lineage or None,
                                 spark_master=self.spark_master or None)

    def engine(self) -> Engine:
        """The run's engine (created on first use; Spark starts only when a block needs it)."""
        if self._engine is None:
            from lineage.spec.loader import load_lineage
            from platform_assets.engine.runner import Engine
            from resources.state.offset_sql import make_owner

            settings = self.settings()
            # The lock owner names the Dagster run: the planner sensor frees it once the run ended.
            self._engine = Engine(settings, load_lineage(settings.lineage), owner=make_owner(run_id=self._run_id),
                                  spark_factory=self._spark_from_resource())
        engine: Engine = self._engine
        return engine

    def _spark_from_resource(self) -> Callable[[], SparkSession] | None:
        """How the engine starts Spark: from the pyspark resource, if the manager has one."""
        resource = self.pyspark
        if resource is None:
            return None

        def start() -> SparkSession:
            from resources.spark.session import ivy_resolution, session_started

            with ivy_resolution(resource.spark_config):  # (two runs on a fresh machine resolve one at a time)
                return session_started(resource.spark_session)
        return start

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._run_id = context.run.run_id if context.run is not None else None

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        """End of the run: stop the SparkSession if this run started it; close the store."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    # ------------------------------------------------------------------ output
    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        from platform_assets.core.protocol import OpenBlock, StepResult

        table = ".".join(context.asset_key.path)
        if isinstance(obj, StepResult):  # nothing to write: a committed block, or a reload that waits
            if context.has_asset_partitions:  # a block partition: only a committed block returns no OpenBlock
                _, seq = self.engine().lineage.block_of(table, context.partition_key)
                context.add_output_metadata({"topic": obj.topic, "block": seq, "rows_written": 0, "already_committed": True,
                                             "note": already_committed(seq), **table_health(self.engine(), table, context.log)})
                return
            context.add_output_metadata({"topic": obj.topic, "note": obj.reason, **table_health(self.engine(), table, context.log)})
            return
        if not isinstance(obj, OpenBlock):
            raise ProcessingError(
                f"asset {context.asset_key.to_user_string()}: the Tidemark IO manager writes blocks opened by "
                f"Engine.open_block, not {type(obj).__name__}"
            )
        result = self.engine().finish(obj)
        context.log.info(f"{result.topic}: {result.reason} wrote {result.rows} rows (Delta version {result.delta_version})"
                         + (", recovered: the data had landed before a crash" if result.recovered else ""))
        context.add_output_metadata({**block_metadata(result), **table_health(self.engine(), table, context.log)})

    # ------------------------------------------------------------------ input
    def load_input(self, context: dg.InputContext) -> DataFrame:
        """The upstream block's rows (every mapped block's, if several), as a Spark DataFrame."""
        from platform_assets.core.protocol import data_app_id

        engine = self.engine()
        key = context.asset_key
        table = ".".join(key.path)
        path = engine.path(table)
        if delta_log.open_table(path) is None:
            raise ProcessingError(f"asset {key.to_user_string()}: no Delta table at {path} (not materialized yet)")
        reader = engine.spark.read.format("delta")
        if not context.has_asset_partitions:
            return reader.load(path)
        files: list[str] = []
        version = -1
        for pkey in context.asset_partition_keys:
            topic, seq = engine.lineage.block_of(table, pkey)
            commit = delta_log.find_txn_commit(path, data_app_id(topic), seq)
            if commit is None:
                raise ProcessingError(
                    f"asset {key.to_user_string()}: block {pkey} of topic '{topic}' has no commit in {path}/_delta_log "
                    "(not materialized yet, or older than the log's retention)"
                )
            gone = delta_meta.missing_files(path, list(commit.paths))
            if gone:  # compacted and vacuumed: its rows are mixed with other blocks' now, and cannot be picked out
                raise ProcessingError(
                    f"asset {key.to_user_string()}: block {pkey} of topic '{topic}' can no longer be loaded on its own: its "
                    f"data file {gone[0]} (Delta version {commit.version}) was deleted by VACUUM after a compaction "
                    f"rewrote its rows into other files. Read {table} whole instead (an unpartitioned input)"
                )
            files += [posixpath.basename(p) for p in commit.paths]
            version = max(version, commit.version)
        from pyspark.sql import functions as F

        df = reader.option("versionAsOf", version).load(path)
        return df.where(F.col("_metadata.file_name").isin(files))


def already_committed(seq: int) -> str:
    """What materializing a block that is already committed did."""
    return f"block {seq} was already committed (nothing written)"


def table_health(engine: Engine, table: str, log: Any) -> dict[str, Any]:
    """``table``'s health as metadata (:func:`platform_assets.maintenance.tables.health_metadata`), read from
    its Delta log; ``{}`` with a warning in ``log`` when it cannot be read (the unit goes on)."""
    try:
        from platform_assets.maintenance import tables as maintain

        found = maintain.healths(engine, [table])
        return maintain.health_metadata(found[0]) if found else {}
    except Exception as exc:  # noqa: BLE001 - the table's health is information, never the unit's failure
        log.warning(f"{table}: the table's health could not be read for the metadata: {type(exc).__name__}: {exc}")
        return {}


def block_metadata(r: StepResult) -> dict[str, Any]:
    """A block's materialization metadata (numbers where the UI should plot them)."""
    stats = r.stats or {}
    meta: dict[str, Any] = {
        "topic": r.topic, "rows": r.rows, "base_rows": r.base_rows, "bad_rows": r.bad_rows,
        "delta_version": r.delta_version, "duration_s": round(r.duration_s, 3), "recovered": r.recovered,
    }
    if r.block is not None:
        meta.update({"block": r.block.seq, "last": r.block.last.label(), "next": r.block.next.label()})
    for k in ("min_ts", "max_ts"):
        if stats.get(k) is not None:
            meta[k.replace("ts", "pos")] = stats[k].isoformat()
    if stats.get("max_lag") is not None:
        meta["lag_s"] = float(stats["max_lag"])
    if stats.get("strategy"):  # a merge unit: which strategy ran and why, what it changed
        meta["strategy"] = stats["strategy"]
        meta["strategy_reason"] = dg.MetadataValue.text(str(stats.get("strategy_reason") or ""))
        for k in ("rows_inserted", "rows_updated", "rows_deleted", "keys_rederived", "late_rows"):
            if stats.get(k) is not None:
                meta[k] = int(stats[k])
        if stats.get("reference_rows_changed"):
            meta["reference_rows_changed"] = dg.MetadataValue.json(stats["reference_rows_changed"])
        ages = {k: v for k, v in (stats.get("offset_age_s") or {}).items() if v is not None}
        if ages:
            meta["offset_age_seconds"] = float(max(ages.values()))  # plotted; per input below
            meta["offset_age_s"] = dg.MetadataValue.json(ages)
    if stats.get("phases_s"):  # where the block's time went (lock, plan, spark, transform, write, log, commit)
        meta["phases_s"] = dg.MetadataValue.json(stats["phases_s"])
    return meta
