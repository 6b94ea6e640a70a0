"""Where Tidemark's values cross into Spark and back, kept independent of the session's settings:

* :func:`ts_literal`: a position's timestamp as a Spark literal that denotes the same instant
  whatever ``spark.sql.session.timeZone`` a user or a host session sets;
* :func:`register_table`: a lineage table made readable by name in the session catalog without
  ever dropping a table Tidemark did not register itself (nor anything in a persistent catalog);
* :func:`observe_output` / :func:`observed_figures`: a block's row count and the null count of
  every column, computed by the write itself (no second scan, no 32-column limit);
* :func:`run_statements` / :func:`transform`: a topic's ``before``/``after`` SQL and its
  transforms, each failure named by topic, file and statement.
"""

from __future__ import annotations

import atexit
import datetime as dt
import decimal
import functools
import importlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lineage.core.errors import ProcessingError, first_line
from lineage.core.positions import to_naive_utc
from lineage.core.retry import retrying
from resources.spark.session import is_connect, stop_siblings

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame, DataFrameWriter, SparkSession
    from pyspark.sql.types import StructType

    from lineage.spec.model import Topic, Transform
    from resources.storage.delta_meta import TableSnapshot

_EPOCH = dt.datetime(1970, 1, 1)

log = logging.getLogger(__name__)


def epoch_micros(value: dt.datetime) -> int:
    """Microseconds since the Unix epoch of a naive-UTC (or aware) datetime."""
    return (to_naive_utc(value) - _EPOCH) // dt.timedelta(microseconds=1)


def from_epoch_micros(micros: int) -> dt.datetime:
    """The naive-UTC datetime ``micros`` microseconds after the Unix epoch (:func:`epoch_micros`'s inverse)."""
    return _EPOCH + dt.timedelta(microseconds=micros)


def ts_literal(value: dt.datetime) -> Column:
    """``value`` (naive UTC) as a Spark ``TIMESTAMP`` literal. Built from epoch microseconds, so
    neither the session's time zone (text cast) nor the driver's (Python datetime literal) can
    shift it. Constant-folded, so Delta still skips files by statistics."""
    from pyspark.sql import functions as F

    return F.timestamp_micros(F.lit(epoch_micros(value)))


# --------------------------------------------------------------------- catalog

#: Tables this process registered: ``schema.name`` -> the location it gave the table. Only these
#: may be re-pointed (dropped and created again), and never in a persistent catalog.
_REGISTERED: dict[str, str] = {}


def shared_catalog(spark: SparkSession) -> str | None:
    """Why ``spark``'s catalog is shared with others (None if it is this process's own in-memory
    catalog): a Spark Connect server's catalog serves every client, a Hive metastore (or any other
    persistent catalog) outlives the process."""
    if is_connect(spark):
        return "a Spark Connect server's catalog, shared by every client"
    impl = spark.conf.get("spark.sql.catalogImplementation", "in-memory")
    return None if impl == "in-memory" else f"the {impl} catalog (spark.sql.catalogImplementation={impl}), shared and persistent"


