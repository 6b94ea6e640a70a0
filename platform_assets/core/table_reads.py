"""A lineage table at one Delta version as a Spark DataFrame (:func:`read_version`), the one way
processors read a table at a version they planned on, and a transform's inputs pinned at versions
as temporary views (:func:`pin_inputs`). Two reads a reverse join makes, JVM-free where
``deltalake`` reads them as Spark does: a changed input's join values from its change data feed
(:func:`changed_values`) and the base rows joining them, by a filtered scan (:func:`rows_matching`).

A plain version (no deletion vectors, column mapping or partition columns: see
:attr:`~resources.storage.snapshot.TableSnapshot.plain`) is read straight from the Parquet files
its log names, with the schema its log gives, both read JVM-free by ``deltalake`` (the snapshot the
planner already opened, usually). Spark's Delta reader would first rebuild the table's state at
that version and filter its file list, two or three Spark jobs for every version it has not seen
(``Compute snapshot for version``, ``Filtering files for query``); a resident follower reads a new
version of each input for nearly every unit, so those jobs were most of a small unit's Spark time
(docs/benchmarks.md, stop 65). The rows are the same: the version's rows are exactly its data
files' rows, and a file written before a column was added reads that column as null, as Delta
reads it. Any other table, or a version with more files than :data:`DIRECT_MAX_FILES`, is read
through Delta.

``$TIDEMARK_DIRECT_IO=off`` reads every table through Delta (to compare, or to rule this out).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from lineage.core.errors import ConfigError
from platform_assets.core import spark_io
from resources.storage import delta_meta
from resources.storage.warehouse import is_object_store

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from lineage.core.positions import Position
    from lineage.spec.model import Topic
    from platform_assets.core.context import UnitContext

#: At most this many files are read directly (Spark looks each given file up on the driver, at
#: most this many without a listing job: ``spark.sql.sources.parallelPartitionDiscovery.threshold``,
#: set to it in Tidemark's sessions); object stores, where each lookup is a request, fewer.
DIRECT_MAX_FILES = 1000
DIRECT_MAX_OBJECTS = 100

ENV = "TIDEMARK_DIRECT_IO"


def direct_io_on() -> bool:
    """Whether plain versions are read from their files (``$TIDEMARK_DIRECT_IO``: on, the
    default, or off); any other value is refused."""
    value = os.environ.get(ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ConfigError(f"${ENV}={os.environ.get(ENV)!r}: expected on or off")
    return value == "on"


def read_version(spark: SparkSession, path: str, version: int | None, *,
                 low: dt.datetime | None = None, high: dt.datetime | None = None,
                 holding: Mapping[str, Collection[Any]] | None = None) -> DataFrame:
    """The table at ``path`` at Delta ``version`` (None: the newest), as Spark reads ``path``.
    ``low``/``high``: the caller keeps only rows with a ``pos`` in that range; ``holding``: only rows
    whose columns take one of the values given for them (a None: a null); so only the files whose
    statistics allow one need be read."""
    direct = _direct(spark, path, version, low, high, holding) if direct_io_on() else None
    if direct is not None:
        return direct
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return reader.load(path)


def _direct(spark: SparkSession, path: str, version: int | None, low: dt.datetime | None,
            high: dt.datetime | None, holding: Mapping[str, Collection[Any]] | None = None) -> DataFrame | None:
    """The version read from its files, or None where Delta must read it."""
    snap = delta_meta.TableSnapshot.open(path, version)
    if snap.table is None or not snap.plain or (version is not None and snap.version != version):
        return None
    files = (delta_meta.files_in_range(snap, *delta_meta.widened(low, high)) if (low or high)
             else snap.files["path"].to_pylist())
    if holding:
        kept = snap.files_holding(holding)
        if kept is not None:
            chosen = set(kept)
            files = [f for f in files if f in chosen]
    if len(files) > (DIRECT_MAX_OBJECTS if is_object_store(path) else DIRECT_MAX_FILES):
        return None
    schema = _schema(snap)
    if not files:
        return spark.createDataFrame([], schema)
    root = path.rstrip("/")
    return spark.read.schema(schema).parquet(*(f"{root}/{rel}" for rel in files))


def schema_of(spark: SparkSession, path: str) -> StructType:
    """The newest schema of the table at ``path`` as Spark reads it, from its log JVM-free (Spark's
    reader would rebuild the table's state first); through Delta when direct reads are off."""
    snap = delta_meta.TableSnapshot.open(path)
    if snap.table is None or not direct_io_on():
        return spark.read.format("delta").load(path).schema
    return _schema(snap)


def _schema(snap: delta_meta.TableSnapshot) -> StructType:
    """The schema of ``snap`` (a version of an existing table) as Spark reads it."""
    from pyspark.sql.types import StructType

    if snap.table is None:
        raise ValueError(f"{snap.path}: no table")
    return StructType.fromJson(_public(json.loads(snap.table.schema().to_json())))


def _public(schema: Any) -> Any:
    """A Delta schema (as JSON) without the ``delta.*`` field metadata Delta's own reader leaves out
    of what it returns (generation expressions, identity, column mapping): a transform that copies
    a column must not carry them into its destination."""
    if isinstance(schema, dict):
        out = {k: _public(v) for k, v in schema.items()}
        if isinstance(out.get("metadata"), dict):
            out["metadata"] = {k: v for k, v in out["metadata"].items() if not k.startswith("delta.")}
        return out
    if isinstance(schema, list):
        return [_public(v) for v in schema]
    return schema


def pin_inputs(ctx: UnitContext, topic: Topic, versions: dict[str, int], prefix: str, views: list[str]) -> dict[str, str]:
    """Temporary views of the inputs ``topic``'s SQL reads, each at the given Delta version (read
    by :func:`read_version`): lineage table -> view name (for :func:`spark_io.transform`'s
    ``tables``); the names are added to ``views`` (to drop when done). None for a Python
    transform: it reads what it names (:func:`lineage.views.refresh.inexact` says what that costs)."""
    out: dict[str, str] = {}
    if topic.python:
        return out
    for i, table in enumerate(spark_io.tables_read(topic, versions)):
        name = f"{prefix}_{i}"
        read_version(ctx.spark, ctx.path(table), versions[table]).createOrReplaceTempView(name)
        views.append(name)
        out[table] = name
    return out


#: Spark types whose values read from Arrow are those Spark collects (a timestamp's would not: time zones).
_EXACT_TYPES = ("BooleanType", "ByteType", "ShortType", "IntegerType", "LongType", "StringType", "DateType",
                "DecimalType")


def changed_values(spark: SparkSession, path: str, start: int, end: int, columns: Mapping[str, str],
                   limit: int) -> tuple[DataFrame, list[tuple[Any, ...]]] | None:
    """:func:`changed_value_rows` as a local relation (the table's types, the given names) and as rows."""
    from pyspark.sql.types import StructField, StructType

    rows = changed_value_rows(path, start, end, columns, limit)
    if rows is None:
        return None
    fields = {f.name: f for f in _schema(delta_meta.TableSnapshot.open(path)).fields}
    schema = StructType([StructField(name, fields[c].dataType, True) for c, name in columns.items()])
    return spark.createDataFrame(rows, schema), rows


def changed_value_rows(path: str, start: int, end: int, columns: Mapping[str, str], limit: int) -> list[tuple[Any, ...]] | None:
    """The distinct values of ``columns`` (the table's column -> the name to give it) in the rows
    of the change data feed of the table at ``path`` from version ``start`` to ``end`` (before and
    after images, inserts, deletes), read JVM-free by ``deltalake`` (Spark's reader first rebuilds
    the table's state: two jobs, 0.2-0.5 s at every reverse-joined unit, docs/benchmarks.md). None
    where Spark reads it: direct I/O off, a table with deletion vectors or column mapping
    (deltalake's change feed reads the files as they are), a column of a type whose Arrow value is
    not what Spark collects (timestamps, floats, nested), more than ``limit`` values, or a feed
    ``deltalake`` cannot read."""
    snap = delta_meta.TableSnapshot.open(path)
    if not direct_io_on() or snap.table is None or snap.version is None or snap.version < end:
        return None
    from resources.storage import delta_read

    if delta_read.needs_scan(snap.table):
        return None
    fields = {f.name: f for f in _schema(snap).fields}
    if not all(c in fields and type(fields[c].dataType).__name__ in _EXACT_TYPES for c in columns):
        return None
    try:
        import pyarrow as pa

        feed = pa.table(snap.table.load_cdf(starting_version=start, ending_version=end, columns=list(columns)))
        distinct = feed.select(list(columns)).group_by(list(columns), use_threads=False).aggregate([])
    except Exception:  # noqa: BLE001 - Spark reads it then (and says why if it cannot either)
        return None
    if distinct.num_rows > limit:
        return None
    return list(zip(*[distinct.column(c).to_pylist() for c in columns], strict=True))


#: A JVM-free filtered scan hands Spark at most this many rows (more: Spark scans the table itself).
MATCHING_ROWS = 1_000_000


def rows_matching(spark: SparkSession, snap: delta_meta.TableSnapshot, values: Mapping[str, Collection[Any]],
                  end: Position, schema: StructType, *, exclude_ids: Collection[int] = ()) -> DataFrame | None:
    """:func:`matching_rows` handed to Spark as a local relation of ``schema`` (the columns Spark
    reads the table with; other columns: None, Spark reads them)."""
    rows = matching_rows(snap, values, end, exclude_ids=exclude_ids)
    if rows is None or rows.column_names != schema.names:
        return None
    return spark_io.from_arrow(spark, rows, schema)


def matching_rows(snap: delta_meta.TableSnapshot, values: Mapping[str, Collection[Any]], end: Position, *,
                  exclude_ids: Collection[int] = (), columns: Collection[str] | None = None) -> pa.Table | None:
    """The rows of the table version ``snap`` whose column takes one of its values in ``values``
    (one column; a None among them matches a null), whose ``(pos, id)`` is at most ``end`` (a null
    ``id`` never is) and whose ``id`` is not in ``exclude_ids``, with ``columns`` and ``pos``, ``id``
    and the filtered column (None: every column, in the table's order): read JVM-free by ``deltalake``'s
    DataFusion reader (deletion vectors and column mapping applied). Spark would read every file
    for them: a base in ``(pos, id)`` order holds a customer's rows everywhere (1 s of Spark at 10M
    rows, where DataFusion took 0.6 s at 50M, docs/benchmarks.md). None where Spark reads them:
    direct I/O off, not one column, values other than integers and strings (their literal text in
    DataFusion and Spark may differ), more than :data:`MATCHING_ROWS` rows, or a table
    ``deltalake`` cannot read."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from resources.storage import delta_read

    wanted = _matching(snap, values)
    if wanted is None:
        return None
    column, predicate = wanted
    try:
        rows = delta_read.scan(snap.table, None if columns is None else sorted({*columns, "pos", "id", column}),
                               predicate=predicate)
    except Exception:  # noqa: BLE001 - Spark reads them then (and says why if it cannot either)
        return None
    rows = _upto_end(rows, end)
    if rows is None or not exclude_ids:
        return rows
    ids = rows.column("id")
    return rows.filter(pc.invert(pc.is_in(ids, value_set=pa.array(list(exclude_ids), ids.type))))


def indexed_rows(snap: delta_meta.TableSnapshot, index: str, values: Mapping[str, Collection[Any]], end: Position,
                 columns: Collection[str]) -> pa.Table | None:
    """:func:`matching_rows` (no ``exclude_ids``) read from the join index at ``index`` on that column
    (:mod:`resources.storage.join_index`) up to its ``upto``, and from the base after it (files
    pruned by ``pos``): where the base is in ``(pos, id)`` order, the index's sorted files are what
    the values' statistics prune. None where the index does not hold exactly ``snap``'s rows up to
    its ``upto`` with ``columns`` (see :func:`~resources.storage.join_index.usable`), or as for
    :func:`matching_rows`: the caller then reads the base."""
    import pyarrow as pa

    from resources.storage import delta_read, join_index

    wanted = _matching(snap, values)
    if wanted is None:
        return None
    column, predicate = wanted
    read = sorted({*columns, "pos", "id", column})
    try:
        found = join_index.usable(snap, index, column, read)
        if found is None:
            return None
        table, cov = found
        tail = in_range(join_index.rows_after(snap, cov.upto, read, predicate), cov.upto, end)
        if tail is None:
            return None
        rows = pa.concat_tables([delta_read.scan(table, read, predicate=predicate).select(read).cast(tail.schema),
                                 tail.select(read)])
    except Exception:  # noqa: BLE001 - (a refresh removed the files it opened, ...): the base is read
        return None
    return _upto_end(rows, end)


def _matching(snap: delta_meta.TableSnapshot, values: Mapping[str, Collection[Any]]) -> tuple[str, str] | None:
    """``(column, DataFusion predicate)`` of the rows whose one column takes one of its values in
    ``values`` (None: not read JVM-free, see :func:`matching_rows`)."""
    from resources.storage import delta_read

    if not direct_io_on() or snap.table is None or len(values) != 1:
        return None
    [(column, wanted)] = values.items()
    known = [v for v in wanted if v is not None]
    if not all(isinstance(v, int | str) and not isinstance(v, bool) for v in known):
        return None
    col = delta_read.quote(column)
    cond = [f"{col} IN ({', '.join(delta_read.sql_literal(v) for v in known)})"] if known else []
    cond += [f"{col} IS NULL"] if len(known) < len(wanted) else []
    return column, " OR ".join(cond) if cond else "false"


def _upto_end(rows: pa.Table, end: Position) -> pa.Table | None:
    return None if rows.num_rows > MATCHING_ROWS else in_range(rows, None, end)


def in_range(rows: pa.Table, low: Position | None, high: Position) -> pa.Table | None:
    """The rows of ``rows`` whose ``(pos, id)`` is after ``low`` (None: no lower bound) and at most
    ``high`` (a null ``id`` never is), as a block's bounds cut; None when ``pos`` is not a timestamp
    with a time zone or ``id`` not an integer."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if "pos" not in rows.column_names or "id" not in rows.column_names:
        return None
    pos, ids = rows.column("pos"), rows.column("id")
    if not pa.types.is_timestamp(pos.type) or pos.type.tz is None or not pa.types.is_integer(ids.type):
        return None

    def at(p: Position) -> Any:
        return pa.scalar(p.pos.replace(tzinfo=dt.UTC), pos.type)

    keep = pc.and_(pc.is_valid(ids), pc.or_(pc.less(pos, at(high)),
                                            pc.and_(pc.equal(pos, at(high)), pc.less_equal(ids, high.id))))
    if low is not None:
        keep = pc.and_(keep, pc.or_(pc.greater(pos, at(low)), pc.and_(pc.equal(pos, at(low)), pc.greater(ids, low.id))))
    return rows.filter(pc.fill_null(keep, False))
