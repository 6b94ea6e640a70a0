"""A CDC source reading Debezium change events from files, so Debezium users can plug Tidemark in
(issue 10): newline-delimited JSON under a directory, one event per line, files taken in name
order and never changed once written (append new files; a file being written should carry a
``.tmp`` or ``.partial`` suffix until it is complete).

A line is a Debezium record value — with its ``schema``/``payload`` envelope (``schemas.enable=true``)
or the payload alone — optionally wrapped as ``{"key": ..., "value": ...}`` (then the key's fields are
the table's key). ``op``: ``c`` create, ``u`` update, ``d`` delete, ``r`` snapshot read (an insert),
``t`` truncate. Events of one transaction (same ``source.txId``) are consecutive in Debezium's
output; they form one :class:`~lineage.cdc.Transaction`. Debezium's placeholder for unchanged
TOAST values (``__debezium_unavailable_value``) marks the column unchanged.

Positions: line ``n`` (1-based) of the ``i``-th file (0-based, in name order) is ``i << 32 | n``,
so the files' order is the source order; a replica records the position it applied up to.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from lineage.cdc import Column, Op, RowChange, TableSchema, Transaction
from lineage.errors import TidemarkError

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
        for i, path in enumerate(self.files()):
            if i < start_file:
                continue
            with path.open("rb") as fh:
                for n, line in enumerate(fh, 1):
                    pos = position(i, n)
                    if pos <= after or not line.strip():
                        continue
                    if not line.endswith(b"\n"):
                        break  # a line still being written: read it next time
                    try:
                        doc = orjson.loads(line)
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
                    selected = self._selected.get(table)
                    if selected is None:
                        selected = self._selected[table] = self.selects(table)
                    if not selected:
                        continue
                    self._learn(table, value if isinstance(value, dict) else {}, payload, key, where=f"{path}:{n}")
                    yield pos, table, payload, key

    def _learn(self, table: str, value: dict[str, Any], payload: dict[str, Any], key: Any, *, where: str) -> None:
        """The table's schema from the envelope's ``schema`` (or the values), its key from the record key."""
        cols: dict[str, str] = {}
        for field in (value.get("schema") or {}).get("fields") or []:
            if field.get("field") in ("after", "before"):
                for f in field.get("fields") or []:
                    cols[f["field"]] = _field_type(f)
        row = payload.get("after") or payload.get("before") or {}
        old = self._schemas.get(table)
        key_fields = key.get("payload", key) if isinstance(key, dict) else {}
        if (old is not None and not cols and row.keys() <= self._names[table]
                and (not key or tuple(k for k in key_fields if k in row) == old.key)):
            return  # nothing new (the common case, checked without building the schema again)
        known = {c.name: c.type for c in old.columns} if old else {}
        for name, v in row.items():
            cols.setdefault(name, known.get(name) or _infer(v))
        keys = tuple(k for k in key_fields if k in cols) if key else ()
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
