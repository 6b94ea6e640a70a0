"""A small unit's transform in the driver: the topic's Spark SQL run by DuckDB over Arrow tables,
where the SQL is of a form whose meaning both engines share (no Spark job; issue 56).

Spark on 2 cores needs ~0.27 s for any join and aggregate, even of local rows; a unit of 10,000
appended rows costs less than that everywhere else. DuckDB gives the same rows only where the SQL
means the same to both, so :func:`translate` accepts a narrow form and refuses everything else
(:class:`Declined`, the unit then runs in Spark as before):

* one ``SELECT`` from ``block``, with ``[LEFT [OUTER]] JOIN``\\ s of inputs (or ``block``) ``ON`` a
  condition; ``WHERE``; ``GROUP BY``. No ``*``, ``DISTINCT``, ``HAVING``, ``ORDER BY``, ``LIMIT``,
  subquery, ``WITH``, set operation, window, arithmetic or other function;
* every output column named (an alias or a bare column);
* expressions: columns; integer, string, boolean and null literals; ``coalesce``; ``CASE WHEN``;
  comparisons (``=``, ``<>``, ``<``, ...), ``IN`` lists, ``IS [NOT] NULL``, ``AND``, ``OR``,
  ``NOT``; ``count``, ``sum``, ``min``, ``max``. Operands of a comparison, ``coalesce``, ``CASE`` or
  ``IN`` share one kind (integers, decimals, strings, dates, instants, local date-times, booleans);
  floating-point values only pass through as columns (Spark and DuckDB differ on NaN and -0.0);
* ``CAST`` of a column only, computed here, before DuckDB sees the rows (:func:`cast_column`):
  an instant or local date-time to ``DATE`` (UTC, the session time zone Tidemark sets), an integer to
  an integer or ``DECIMAL(p, s)``, a decimal to a decimal of no smaller scale, a date to a date, a
  double to ``DECIMAL(p, s)`` where every value's shortest text has at most ``s`` decimals (Spark's
  rounding cannot then differ from that text; a value with more decimals declines at run time).

Results are cast to the view's own column types with Arrow's safe cast: a value that does not fit
(an overflowing sum) declines as well, and Spark says what it says of it. This module imports no
Spark and nothing of the room; ``driver_unit`` runs it for a unit.
"""

from __future__ import annotations

import datetime
import decimal
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class Declined(Exception):  # noqa: N818 - a decision, not a failure: the unit runs in Spark
    """The SQL (or a value of the rows) is outside the form the driver runs exactly; the reason."""


@dataclass(frozen=True)
class CastColumn:
    """A ``CAST`` of a column the driver computes: table (alias), column, target, the new column."""

    alias: str
    column: str
    target: pa.DataType
    name: str


@dataclass
class Translated:
    """The SQL as DuckDB runs it: ``sql`` over one relation per alias of the query (``aliases``:
    alias -> (relation, table: ``block`` or a lineage table)), the columns it reads per table, the
    casts computed first, and the output columns in order."""

    sql: str
    aliases: dict[str, tuple[str, str]]
    columns: dict[str, set[str]] = field(default_factory=dict)
    casts: list[CastColumn] = field(default_factory=list)
    output: list[str] = field(default_factory=list)
    grouped: bool = False  # GROUP BY or an aggregate: rows of several base rows
    #: output column -> the ``block`` column it is, as it is: a bare column of the ``FROM`` table
    #: (not a cast, an expression over it, or a column of a joined ``block``)
    copied: dict[str, str] = field(default_factory=dict)


#: (side, kind) of the joins run in the driver: [INNER] JOIN, LEFT [OUTER] JOIN
_JOINS = {("", ""), ("", "INNER"), ("LEFT", ""), ("LEFT", "OUTER")}
_KINDS = {"int": pa.types.is_integer, "decimal": pa.types.is_decimal, "string": pa.types.is_string,
          "date": pa.types.is_date32, "bool": pa.types.is_boolean}


