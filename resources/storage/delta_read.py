"""Rows and statistics of Delta tables as Spark and Databricks write them, JVM-free: column
mapping (``name`` and ``id``) and deletion vectors, through ``deltalake``'s own readers.

- Rows of a whole table: ``DeltaTable.scan`` (deltalake's DataFusion reader, which applies the
  deletion vectors and the column mapping), normalised to the plain Arrow types the rest of
  Tidemark reads (``string``, not ``string_view``; no field metadata): :func:`scan`.
- Statistics: the log keeps them under the columns' physical names (``col-<uuid>``);
  :func:`logical_files` gives the add actions with the table's own column names.
- One data file's rows, for the few places that read chosen files (late rows): the Parquet file
  read as it is, its physical columns named as the table names them (:class:`FileReader`).

Nothing here parses the Delta log or a deletion vector itself; that is deltalake's job.
May import: pyarrow, deltalake, ``lineage.core``, ``resources.core``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from lineage.core.errors import ProcessingError
from resources.core.lru import Bounded

#: Reader features the ``pyarrow`` dataset path of deltalake refuses and its DataFusion reader reads.
SCANNED_FEATURES = frozenset({"deletionVectors", "columnMapping"})

PHYSICAL_NAME = "delta.columnMapping.physicalName"


def column_mapping(table: Any) -> str:
    """The table's column mapping mode: ``none``, ``name`` or ``id``."""
    return str((table.metadata().configuration or {}).get("delta.columnMapping.mode", "none")).lower()


def needs_scan(table: Any) -> bool:
    """Whether ``table``'s rows must be read through deltalake's DataFusion reader: it has column
    mapping (reader version 2, or the ``columnMapping`` feature) or deletion vectors."""
    proto = table.protocol()
    return (proto.min_reader_version == 2 or bool(SCANNED_FEATURES & set(proto.reader_features or ()))
            or column_mapping(table) != "none")


def physical_names(table: Any) -> dict[str, str]:
    """``{physical name: column name}`` of ``table``'s top-level columns that are stored under
    another name (empty without column mapping)."""
    if column_mapping(table) == "none":
        return {}
    out: dict[str, str] = {}
    for f in table.schema().fields:
        physical = (f.metadata or {}).get(PHYSICAL_NAME)
        if isinstance(physical, str) and physical != f.name:
            out[physical] = f.name
    return out


def logical_files(table: Any, names: Mapping[str, str] | None = None) -> pa.Table:
    """``table.get_add_actions(flatten=True)`` with the statistics' columns (``min.<c>``,
    ``max.<c>``, ``null_count.<c>``) named by the table's column names instead of their
    physical names (``names``: :func:`physical_names` of ``table``, when the caller has them)."""
    files = pa.table(table.get_add_actions(flatten=True))
    names = physical_names(table) if names is None else names
    if not names:
        return files
    return files.rename_columns([_logical_stat(c, names) for c in files.column_names])


def _logical_stat(column: str, names: Mapping[str, str]) -> str:
    kind, dot, rest = column.partition(".")
    if not dot:
        return column
    head, sub, tail = rest.partition(".")
    return f"{kind}.{names.get(head, head)}{sub}{tail}"


def logical_stats(stats: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """A file's statistics as the log holds them (``{"minValues": {physical: v}, ...}``) with
    the table's column names (``names``: :func:`physical_names`)."""
    if not names:
        return dict(stats)
    return {k: ({names.get(c, c): x for c, x in v.items()} if isinstance(v, dict) else v) for k, v in stats.items()}


def plain_type(t: pa.DataType) -> pa.DataType:
    """``t`` with the view types DataFusion returns (``string_view``, ``binary_view``) as the
    plain ones, inside nested types too."""
    if t == pa.string_view():
        return pa.string()
    if t == pa.binary_view():
        return pa.binary()
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, plain_type(f.type), f.nullable) for f in t])
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = t.value_field
        kind = pa.list_ if pa.types.is_list(t) else pa.large_list
        return kind(pa.field(item.name, plain_type(item.type), item.nullable))
    if pa.types.is_map(t):
        return pa.map_(plain_type(t.key_type), plain_type(t.item_type))
    return t