def register_table(spark: SparkSession, table: str, path: str | None) -> None:
    """Make ``table`` (``schema.name``) name the Delta table at ``path`` in the session catalog, as
    an external table (``path=None``: the lineage table does not exist yet; only a stale name this
    process registered is removed, so it cannot be read by mistake).

    A name already taken by anything else (a managed table, a view, a table someone else created
    over another location, or any table in a persistent catalog) is never dropped: a
    :class:`ProcessingError` names it and says how to fix. A Spark Connect server's catalog is
    shared by its clients, but in memory: there a name this process registered may be re-pointed
    (another client's registration never is: it is not in this process's record)."""
    schema, _, name = table.partition(".")
    ident = f"`{schema}`.`{name}`"
    exists = spark.catalog.tableExists(f"{schema}.{name}")
    if exists:
        kind, current = _describe(spark, ident)
        if path is not None and _same_location(current, path):
            return
        mine = kind == "EXTERNAL" and table in _REGISTERED and _same_location(_REGISTERED[table], current)
        shared = shared_catalog(spark)
        if not mine or (shared and not is_connect(spark)):
            where = f"{kind or 'unknown type'} table" + (f" at {current}" if current else "")
            why = ("Tidemark did not register it" + (f"; the catalog is {shared}" if shared else "") if not mine
                   else f"the catalog is {shared}")
            want = f"the lineage's {table} is at {path}" if path else f"the lineage's {table} is not created yet"
            raise ProcessingError(
                f"table {table}: the session catalog already has {table}, a {where}; {want}. Tidemark never drops "
                f"that table ({why}), and the transforms would read the wrong data under this name. Fix: rename or "
                f"drop that table (ALTER TABLE {table} RENAME TO ...), or rename {table} in the lineage"
            )
        # A table this process registered over another warehouse (another engine in this process):
        # re-point it. Dropping an external table keeps its files.
        spark.sql(f"DROP TABLE {ident}")
        _REGISTERED.pop(table, None)
    if path is None:
        return
    spark.sql(f"CREATE SCHEMA IF NOT EXISTS `{schema}`")
    spark.sql(f"CREATE TABLE {ident} USING delta LOCATION {sql_string(path)}")
    _REGISTERED[table] = _describe(spark, ident)[1] or path


def _describe(spark: SparkSession, ident: str) -> tuple[str, str]:
    """The table's type (``MANAGED``, ``EXTERNAL``, ``VIEW``) and location ('' if none)."""
    rows = spark.sql(f"DESCRIBE TABLE EXTENDED {ident}").collect()
    info = {r.col_name: r.data_type for r in rows}
    return str(info.get("Type") or "").upper(), str(info.get("Location") or "")


def _same_location(a: str, b: str) -> bool:
    def norm(x: str) -> str:
        return x.removeprefix("file:").lstrip("/").rstrip("/")

    return bool(a) and norm(a) == norm(b)


# --------------------------------------------------------------------- block figures


@dataclass(frozen=True)
class BlockFigures:
    """Exact figures of the rows a block wrote: their number and the null count of every
    top-level column (zeros included, so a column missing here is one that was not counted)."""

    rows: int
    nulls: dict[str, int]


@dataclass(frozen=True)
class BlockObservation:
    """An observation attached to a block's output (see :func:`observe_output`)."""

    observation: Any  # pyspark.sql.Observation (classic or Spark Connect)
    columns: tuple[str, ...]

    def figures(self) -> BlockFigures:
        """The figures, once the write has run (call only then: a classic session's observation
        waits for its action, and Delta skips a write whose transaction is already recorded)."""
        got = self.observation.get
        if "rows" not in got:
            raise ProcessingError("the block's write reported no observed figures")
        return BlockFigures(int(got["rows"]), {c: int(got.get(f"n{i}") or 0) for i, c in enumerate(self.columns)})


@dataclass(frozen=True)
class Counted:
    """A unit's figures counted before its write (the rows committed from the driver:
    :mod:`platform_assets.core.driver_writes`), read as a :class:`BlockObservation` is."""

    counted: BlockFigures

    def figures(self) -> BlockFigures:
        return self.counted


#: A step block of at most this many base rows is written as one file (:func:`one_file_if_small`).
SMALL_BLOCK_ROWS = 100_000


def one_file_if_small(out: DataFrame, base_rows: int) -> DataFrame:
    """``out`` (a block's output) in one partition, so its commit adds one file, when the block holds
    1 to :data:`SMALL_BLOCK_ROWS` base rows; else ``out`` as it is. A small block read from several
    of its base's files (a feeder's commit every few seconds) otherwise wrote one file per base file
    (3 files of 13-50 rows per block in the demo), and every later snapshot, join and compaction of
    the destination pays per file. One task writes the block: at that size, under a second."""
    return out.coalesce(1) if 1 <= base_rows <= SMALL_BLOCK_ROWS else out


