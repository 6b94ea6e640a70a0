"""A row-wise unit's rows held in the driver (issue 56, "a small unit's fixed cost"): the
transform's output over the base rows the unit found, marked by part (``even``, ``odd``: the
rows found, in two parts; ``alone``: rows made from no base row; ``old``: the rows the affected
keys held), collected once as Arrow (:func:`collected`), and everything the unit then needs of them
computed here without another Spark job: its checks (:func:`checks`, what
:func:`platform_assets.views.row_wise._checks` computes in Spark; :func:`differ`), the values of a column
(:func:`distinct_values`), the affected keys (:func:`key_rows`) and the MERGE's source
(:func:`merge_source`: each key's new row, or the key alone where no row gives it any more).

Rows are compared as Spark's grouping does: nulls equal, NaN equal to NaN, ``-0.0`` to ``0.0``
(Python's own equality and hash, with NaN made one value); struct and array values by their
fields and elements; a unit with collated strings (``UTF8_LCASE``) stays in Spark
(:func:`binary_strings`). Pure Arrow and Python (Spark's types only to read a schema); imports
nothing of the other strategies."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

#: A row-wise unit whose rows (every part) are at most this many is computed in the driver.
IN_HAND_ROWS = 100_000

_NAN = ("tm_nan",)  # every NaN as one value (Spark's grouping normalises NaN)


def collected(rows: DataFrame) -> pa.Table | None:
    """``rows`` (computed already: a local checkpoint) as Arrow when it has at most
    :data:`IN_HAND_ROWS` rows (read at call time), else None. Arrow keeps every value as Spark has
    it (a timestamp as UTC microseconds, a decimal with its scale), where ``collect`` goes through
    Python's local time."""
    limit = IN_HAND_ROWS
    # one task over every partition (a checkpoint of a union has many; a limit over them scans them in rounds)
    got = rows.coalesce(1).limit(max(limit, 0) + 1).toArrow()
    return None if got.num_rows > limit else got


def binary_strings(schema: StructType) -> bool:
    """Whether every string in ``schema`` (nested too) compares by its bytes, as Python compares
    them: a collated string (``UTF8_LCASE``) is equal to others in Spark that Arrow cannot tell."""
    return all(getattr(t, "collation", "UTF8_BINARY") == "UTF8_BINARY" for t in _types(schema))


def _types(t: Any) -> Iterable[Any]:
    from pyspark.sql.types import ArrayType, MapType, StructType

    yield t
    if isinstance(t, StructType):
        for f in t.fields:
            yield from _types(f.dataType)
    elif isinstance(t, ArrayType):
        yield from _types(t.elementType)
    elif isinstance(t, MapType):
        yield from _types(t.keyType)
        yield from _types(t.valueType)