def kind(t: pa.DataType) -> str:
    """The kind of values of an Arrow type, as comparisons group them ("" for one the driver does not compare)."""
    if pa.types.is_large_string(t):
        return "string"
    if pa.types.is_timestamp(t):
        return "instant" if t.tz is not None else "local"
    return next((k for k, test in _KINDS.items() if test(t)), "float" if pa.types.is_floating(t) else "")


def translate(sql: str, schemas: Mapping[str, pa.Schema]) -> Translated:
    """``sql`` (Spark SQL; ``block`` and the lineage tables of ``schemas``, by name) as DuckDB SQL;
    :class:`Declined` where it is outside the form both engines run alike (module docstring)."""
    import sqlglot
    from sqlglot import exp

    try:
        parsed = sqlglot.parse(sql, read="spark")
    except Exception as exc:  # noqa: BLE001 - Spark parses it (and says what it thinks of it)
        raise Declined(f"sqlglot cannot parse it ({str(exc).splitlines()[0][:120]})") from exc
    statements = [s for s in parsed if s is not None]
    if len(statements) != 1 or type(statements[0]) is not exp.Select:
        raise Declined("not one plain SELECT")
    select = statements[0]
    for arg, value in select.args.items():  # what the form has; anything else (WITH, DISTINCT, ORDER BY, ...) declines
        if value and arg not in ("expressions", "from", "from_", "joins", "where", "group"):
            raise Declined(f"{arg.rstrip('_').upper()} is not run in the driver")
    source = select.args.get("from") or select.args.get("from_")
    if source is None or type(source.this) is not exp.Table:
        raise Declined("FROM is not a table")
    tables = [source.this]
    for join in select.args.get("joins") or []:
        if (join.side, join.kind) not in _JOINS or join.args.get("using") \
                or join.args.get("on") is None or type(join.this) is not exp.Table or join.args.get("method"):
            raise Declined(f"a join other than [LEFT] JOIN ... ON ({join.sql(dialect='spark')[:80]})")
        tables.append(join.this)
    tr = Translated("", {})
    types: dict[str, pa.Schema] = {}
    for i, tb in enumerate(tables):
        if tb.args.get("catalog") or tb.args.get("joins") or tb.args.get("laterals") or tb.args.get("pivots"):
            raise Declined(f"table {tb.sql(dialect='spark')}")
        name = f"{tb.db}.{tb.name}".lower() if tb.db else tb.name.lower()
        known = {k.lower(): k for k in schemas}
        if name not in known or (i == 0 and name != "block"):
            raise Declined(f"reads {name}, not block and the topic's inputs" if i else "does not read FROM block")
        table = known[name]
        alias = (tb.alias or tb.name).lower()
        if alias in tr.aliases:
            raise Declined(f"two tables named {alias}")
        tr.aliases[alias] = (f"tm_rel_{i}", table)
        types[alias] = schemas[table]
        tb.replace(exp.alias_(exp.to_table(f"tm_rel_{i}"), alias, table=True))
    tr.columns = {t: set() for _, t in tr.aliases.values()}
    tr.grouped = select.args.get("group") is not None or any(True for _ in select.find_all(exp.AggFunc))
    typer = _Typer(tr, types)
    items: list[Any] = []
    bodies: dict[int | str, Any] = {}
    for item in select.expressions:
        if isinstance(item, exp.Alias):
            out, body = item.alias, item.this
        elif isinstance(item, exp.Column) and not isinstance(item.this, exp.Star):
            out, body = item.name, item
        else:
            raise Declined(f"output column without a name ({item.sql(dialect='spark')[:80]})")
        if typer.kind(body, aggregate_ok=True) == "float" and not isinstance(body, exp.Column):
            raise Declined(f"{out}: a floating-point value computed")
        if isinstance(body, exp.Column):
            alias, name, _ = typer.field(body)
            out = name if not isinstance(item, exp.Alias) else out
            if tr.aliases[alias][0] == "tm_rel_0":  # the FROM table: block
                tr.copied[out] = name
        if out.lower() in {o.lower() for o in tr.output}:
            raise Declined(f"two output columns named {out}")
        tr.output.append(out)
        bodies[len(tr.output)] = bodies[out.lower()] = body
        items.append(exp.alias_(typer.rewrite(body), out, quoted=True))
    for join in select.args.get("joins") or []:
        typer.condition(join.args["on"])
        join.set("on", typer.rewrite(join.args["on"]))
    where = select.args.get("where")
    if where is not None:
        typer.condition(where.this)
        where.set("this", typer.rewrite(where.this))
    group = select.args.get("group")
    if group is not None:
        if any(group.args.get(a) for a in ("grouping_sets", "cube", "rollup", "totals")):
            raise Declined("GROUPING SETS, CUBE or ROLLUP")
        for g in list(group.expressions):
            expr = _grouped_by(g, bodies, typer)
            if typer.kind(expr) == "float":
                raise Declined("GROUP BY a floating-point value")
            g.replace(typer.rewrite(expr))
    select.set("expressions", items)
    tr.sql = select.sql(dialect="duckdb")
    return tr