def observe_output(out: DataFrame) -> tuple[DataFrame, BlockObservation]:
    """``out`` with an observation of its row count and every column's null count attached: the
    figures are computed while the write runs (no extra scan). Write the returned DataFrame."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    obs = Observation(f"tidemark_{uuid.uuid4().hex}")
    exprs = [F.count(F.lit(1)).alias("rows")]
    exprs += [F.count_if(F.col(f"`{c.replace('`', '``')}`").isNull()).alias(f"n{i}") for i, c in enumerate(out.columns)]
    return out.observe(obs, *exprs), BlockObservation(obs, tuple(out.columns))


# --------------------------------------------------------------------- a topic's SQL and transforms


def run_statements(spark: SparkSession, topic: Topic, which: str) -> None:
    """Run the topic's ``before`` or ``after`` statements (``which``), in order."""
    for i, stmt in enumerate(getattr(topic.spec, which), 1):
        try:
            spark.sql(stmt)
        except Exception as exc:
            raise ProcessingError(f"topic '{topic.name}' ({topic.where}): {which} statement {i} failed: {first_line(exc)}\n  {stmt}") from exc


def tables_read(topic: Topic, tables: Iterable[str]) -> list[str]:
    """Those of ``tables`` (``schema.name``) that ``topic``'s SQL (transforms, ``before``,
    ``after``) names, plain or back-quoted, in any case; all of them when a transform is Python
    code (it may read any table)."""
    tables = list(tables)
    if topic.python:
        return tables
    text = "\n".join([*(t.sql or "" for t in topic.transforms), *topic.spec.before, *topic.spec.after])
    return [table for table in tables if _table_pattern(table).search(text)]


@functools.cache
def _table_pattern(table: str) -> re.Pattern[str]:
    """How SQL names ``table`` (``schema.name``): plain or back-quoted parts, in any case."""
    schema, _, name = table.partition(".")
    part = r"(?:`{0}`|(?<![\w`]){0}(?![\w`]))"
    return re.compile(part.format(re.escape(schema)) + r"\s*\.\s*" + part.format(re.escape(name)), flags=re.IGNORECASE)


#: A SQL string literal or comment: names inside them are not table references.
_NOT_CODE = re.compile(r"'(?:[^'\\]|\\.|'')*'|\"(?:[^\"\\]|\\.)*\"|--[^\n]*|/\*.*?\*/", flags=re.S)


def bind_tables(sql: str, views: dict[str, str]) -> str:
    """``sql`` with every reference to a lineage table of ``views`` (``schema.name`` -> temporary
    view) replaced by the view, outside string literals and comments: how a transform reads an
    input at a pinned Delta version (the version a unit planned, or the one before a change)."""
    if not views:
        return sql
    out, at = [], 0
    for m in [*_NOT_CODE.finditer(sql), None]:
        code = sql[at:m.start()] if m is not None else sql[at:]
        for table, view in views.items():
            code = _table_pattern(table).sub(view, code)
        out.append(code)
        if m is not None:
            out.append(m.group(0))
            at = m.end()
    return "".join(out)


def transform(spark: SparkSession, topic: Topic, block_df: DataFrame, view: str = "block",
              tables: dict[str, str] | None = None, paths: Mapping[str, str] | None = None) -> DataFrame:
    """The topic's output over ``block_df`` (the view ``block``): its transforms' results, unioned by name.

    ``view``: the temporary view holding ``block_df`` when it is not ``block``; SQL transforms then
    read it as ``block`` through a CTE bound in their own plan, so one process can build outputs
    over different blocks at once (a view replaced later, or resolved late by Spark Connect, cannot
    change them).

    ``tables``: lineage tables a SQL transform reads from the given temporary views instead (see
    :func:`bind_tables`; a Python transform reads what it names).

    ``paths``: the locations of the topic's inputs (``depends_on``), to say in the error of a
    transform that reads a column one of them renamed or dropped (column mapping) where that
    happened."""
    outs = [_one_transform(spark, topic, t, block_df, view, tables or {}, paths or {}) for t in topic.transforms]
    out = outs[0]
    for other in outs[1:]:
        out = out.unionByName(other, allowMissingColumns=True)
    return out