def hashable(value: Any) -> Any:
    """``value`` (as ``to_pylist`` gives it) as a hashable value equal where Spark's grouping finds
    it equal."""
    if isinstance(value, float) and value != value:
        return _NAN
    if isinstance(value, dict):
        return tuple((k, hashable(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(hashable(v) for v in value)
    return value


def _tuples(table: pa.Table, cols: Iterable[str]) -> list[tuple[Any, ...]]:
    columns = [[hashable(v) for v in table.column(c).to_pylist()] for c in cols]
    return list(zip(*columns, strict=True)) if columns else [() for _ in range(table.num_rows)]


def part(every: pa.Table, part_col: str, *names: str) -> pa.Table:
    """The rows of ``every`` of the parts ``names``, without the part column."""
    mask = pc.is_in(every.column(part_col), value_set=pa.array(list(names), pa.string()))
    return every.filter(mask).drop_columns([part_col])


def checks(every: pa.Table, key: list[str], part_col: str, found: pa.Table | None) -> dict[str, Any]:
    """What a row-wise unit checks of its rows ``every``: ``rows`` the rows made from the base rows
    found (parts ``even`` and ``odd``), ``alone`` the rows made from no base row, ``twice`` the keys
    given to more than one of those rows (``most``: one of the keys given most often, as
    ``{column: value}``; ``most_n``: how often), and, when the unit found its base rows in the view
    (``found``: those view rows), ``differ``: the rows in which ``found`` and part ``old`` (the
    transform over their base columns; the same column types) differ, each row as often as it
    occurs (0: the same rows)."""
    made = part(every, part_col, "even", "odd")
    counts = collections.Counter(_tuples(made, key))
    most, most_n = (counts.most_common(1)[0] if counts else ((), 0))
    got: dict[str, Any] = {
        "rows": made.num_rows, "alone": part(every, part_col, "alone").num_rows,
        "twice": sum(1 for n in counts.values() if n > 1), "most_n": most_n,
        "most": dict(zip(key, _raw(made, key, most), strict=True)) if counts else None, "differ": 0}
    if found is not None:
        got["differ"] = differ(part(every, part_col, "old"), found)
    return got


def differ(again: pa.Table, found: pa.Table) -> int:
    """The rows in which ``found`` (rows looked up in the view) and ``again`` (the transform over
    their base columns, with at least ``found``'s columns) differ, each row as often as it occurs
    (0: the same rows, as Spark's grouping compares them). The same rows are told by Arrow, both
    sorted (:func:`_same_rows`); only where it cannot tell are the rows counted as Python values."""
    if _same_rows(again.select(found.column_names), found):
        return 0
    counted = collections.Counter(_tuples(again, found.column_names))
    counted.subtract(collections.Counter(_tuples(found, found.column_names)))
    return sum(abs(n) for n in counted.values())


def _same_rows(a: pa.Table, b: pa.Table) -> bool:
    """Whether ``a`` and ``b`` (the same columns) hold the same rows in some order: each sorted by
    every column, then compared column by column (a -0.0 equals a 0.0, as in Spark's grouping).
    False also where Arrow cannot tell: a column it cannot sort (nested), a NaN (never equal to
    itself in Arrow), columns of other types."""
    cols = a.column_names
    if a.num_rows != b.num_rows or cols != b.column_names:
        return False
    if not cols or a.num_rows == 0:
        return True
    try:
        order = [(c, "ascending") for c in cols]
        left, right = (t.take(pc.sort_indices(t, sort_keys=order)) for t in (a, b))
        return all(left.column(c).equals(right.column(c)) for c in cols)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
        return False


def _raw(table: pa.Table, cols: list[str], wanted: tuple[Any, ...]) -> list[Any]:
    """The values of ``cols`` in the first row of ``table`` whose hashable values are ``wanted``."""
    for i, row in enumerate(_tuples(table, cols)):
        if row == wanted:
            return [table.column(c)[i].as_py() for c in cols]
    return list(wanted)


def comparable(every: pa.Table, found: pa.Table) -> bool:
    """Whether part ``old`` of ``every`` and ``found`` have the same Arrow type in every column of
    ``found`` (else Spark casts the former to the view's types before comparing)."""
    return all(c in every.column_names and every.schema.field(c).type == found.schema.field(c).type
               for c in found.column_names)


def distinct_values(table: pa.Table, col: str, limit: int) -> list[Any] | None:
    """The distinct values of ``col`` in ``table`` (as ``to_pylist`` gives them; None among them for
    a null), or None when there are more than ``limit``."""
    got = key_rows([table], [col], limit)
    return None if got is None else [v for (v,) in got]


def key_rows(tables: Iterable[pa.Table], key: list[str], limit: int) -> list[tuple[Any, ...]] | None:
    """The distinct keys (tuples of ``key``'s values) of ``tables``, in order of appearance; None
    when there are more than ``limit``."""
    seen: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for table in tables:
        raw = list(zip(*[table.column(k).to_pylist() for k in key], strict=True)) if key else []
        for h, r in zip(_tuples(table, key), raw, strict=True):
            seen.setdefault(h, r)
            if len(seen) > limit:
                return None
    return list(seen.values())


def merge_source(made: pa.Table, old_keys: pa.Table, key: list[str], present: str) -> pa.Table:
    """A row-wise MERGE's source: every row of ``made`` (the affected keys' new rows, one per key)
    with ``present`` true, and every key of ``old_keys`` that ``made`` does not give, once, with
    ``present`` null and its other columns null (the key is no longer produced)."""
    given = set(_tuples(made, key))
    gone: dict[tuple[Any, ...], int] = {}
    for i, k in enumerate(_tuples(old_keys, key)):
        if k not in given:
            gone.setdefault(k, i)
    rows = made.append_column(present, pa.array([True] * made.num_rows, pa.bool_()))
    rows = rows.cast(pa.schema([f.with_nullable(True) for f in rows.schema]))  # a gone key's other columns are null
    if not gone:
        return rows
    taken = old_keys.select(key).take(pa.array(list(gone.values()), pa.int64()))
    columns = [taken.column(f.name) if f.name in key else pa.nulls(taken.num_rows, f.type) for f in rows.schema]
    return pa.concat_tables([rows, pa.table(columns, schema=rows.schema)])
