"""A CDC source reading Debezium change events from files, so Debezium users can plug Tidemark in
(issue 10): newline-delimited JSON under a directory, one event per line, files taken in name
order and never changed once written (append new files; a file being written should carry a
``.tmp`` or ``.partial`` suffix until it is complete).

A line is a Debezium record value — with its ``schema``/``payload`` envelope (``schemas.enable=true``)
or the payload alone — optionally wrapped as ``{"key": ..., "value": ...}`` (then the key's fields are
the table's key). ``op``: ``c`` create, ``u`` update, ``d`` delete, ``r`` snapshot read (an insert),
``t`` truncate. Events of one transaction (same ``source.txId``) are consecutive in Debezium's
output; they form one :class:`~lineage.cdc.changes.Transaction`. Debezium's placeholder for unchanged
TOAST values (``__debezium_unavailable_value``) marks the column unchanged.

Positions: line ``n`` (1-based) of the ``i``-th file (0-based, in name order) is ``i << 32 | n``,
so the files' order is the source order; a replica records the position it applied up to.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from lineage.cdc import columns as cdc_columns
from lineage.cdc.changes import Column, Op, RowChange, TableSchema, Transaction
from lineage.cdc.columns import ColumnRead, arrow_type
from lineage.core.errors import TidemarkError

UNAVAILABLE = "__debezium_unavailable_value"
OPS = {"c": Op.INSERT, "r": Op.INSERT, "u": Op.UPDATE, "d": Op.DELETE, "t": Op.TRUNCATE}
#: Debezium/Kafka Connect field types -> Spark SQL types (logical names first).
LOGICAL = {"io.debezium.time.MicroTimestamp": "timestamp", "io.debezium.time.Timestamp": "timestamp",
           "io.debezium.time.NanoTimestamp": "timestamp", "io.debezium.time.ZonedTimestamp": "timestamp",
           "io.debezium.time.Date": "date", "org.apache.kafka.connect.data.Date": "date",
           "org.apache.kafka.connect.data.Timestamp": "timestamp"}
PRIMITIVE = {"int8": "tinyint", "int16": "smallint", "int32": "int", "int64": "bigint", "float32": "float",
             "float64": "double", "boolean": "boolean", "string": "string", "bytes": "binary"}
_EPOCH = dt.datetime(1970, 1, 1)
#: The JSON value each Spark type is parsed from by the columnar read (Arrow's JSON reader is strict:
#: a value of another JSON type fails the parse, and the read falls back to ``read()``).
_JSON_TYPE = {"tinyint": pa.int64(), "smallint": pa.int64(), "int": pa.int64(), "bigint": pa.int64(),
              "float": pa.float64(), "double": pa.float64(), "boolean": pa.bool_(), "string": pa.string(),
              "timestamp": pa.int64(), "date": pa.int64()}
#: Lines parsed at once by the columnar read (at least a little more than max_changes).
BATCH_LINES = 50_000
#: Python's datetime/date range (read() raises beyond it): microseconds and days from the epoch.
_US_RANGE = (-62135596800 * 10**6, 253402300800 * 10**6 - 1)
_DAY_RANGE = (-719162, 2932896)
#: A Kafka tombstone line: ``"value": null`` as the last member of the top-level object (a nested
#: member would be followed by more closing braces; a string cannot hold an unescaped quote).
_TOMBSTONE = r'"value"\s*:\s*null\s*\}\s*$'


class DebeziumFormatError(TidemarkError):
    """A line that is not a Debezium change event."""


def position(file_index: int, line: int) -> int:
    return (file_index << 32) | line


def _field_type(field: dict[str, Any]) -> str:
    name = field.get("name") or ""
    if name in LOGICAL:
        return LOGICAL[name]
    if name == "org.apache.kafka.connect.data.Decimal":
        params = field.get("parameters") or {}
        return f"decimal(38,{int(params.get('scale', 0))})"
    return PRIMITIVE.get(str(field.get("type")), "string")


def _convert(value: Any, spark_type: str) -> Any:
    """A Debezium JSON value as the Python value of the replica column."""
    if value is None or value == UNAVAILABLE:
        return value
    if spark_type == "timestamp" and isinstance(value, int):
        return _EPOCH + dt.timedelta(microseconds=value if abs(value) > 10**14 else value * 1000)
    if spark_type == "timestamp" and isinstance(value, str):
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(dt.UTC).replace(tzinfo=None)
    if spark_type == "date" and isinstance(value, int):
        return (_EPOCH + dt.timedelta(days=value)).date()
    if spark_type.startswith("decimal"):
        import base64
        import decimal

        scale = int(spark_type.split(",")[1].rstrip(")"))
        if isinstance(value, str):  # Connect's decimal: base64 big-endian two's complement unscaled value
            raw = base64.b64decode(value)
            return decimal.Decimal(int.from_bytes(raw, "big", signed=True)).scaleb(-scale)
        return decimal.Decimal(str(value))
    if spark_type == "binary" and isinstance(value, str):
        import base64

        return base64.b64decode(value)
    if spark_type in ("string",) and not isinstance(value, str):
        return json.dumps(value)
    return value


def _infer(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "bigint"
    if isinstance(value, float):
        return "double"
    return "string"


class DebeziumFileSource:
    """Debezium JSON change events from the files under ``path`` (see the module docstring)."""

    snapshots = False  # the events carry the snapshot themselves (op "r")

    def __init__(self, path: str | Path, *, name: str, selects: Callable[[str], bool]) -> None:
        self.root = Path(path)
        self.name = name
        self.selects = selects
        self._schemas: dict[str, TableSchema] = {}
        self._selected: dict[str, bool] = {}  # table -> selected (fnmatch once per table, not per event)
        self._names: dict[str, set[str]] = {}  # column names of each table's schema
        self._scanned = 0  # events up to here were learned by tables() (files never change once written)
        # tables whose record key named other key columns than before: read() learning an older event
        # again sets its key back, so the key of a change depends on where the read starts
        self._rekeyed: set[str] = set()
        # per table, the last position where an UPDATE's after-image lacked some of the table's columns
        # (read() carries such a column from the row's earlier state; a column null in Arrow cannot say
        # that), or where the table gained a column after an UPDATE (the UPDATEs before lack that one; a
        # first DELETE, whose before-image holds only the key, adds the other columns after it harmlessly)
        self._partial: dict[str, int] = {}
        self._updated: set[str] = set()  # tables with an UPDATE learned

    def ensure_setup(self) -> None:
        if not self.root.is_dir():
            raise TidemarkError(f"debezium replicator '{self.name}': {self.root} is not a directory (set `path:` to the "
                                f"directory Debezium's JSON change events are written to)")

    def close(self) -> None:
        pass

    def snapshot(self) -> Any:
        raise TidemarkError(f"debezium replicator '{self.name}': the files carry the snapshot (op 'r' events); "
                            f"there is no separate one")

    def files(self) -> list[Path]:
        return sorted(p for p in self.root.iterdir() if p.is_file() and not p.name.startswith(".")
                      and not p.name.endswith((".tmp", ".partial")))

    def tables(self) -> dict[str, TableSchema]:
        """The selected tables seen in the files so far, with their newest schema (reads only what
        was added since the last call: a unit's cost does not grow with the files already read)."""
        for pos, *_ in self._events(self._scanned):
            self._scanned = pos
        return dict(self._schemas)

    def ack(self, lsn: int) -> None:
        """Files are the user's: nothing to acknowledge (archive them once every replica passed them)."""

    def position_end(self) -> int:
        files = self.files()
        if not files:
            return 0
        with files[-1].open("rb") as fh:
            lines = sum(1 for _ in fh)
        return position(len(files) - 1, lines)

    # ------------------------------------------------------------------ decoding
    def _events(self, after: int) -> Iterator[tuple[int, str, dict[str, Any], Any]]:
        """``(position, table, payload, key)`` of every selected event after ``after``."""
        start_file = after >> 32
        loads, selected_of, learn = orjson.loads, self._selected.get, self._learn
        for i, path in enumerate(self.files()):
            if i < start_file:
                continue
            skip = after & 0xFFFFFFFF if i == start_file else 0  # the lines up to ``after``, not decoded
            file_pos = position(i, 0)
            with path.open("rb") as fh:
                for n, line in enumerate(itertools.islice(fh, skip, None), skip + 1):
                    if not line.strip():
                        continue
                    if not line.endswith(b"\n"):
                        break  # a line still being written: read it next time
                    try:
                        doc = loads(line)
                    except json.JSONDecodeError as exc:
                        raise DebeziumFormatError(f"{path}:{n}: not JSON ({exc.msg} at column {exc.colno})") from None
                    value, key = (doc.get("value"), doc.get("key")) if isinstance(doc, dict) and "value" in doc else (doc, None)
                    if value is None:
                        continue  # a tombstone (Kafka compaction marker after a delete)
                    payload = value.get("payload", value) if isinstance(value, dict) else None
                    if not isinstance(payload, dict) or payload.get("op") not in OPS:
                        raise DebeziumFormatError(f"{path}:{n}: not a Debezium change event (no payload.op in "
                                                  f"c/r/u/d/t)")
                    src = payload.get("source") or {}
                    table = f"{src.get('schema') or src.get('db') or 'public'}.{src.get('table')}"
                    selected = selected_of(table)
                    if selected is None:
                        selected = self._selected[table] = self.selects(table)
                    if not selected:
                        continue
                    pos = file_pos | n
                    learn(table, value, payload, key, pos)
                    yield pos, table, payload, key

    def _learn(self, table: str, value: dict[str, Any], payload: dict[str, Any], key: Any, pos: int) -> None:
        """The table's schema from the envelope's ``schema`` (or the values), its key from the record key;
        ``_partial`` kept (see ``__init__``)."""
        names = self._names.get(table)
        row = payload.get("after") or payload.get("before") or {}
        if names is None or "schema" in value or not row.keys() <= names or (key and not self._same_key(table, key, row)):
            columns = len(names or ())  # something may be new (the common case above needs no call)
            self._learn_schema(table, value, payload, key)
            names = self._names[table]
            if len(names) > columns and table in self._updated:
                self._partial[table] = pos  # a column added after UPDATEs that lack it
        if payload.get("op") == "u":
            self._updated.add(table)
            after = payload.get("after")
            if isinstance(after, dict) and len(after) < len(names):
                self._partial[table] = pos

    def _same_key(self, table: str, key: Any, row: dict[str, Any]) -> bool:
        """Whether the record key names the table's known key (its fields found in ``row``)."""
        key_fields = key.get("payload", key) if isinstance(key, dict) else {}
        known = self._schemas[table].key
        if tuple(key_fields) == known and row.keys() >= set(known):
            return True  # the common case: the same fields, all in the row
        return tuple(k for k in key_fields if k in row) == known

    def _learn_schema(self, table: str, value: dict[str, Any], payload: dict[str, Any], key: Any) -> None:
        """The schema and key of :meth:`_learn`, for an event its quick check could not vouch for (the
        table new, a ``schema`` envelope, a column or key field not seen yet): rebuilt, and replaced
        only when it differs."""
        cols: dict[str, str] = {}
        for field in (value.get("schema") or {}).get("fields") or []:
            if field.get("field") in ("after", "before"):
                for f in field.get("fields") or []:
                    cols[f["field"]] = _field_type(f)
        row = payload.get("after") or payload.get("before") or {}
        old = self._schemas.get(table)
        key_fields = key.get("payload", key) if isinstance(key, dict) else {}
        known = {c.name: c.type for c in old.columns} if old else {}
        for name, v in row.items():
            cols.setdefault(name, known.get(name) or _infer(v))
        keys = tuple(k for k in key_fields if k in cols) if key else ()
        if keys and old is not None and old.key and keys != old.key:
            self._rekeyed.add(table)
        merged = {**known, **{k: v for k, v in cols.items() if k not in known}}
        if old is None or list(merged) != old.names or (keys and keys != old.key):
            self._schemas[table] = TableSchema(table, tuple(Column(n, t) for n, t in merged.items()),
                                               keys or (old.key if old else ()))
            self._names[table] = set(merged)

    def read(self, after: int, *, upto: int | None = None, max_changes: int = 100_000,
             wanted: Callable[[str, int], bool] | None = None) -> list[Transaction]:
        out: list[Transaction] = []
        cur: list[RowChange] = []
        cur_id: Any = object()
        cur_pos, cur_time, count = 0, _EPOCH, 0

        def close() -> None:
            if cur:
                out.append(Transaction(abs(hash(cur_id)) % (2**62), cur_pos, cur_time, tuple(cur), end_lsn=cur_pos))

        for pos, table, payload, _key in self._events(after):
            if upto is not None and pos > upto:
                break
            src = payload.get("source") or {}
            txid = src.get("txId") if src.get("txId") is not None else (payload.get("transaction") or {}).get("id")
            if txid is None or txid != cur_id:
                close()
                if count >= max_changes:
                    return out
                cur, cur_id = [], txid if txid is not None else object()
            cur_pos = pos
            ts = payload.get("ts_ms") or src.get("ts_ms") or 0
            cur_time = _EPOCH + dt.timedelta(milliseconds=int(ts))
            if wanted is not None and not wanted(table, pos):
                continue
            cur.append(self._change(table, payload))
            count += 1
        close()
        return out

    def _change(self, table: str, payload: dict[str, Any]) -> RowChange:
        op = OPS[payload["op"]]
        schema = self._schemas[table]
        types = {c.name: c.type for c in schema.columns}
        if op is Op.TRUNCATE:
            return RowChange(table, op)

        def conv(row: dict[str, Any] | None) -> dict[str, Any] | None:
            return None if row is None else {k: _convert(v, types.get(k, "string")) for k, v in row.items()}

        after, before = conv(payload.get("after")), conv(payload.get("before"))
        unchanged = frozenset(k for k, v in (after or {}).items() if v == UNAVAILABLE)
        if after is not None:
            after = {k: v for k, v in after.items() if k not in unchanged}
        if before is not None and schema.key:
            before = {k: before[k] for k in schema.key if k in before} or None
        return RowChange(table, op, after=after, before=before, unchanged=unchanged)

    # ------------------------------------------------------------------ columnar read
    def read_columns(self, after: int, *, upto: int | None = None, max_changes: int = 100_000,
                     wanted_after: Mapping[str, int | None], spill_dir: Path | None = None,
                     spill_rows: int = 1_000_000) -> ColumnRead | None:
        """``read(after, upto=upto, max_changes=max_changes, wanted=...)`` as one Arrow table, parsed
        by Arrow's JSON reader (C++) instead of an object per event; ``wanted_after[t]``: changes of
        ``t`` at positions above it are wanted (None: none are). None whenever the answer could differ
        from read()'s in any way (the caller then calls read(), which also raises read()'s errors).

        Columns, one row per wanted change: ``_tm_pos``, ``_tm_lsn``, ``_tm_time`` (naive UTC),
        ``_tm_tx`` (0, 1, ... per Transaction), ``_tm_table``, ``_tm_op`` (``insert``/``update``/
        ``delete``), every column of the frame's tables (the after-image, typed as the replica),
        ``_tm_before_<k>`` per key column k (the before-image's key) and ``_tm_has_before``.

        The schemas are current (``tables()`` is called here, before and after the files are read:
        every line read here was learned, so every field of an event is a column of its table, and a
        table's key is the one read() would use, unless the key changed: ``_rekeyed``). tables() also
        parsed every line with orjson, as read() does: a line orjson refuses (not JSON, NaN, Infinity,
        invalid UTF-8 — some of which Arrow's parser lets by in the fields it skips) makes it raise,
        and this returns None. Supported
        lines: ``{"key":..,"value":{"payload":{..}}}`` (with or without ``schema``),
        ``{"key":..,"value":{..}}``, ``{"payload":{..}}`` and the payload alone; timestamps and dates
        as numbers (an ISO string fails the strict parse: None); no decimal or binary columns.
        ``spill_dir`` and ``spill_rows`` are taken and ignored: the read is held whole, as Arrow, and
        ``max_changes`` bounds it (the replicator passes them to every source)."""
        del spill_dir, spill_rows
        try:
            schemas = self.tables()
        except DebeziumFormatError:
            return None  # read() raises it again, with the line
        rekeyed = set(self._rekeyed)
        # the tables whose changes can be in the frame: their columns (parsed) and key columns
        candidates = [schemas[t] for t, p in wanted_after.items() if p is not None and t in schemas]
        if any(not s.key or s.table in rekeyed or self._partial.get(s.table, 0) > after for s in candidates):
            return None  # a multiset, a key that depends on where the read starts, or an UPDATE without every column
        json_types: dict[str, pa.DataType] = {}
        for s in candidates:
            for c in s.columns:
                jt = _JSON_TYPE.get(c.type)
                if jt is None or json_types.setdefault(c.name, jt) != jt:
                    return None  # decimal/binary, or two tables reading one name as different JSON types
        after_struct = pa.struct([(n, t) for n, t in json_types.items()] or [("\0", pa.null())])
        key_names = list(dict.fromkeys(k for s in candidates for k in s.key))
        before_struct = pa.struct([(k, json_types[k]) for k in key_names] or [("\0", pa.null())])
        payload = pa.struct([("op", pa.string()), ("before", before_struct), ("after", after_struct),
                             ("source", pa.struct([("schema", pa.string()), ("db", pa.string()), ("table", pa.string()),
                                                   ("txId", pa.int64()), ("ts_ms", pa.int64())])),
                             ("ts_ms", pa.int64()), ("transaction", pa.struct([("id", pa.string())]))])
        parts: list[pa.Table] = [_no_events(payload)]
        wanted, stopped = 0, False
        files = self.files()
        # read() stops at the transaction after max_changes wanted changes: so may the parse
        batch = max(max_changes + max_changes // 8 + 100, BATCH_LINES)
        for i, path in enumerate(files):
            if stopped or i < after >> 32 or (upto is not None and i > upto >> 32):
                continue
            buf = path.read_bytes()
            if i < len(files) - 1 and len(buf) and buf[-1] != 10:
                return None  # a partly written line before the last file: tables() skipped it, read() too
            nl = np.flatnonzero(np.frombuffer(buf, np.uint8) == 10)
            first = (after & 0xFFFFFFFF) + 1 if i == after >> 32 else 1
            end = len(nl) if upto is None or i < upto >> 32 else min(len(nl), upto & 0xFFFFFFFF)
            for lo in range(first, end + 1, batch):
                part = self._file_events(i, buf, nl, lo, min(lo + batch - 1, end), payload)
                if part is None:
                    return None
                parts.append(part)
                wanted += int(_wanted(part, wanted_after).sum())
                if wanted >= max_changes and _cut(pa.concat_tables(parts), wanted_after, max_changes)[1]:
                    stopped = True  # read() stops inside what was read: the lines after do not matter
                    break
        try:
            if self.tables() != schemas or self._rekeyed != rekeyed:
                return None  # lines appended meanwhile changed a schema
        except DebeziumFormatError:
            return None
        events = pa.concat_tables(parts).combine_chunks()
        events = events.slice(0, _cut(events, wanted_after, max_changes)[0])
        if any(t not in wanted_after for t in pc.unique(events.column("table")).to_pylist()):
            return None  # a table the caller does not know yet (the read() path makes its replica)
        if "t" in pc.unique(events.column("op")).to_pylist():
            return None  # a truncate
        return _frame(events, wanted_after, schemas)

    def _file_events(self, i: int, buf: bytes, nl: np.ndarray, first: int, end: int,
                     payload: pa.StructType) -> pa.Table | None:
        """The selected events of lines ``first..end`` of file ``i`` (its bytes, the offsets of its
        newlines; columns: :func:`_no_events`), or None when a line is not one read() would read the
        same way."""
        if end < first:
            return _no_events(payload)
        starts = nl[max(first - 2, 0):end - 1] + 1
        if first == 1:
            starts = np.concatenate([np.zeros(1, np.int64), starts])
        ends = nl[first - 1:end]
        data = np.frombuffer(buf, np.uint8)
        if not (data[starts] == ord("{")).all():
            return None  # a blank line, leading whitespace, or no JSON object
        lo, hi = int(starts[0]), int(ends[-1]) + 1
        shape = _shape(buf, starts, ends)
        if shape is None:
            return None
        if shape in ("kv_bare", "bare") and buf.find(b'"payload"', lo, hi) >= 0:
            return None  # a "payload" member could be the envelope's (read() takes it as the payload)
        if shape in ("payload", "bare") and buf.find(b'"value"', lo, hi) >= 0:
            return None  # a "value" member could be a record value or a tombstone's
        fields = {"kv_payload": [("value", pa.struct([("payload", payload)]))], "kv_bare": [("value", payload)],
                  "payload": [("payload", payload)], "bare": list(payload)}[shape]
        try:
            parsed = pj.read_json(pa.BufferReader(pa.py_buffer(buf)[lo:hi]),
                                  read_options=pj.ReadOptions(block_size=max(1 << 22, int((ends - starts).max()) + 2)),
                                  parse_options=pj.ParseOptions(explicit_schema=pa.schema(fields),
                                                                unexpected_field_behavior="ignore"))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None  # not JSON, or a value of another type than the column's
        n = len(starts)
        if parsed.num_rows != n:
            return None  # lines and rows do not pair up: positions would be wrong
        parsed = parsed.combine_chunks()
        tomb = np.zeros(n, dtype=bool)
        if shape == "bare":
            pay = pa.StructArray.from_arrays([parsed.column(f.name).chunk(0) for f in payload], fields=list(payload))
        elif shape == "payload":
            pay = parsed.column("payload").chunk(0)
        else:
            value = parsed.column("value").chunk(0)
            tomb = value.is_null().to_numpy(zero_copy_only=False)
            if tomb.any():  # each line with its newline, as one binary array over the file's bytes
                lines = pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(
                    np.append(starts, ends[-1] + 1).astype(np.int64)), pa.py_buffer(buf)])
                raw = lines.filter(pa.array(tomb))
                if not pc.all(pc.match_substring_regex(raw, _TOMBSTONE)).as_py():
                    return None  # a null value that is not a top-level "value": null
            pay = value.flatten()[0] if shape == "kv_payload" else value
            if shape == "kv_payload" and (pc.sum(pc.is_null(pay)).as_py() or 0) != int(tomb.sum()):
                return None  # a value without its payload (or a null one): read() reads that otherwise
        if shape == "payload" and pay.null_count:
            return None  # a null or absent payload: read() raises or reads the line otherwise
        op, before, after_img, source, ts_ms, transaction = pay.flatten()
        keep = ~tomb
        if not pc.all(pc.is_in(pc.filter(op, pa.array(keep)), pa.array(list(OPS)))).as_py() and keep.any():
            return None  # not a Debezium change event: read() raises the precise error
        schema_, db, table, tx_id, src_ts = source.flatten()
        ns = pc.if_else(pc.fill_null(pc.not_equal(schema_, ""), False), schema_,
                        pc.if_else(pc.fill_null(pc.not_equal(db, ""), False), db, "public"))
        names = pc.binary_join_element_wise(ns, pc.fill_null(table, "None"), ".")
        unique = pc.unique(pc.filter(names, pa.array(keep))).to_pylist()
        for t in unique:
            if t not in self._selected:
                self._selected[t] = self.selects(t)
        chosen = keep & pc.is_in(names, pa.array([t for t in unique if self._selected[t]], pa.string())).to_numpy(
            zero_copy_only=False)
        ts = pc.if_else(pc.fill_null(pc.not_equal(ts_ms, 0), False), ts_ms,
                        pc.if_else(pc.fill_null(pc.not_equal(src_ts, 0), False), src_ts, 0))
        tx_str = transaction.flatten()[0]
        txk = pc.if_else(pc.is_valid(tx_id), 1, pc.if_else(pc.is_valid(tx_str), 2, 0)).cast(pa.int8())
        pos = (np.int64(i) << 32) | (np.arange(first, end + 1, dtype=np.int64))
        events = pa.table({"pos": pa.array(pos), "table": names, "op": op, "txk": txk, "txi": pc.fill_null(tx_id, 0),
                           "txs": pc.if_else(pc.is_valid(tx_id), pa.scalar(None, pa.string()), tx_str),
                           "ts": ts.cast(pa.int64()), "after": after_img, "before": before})
        return events if chosen.all() else events.take(pa.array(np.flatnonzero(chosen)))