def _grouped_by(g: Any, bodies: dict[int | str, Any], typer: _Typer) -> Any:
    """A ``GROUP BY`` item as Spark resolves it: a position names that output column's expression
    (``spark.sql.groupByOrdinal``), and a name that is no input column an output alias
    (``spark.sql.groupByAliases``)."""
    from sqlglot import exp

    if isinstance(g, exp.Literal):
        if not g.is_int or int(g.name) not in bodies:
            raise Declined(f"GROUP BY {g.sql(dialect='spark')}: not a position of the output")
        return bodies[int(g.name)]
    if isinstance(g, exp.Column) and not g.table and g.name.lower() in bodies and not any(
            g.name.lower() in (n.lower() for n in s.names) for s in typer.types.values()):
        return bodies[g.name.lower()]
    return g


class _Typer:
    """Kinds of expressions in the accepted form (:class:`Declined` for any other), and the
    expressions rewritten for DuckDB (casts replaced by the columns computed for them)."""

    def __init__(self, tr: Translated, types: dict[str, pa.Schema]) -> None:
        self.tr, self.types = tr, types

    def field(self, col: Any) -> tuple[str, str, pa.DataType]:
        """(alias, column name as the table names it, type) of a column reference."""
        name = col.name.lower()
        aliases = [col.table.lower()] if col.table else [a for a, s in self.types.items()
                                                          if name in (n.lower() for n in s.names)]
        if len(aliases) != 1 or aliases[0] not in self.types or col.args.get("db") or col.args.get("catalog"):
            raise Declined(f"column {col.sql(dialect='spark')} is not one column of one table")
        schema = self.types[aliases[0]]
        found = [f for f in schema if f.name.lower() == name]
        if len(found) != 1:
            raise Declined(f"column {col.sql(dialect='spark')} is not one column of its table")
        self.tr.columns[self.tr.aliases[aliases[0]][1]].add(found[0].name)
        return aliases[0], found[0].name, found[0].type

    def condition(self, node: Any) -> None:
        if self.kind(node) not in ("bool", "null"):
            raise Declined(f"a condition that is not a boolean ({node.sql(dialect='spark')[:80]})")

    def kind(self, node: Any, aggregate_ok: bool = False) -> str:  # noqa: C901, PLR0911, PLR0912 - one case per form
        from sqlglot import exp

        if isinstance(node, exp.Paren):
            return self.kind(node.this, aggregate_ok)
        if isinstance(node, exp.Column):
            if isinstance(node.this, exp.Star):
                raise Declined("SELECT *")
            found = kind(self.field(node)[2])
            if not found:
                raise Declined(f"column {node.sql(dialect='spark')} of type {self.field(node)[2]}")
            return found
        if isinstance(node, exp.Null):
            return "null"
        if isinstance(node, exp.Boolean):
            return "bool"
        if isinstance(node, exp.Literal):
            if node.is_string:
                if "\\" in node.this or any(ord(ch) < 32 for ch in node.this):  # Spark's escapes are its own
                    raise Declined(f"a string literal with an escape ({node.sql(dialect='spark')[:40]})")
                return "string"
            if node.is_int:
                return "int"
            raise Declined(f"the literal {node.sql(dialect='spark')} (a decimal or floating-point literal)")
        if isinstance(node, exp.Cast | exp.TryCast):
            if _date_literal(node):
                return "date"
            return kind(self._cast(node).target)
        if isinstance(node, exp.Coalesce):
            return self._same([node.this, *node.expressions], aggregate_ok, "coalesce")
        if isinstance(node, exp.Case):
            if node.this is not None:
                raise Declined("CASE x WHEN ... (a simple CASE)")
            for when in node.args.get("ifs") or []:
                self.condition(when.this)
            return self._same([*(w.args["true"] for w in node.args.get("ifs") or []), node.args.get("default")],
                              aggregate_ok, "CASE")
        if isinstance(node, exp.EQ | exp.NEQ | exp.GT | exp.GTE | exp.LT | exp.LTE):
            self._same([node.this, node.expression], False, "a comparison")
            return "bool"
        if isinstance(node, exp.In):
            if node.args.get("query") or node.args.get("unnest") or node.args.get("field"):
                raise Declined("IN (subquery)")
            self._same([node.this, *node.expressions], False, "IN")
            return "bool"
        if isinstance(node, exp.Is):
            if not isinstance(node.expression, exp.Null):
                raise Declined("IS other than IS [NOT] NULL")
            self.kind(node.this)
            return "bool"
        if isinstance(node, exp.And | exp.Or):
            self.condition(node.this)
            self.condition(node.expression)
            return "bool"
        if isinstance(node, exp.Not):
            self.condition(node.this)
            return "bool"
        if isinstance(node, exp.Count | exp.Sum | exp.Min | exp.Max) and aggregate_ok:
            arg = node.this
            if isinstance(arg, exp.Distinct) or node.args.get("distinct"):
                raise Declined("DISTINCT in an aggregate")
            if isinstance(node, exp.Count):
                if not isinstance(arg, exp.Star):
                    self.kind(arg)
                return "int"
            got = self.kind(arg)
            if got == "float" or (isinstance(node, exp.Sum) and got not in ("int", "decimal", "null")):
                raise Declined(f"{node.key} of {got} values")
            return got
        raise Declined(f"{type(node).__name__.lower()} ({node.sql(dialect='spark')[:80]}) is not run in the driver")

    def _same(self, nodes: list[Any], aggregate_ok: bool, what: str) -> str:
        kinds = {self.kind(n, aggregate_ok) for n in nodes if n is not None} - {"null"}
        if len(kinds) > 1 or "float" in kinds:
            raise Declined(f"{what} of {', '.join(sorted(kinds))} values")
        return next(iter(kinds), "null")

    def _cast(self, node: Any) -> CastColumn:
        from sqlglot import exp

        if not isinstance(node.this, exp.Column):
            raise Declined(f"CAST of an expression ({node.sql(dialect='spark')[:80]})")
        alias, column, source = self.field(node.this)
        target = _target(node.args["to"])
        if not _castable(source, target):
            raise Declined(f"CAST of {source} to {target}")
        for c in self.tr.casts:
            if (c.alias, c.column, c.target) == (alias, column, target):
                return c
        made = CastColumn(alias, column, target, f"tm_cast_{len(self.tr.casts)}")
        self.tr.casts.append(made)
        return made

    def rewrite(self, node: Any) -> Any:
        """``node`` with every cast replaced by its computed column."""
        from sqlglot import exp

        def swap(n: Any) -> Any:
            if isinstance(n, exp.Cast | exp.TryCast) and not _date_literal(n):
                c = self._cast(n)
                return exp.column(c.name, table=c.alias, quoted=True)
            return n

        return node.copy().transform(swap)


