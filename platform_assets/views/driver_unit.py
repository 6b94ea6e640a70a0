"""A unit in the driver (issue 56): for an additive or row-wise view, a unit whose changes are new
base rows and at most one changed reference table reads its rows by ``deltalake`` (JVM-free: the
block; the base rows joining a changed reference row, by their join values from its change feed,
from the base, from the view's join index while it covers the base (``join_index: true``,
:mod:`resources.storage.join_index`) or, for a row-wise view that stands in for it, from the view
(:func:`_view_stands_in`);
the inputs at their versions), runs the transform by DuckDB
(:mod:`~platform_assets.views.driver_sql`, where the SQL is of a form both engines run alike), and
lands the rows by ``deltalake``: appended to a row-wise view (new rows only), MERGEd as re-derived
rows (a row-wise view's changed reference rows), or added to an additive view's groups. No Spark job.

Anything outside that (late rows, several changed inputs, SQL outside the form, a value Spark would
compute otherwise, a block over :data:`BLOCK_ROWS` rows, an input over :data:`INPUT_ROWS`, join
values or base rows the reverse join cannot read JVM-free, a table ``deltalake`` cannot read,
``$TIDEMARK_DRIVER_SQL=off``) leaves the unit to Spark as before: :func:`in_driver` gives None and
has changed nothing. What the Spark unit checks, the driver checks too or declines: a key given
twice, a null in a contribution, a sum that reaches 0 as rows leave, an output that does not fit
the view's types. Imports ``driver_sql``, ``in_hand``, ``additive``, ``row_wise``, ``reverse`` and
``work`` of the room."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from lineage.core.errors import ConfigError
from lineage.core.positions import Position
from lineage.spec.model import Topic
from lineage.views.refresh import cluster_column
from platform_assets.core import table_reads
from platform_assets.views import driver_sql, in_hand, reverse, row_wise
from platform_assets.views.additive import additive, groups_filter, zero_sums
from platform_assets.views.work import LOCAL_KEYS, PRESENT, MergeWork
from resources.storage import delta_meta, delta_read, join_index

if TYPE_CHECKING:
    from platform_assets.core.context import UnitContext
    from platform_assets.core.protocol import Planned
    from resources.state.offsets import OffsetRecord

log = logging.getLogger(__name__)

ENV = "TIDEMARK_DRIVER_SQL"
#: A unit of at most this many new base rows runs in the driver (more: Spark).
BLOCK_ROWS = 100_000
#: An input of at most this many rows is read whole by ``deltalake`` for a unit in the driver.
INPUT_ROWS = 1_000_000
#: What a unit's reason says where it read the base rows joining a changed row from the join index.
JOIN_INDEX_READ = "the base rows joining a changed row read from the join index on {column}, not by a scan of the base"


def enabled() -> bool:
    """``$TIDEMARK_DRIVER_SQL`` (``on``, the default, or ``off``: every unit's transform in Spark),
    with direct I/O on."""
    value = os.environ.get(ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ConfigError(f"${ENV}={os.environ.get(ENV)!r}: expected on or off")
    return value == "on" and table_reads.direct_io_on()


def prospect(topic: Topic, base_rows: int, late_rows: int, base: delta_meta.TableSnapshot,
             inputs: dict[str, delta_meta.TableSnapshot], view: delta_meta.TableSnapshot) -> str | None:
    """Why the next unit of ``topic`` cannot run in the driver, as far as the plan tells without
    reading its rows (JVM-free, for ``tidemark explain``); None: it may (the unit itself still
    declines on what it reads: a key given twice, a value Spark would compute otherwise, ...)."""
    if (why := _unfit(topic, base_rows, late_rows)) is not None:
        return why
    if (big := [t for t, s in inputs.items() if s.row_count is None or s.row_count > INPUT_ROWS]):
        return f"{', '.join(big)}: over {INPUT_ROWS:,} rows or of unknown size"
    try:
        _translation(topic, base, inputs)
        _schema(view)
    except driver_sql.Declined as why:
        return str(why)
    return None


def _unfit(topic: Topic, base_rows: int, late_rows: int) -> str | None:
    """Why a unit of ``topic`` with ``base_rows`` new and ``late_rows`` late base rows is not one
    the driver runs, by the spec and the sizes alone; None: it may be."""
    if (why := unfit_spec(topic)) is not None:
        return why
    if late_rows:
        return "late rows to re-derive"
    if not 0 <= base_rows <= BLOCK_ROWS:
        return f"{base_rows:,} new base rows (at most {BLOCK_ROWS:,})"
    return None


def unfit_spec(topic: Topic) -> str | None:
    """Why no unit of ``topic`` runs in the driver, by its spec and the environment alone; None: one may."""
    spec = topic.spec
    if not enabled():
        return f"${ENV} is off, or direct I/O is"
    if spec.additive is None and not spec.row_wise:
        return "neither additive nor row_wise"
    if topic.python or len(topic.transforms) != 1 or topic.transforms[0].sql is None or spec.before or spec.after:
        return "not one SQL transform without before/after statements"
    return None


def block_columns(topic: Topic, base: delta_meta.TableSnapshot, inputs: dict[str, delta_meta.TableSnapshot]) -> set[str]:
    """The base columns ``topic``'s transform reads, as the driver translates it against these
    versions' schemas (raises :class:`driver_sql.Declined` where it does not)."""
    return set(_translation(topic, base, inputs).columns["block"])


def _translation(topic: Topic, base: delta_meta.TableSnapshot,
                 inputs: dict[str, delta_meta.TableSnapshot]) -> driver_sql.Translated:
    """The topic's SQL translated for DuckDB against the base's and the inputs' schemas."""
    schemas = {"block": _schema(base), **{t: _schema(s) for t, s in inputs.items()}}
    return _translated(topic.transforms[0].sql or "", tuple(sorted(schemas.items())))


def in_driver(eng: UnitContext, topic: Topic, rec: OffsetRecord, planned: Planned, work: MergeWork,
              base: delta_meta.TableSnapshot) -> MergeWork | None:
    """The unit's work when it ran its transform in the driver (a copy of ``work``: ``source`` holds
    its rows, the additive MERGE's source, the re-derived rows or the rows to append, ``append``;
    ``driver`` set). None where Spark runs it (module docstring); ``work`` is never changed."""
    spec, block = topic.spec, planned.block
    if (block is None or not work.strategy.incremental or not work.built or work.view is None
            or work.view.table is None or not (block.next > block.last or work.strategy.reverse)
            or rec.inputs_next is None or _unfit(topic, planned.base_rows, work.late_rows) is not None):
        return None
    view, work = work.view, dataclasses.replace(work)  # what a declined unit set stays out of Spark's
    if view is None:
        return None
    try:
        conf = eng.spark.conf
        if conf.get("spark.sql.session.timeZone") != "UTC" or conf.get("spark.sql.caseSensitive", "false") != "false":
            raise driver_sql.Declined("the Spark session's time zone is not UTC, or its names are case-sensitive")
        inputs = {t: _snapshot(eng, t, v) for t, v in rec.inputs_next.items() if t in spec.depends_on[1:]}
        tr = _translation(topic, base, inputs)
        rows = _block(base, planned, tr.columns["block"]) if block.next > block.last else None
        unit = _Unit(tr, inputs, _schema(view))
        if spec.additive is not None:
            _added(eng, topic, work, unit, rows, base, block.last)
        elif work.strategy.reverse:
            _rederived(eng, topic, work, unit, rows, base, block.last)
        else:
            _appended(eng, topic, work, tr, unit.output(rows, inputs), block.last)
    except driver_sql.Declined as why:
        log.debug("topic %s: the transform runs in Spark: %s", topic.name, why)
        return None
    except Exception as exc:  # noqa: BLE001 - DuckDB's or deltalake's refusal: Spark runs the unit, as before
        log.info("topic %s: the transform in the driver failed (%s); Spark runs it", topic.name,
                 str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return None
    return work


def _snapshot(eng: UnitContext, table: str, version: int) -> delta_meta.TableSnapshot:
    snap = delta_meta.TableSnapshot.open(eng.path(table), version)
    if snap.table is None or snap.version != version:
        raise driver_sql.Declined(f"{table} version {version} cannot be opened")
    return snap


@dataclasses.dataclass(frozen=True)
class _Unit:
    """What a unit in the driver runs: the translated SQL, its inputs at the versions the unit
    planned (table -> snapshot), and the view's columns (its output is cast to them)."""

    tr: driver_sql.Translated
    inputs: dict[str, delta_meta.TableSnapshot]
    schema: pa.Schema

    def output(self, rows: pa.Table | None, inputs: dict[str, delta_meta.TableSnapshot]) -> pa.Table:
        """The transform over ``rows`` (base rows) with the inputs at ``inputs``' versions."""
        if rows is None:
            raise driver_sql.Declined("no base rows")
        tables = {"block": rows, **{t: _input(inputs[t], cols) for t, cols in self.tr.columns.items() if t != "block"}}
        return driver_sql.cast_to(driver_sql.run(self.tr, tables), self.schema)


def _schema(snap: delta_meta.TableSnapshot) -> pa.Schema:
    if snap.table is None:
        raise driver_sql.Declined(f"{snap.path}: no table")
    arrow = pa.schema(snap.table.schema().to_arrow())
    return pa.schema([pa.field(f.name, delta_read.plain_type(f.type), f.nullable) for f in arrow])


def _translated(sql: str, schemas: tuple[tuple[str, pa.Schema], ...]) -> driver_sql.Translated:
    """:func:`driver_sql.translate`, remembered (or its refusal) for the SQL and the tables' schemas."""
    got = _translate(sql, schemas)
    if isinstance(got, str):
        raise driver_sql.Declined(got)
    return got


@functools.lru_cache(maxsize=64)
def _translate(sql: str, schemas: tuple[tuple[str, pa.Schema], ...]) -> driver_sql.Translated | str:
    try:
        return driver_sql.translate(sql, dict(schemas))
    except driver_sql.Declined as why:
        return str(why)


def _block(base: delta_meta.TableSnapshot, planned: Planned, columns: set[str]) -> pa.Table:
    """The block's rows ``(last, next]`` by ``(pos, id)`` at the planned version, as
    :func:`platform_assets.core.blocks.block_df` selects them (a null ``id`` never is one)."""
    block = planned.block
    assert block is not None and base.table is not None  # noqa: S101 - checked by in_driver
    if not (delta_read.nanosecond_range(block.last.pos) and delta_read.nanosecond_range(block.next.pos)):
        raise driver_sql.Declined("block bounds outside DataFusion's timestamps")
    rows = delta_read.scan(base.table, sorted(columns | {"pos", "id"}),
                           predicate=f"pos >= {delta_read.sql_literal(block.last.pos)} AND "
                                     f"pos <= {delta_read.sql_literal(block.next.pos)}")
    rows = table_reads.in_range(rows, block.last, block.next)
    if rows is None:
        raise driver_sql.Declined("the base's pos is not a timestamp or its id not an integer")
    if planned.base_rows >= 0 and rows.num_rows != planned.base_rows:
        raise driver_sql.Declined(f"{rows.num_rows} block rows read, {planned.base_rows} planned")
    return rows


_INPUTS: collections.OrderedDict[tuple[Any, ...], pa.Table] = collections.OrderedDict()


def _input(snap: delta_meta.TableSnapshot, columns: set[str]) -> pa.Table:
    """The input's ``columns`` at the version ``snap``, read whole by ``deltalake`` (deletion vectors
    applied); a version's rows do not change, so the newest few reads are kept (by the table's id)."""
    if snap.table is None or snap.row_count is None or snap.row_count > INPUT_ROWS:
        raise driver_sql.Declined(f"{snap.path}: an input of unknown size or over {INPUT_ROWS:,} rows")
    key = (snap.path, snap.version, snap.table.metadata().id, tuple(sorted(columns)))
    got = _INPUTS.get(key)
    if got is None:
        got = delta_read.scan(snap.table, sorted(columns))
        _INPUTS[key] = got
        while len(_INPUTS) > 4:
            _INPUTS.popitem(last=False)
    else:
        _INPUTS.move_to_end(key)
    return got


def _added(eng: UnitContext, topic: Topic, work: MergeWork, unit: _Unit, rows: pa.Table | None,
           base: delta_meta.TableSnapshot, last: Position) -> None:
    """An additive view's unit: what it adds to each group is the transform over the new base rows
    and the rows joining a changed reference row with the inputs at their new versions, minus the
    transform over the latter at the versions the view applied (as
    :func:`platform_assets.views.reverse.moved` computes it in Spark)."""
    spec, add = topic.spec, additive(topic)
    key, sums = list(spec.key), [add.count, *add.sums]
    if not unit.tr.grouped:
        raise driver_sql.Declined("an additive transform without GROUP BY")
    if sorted(unit.schema.names) != sorted([*key, *sums]):
        raise driver_sql.Declined("the view's columns are not its key, count and sums")
    # each contribution checked alone, as Spark's unit checks it (a null in one: its groups re-derived)
    parts = [(1, unit.output(rows, unit.inputs))] if rows is not None else []
    how = ""
    if work.strategy.reverse:
        column, values, old = _changed(eng, topic, work)
        held, how = _held(eng, topic, unit, base, last, column, values)
        parts += [(1, unit.output(held, unit.inputs)), (-1, unit.output(held, {**unit.inputs, **old}))]
    for _, out in parts:
        if any(out.column(c).null_count for c in sums):
            raise driver_sql.Declined("a null in a sum column")
        if not driver_sql.keys_unique(out, key):
            raise driver_sql.Declined("a group given twice")
    summed = driver_sql.signed_sum(parts, key, sums, unit.schema)
    leaving = [r for r in summed.to_pylist() if r["_tm_minus"]]
    if leaving and (zero := zero_sums(eng, topic, leaving, frozenset(add.sums))):
        raise driver_sql.Declined(f"{zero} group(s) whose sum reaches 0 as rows leave (a sum over only nulls is null)")
    types = {f.name: f.dataType for f in table_reads.schema_of(eng.spark, eng.path(spec.destination)).fields}
    work.types = {c: types[c].simpleString() for c in add.columns}
    source = summed.drop_columns(["_tm_minus"])
    work.prune = groups_filter(source.select(key).to_pylist(), key)
    _done(work, source, f"additive: {source.num_rows} groups changed by the moved rows' contributions{how}")


def _changed(eng: UnitContext, topic: Topic, work: MergeWork) -> tuple[str, list[Any] | None,
                                                                      dict[str, delta_meta.TableSnapshot]]:
    """The one reverse-joined input's join column (the base's), its changed rows' join values (its
    change feed's, JVM-free; a literal list of one column, None where they are not one) and that
    input at the version the view applied."""
    if len(work.strategy.reverse) != 1:
        raise driver_sql.Declined("more than one changed input")
    [table] = work.strategy.reverse
    pairs = topic.spec.join_keys[table]
    change = next(c for c in work.changes if c.table == table)
    if len(pairs) != 1 or change.new is None or change.old is None:
        raise driver_sql.Declined(f"{table}: not one join column, or no version applied")
    [(column, theirs)] = pairs.items()
    # (more than reverse.IN_LIST values are not listed, and the unit declines: not turned into Python objects)
    found = table_reads.changed_value_rows(eng.path(table), change.old + 1, change.new, {theirs: column}, reverse.IN_LIST)
    return column, reverse.values_listed([column], found), {table: _snapshot(eng, table, change.old)}


def _held(eng: UnitContext, topic: Topic, unit: _Unit, base: delta_meta.TableSnapshot, last: Position, column: str,
          values: list[Any] | None) -> tuple[pa.Table, str]:
    """The base rows up to ``last`` whose ``column`` takes one of ``values`` (the block's columns),
    from the view's join index where it declares one and it is usable
    (:func:`~platform_assets.core.table_reads.indexed_rows`), else by a filtered scan of the base;
    and a note of the former for the unit's reason ("" for the latter)."""
    columns = sorted(unit.tr.columns["block"] | {"pos", "id"})
    if values is not None and topic.spec.join_index:
        index = join_index.index_path(eng.settings.warehouse, topic.spec.destination, column)
        held = table_reads.indexed_rows(base, index, {column: values}, last, columns)
        if held is not None:
            return held.select(columns), f"; {JOIN_INDEX_READ.format(column=column)}"
        log.info("topic %s: its join index on %s does not cover the base at version %s; the base is scanned",
                 topic.name, column, base.version)
    held = None if values is None else table_reads.matching_rows(base, {column: values}, last, columns=columns)
    if held is None:
        raise driver_sql.Declined(f"{column}: the changed rows' join values or the base rows joining them are not "
                                  f"read JVM-free")
    return held.select(columns), ""


def _in_view(eng: UnitContext, topic: Topic, work: MergeWork, unit: _Unit, base: delta_meta.TableSnapshot,
             last: Position, column: str, values: list[Any] | None) -> pa.Table | None:
    """The view's rows (every column) holding the base rows :func:`_held` reads, where the view stands
    in for the base (:func:`_view_stands_in`) and reads fewer bytes (:func:`_cheaper_in_view`); else None."""
    columns = sorted(unit.tr.columns["block"] | {"pos", "id"})
    if values is None or work.view is None or not _cheaper_in_view(work.view, base, {column: values}, columns) \
            or not _view_stands_in(eng, topic, work, unit, base, last, column):
        return None
    return table_reads.matching_rows(work.view, {column: values}, last)


def _cheaper_in_view(view: delta_meta.TableSnapshot, base: delta_meta.TableSnapshot, values: dict[str, Any],
                     columns: list[str]) -> bool:
    """Whether the view's files whose statistics allow ``values`` (read whole: every view column,
    to check the rows found) are fewer bytes than the base's ``columns`` a filtered scan of every
    base file reads (their share of its bytes by count), by the Delta logs: a view whose clustering
    the MERGEs wore away (every file may hold every value) is not read for them."""
    in_view, whole = view.bytes_holding(values), base.size_bytes
    return in_view is not None and whole is not None and bool(base.columns) and \
        in_view < whole * len(columns) / len(base.columns)


def _view_stands_in(eng: UnitContext, topic: Topic, work: MergeWork, unit: _Unit, base: delta_meta.TableSnapshot,
                    last: Position, column: str) -> bool:
    """Whether a row-wise view holds, in its own rows, the base rows up to ``last`` joining a value of
    ``column`` (the changed input's join column), found there by the view's clustering, where the
    base (in ``(pos, id)`` order) is scanned whole: what
    :func:`platform_assets.views.row_wise.found_in_view` checks in Spark, checked from the Delta
    logs and the translated SQL. ``column`` is the view's clustering column; every base column the
    transform reads (and ``pos``, ``id``, ``column``, the key) is an output column of its own name that is that
    column of the ``FROM`` table as it is, and of the base's type in the view; neither table has
    deletion vectors; the view's newest commit is this topic's unit up to ``last``; and its row count
    (the log's) is the base's up to ``last``. What that cannot show (a transform edited since the
    rows were written), the unit checks over the rows found (:func:`_rederived`)."""
    view, spec = work.view, topic.spec
    if view is None or view.table is None or cluster_column(spec, unit.schema.names) != column:
        return False
    needed = unit.tr.columns["block"] | {"pos", "id", column}  # the join column looked up, read or not
    theirs = _schema(base)
    if not set(spec.key) <= needed or any(
            unit.tr.copied.get(c) != c or c not in unit.schema.names or c not in theirs.names
            or unit.schema.field(c).type != theirs.field(c).type for c in needed):
        return False
    if delta_meta.deletion_vectors(view).feature or not row_wise.append_point(eng, topic, work, last):
        return False
    held = view.row_count
    return held is not None and held == delta_meta.count_upto(base, last)


def _rederived(eng: UnitContext, topic: Topic, work: MergeWork, unit: _Unit, rows: pa.Table | None,
               base: delta_meta.TableSnapshot, last: Position) -> None:
    """A row-wise view's unit with a changed reference table: the affected keys' new rows are the
    transform over the new base rows and those joining a changed row, at the new versions; their
    old rows (the keys they leave) the transform over the latter at the versions the view applied
    (as :func:`platform_assets.views.row_wise.rederive` computes them in Spark). The MERGE's source:
    every new row, and every old key no new row gives, to delete. Those base rows are looked up in
    the view where it stands in for the base, and must then be what the transform over their base
    columns gives back; else they are read from the base."""
    key = list(topic.spec.key)
    if unit.tr.grouped:
        raise driver_sql.Declined("a row-wise transform with an aggregate")
    column, values, old = _changed(eng, topic, work)
    found = _in_view(eng, topic, work, unit, base, last, column, values)
    how = ""
    if found is not None:
        held = found.select(sorted(unit.tr.columns["block"] | {"pos", "id"}))
        left = unit.output(held, {**unit.inputs, **old})
        differ = in_hand.differ(left, found) if in_hand.comparable(left, found) else -1
        how = f"; {row_wise.FOUND_IN_VIEW}" if differ == 0 else ""
        if differ:
            log.info("topic %s: %s", topic.name, row_wise.not_in_view(differ) if differ > 0 else
                     "the rows looked up in the view are not of the view's types; read from the base")
            found = None
    if found is None:
        held, how = _held(eng, topic, unit, base, last, column, values)
        left = unit.output(held, {**unit.inputs, **old})
    every = held
    if rows is not None:  # the block's rows (the base's) and the rows found (maybe the view's: nullable columns)
        both = pa.schema([f.with_nullable(True) for f in rows.schema])
        every = pa.concat_tables([rows.cast(both), held.select(rows.column_names).cast(both)])
    made = unit.output(every, unit.inputs)
    if not driver_sql.keys_unique(made, key) or not driver_sql.keys_unique(left, key):
        raise driver_sql.Declined("a key given twice")
    work.columns = list(made.column_names)
    work.key_rows = in_hand.key_rows([left, made], key, LOCAL_KEYS)
    if work.key_rows is None:
        raise driver_sql.Declined(f"more than {LOCAL_KEYS} keys")
    col = cluster_column(topic.spec, work.columns)
    if rows is None and col is not None:  # only moved rows: the view's rows of the keys are the old rows
        work.held = in_hand.distinct_values(left, col, reverse.NARROW_VALUES)
    read = reverse.prune_reads_view(topic, work, key, work.key_rows)
    work.prune = reverse.prune(eng, topic, work, key, work.key_rows)
    _done(work, in_hand.merge_source(made, left.select(key), key, PRESENT),
          f"row_wise: {made.num_rows} rows re-derived from the base rows found, not from the full base{how}",
          spark=None if read is None else f"one Spark job read the view's {read} of the {len(work.key_rows)} affected "
                                          f"keys, to prune the MERGE")


def _appended(eng: UnitContext, topic: Topic, work: MergeWork, tr: driver_sql.Translated, rows: pa.Table,
              last: Position) -> None:
    """A row-wise view's unit: the rows are appended, the view holding none of the new base rows
    (:func:`~platform_assets.views.row_wise.append_point`)."""
    key = list(topic.spec.key)
    if tr.grouped:
        raise driver_sql.Declined("a row-wise transform with an aggregate")
    if not row_wise.append_point(eng, topic, work, last):
        raise driver_sql.Declined("the view may hold rows of base rows after its last")
    if not driver_sql.keys_unique(rows, key):
        raise driver_sql.Declined("a key given twice")
    work.append = True
    _done(work, rows, f"row_wise: {rows.num_rows} rows re-derived from the base rows found, not from the full base; "
                      f"appended: the view holds no row of base rows after its last")


def _done(work: MergeWork, rows: pa.Table, what: str, *, spark: str | None = None) -> None:
    """The unit's rows (``rows``) and reason; ``spark``: the Spark job the unit still runs, if any."""
    work.source = rows
    work.driver = True
    how = f"; {spark}" if spark else ": no Spark job"
    work.strategy = dataclasses.replace(
        work.strategy, reason=f"{work.strategy.reason}; {what} (the transform run in the driver by DuckDB{how})")