def _no_events(payload: pa.StructType) -> pa.Table:
    """The columns of :meth:`DebeziumFileSource._file_events`, no rows."""
    return pa.table({"pos": pa.array([], pa.int64()), "table": pa.array([], pa.string()),
                     "op": pa.array([], pa.string()), "txk": pa.array([], pa.int8()), "txi": pa.array([], pa.int64()),
                     "txs": pa.array([], pa.string()), "ts": pa.array([], pa.int64()),
                     "after": pa.array([], payload.field("after").type),
                     "before": pa.array([], payload.field("before").type)})


def _shape(buf: bytes, starts: np.ndarray, ends: np.ndarray) -> str | None:
    """How the file's records hold the payload, from its first record that is not a tombstone."""
    for s, e in zip(starts[:100].tolist(), ends[:100].tolist(), strict=True):
        try:
            doc = orjson.loads(buf[s:e])
        except orjson.JSONDecodeError:
            return None
        if not isinstance(doc, dict):
            return None
        if "value" in doc:
            if doc["value"] is None:
                continue
            return "kv_payload" if isinstance(doc["value"], dict) and "payload" in doc["value"] else "kv_bare"
        return "payload" if "payload" in doc else "bare"
    return None


def _starts(events: pa.Table) -> np.ndarray:
    """Which events start a Transaction of read(): no txId, or another than the previous event's."""
    txk = events.column("txk").to_numpy()
    txi = events.column("txi").to_numpy()
    start = np.ones(len(txk), dtype=bool)
    if len(txk) > 1:
        txs = events.column("txs")
        same_s = pc.fill_null(pc.equal(txs.slice(1), txs.slice(0, len(txk) - 1)), False).to_numpy(zero_copy_only=False)
        same = (txk[1:] == txk[:-1]) & (txk[1:] != 0) & np.where(txk[1:] == 1, txi[1:] == txi[:-1], same_s)
        start[1:] = ~same
    return start