def _date_literal(node: Any) -> bool:
    """Whether a cast is a date literal (``DATE '2024-01-31'``): an ISO date both engines read alike."""
    from sqlglot import exp

    if not (isinstance(node.this, exp.Literal) and node.this.is_string):
        return False
    if _target(node.args["to"]) != pa.date32() or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", node.this.name):
        raise Declined(f"the literal {node.sql(dialect='spark')[:80]}")
    try:
        datetime.date.fromisoformat(node.this.name)
    except ValueError as exc:
        raise Declined(f"the literal {node.sql(dialect='spark')[:80]}") from exc
    return True


def _target(to: Any) -> pa.DataType:
    """The Arrow type of a cast's target (DATE, an integer, DECIMAL(p, s) with both given)."""
    from sqlglot import exp

    t = to.this
    plain = {exp.DataType.Type.DATE: pa.date32(), exp.DataType.Type.TINYINT: pa.int8(),
             exp.DataType.Type.SMALLINT: pa.int16(), exp.DataType.Type.INT: pa.int32(),
             exp.DataType.Type.BIGINT: pa.int64()}
    if t in plain and not to.expressions:
        return plain[t]
    if t == exp.DataType.Type.DECIMAL and len(to.expressions) == 2:
        p, s = (int(e.this.name) for e in to.expressions)
        if 0 <= s <= p <= 38:
            return pa.decimal128(p, s)
    raise Declined(f"CAST to {to.sql(dialect='spark')}")


