"""Column types of the event intake: implicit types by JSON node, the seed's typecast tree for
promotion inside a batch, and coercion of one value into a column of a given type.

Typecast tree (seed 002): the common type of two is their lowest common ancestor::

         STRING
         /    \\
    FLOAT64  TIMESTAMP
       |
     INT64
       |
      BOOL
"""

from __future__ import annotations

import datetime as dt
import math
from enum import StrEnum
from typing import Any

from lineage.intake.bodies import dumps_exact


class SqlType(StrEnum):
    BOOLEAN = "boolean"
    BIGINT = "bigint"
    DOUBLE = "double"
    TIMESTAMP = "timestamp"
    STRING = "string"


_PARENT: dict[SqlType, SqlType | None] = {
    SqlType.BOOLEAN: SqlType.BIGINT, SqlType.BIGINT: SqlType.DOUBLE, SqlType.DOUBLE: SqlType.STRING,
    SqlType.TIMESTAMP: SqlType.STRING, SqlType.STRING: None,
}
_INT64 = (-(2**63), 2**63 - 1)


def _ancestors(t: SqlType) -> list[SqlType]:
    out: list[SqlType] = []
    cur: SqlType | None = t
    while cur is not None:
        out.append(cur)
        cur = _PARENT[cur]
    return out


def promote(a: SqlType, b: SqlType) -> SqlType:
    """The lowest common ancestor of ``a`` and ``b`` in the typecast tree."""
    if a is b:
        return a
    up = _ancestors(a)
    for t in _ancestors(b):
        if t in up:
            return t
    return SqlType.STRING  # unreachable: STRING is everyone's ancestor


def implicit_type(value: Any) -> SqlType | None:
    """The type of a (flattened) JSON value; ``None`` for null, which fits any column."""
    if value is None:
        return None
    if isinstance(value, bool):
        return SqlType.BOOLEAN
    if isinstance(value, int):
        return SqlType.BIGINT if _INT64[0] <= value <= _INT64[1] else SqlType.STRING
    if isinstance(value, float):
        return SqlType.DOUBLE
    return SqlType.STRING


def parse_timestamp(value: str) -> dt.datetime:
    """ISO 8601 (``Z`` or an offset; naive means UTC) -> an aware UTC datetime; ``ValueError`` if not."""
    ts = dt.datetime.fromisoformat(value)
    return ts.replace(tzinfo=dt.UTC) if ts.tzinfo is None else ts.astimezone(dt.UTC)


class CoercionError(ValueError):
    """A value that cannot be stored in a column of the given type."""


def to_text(value: Any) -> str:
    """A value as a string column holds it: a string as it is, anything else as its JSON text
    (an integer beyond 64 bits as its exact decimal digits)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return dumps_exact(value).decode()


def coerce(value: Any, to: SqlType, *, int_bits: int = 64) -> Any:
    """``value`` as it is stored in a column of type ``to``; raises :class:`CoercionError` saying
    why it does not fit. Follows the typecast tree: a value of a type below ``to`` fits; above
    it, only when nothing is lost (2.0 into bigint, "2026-01-01T00:00:00Z" into timestamp).
    ``int_bits``: 32 or narrower for an existing table's int/short/byte column."""
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):  # JSON has no such number: never from the collector
        raise CoercionError(f"{value} is not a finite number; JSON cannot hold it")
    if to is SqlType.STRING:
        return to_text(value)
    if to is SqlType.DOUBLE:
        if isinstance(value, float) or (isinstance(value, int) and _INT64[0] <= value <= _INT64[1]):
            return float(value)  # bool is an int: True -> 1.0, as the tree says
        if isinstance(value, int):
            raise CoercionError(f"{value} is an integer beyond 64 bits; a double column would round it")
    elif to is SqlType.BIGINT:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int):
            lo, hi = -(2 ** (int_bits - 1)), 2 ** (int_bits - 1) - 1
            if lo <= value <= hi:
                return int(value)
            raise CoercionError(f"{value} is out of range of a {int_bits}-bit integer column")
    elif to is SqlType.BOOLEAN:
        if isinstance(value, bool):
            return value
    elif to is SqlType.TIMESTAMP:
        if isinstance(value, dt.datetime):
            return value
        if isinstance(value, str):
            try:
                return parse_timestamp(value)
            except ValueError:
                raise CoercionError(f"{value!r} is not an ISO 8601 timestamp") from None
    kind = implicit_type(value)
    raise CoercionError(f"a {kind.value if kind else 'null'} value ({to_text(value)[:80]}) does not fit a {to.value} column")