def _wanted(events: pa.Table, wanted_after: Mapping[str, int | None]) -> np.ndarray:
    """read()'s ``wanted(table, pos)`` per event (False for a table not in ``wanted_after``)."""
    tables = events.column("table")
    pos = events.column("pos").to_numpy()
    wanted = np.zeros(len(pos), dtype=bool)
    for t in pc.unique(tables).to_pylist():
        p = wanted_after.get(t)
        if p is not None:
            wanted |= pc.equal(tables, t).to_numpy(zero_copy_only=False) & (pos > p)
    return wanted


def _cut(events: pa.Table, wanted_after: Mapping[str, int | None], max_changes: int) -> tuple[int, bool]:
    """How many of the events read() goes through before ``max_changes`` stops it (it stops at the
    start of a transaction once that many changes are wanted), and whether it stopped."""
    if events.num_rows == 0:
        return 0, False
    wanted = _wanted(events, wanted_after)
    before = np.cumsum(wanted) - wanted
    stops = np.flatnonzero(_starts(events) & (before >= max_changes))
    return (int(stops[0]), True) if len(stops) else (events.num_rows, False)


def _frame(events: pa.Table, wanted_after: Mapping[str, int | None], schemas: Mapping[str, TableSchema]) -> ColumnRead | None:
    """The wanted changes of ``events`` (those read() goes through) as read_columns' frame."""
    n = events.num_rows
    if n == 0:
        return ColumnRead(cdc_columns.empty_frame(), 0, 0)
    start = _starts(events)
    group = np.cumsum(start) - 1
    wanted = _wanted(events, wanted_after)
    last = np.append(np.flatnonzero(start)[1:] - 1, n - 1).astype(np.int64)  # each transaction's last event
    pos = events.column("pos").to_numpy()
    ts = events.column("ts").to_numpy()
    has = np.bincount(group, weights=wanted, minlength=len(last)) > 0  # read() returns it
    tx_no = np.cumsum(has) - 1
    g_ts = ts[last]
    if ts.min() < _US_RANGE[0] // 1000 or ts.max() > _US_RANGE[1] // 1000:
        return None  # a commit time beyond Python's datetime: read() raises (it converts every event's)
    rows = np.flatnonzero(wanted)
    ev = events if len(rows) == n else events.take(pa.array(rows))
    g = group[rows]
    cols: dict[str, pa.Array] = {
        cdc_columns.POS: pa.array(pos[rows]), cdc_columns.LSN: pa.array(pos[last][g]),
        cdc_columns.TIME: pa.array(g_ts[g] * 1000).cast(pa.timestamp("us")),
        cdc_columns.TX: pa.array(tx_no[g]), cdc_columns.TABLE: ev.column("table").combine_chunks(), cdc_columns.OP: _op_names(ev)}
    in_frame = [schemas[t] for t in pc.unique(cols[cdc_columns.TABLE]).to_pylist()]
    types: dict[str, str] = {}
    for s in in_frame:
        for c in s.columns:
            if types.setdefault(c.name, c.type) != c.type or c.name.startswith("_tm_"):
                return None  # two tables in the frame with one column name of different types (or ours)
    after = ev.column("after").combine_chunks()
    after_by = dict(zip([f.name for f in after.type], after.flatten(), strict=True))
    for name, spark_type in types.items():
        col = _column(after_by[name], spark_type, arrow_type(spark_type))
        if col is None:
            return None
        cols[name] = col
    before = ev.column("before").combine_chunks()
    before_valid = before.is_valid().to_numpy(zero_copy_only=False)
    before_by = dict(zip([f.name for f in before.type], before.flatten(), strict=True))
    table_of = cols[cdc_columns.TABLE]
    any_key = np.zeros(len(rows), dtype=bool)
    keys = list(dict.fromkeys(k for s in in_frame for k in s.key))
    for k in keys:
        mine = pc.is_in(table_of, pa.array([s.table for s in in_frame if k in s.key], pa.string()))
        value = pc.if_else(mine, before_by[k], pa.scalar(None, before_by[k].type))
        col = _column(value, types[k], arrow_type(types[k]))
        if col is None or cdc_columns.before(k) in cols:
            return None
        cols[cdc_columns.before(k)] = col
        any_key |= pc.fill_null(pc.is_valid(value), False).to_numpy(zero_copy_only=False) &             mine.to_numpy(zero_copy_only=False)
    if (before_valid & ~any_key).any():
        return None  # a before-image whose key values are all null or absent (read() tells them apart)
    cols[cdc_columns.HAS_BEFORE] = pa.array(before_valid & any_key)
    frame = pa.table(cols)
    return ColumnRead(frame, int(has.sum()), int(pos[last][has][-1]) if has.any() else 0)