def _castable(source: pa.DataType, target: pa.DataType) -> bool:
    src, dst = kind(source), kind(target)
    if dst == "date":
        return src in ("date", "instant", "local")
    if dst == "int":
        return src == "int"
    if dst == "decimal":
        return (src == "int" or pa.types.is_float64(source)
                or (src == "decimal" and target.scale >= source.scale))  # type: ignore[attr-defined]
    return False


def cast_column(values: pa.ChunkedArray | pa.Array, target: pa.DataType) -> pa.Array:
    """``CAST(values AS target)`` as Spark computes it (session time zone UTC), or :class:`Declined`
    where a value would not give what Spark gives (a double with more decimals than the target
    keeps, one out of its range, a value that does not fit)."""
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    t = values.type
    try:
        if pa.types.is_date32(target) and pa.types.is_timestamp(t):
            per_day = {"s": 86_400, "ms": 86_400_000, "us": 86_400_000_000, "ns": 86_400_000_000_000}[t.unit]
            raw = values.cast(pa.int64())
            days = np.floor_divide(raw.fill_null(0).to_numpy(), per_day)  # floor: before 1970 too
            return pa.array(days.astype(np.int32), pa.int32(),
                            mask=raw.is_null().to_numpy(zero_copy_only=False)).cast(pa.date32())
        if pa.types.is_decimal(target) and pa.types.is_floating(t):
            return pa.array([_exact_decimal(v, target) for v in values.to_pylist()], target)
        return values.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OverflowError) as exc:
        raise Declined(f"a value does not cast to {target} as Spark would ({str(exc)[:100]})") from exc