def bind_block(sql: str, view: str) -> str:
    """``sql`` with ``block`` bound to temporary view ``view`` by a leading CTE (merged into the
    statement's own ``WITH`` if it has one; leading comments kept)."""
    head = re.match(r"\s*(?:(?:--[^\n]*(?:\n|$)|/\*.*?\*/)\s*)*", sql, flags=re.S)
    at = head.end() if head else 0
    cte = f"block AS (SELECT * FROM {view})"
    rest = sql[at:]
    if re.match(r"with\b", rest, flags=re.I):
        return f"{sql[:at]}WITH {cte}, {rest[4:].lstrip()}"
    return f"{sql[:at]}WITH {cte}\n{rest}"


def _one_transform(spark: SparkSession, topic: Topic, t: Transform, block_df: DataFrame, view: str,
                   tables: dict[str, str], paths: Mapping[str, str]) -> DataFrame:
    from pyspark.sql import DataFrame as SparkDataFrame

    try:
        if t.python is not None:
            module, func = t.python
            result = getattr(importlib.import_module(module), func)(block_df)
            if not isinstance(result, SparkDataFrame) and not hasattr(result, "write"):
                raise ProcessingError(f"{t.ref} returned {type(result).__name__}, not a Spark DataFrame")
            return result
        sql = bind_tables(t.sql or "", tables)
        return spark.sql(sql if view == "block" else bind_block(sql, view))
    except ProcessingError:
        raise
    except Exception as exc:
        raise ProcessingError(f"topic '{topic.name}' ({topic.where}): transform {t.ref} failed: {first_line(exc)}"
                              f"{_gone_column(str(exc), topic, paths)}") from exc


def _gone_column(error: str, topic: Topic, paths: Mapping[str, str]) -> str:
    """For an error about a column Spark cannot resolve: which of the topic's inputs renamed or
    dropped it, and at which version ("" when none did, or the error is another)."""
    m = re.search(r"UNRESOLVED_COLUMN\.\w+\].*?name ((?:`[^`]+`\.?)+)", error)
    if not m:
        return ""
    from resources.storage import delta_log, delta_read

    column = re.findall(r"`([^`]+)`", m.group(1))[-1]  # (`b`.`note`: the column of a qualified name)
    for table in topic.spec.depends_on:
        found = delta_log.open_table(paths[table]) if table in paths else None
        fate = delta_read.column_fate(found, column) if found is not None else None
        if fate is not None:
            return f" ({table} {fate}: change the transform to read the column by its new name, or not at all)"
    return ""


# --------------------------------------------------------------------- keyed joins and MERGE (merge topics)


def quote(col: str) -> str:
    """``col`` as a Spark SQL identifier."""
    return "`" + col.replace("`", "``") + "`"


_PLAIN = re.compile(r"[ -~]*")  # printable ASCII: a quoted literal needs no escape but \\ and '


def sql_literal(value: Any) -> str | None:
    """``value`` (as ``collect`` returns it) as Spark SQL literal text, for the types whose text
    is exact whatever the session's settings (integers, booleans, decimals, dates, printable
    strings); None for any other (timestamps depend on the driver's time zone, floats on
    formatting). Literal text costs one parse, where a Python ``Column`` per value costs a JVM
    round trip each."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, decimal.Decimal):
        return f"{value}BD" if value.is_finite() else None
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return f"DATE'{value.isoformat()}'"
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return sql_string(value)
    return None


def one_of(column: str, values: Collection[Any]) -> str | None:
    """SQL text: ``column`` (as written) equals one of ``values``, a null by ``IS NULL``; ``FALSE``
    for no values. None when a value has no exact literal text (:func:`sql_literal`)."""
    texts = [sql_literal(v) for v in values if v is not None]
    if None in texts:
        return None
    conds = ([f"{column} IN ({', '.join(t for t in texts if t is not None)})"] if texts else []) \
        + ([f"{column} IS NULL"] if None in values else [])
    return " OR ".join(conds) or "FALSE"


def sql_string(text: str) -> str:
    """``text`` as a quoted Spark SQL string literal (backslashes and quotes escaped)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _on(cols: list[str], names: list[str]) -> Column:
    """Null-safe equality of ``l.cols`` and ``r.names`` (both sides aliased: a plan joined with
    itself needs qualified names)."""
    from pyspark.sql import functions as F

    return functools.reduce(lambda a, b: a & b, [F.col(f"l.{quote(c)}").eqNullSafe(F.col(f"r.{quote(n)}"))
                                                 for c, n in zip(cols, names, strict=True)])