def plain(table: pa.Table) -> pa.Table:
    """``table`` with plain types and without field metadata (see :func:`plain_type`)."""
    schema = pa.schema([pa.field(f.name, plain_type(f.type), f.nullable) for f in table.schema])
    return table if table.schema.equals(schema, check_metadata=True) else table.cast(schema)


def scan(table: Any, columns: Sequence[str] | None = None, predicate: str | None = None) -> pa.Table:
    """The rows of ``table`` (a ``deltalake.DeltaTable``) where ``predicate`` (DataFusion SQL, or
    None: every row) holds, with ``columns`` (None: all), deletion vectors applied and columns
    named as the table names them. Files whose statistics rule the predicate out are not read."""
    reader = table.scan(columns=list(columns) if columns is not None else None, predicate=predicate)
    return plain(pa.table(reader.read_all()))


@contextlib.contextmanager
def readable(where: str) -> Iterator[None]:
    """Reads of the rows of the table at ``where`` inside: deltalake's refusal of a reader feature
    neither of its readers supports (``typeWidening``, as of deltalake 1.6) raised as a
    :class:`ProcessingError` that names the table and the way out, not as a library traceback."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only the refusal is turned; anything else is raised as it is
        text = str(exc)
        found = re.search(r"reader features:? \{([^}]*)\}|Unsupported table features required: \[([^\]]*)\]", text)
        if found is None:
            raise
        features = [f.strip(" '\"") for f in (found.group(1) or found.group(2) or "").split(",") if f.strip(" '\"")]
        feature = next((f[0].lower() + f[1:] for f in features), "...")  # (DataFusion's error capitalises it)
        raise ProcessingError(
            f"{where}: deltalake cannot read this table's rows (reader features: {', '.join(features)}), and Tidemark "
            f"reads them without a JVM to plan blocks: drop the feature from the table (ALTER TABLE delta.`{where}` "
            f"DROP FEATURE {feature}) or read it as a later input of depends_on (Spark reads those)") from exc


def sql_literal(value: Any) -> str:
    """``value`` (a naive UTC datetime, an int, a str) as a DataFusion SQL literal."""
    import datetime as dt

    if isinstance(value, dt.datetime):
        return f"TIMESTAMP '{value.replace(tzinfo=None).isoformat(sep=' ', timespec='microseconds')}'"
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"no SQL literal for {value!r}")
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


def nanosecond_range(ts: Any) -> bool:
    """Whether ``ts`` (a naive UTC datetime, or None) is a bound DataFusion can plan with: it
    simplifies timestamp literals through nanoseconds, which end before 1678 and after 2261."""
    import datetime as dt

    return isinstance(ts, dt.datetime) and dt.datetime(1678, 1, 1) < ts.replace(tzinfo=None) < dt.datetime(2262, 1, 1)


def quote(column: str) -> str:
    """``column`` as a DataFusion SQL identifier."""
    return '"' + column.replace('"', '""') + '"'


class FileReader:
    """Reads chosen data files of one table version with its column names: a file of a table with
    column mapping holds its columns under their physical names. The rows are the file's own, all
    of them: a deletion vector added since does not hide a row from this read (late-row detection
    looks for rows that arrived, whatever happened to them after)."""

    def __init__(self, table: Any, names: Mapping[str, str] | None = None) -> None:
        self.names = physical_names(table) if names is None else dict(names)
        self.columns = [f.name for f in table.schema().fields]

    def logical(self, part: pa.Table) -> pa.Table:
        """``part`` (a data file's columns) named by the table's column names; a physical column the
        table no longer has (dropped) is left out."""
        if not self.names:
            return part
        keep = [i for i, c in enumerate(part.column_names) if self.names.get(c, c) in self.columns]
        part = part.select(keep)
        return part.rename_columns([self.names.get(c, c) for c in part.column_names])

    def read(self, file: str, fs: Any) -> pa.Table:
        """Every row of the data file at ``file`` (on ``fs``), columns named as the table names them."""
        import pyarrow.dataset as pads

        return self.logical(pads.dataset(file, format="parquet", filesystem=fs).to_table())


def read_parquet_range(file: str, fs: Any, columns: list[str], column: str, low: dt.datetime | None,
                       high: dt.datetime | None) -> pa.Table:
    """``columns`` of the Parquet file ``file`` (on ``fs``), from the row groups whose statistics of
    the timestamp ``column`` allow a value in ``[low, high]`` (naive UTC; None: unbounded) and every
    row group without such statistics. A file in ``column`` order, written in small row groups (a
    compaction by ``tidemark maintain``), is read in the few groups that can hold the range."""
    import pyarrow.parquet as pq

    key = _FOOTERS.key(file, fs)
    meta = _FOOTERS.get(key)
    pf = pq.ParquetFile(file, filesystem=fs, coerce_int96_timestamp_unit="us", metadata=meta)
    if meta is None and key is not None:
        _FOOTERS.put(key, pf.metadata)
    groups = _row_groups(pf.metadata, column, low, high)
    if groups is None:
        return pf.read(columns=columns, use_threads=False)
    return pf.read_row_groups(groups, columns=columns, use_threads=False)


class _Footers:
    """The Parquet footers (``FileMetaData``) read last, by file: planning reads the newest file of
    a base on every tick, and a compacted file's footer lists every row group's statistics. A
    Delta data file is written once under a name of its own; the file's size and modification
    time, looked up on each use, are part of the key all the same."""

    def __init__(self, size: int = 256) -> None:
        self._footers: Bounded[tuple[str, int, int], Any] = Bounded(size)

    @staticmethod
    def key(file: str, fs: Any) -> tuple[str, int, int] | None:
        """The file's path, size and modification time (None: not found, or no file system given)."""
        if fs is None:
            return None
        try:
            info = fs.get_file_info(file)
        except (OSError, ValueError):
            return None
        return None if info.size is None else (file, int(info.size), int(info.mtime_ns or 0))

    def get(self, key: tuple[str, int, int] | None) -> Any | None:
        return None if key is None else self._footers.get(key)

    def put(self, key: tuple[str, int, int], meta: Any) -> None:
        self._footers.put(key, meta)

    def clear(self) -> None:
        self._footers.clear()


_FOOTERS = _Footers()


#: Nanoseconds per unit of a Parquet timestamp's ``timeUnit``.
NS_PER = {"milliseconds": 1_000_000, "microseconds": 1_000, "nanoseconds": 1}


def footer_type(column: Any) -> dict[str, Any]:
    """A Parquet footer's column (``meta.schema.column(i)``): its physical type (``physical``) and
    its logical type's fields (``Type``, ``timeUnit``, ``isSigned``, ...)."""
    return {"physical": column.physical_type, **json.loads(column.logical_type.to_json())}


def timestamp_ns_per(column: Any) -> int | None:
    """Nanoseconds per stored unit of a footer's column that is an INT64 timestamp (then its raw
    statistics, ``min_raw``/``max_raw``, are those units since the epoch: UTC for an instant, the
    wall clock read as UTC for a timestamp without time zone); None for any other column."""
    kind = footer_type(column)
    if kind["physical"] != "INT64" or kind.get("Type") != "Timestamp":
        return None
    return NS_PER.get(kind.get("timeUnit", ""))


def epoch_ns(value: dt.datetime) -> int:
    """A naive UTC ``value`` as nanoseconds since the epoch."""
    return (value - dt.datetime(1970, 1, 1)) // dt.timedelta(microseconds=1) * 1_000


def _row_groups(meta: Any, column: str, low: dt.datetime | None, high: dt.datetime | None) -> list[int] | None:
    """The row groups of a file (its ``meta``) that may hold a ``column`` value in ``[low, high]``;
    None: all of them (one group, no bounds, or no usable statistics). An INT64 timestamp (what
    Spark, deltalake and pyarrow write) is compared by its raw statistics: a compacted file's
    footer lists dozens of groups, and making a ``datetime`` of each bound costs more than the rest."""
    if meta.num_row_groups < 2 or (low is None and high is None):
        return None
    at = next((i for i in range(meta.num_columns) if meta.schema.column(i).path == column), None)
    if at is None:
        return None
    per = timestamp_ns_per(meta.schema.column(at))
    if per is not None:
        bottom, top = (None if low is None else epoch_ns(low)), (None if high is None else epoch_ns(high))
        keep = []
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(at).statistics
            if stats is None or not stats.has_min_max or not (
                    (top is not None and stats.min_raw * per > top) or (bottom is not None and stats.max_raw * per < bottom)):
                keep.append(g)
        return keep
    aware = (None if low is None else low.replace(tzinfo=dt.UTC), None if high is None else high.replace(tzinfo=dt.UTC))
    keep = []
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(at).statistics
        try:
            lo, hi = (stats.min, stats.max) if stats is not None and stats.has_min_max else (None, None)
            # (an aware value, isAdjustedToUTC, is compared with the bounds as UTC; a naive one as they are)
            bottom_dt, top_dt = aware if isinstance(lo, dt.datetime) and lo.tzinfo is not None else (low, high)
            out = (isinstance(lo, dt.datetime) and isinstance(hi, dt.datetime)
                   and ((top_dt is not None and lo > top_dt) or (bottom_dt is not None and hi < bottom_dt)))
        except (ValueError, TypeError, OverflowError):  # e.g. nanoseconds beyond datetime's range
            out = False
        if not out:
            keep.append(g)
    return keep


def read_rows(table: Any, columns: Sequence[str] | None = None) -> pa.Table:
    """Every row of ``table`` with ``columns`` (None: all): deltalake's ``pyarrow`` dataset for a
    plain table (as cheap as before), its DataFusion reader for one with column mapping or
    deletion vectors."""
    if needs_scan(table):
        return scan(table, columns)
    return table.to_pyarrow_dataset().to_table(columns=list(columns) if columns is not None else None)


def count_rows(table: Any) -> int:
    """How many rows ``table`` holds, deleted ones (deletion vectors) not counted."""
    if not needs_scan(table):
        return int(table.to_pyarrow_dataset().count_rows())
    from deltalake import QueryBuilder

    result = pa.table(QueryBuilder().register("t", table).execute("SELECT count(*) AS n FROM t").read_all())
    return int(result.column("n")[0].as_py())


def deleted_rows(table: Any) -> tuple[int, int]:
    """``(files, rows)``: how many of ``table``'s data files carry a deletion vector, and how many
    rows those vectors mark deleted (from deltalake's ``deletion_vectors``; ``(0, 0)`` for a table
    without the feature)."""
    if "deletionVectors" not in set(table.protocol().reader_features or ()):
        return 0, 0
    import pyarrow.compute as pc

    vectors = pa.table(table.deletion_vectors())
    if not vectors.num_rows:
        return 0, 0
    keep = pc.list_flatten(vectors.column("selection_vector"))
    return vectors.num_rows, len(keep) - int(pc.sum(keep).as_py() or 0)


def column_fate(table: Any, column: str, *, commits: int = 1000) -> str | None:
    """What became of ``column`` in ``table``, from the newest ``commits`` commits' own words
    (JVM-free): ``"renamed note to memo at version 4"``, ``"dropped at version 5"``; None when
    none of them renamed or dropped it. Names compare case-insensitively, as Spark resolves them."""
    import json

    for entry in table.history(commits):
        op, params = str(entry.get("operation") or ""), entry.get("operationParameters") or {}
        version = entry.get("version")
        old = str(params.get("oldColumnPath", "")).strip("`")
        if op == "RENAME COLUMN" and old.lower() == column.lower():
            return f"renamed {old} to {str(params.get('newColumnPath', '?')).strip('`')} at version {version}"
        if op in ("DROP COLUMNS", "DROP COLUMN"):
            try:
                dropped = [str(c).strip("`") for c in json.loads(str(params.get("columns") or "[]"))]
            except ValueError:
                dropped = []
            for name in dropped:
                if name.lower() == column.lower():
                    return f"dropped {name} at version {version}"
    return None