def _exact_decimal(value: float | None, target: pa.DataType) -> decimal.Decimal | None:
    """A double as ``DECIMAL(p, s)``, where no rounding rule can matter: its shortest text has at
    most ``s`` decimals and its last binary place is far below ``10^-s`` (so Spark's HALF_UP rounding
    of its exact value, or of Java's text of it, gives that text)."""
    if value is None:
        return None
    scale, precision = target.scale, target.precision  # type: ignore[attr-defined]
    text = repr(float(value))
    if not math.isfinite(value) or "e" in text or math.ulp(value) >= 0.5 * 10.0 ** -scale:
        raise Declined(f"the double {text} as DECIMAL({precision}, {scale})")
    whole, _, frac = text.lstrip("-").partition(".")
    frac = frac.rstrip("0")
    if len(frac) > scale or len(whole.lstrip("0")) > precision - scale:
        raise Declined(f"the double {text} as DECIMAL({precision}, {scale}) (rounded or out of range)")
    return decimal.Decimal(text)


def run(tr: Translated, tables: Mapping[str, pa.Table]) -> pa.Table:
    """The translated SQL over ``tables`` (table -> its rows, with at least the columns it reads),
    by DuckDB; :class:`Declined` where a cast's value would not be Spark's."""
    import duckdb

    con = duckdb.connect()
    try:
        con.execute("SET TimeZone = 'UTC'")
        for alias, (relation, table) in tr.aliases.items():  # one per alias: each has its own computed columns
            rows = tables[table].select(sorted(tr.columns[table]))
            for c in (c for c in tr.casts if c.alias == alias):
                rows = rows.append_column(c.name, cast_column(tables[table].column(c.column), c.target))
            con.register(relation, rows)
        return con.sql(tr.sql).to_arrow_table()
    finally:
        con.close()


def cast_to(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """``rows`` as the columns of ``schema`` in its order and types, by Arrow's safe cast;
    :class:`Declined` where a value does not fit or a column is missing or extra."""
    if sorted(rows.column_names) != sorted(schema.names):
        raise Declined(f"the output's columns ({', '.join(rows.column_names)}) are not the view's "
                       f"({', '.join(schema.names)})")
    try:
        return pa.table([rows.column(f.name).cast(f.type, safe=True) for f in schema], schema=schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise Declined(f"an output value does not fit the view's type ({str(exc)[:100]})") from exc


def signed_sum(parts: list[tuple[int, pa.Table]], key: list[str], sums: list[str], schema: pa.Schema) -> pa.Table:
    """Per key of the ``parts`` (sign, rows with ``key`` and ``sums``), the sum of their ``sums``,
    a part of sign -1 subtracted; with ``_tm_minus``: whether such a part has the key. Summed as
    38-digit decimals (no overflow for a unit's rows) and cast back to ``schema``'s types
    (:class:`Declined` where a sum does not fit)."""
    wide = {c: pa.decimal128(38, schema.field(c).type.scale if pa.types.is_decimal(schema.field(c).type) else 0)
            for c in sums}
    tables = []
    for sign, t in parts:
        cols = [t.column(c).cast(wide[c]) for c in sums]
        tables.append(pa.table([*(t.column(k) for k in key), *(pc.negate_checked(c) if sign < 0 else c for c in cols),
                                pa.array([sign < 0] * t.num_rows, pa.bool_())], names=[*key, *sums, "_tm_minus"]))
    summed = pa.concat_tables(tables).group_by(key, use_threads=False).aggregate(
        [*((c, "sum") for c in sums), ("_tm_minus", "any")])
    try:
        return pa.table([*(summed.column(k) for k in key), *(summed.column(f"{c}_sum").cast(schema.field(c).type)
                                                             for c in sums), summed.column("_tm_minus_any")],
                        names=[*key, *sums, "_tm_minus"])
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise Declined(f"a sum does not fit the view's type ({str(exc)[:100]})") from exc


def keys_unique(rows: pa.Table, key: list[str]) -> bool:
    """Whether no two rows of ``rows`` share a key (nulls equal, as Spark groups them)."""
    if rows.num_rows < 2:
        return True
    counted = rows.select(key).group_by(key, use_threads=False).aggregate([([], "count_all")])
    return bool(pc.max(counted.column("count_all")).as_py() == 1)