def _op_names(events: pa.Table) -> pa.Array:
    """The ``Op`` value of each event's ``op`` (``c``/``r``: insert)."""
    op = events.column("op").combine_chunks()
    return pc.if_else(pc.equal(op, "u"), Op.UPDATE.value, pc.if_else(pc.equal(op, "d"), Op.DELETE.value,
                                                                      Op.INSERT.value))


def _column(parsed: pa.Array, spark_type: str, arrow: pa.DataType) -> pa.Array | None:
    """A parsed JSON column as the replica's column (``_convert``'s rules), or None when read() would
    give another value (or raise)."""
    try:
        if spark_type == "timestamp":
            ints = pc.fill_null(parsed, 0).to_numpy()
            us = np.where(np.abs(ints) > 10**14, ints, ints * 1000)
            if len(us) and (us.min() < _US_RANGE[0] or us.max() > _US_RANGE[1]):
                return None  # beyond Python's datetime: read() raises
            return pa.array(us, mask=parsed.is_null().to_numpy(zero_copy_only=False)).cast(arrow)
        if spark_type == "date":
            days = pc.fill_null(parsed, 0).to_numpy()
            if len(days) and (days.min() < _DAY_RANGE[0] or days.max() > _DAY_RANGE[1]):
                return None
            return pa.array(days, mask=parsed.is_null().to_numpy(zero_copy_only=False)).cast(pa.int32()).cast(arrow)
        if spark_type == "string" and pc.any(pc.equal(parsed, UNAVAILABLE)).as_py():
            return None  # an unchanged TOAST value: read() leaves the column out of the change
        if pa.types.is_floating(parsed.type) and pc.any(pc.is_nan(parsed)).as_py():
            return None  # NaN/Infinity are not JSON: read() raises
        return parsed.cast(arrow)
    except (pa.ArrowInvalid, OverflowError):
        return None
