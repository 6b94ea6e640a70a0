"""The one step of table maintenance that needs Spark: purging deletion vectors (Spark's
``REORG TABLE ... APPLY (PURGE)``). ``deltalake``'s compaction drops the rows a vector marks only
in the files it bins, and it leaves alone a file above its target and a bin of one file; the
REORG rewrites every file that carries a vector, in one commit that changes no data
(``dataChange: false``, so a view reading the table runs no unit for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from platform_assets.core import spark_io
from resources.storage.maintenance import Health, Purge

if TYPE_CHECKING:
    from platform_assets.core.context import TopicContext

#: The Spark setting that bounds the size of the files a REORG (an OPTIMIZE) writes.
MAX_FILE_SIZE = "spark.databricks.delta.optimize.maxFileSize"


def purger(eng: TopicContext) -> Purge:
    """A :data:`Purge` on ``eng``'s Spark session (started when the first purge is due)."""

    def purge(h: Health) -> dict[str, Any]:
        spark = eng.spark
        kept = spark.conf.get(MAX_FILE_SIZE, None)
        if h.kept_small:  # a view kept in small clustered files: the rewritten files stay that small
            spark.conf.set(MAX_FILE_SIZE, str(h.target_bytes))
        try:
            rows = spark_io.retry_conflicts(
                lambda: spark.sql(f"REORG TABLE delta.`{h.path}` APPLY (PURGE)").collect())
        finally:
            if h.kept_small:
                if kept is None:
                    spark.conf.unset(MAX_FILE_SIZE)
                else:
                    spark.conf.set(MAX_FILE_SIZE, kept)
        metrics = rows[0]["metrics"].asDict(recursive=True) if rows else {}
        vectors = metrics.get("deletionVectorStats") or {}
        return {"numFilesRemoved": int(metrics.get("numFilesRemoved") or 0),
                "numFilesAdded": int(metrics.get("numFilesAdded") or 0),
                "numDeletionVectorsRemoved": int(vectors.get("numDeletionVectorsRemoved") or 0),
                "numDeletedRowsRemoved": int(vectors.get("numDeletionVectorRowsRemoved") or 0)}

    return purge