def _keys(right: DataFrame, cols: list[str]) -> tuple[DataFrame, list[str]]:
    names = [f"_tm_k{i}" for i in range(len(cols))]
    return right.select(*[right[c].alias(n) for c, n in zip(cols, names, strict=True)]).alias("r"), names


def semi_join(left: DataFrame, right: DataFrame, cols: list[str]) -> DataFrame:
    """Rows of ``left`` whose ``cols`` equal (null-safe) those of some row of ``right``."""
    r, names = _keys(right, cols)
    return left.alias("l").join(r, _on(cols, names), "left_semi")


def rows_of_keys(keys: DataFrame, rows: DataFrame, cols: list[str]) -> DataFrame:
    """Every key of ``keys`` with its row of ``rows`` (null columns where ``rows`` has none)."""
    from pyspark.sql import functions as F

    r, names = _keys(keys, cols)
    joined = r.join(rows.alias("l"), _on(cols, names), "left")
    # the key from ``keys`` (``rows``' is null for a key no longer produced), every other column from ``rows``
    return joined.select(*[F.col(f"r.{n}").alias(c) for c, n in zip(cols, names, strict=True)],
                         *[F.col(f"l.{quote(c)}") for c in rows.columns if c not in cols])


#: Delta's optimistic concurrency: a commit that lost to a concurrent one touching the same files.
_CONFLICT = re.compile(r"DELTA_CONCURRENT_|Concurrent(Append|DeleteRead|DeleteDelete|Transaction|Write)Exception"
                       r"|DELTA_METADATA_CHANGED|MetadataChangedException|DELTA_PROTOCOL_CHANGED|ProtocolChangedException")
#: How often a write that lost to a concurrent commit is tried again.
CONFLICT_ATTEMPTS = 5


DELETION_VECTORS = "delta.enableDeletionVectors"


def set_deletion_vectors(spark: SparkSession, path: str, want: bool, snap: TableSnapshot | None = None) -> str:
    """The existing Delta table at ``path`` (``snap``: it now, when the caller has it open) with
    deletion vectors on or off as ``want`` says; what was done ("" when nothing). Off drops the
    table feature (Delta rewrites the files that carry a vector), so the ``deltalake`` reader
    (pandas, polars, JVM-free tools) reads the table again."""
    from resources.storage import delta_meta

    have = delta_meta.deletion_vectors(snap or delta_meta.TableSnapshot.open(path))
    if want and not have.enabled:
        spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('{DELETION_VECTORS}' = 'true')")
        return "deletion vectors on"
    if not want and have.feature:
        spark.sql(f"ALTER TABLE delta.`{path}` DROP FEATURE deletionVectors")
        return "deletion vectors off; the table feature dropped, its files rewritten without them"
    if not want and have.enabled:
        spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('{DELETION_VECTORS}' = 'false')")
        return "deletion vectors off"
    return ""


