"""How a merge topic (a materialized view) brings its view up to date: pure decisions, no Spark.

A unit of a merge topic applies two kinds of change:

* new rows of the base table (the first of ``depends_on``), in a block ``(last, next]`` by
  ``(pos, id)`` as a step topic reads them, plus late rows when ``late_rows: rederive``;
* changes of every other input (a dimension updated in place), found by Delta version through
  the input's change data feed, from the version the topic applied last (its per-input offset).

Incremental: the view keys those changes touch are re-derived from the full inputs and MERGEd.
The keys come by the delta rule (:func:`inexact` says when it applies): new base rows give the
transform's keys over them; a changed input gives the transform's keys over the base rows that
join to a changed row of it (``join_keys``: base column -> input column), evaluated against the
input's previous and its new version. That is only possible when every changed input declares
its base join column and its change feed can be read; and it is only worth it while it reads and
writes less than a recompute (:func:`estimate`, from the tables' sizes in their Delta logs) and
no more than ``full_above`` of an input changed. An additive view (``additive``: a ``GROUP BY``
of a count and sums) re-derives nothing: its unit adds the changed rows' contributions, so only
those rows are read (:func:`estimate`), and it has no default ``full_above``; nor has a row-wise
view (``row_wise``: a view row per base row), whose unit re-derives only the rows it found. Otherwise the whole view is recomputed, and the reason is recorded; a topic with
``refresh: incremental_strict`` fails instead (:class:`RefreshRefused`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from lineage.core.durations import format_size
from lineage.core.errors import ProcessingError
from lineage.spec.model import Refresh, TopicSpec


class RefreshRefused(ProcessingError):
    """``refresh: incremental_strict`` and the unit could only be done by a full recompute."""


@dataclass(frozen=True)
class InputChange:
    """What changed in one input (not the base) since the version the topic applied last."""

    table: str
    old: int | None  # the topic's offset for this input (None: never applied)
    new: int | None  # the input's version now (None: the table does not exist)
    changed_rows: int | None = None  # rows its commits inserted, updated or deleted (None: unknown)
    table_rows: int | None = None  # rows in the input now (None: unknown)
    problem: str = ""  # why its change data feed cannot be read over (old, new] ("" = it can)
    table_bytes: int | None = None  # bytes of its data files at ``new`` (None: unknown)
    #: every commit in (old, new] only rewrote files (``dataChange: false``: OPTIMIZE, a purge of
    #: deletion vectors): the same rows, so no unit is due for this input
    rewrites_only: bool = False

    @property
    def changed(self) -> bool:
        return self.new is not None and (self.old is None or self.new > self.old)

    @property
    def due(self) -> bool:
        """Whether this change calls for a unit: new versions that are not only rewrites."""
        return self.changed and not self.rewrites_only

    @property
    def versions(self) -> str:
        first = 0 if self.old is None else self.old + 1
        return f"version {first}" if first == self.new else f"versions {first}..{self.new}"


@dataclass(frozen=True)
class Strategy:
    """The decision for one unit, recorded in ``etl.log`` and the materialization metadata."""

    incremental: bool
    reason: str
    reverse: tuple[str, ...] = ()  # inputs whose changes are applied by reverse join
    fallback: bool = False  # a full recompute because incremental was impossible or dearer
    estimate: Estimate | None = None  # what each strategy would read and write (None: not estimated)

    @property
    def name(self) -> str:
        return "incremental" if self.incremental else "full"


@dataclass(frozen=True)
class Sizes:
    """What a unit's tables hold, from their Delta logs (file sizes; JVM-free): the base at the
    planned version, every other input at its new version, the view now."""

    base_bytes: int
    base_rows: int
    view_bytes: int
    view_files: int
    view_rows: int
    inputs_bytes: dict[str, int]
    view_columns: int = 1
    #: the view's files hold narrow ranges of its clustering column (:func:`cluster_column`), so a
    #: MERGE of few keys reads only the files holding them
    clustered: bool = False


#: Writing a byte (Parquet encoding, compression, statistics, the commit) costs about this many
#: reads of one: the weight of written bytes in an estimate.
WRITE_COST = 3
#: Beyond its bytes, each view file a MERGE rewrites costs about what a recompute moves in this
#: many bytes: Spark's copy-on-write MERGE reads each touched file twice (to find it, then to
#: rewrite it) and writes it again, a task and a Parquet writer per file. Measured
#: (``bench/view_scaling.py``, 50M orders, 1,200 changed customers of ``mart.orders_wide``): 880
#: files of 25,000 rows rewritten in 102 s (scan 32 s, rewrite 70 s), against a 47 s rebuild that
#: moves ~3.8 GiB by the estimate (~80 MiB/s); the files' bytes account for ~22 s of it, the rest
#: is ~90 ms a file. The estimate counted ~1,400 files there (two groups per changed row: the one
#: it leaves and the one it joins), so ~57 ms, ~4.6 MiB, per file it counts. Twice that sent
#: changes of 17-38 reference rows at 10M orders to a full recompute, where a Spark unit of 10 costs
#: 1.5-2 s against an 11.5 s rebuild (``docs/limits.md``).
MERGE_FILE_COST = 4 * 2**20
#: The estimate decides only when a full recompute would move at least this many bytes. Below it
#: both strategies take a few seconds, and the incremental unit keeps the view's change feed to
#: the rows that really changed (a view over this view then reverse-joins a few rows).
COST_FLOOR = 16 * 2**20
#: The fixed cost of a reverse join beyond a recompute's (the change feed, the inputs pinned at two
#: versions, collecting keys and rows, the MERGE's two passes: a dozen more Spark jobs), as the
#: bytes a recompute moves in that time: about 7 to 18 s on 2 cores (``bench/view_scaling.py``,
#: 1M and 5M orders). A unit of new base rows alone costs about what its bytes say.
REVERSE_OVERHEAD = 256 * 2**20
#: The same for an additive view (no re-derivation: the change feed, the rows joining a changed row
#: checkpointed, their contributions at two versions, one small MERGE): about 3 s on 2 cores, plus
#: about 2 s more for 1,200 changed rows than for 12 (a semi join where a literal list was pushed
#: down), against a recompute moving ~30 MiB/s (``bench/view_scaling.py``, 10M orders).
ADDITIVE_OVERHEAD = 96 * 2**20
ADDITIVE_PER_ROW = 48 * 2**10
#: A filtered scan of the base (no join, no aggregate, no shuffle) costs about this share of what
#: a recompute pays per base byte: 2 s against 5 s for 10M orders (``bench/view_scaling.py``).
FILTERED_SCAN = 0.4
#: A full recompute replaces an incremental unit only when the latter is estimated this much
#: dearer: the estimate is coarse, and the incremental unit keeps the view's change feed small.
FULL_MARGIN = 1.25
#: Up to this many affected keys, a clustered view's MERGE is pruned by their values (as literals).
PRUNED_KEYS = 5_000


@dataclass(frozen=True)
class Estimate:
    """Bytes each strategy would read plus written bytes weighted by :data:`WRITE_COST`."""

    incremental: int
    full: int
    files_rewritten: float  # the view's files an incremental unit's MERGE is expected to rewrite

    def text(self) -> str:
        return (f"estimated {format_size(self.incremental)} incremental against {format_size(self.full)} full "
                f"(~{self.files_rewritten:.0f} view files rewritten)")


#: Rows per file of a view's build clustered by its join column (at most CLUSTER_FILES files), and
#: the file size table maintenance keeps such a view at: a reverse join's MERGE rewrites whole
#: files, so smaller files make it cheaper, and the build dearer (``bench/view_scaling.py``).
CLUSTER_ROWS, CLUSTER_FILES = 25_000, 4096


def cluster_column(spec: TopicSpec, columns: Collection[str]) -> str | None:
    """The view column a full build clusters its files by (and a MERGE of few keys is pruned by):
    the first view column of ``join_keys`` the view has."""
    return next((c for pairs in spec.join_keys.values() for c in pairs if c in columns), None)


def estimate(sizes: Sizes, *, base_rows: int, late_rows: int, changes: Sequence[InputChange],
             reverse: Sequence[str], additive: bool = False, row_wise: bool = False) -> Estimate:
    """What a full recompute and an incremental unit would read and write, in bytes, from what
    the unit does (:mod:`platform_assets.views.merge`):

    * full: every input read once, the whole view written (its size now);
    * incremental: the base read to find the rows joining a changed row (when an input changed)
      and again, with every input, to re-derive the affected keys (a pushed-down filter skips
      files only where statistics allow: counted whole); the changed inputs read at their old
      version; the view read by the MERGE (a clustered view: two of its columns to find the files
      of the affected keys, then those files); each view file holding an affected row read and
      written again, plus :data:`MERGE_FILE_COST` a file (with deletion vectors alike: see
      below); and, for a reverse join, a fixed :data:`REVERSE_OVERHEAD`. Affected rows are placed
      in files at random, except that the rows of one changed input row share a file (a view
      clustered by its join column): ``k`` affected clusters touch ``F * (1 - (1 - 1/F)**k)`` of
      ``F`` files. New base rows mostly make new
      keys (inserted, no file rewritten) where the view has about a row per base row, and fall
      into existing groups where it has far fewer (an aggregate).

    An additive view (``additive``) re-derives nothing: its unit reads the new block, the base once
    for the rows joining a changed row (a filtered scan, weighted :data:`FILTERED_SCAN`), and every
    input, and pays :data:`ADDITIVE_OVERHEAD` plus :data:`ADDITIVE_PER_ROW` per changed row for a
    reverse join. So does a row-wise view (``row_wise``), whose unit re-derives only the rows it
    found: the base once filtered and the new block, with a reverse join's fixed cost (measured: a
    row-wise unit of 10 changed customers at 10M orders costs about a recompute, 9.8 s, as
    ``bench/view_scaling.py`` shows); its MERGE rewrites files
    like any other view's, and a unit of new base rows alone appends them (no view file read)."""
    narrow = additive or row_wise
    inputs = sum(sizes.inputs_bytes.values())
    full = sizes.base_bytes + inputs + WRITE_COST * sizes.view_bytes
    by_table = {c.table: c for c in changes}
    before = sizes.base_rows - base_rows  # the base rows the view holds now
    existing = 1 - min(1.0, sizes.view_rows / before) if before > 0 else 1.0
    clusters = late_rows + min(base_rows, sizes.view_rows) * existing
    find = 0.0
    changed = 0
    for t in reverse:
        c = by_table[t]
        rows = c.changed_rows if c.changed_rows is not None else (c.table_rows or 0)
        changed += rows
        clusters += 2 * rows  # the groups rows leave (old value) and join (new value)
        find += sizes.inputs_bytes.get(t, 0)  # the input at its old version
    if reverse:
        find += sizes.base_bytes * (FILTERED_SCAN if narrow else 1)
    elif base_rows and sizes.base_rows:
        find += sizes.base_bytes * min(1.0, base_rows / sizes.base_rows)  # the new block alone
    appends = row_wise and not reverse and not late_rows  # new base rows only: appended, the view is not read
    files = max(sizes.view_files, 1)
    rewritten = files * (1 - (1 - 1 / files) ** clusters) if clusters and not appends else 0.0
    touched = sizes.view_bytes * rewritten / files
    if appends:
        scan = 0.0
    elif sizes.clustered and clusters <= PRUNED_KEYS:  # two columns of the view, then the files holding the keys
        scan = sizes.view_bytes * min(1.0, 2 / max(sizes.view_columns, 1)) + touched
    else:
        scan = sizes.view_bytes
    # each touched file read and written again, and a fixed cost a file. With deletion vectors Delta
    # writes only the changed rows and a vector per file, but it reads each touched file again for
    # the rows' indexes and writes each vector on its own: measured, of the order of a rewrite per
    # file (1,000 changed customers at 50M orders: 706 vectors in 56.2 s, the unit 104.1 s against a
    # 48.6 s rebuild, bench/view_scaling.py --deletion-vectors), so both count alike (the rows
    # written anew, a few per key, are left out of both)
    rewrite = touched * (1 + WRITE_COST) + rewritten * MERGE_FILE_COST
    overhead = ((ADDITIVE_OVERHEAD + ADDITIVE_PER_ROW * changed if additive else REVERSE_OVERHEAD)
                if reverse else 0)
    # the base read again to re-derive (not by an additive view; by a row-wise one only for late rows)
    again = 0 if additive or (row_wise and not late_rows) else sizes.base_bytes
    incremental = overhead + find + again + inputs + scan + rewrite
    return Estimate(int(incremental), int(full), rewritten)