def is_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` is Delta's "a concurrent commit changed what this one read" (classic and Connect)."""
    return bool(_CONFLICT.search(f"{type(exc).__name__}: {exc}"))


def retry_conflicts(write: Callable[[], Any], attempts: int = CONFLICT_ATTEMPTS) -> Any:
    """``write()``, again when it lost to a concurrent commit (e.g. ``tidemark maintain`` compacting
    the files a MERGE read: the MERGE is planned again from the newer version, with the same rows).
    Safe: the losing commit did not land, and the write is idempotent by its txn id."""
    return retrying(write, attempts=attempts, retryable=is_conflict, backoff_s=0.5,
                    on_retry=lambda exc, n: log.warning("write lost to a concurrent commit (%s); trying again (%d of %d)",
                                                        first_line(exc)[:200], n, attempts))


def as_unit(writer: DataFrameWriter, *, app_id: str, seq: int, meta: str) -> DataFrameWriter:
    """``writer`` (a Delta write) as the commit of one unit: carrying ``txnAppId=app_id``/
    ``txnVersion=seq`` (Delta skips the write when it recorded that version of the app already:
    a replay lands nothing twice) and ``meta`` as its ``userMetadata`` (where the next unit starts).
    A ``MERGE`` sets the same through session settings: :func:`run_merge`."""
    return writer.option("txnAppId", app_id).option("txnVersion", seq).option("userMetadata", meta)


def save_unit(writer: DataFrameWriter, dest: str, *, app_id: str, seq: int, meta: str) -> None:
    """``writer`` saved to ``dest`` as the commit of one unit (:func:`as_unit`), again when it lost
    to a concurrent commit (:func:`retry_conflicts`): a compaction that removed the files it
    replaces, or another first write of the table (a killed client's write going on in its Spark
    Connect server). The txn id skips a retry whose unit landed meanwhile."""
    retry_conflicts(lambda: as_unit(writer, app_id=app_id, seq=seq, meta=meta).save(dest))


#: How long a process that is ending waits for the txn-state look-aheads it started (:func:`look_ahead_txn_state`).
LOOK_AHEAD_EXIT_WAIT_S = 20.0
_look_aheads: list[threading.Thread] = []  # look-aheads and deferred session stops an ending process waits for
_look_aheads_awaited: list[bool] = []  # the exit handler registered
_look_ahead_guard = threading.Lock()


class LookAhead(threading.Thread):
    """A background ``DESCRIBE DETAIL`` of one Delta table on ``session`` (:func:`look_ahead_txn_state`).

    It lets go of ``session`` when it ends (``session`` is then ``None``): a finished look-ahead
    must not keep a session, nor the sibling sessions made for it (:func:`sibling_sessions`), from
    being collected. An uncollected Spark Connect session's client stays open, and pyspark's exit
    handler then calls its server, retrying for minutes when the server is gone."""

    def __init__(self, session: SparkSession, dest: str) -> None:
        super().__init__(name=f"tidemark-txn-look-ahead-{dest.rsplit('/', 1)[-1]}", daemon=True)
        self.session: SparkSession | None = session
        self.dest = dest

    def run(self) -> None:
        session = self.session
        try:
            if session is not None:
                session.sql(f"DESCRIBE DETAIL delta.`{self.dest}`").collect()
        except Exception as exc:  # noqa: BLE001 - a look-ahead; the next write computes the state itself
            log.debug("txn state look-ahead of %s failed: %s", self.dest, first_line(exc))
        finally:
            self.session = None


def look_ahead_txn_state(spark: SparkSession, dest: str) -> LookAhead | None:
    """After a unit's commit to the Delta table at ``dest`` through a Spark Connect server: have
    the server compute the table's state at its newest version now, in a background thread, so
    that the next unit's write does not.

    A write carrying ``txnAppId``/``txnVersion`` (:func:`as_unit`, :func:`run_merge`) makes Delta
    look the application's version up in the table's full state (``Snapshot.setTransactions``), a
    Spark job over the log that the server caches with the snapshot. The snapshot a commit leaves
    has no such state yet, so every next unit paid for it inside its write (1.0-1.5 s on a warm
    server with a new session per unit; 0.3-0.4 s once computed). ``DESCRIBE DETAIL`` computes it
    and writes nothing (a missing table stays missing). The server outlives the process (each
    Dagster run is one), hence Connect only: a classic session's JVM ends with its process. An
    ending process waits up to :data:`LOOK_AHEAD_EXIT_WAIT_S` for these threads (after its run
    reported its result). A failure only costs the next write the lookup; it is logged at debug
    level. ``TIDEMARK_TXN_LOOK_AHEAD=0`` turns this off."""
    if not is_connect(spark) or os.environ.get("TIDEMARK_TXN_LOOK_AHEAD", "1") == "0":
        return None
    thread = LookAhead(spark, dest)
    _start_tracked(thread)
    return thread


def stop_session(spark: SparkSession) -> None:
    """Stop ``spark`` (a session Tidemark started) once the look-aheads it runs have ended
    (:func:`look_ahead_txn_state`): at once when none runs, else from a background thread the
    ending process waits for. Stopping a Connect session releases it on the server, which cancels
    what it still runs. The sibling sessions made for it (:func:`sibling_sessions`) are closed with
    it (:func:`stop_siblings`)."""
    with _look_ahead_guard:
        running = [t for t in _look_aheads if isinstance(t, LookAhead) and t.session is spark and t.is_alive()]
    if not running:
        stop_siblings(spark)
        spark.stop()
        return

    def stop_later() -> None:
        for t in running:
            t.join(LOOK_AHEAD_EXIT_WAIT_S)
        stop_siblings(spark)
        spark.stop()

    _start_tracked(threading.Thread(target=stop_later, name="tidemark-session-stop", daemon=True))


def _start_tracked(thread: threading.Thread) -> None:
    with _look_ahead_guard:
        if not _look_aheads_awaited:
            atexit.register(_await_look_aheads)
            _look_aheads_awaited.append(True)
        _look_aheads[:] = [t for t in _look_aheads if t.is_alive()]
        _look_aheads.append(thread)
    thread.start()


def _await_look_aheads(timeout: float | None = None) -> None:
    """Wait for the look-aheads and deferred stops started so far, at most ``timeout`` seconds in all."""
    deadline = time.monotonic() + (LOOK_AHEAD_EXIT_WAIT_S if timeout is None else timeout)
    with _look_ahead_guard:
        threads = list(_look_aheads)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def run_merge(spark: SparkSession, sql: str, source: DataFrame, *, app_id: str, seq: int, meta: str,
              in_hand: bool = False) -> None:
    """Run a ``MERGE`` statement whose ``{source}`` is ``source`` as one Delta commit carrying
    ``txnAppId=app_id``/``txnVersion=seq`` (Delta's idempotency settings for DML, as session
    settings: a replay is skipped) and ``meta`` as its ``userMetadata``.

    ``in_hand``: the source is rows already computed in a local checkpoint (and deterministic
    operators over them), which give the same rows each time they are read. Delta copies a source
    that is not a Delta scan (``localCheckpoint``) before the MERGE's two passes over it, so that
    both see the same rows; such a source needs no copy
    (``spark.databricks.delta.merge.materializeSource = none``). Not for a large local relation
    from Arrow: reading it twice cost more than the copy (a CDC unit of 1M events, bench/cdc_apply.py)."""
    name = f"tm_merge_{uuid.uuid4().hex[:10]}"
    source.createOrReplaceTempView(name)
    confs = {"spark.databricks.delta.write.txnAppId": app_id, "spark.databricks.delta.write.txnVersion": str(seq),
             "spark.databricks.delta.commitInfo.userMetadata": meta,
             **({"spark.databricks.delta.merge.materializeSource": "none"} if in_hand else {})}
    try:
        for k, v in confs.items():
            spark.conf.set(k, v)
        retry_conflicts(lambda: spark.sql(sql.replace("{source}", name)).collect())
    finally:
        for k in confs:
            spark.conf.unset(k)
        spark.catalog.dropTempView(name)


def from_arrow(spark: SparkSession, rows: pa.Table, schema: StructType) -> DataFrame | None:
    """``rows`` (in the driver, as Arrow) as a local relation of ``schema``; None where Spark does
    not take such values from Arrow (the caller then lets Spark compute them)."""
    try:
        return spark.createDataFrame(rows, schema)
    except Exception:  # noqa: BLE001 - the caller's Spark path computes the same rows
        return None


def small_local(spark: SparkSession, df: DataFrame, limit: int) -> tuple[DataFrame, list[Any] | None]:
    """``df`` computed once and handed back as a local relation when it has at most ``limit`` rows
    (then Spark broadcasts it into joins and no plan computes it again), with its rows; else ``df``
    itself and None."""
    rows = df.limit(limit + 1).collect()
    if len(rows) > limit:
        return df, None
    return spark.createDataFrame(rows, df.schema), rows