#: ``full_above`` when a spec does not set it: a re-derived view's MERGE rewrites every data file
#: holding an affected row, so a wide change costs more than a rebuild (``bench/reverse_join.py``).
#: An additive or row-wise view has no default cap: its unit reads the changed rows, not the affected
#: groups' whole base, and the estimate decides.
FULL_ABOVE = 0.005


def full_above(spec: TopicSpec) -> float | None:
    """The share of an input's rows above which a view is recomputed whole (None: no cap)."""
    if spec.full_above is not None:
        return spec.full_above
    return None if spec.additive is not None or spec.row_wise else FULL_ABOVE


def inexact(spec: TopicSpec, table: str, base_columns: Collection[str], *, python_transform: bool = False) -> str:
    """Why a change of input ``table`` cannot be applied to the view by the delta rule ('' if it can).

    The rule: the view keys a changed reference row affects are the transform's keys of the base
    rows that join to it, evaluated against the input's previous version (their old groups) and
    its new version (their new groups). That needs ``join_keys`` to name the base's join column
    (``{customer_id: id}``: base column -> input column), and a SQL transform (the previous
    version is substituted for the table's name). A view column that merely carries a reference
    value cannot say which base rows move: a row whose reference vanished or appeared, or whose
    key is an expression of it (``coalesce``, ``CASE``, a bucket), lands in a group no changed
    reference row names."""
    pairs = spec.join_keys.get(table)
    if not pairs:
        return f"the spec declares no join_keys for {table}"
    missing = [c for c in pairs if c not in base_columns]
    if missing:
        return (f"its join_keys name {', '.join(missing)}, which the base {spec.base} does not have, so the affected keys "
                f"cannot be derived exactly (view columns cannot say which base rows move between groups when a "
                f"reference row vanishes, appears or maps to an expression); declare the base's join column instead, "
                f"e.g. {{{table}: {{<{spec.base} column>: {pairs[missing[0]]}}}}}")
    if python_transform:
        return (f"a Python transform reads {table} by name, so its previous version cannot be substituted and the "
                f"affected keys cannot be derived exactly (write the transform in SQL)")
    return ""


def choose(spec: TopicSpec, *, built: bool, base_rows: int, base_columns: Collection[str], late_rows: int = 0,
           changes: Sequence[InputChange] = (), python_transform: bool = False, sizes: Sizes | None = None,
           by_cost: bool = True) -> Strategy:
    """The strategy of the next unit of merge topic ``spec``.

    ``built``: the view holds a commit of this topic (else the first unit builds it whole);
    ``base_rows``: base rows in the block; ``base_columns``: the base table's columns (which
    ``join_keys`` name base join columns, see :func:`inexact`); ``late_rows``: late base rows to
    re-derive; ``changes``: every other input; ``python_transform``: a transform is Python code.
    Raises :class:`RefreshRefused` when ``refresh: incremental_strict`` and only a full
    recompute can do the unit.

    ``sizes``: the tables' sizes from their logs. With them, an incremental unit that
    :func:`estimate` finds :data:`FULL_MARGIN` times dearer than a full recompute becomes a full one, once the full
    recompute moves at least :data:`COST_FLOOR` bytes (never under ``incremental_strict``); the
    estimate is recorded in the strategy either way (``by_cost`` False: it decides nothing; the caller
    knows the incremental unit costs less than the estimate says). ``full_above`` stays a cap set by share."""
    if not built:
        return Strategy(False, f"initial build: {spec.destination} holds no commit of topic '{spec.name}'")
    if spec.refresh is Refresh.FULL:
        return Strategy(False, "refresh: full (the spec asks for a full recompute every time)")
    strict = spec.refresh is Refresh.STRICT
    cap = full_above(spec)
    why: list[str] = []
    reverse: list[str] = []
    for c in changes:
        if not c.changed:
            continue
        if c.old is None:
            why.append(f"{c.table} has no offset yet (added to depends_on after the view was built)")
        elif c.table not in spec.join_keys:
            why.append(f"{c.table} changed ({c.versions}) and the spec declares no join_keys for it")
        elif problem := inexact(spec, c.table, base_columns, python_transform=python_transform):
            why.append(f"{c.table} changed ({c.versions}) and {problem}")
        elif c.problem:
            why.append(f"{c.table} changed ({c.versions}) but its change data feed cannot be read: {c.problem}")
        elif (not strict and cap is not None and c.changed_rows is not None and c.table_rows
              and c.changed_rows > cap * c.table_rows):
            why.append(f"{c.changed_rows} rows of {c.table} changed, more than full_above {cap * 100:g}% of its "
                       f"{c.table_rows} rows (a full recompute is cheaper)")
        else:
            reverse.append(c.table)
    if why:
        reason = "full recompute because " + "; ".join(why)
        if strict:
            raise RefreshRefused(f"topic '{spec.name}': refresh: incremental_strict refuses a {reason}. Fix the cause "
                                 f"(declare join_keys on the base's join column, enable delta.enableChangeDataFeed on the "
                                 f"input), or run it once "
                                 f"with refresh: incremental")
        return Strategy(False, reason, fallback=True)
    parts = []
    if base_rows:
        parts.append(f"{base_rows} new base rows")
    if late_rows:
        parts.append(f"{late_rows} late base rows re-derived")
    by_table = {c.table: c for c in changes}
    for t in reverse:
        c = by_table[t]
        n = "an unknown number of" if c.changed_rows is None else str(c.changed_rows)
        parts.append(f"reverse join of {n} changed rows of {t} ({c.versions}) on "
                     + ", ".join(f"{v}={i}" for v, i in spec.join_keys[t].items()))
    guess = (None if sizes is None else
             estimate(sizes, base_rows=base_rows, late_rows=late_rows, changes=changes, reverse=reverse,
                      additive=spec.additive is not None, row_wise=spec.row_wise))
    if by_cost and guess is not None and not strict and guess.full >= COST_FLOOR and guess.incremental > FULL_MARGIN * guess.full:
        return Strategy(False, f"full recompute because it is cheaper: {guess.text()}", fallback=True, estimate=guess)
    reason = "incremental: " + ("; ".join(parts) or "nothing changed")
    return Strategy(True, reason + (f" ({guess.text()})" if guess is not None else ""), reverse=tuple(reverse),
                    estimate=guess)
