"""A view's join index (issue 56): a copy of some of a base table's columns, sorted by one column (the
base's side of a reverse join) and written in small row groups, covering the base's rows up to a
position at one version. The base is in ``(pos, id)`` order, so each of its row groups holds nearly
every join value and a scan filtered by a few of them reads every file; in the index, DataFusion
skips every file and row group whose statistics rule the values out.

What it covers is recorded in its newest commit (:class:`Covered`): the base table's id, version,
the largest ``(pos, id)`` it holds (``upto``), the columns, and a digest of the base's data files
that may hold a row at or before ``upto`` (their paths and the rows their deletion vectors delete).
For a later version of the base, the index holds exactly its rows up to ``upto`` while that digest is
unchanged (:func:`usable`): rows appended after ``upto`` are in other files, which a scan of the base
reads by ``pos``; a late row, a delete, an update or a compaction among those files changes the
digest, and the base is read as before until the index is written anew.

:func:`refresh` (``tidemark maintain``) appends the rows after ``upto`` while the digest holds (each
append a file sorted on its own), and writes the index anew otherwise or once it has
:data:`MAX_PARTS` appended parts. A reader that finds an index it cannot use, or whose files a
concurrent refresh removed, reads the base: the index never decides what a unit sees, only where it
reads it from. May import ``lineage`` and ``resources.storage``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Collection, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lineage.core.positions import Position
from resources.storage import delta_log, delta_read
from resources.storage.positions import files_in_range, position_filter
from resources.storage.snapshot import TableSnapshot
from resources.storage.statistics import STATS_SLACK
from resources.storage.warehouse import storage_options

#: Rows per row group of the index's files: small enough that a few join values read a few of them.
ROW_GROUP = 16_384
#: An index with more appended parts than this is written anew (sorted as one) by the next refresh.
MAX_PARTS = 16
#: The commit-info key under which the index records what it covers.
META = "tidemark.joinIndex"
#: A refresh's line where :func:`digest` cannot tell the base's files apart.
UNTOLD = "not written: the base's files cannot be told apart (a path the log gives twice, or a deletion vector's file by its name)"


def index_path(warehouse: str, view: str, column: str) -> str:
    """Where the join index of ``view`` on the base column ``column`` lives: beside the warehouse's
    tables (``<warehouse>/_tidemark/index/<view>/<column>``), not among them."""
    return f"{warehouse.rstrip('/')}/_tidemark/index/{view}/{column}"


@dataclasses.dataclass(frozen=True)
class Covered:
    """What an index holds: the base (its table id) at ``version``, its rows up to ``upto`` (their
    ``columns``, sorted by ``column``), ``files`` the digest of the base files that may hold them,
    ``rows`` how many, ``parts`` how many appends since it was last written whole, ``prev`` the
    index's version the commit was made onto (its own version is ``prev + 1`` unless another refresh
    committed in between: then it is not used)."""

    base: str
    version: int
    upto: Position
    column: str
    columns: tuple[str, ...]
    files: str
    rows: int
    parts: int
    prev: int  # the index's version this commit was written onto (-1: none): a concurrent write shows

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["upto"] = self.upto.to_text()
        d["columns"] = list(self.columns)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Covered:
        d = json.loads(text)
        return cls(str(d["base"]), int(d["version"]), Position.parse(d["upto"]), str(d["column"]),
                   tuple(d["columns"]), str(d["files"]), int(d["rows"]), int(d["parts"]), int(d["prev"]))


def covered(path: str) -> tuple[Any, Covered] | None:
    """The index at ``path`` (its newest version, a ``deltalake.DeltaTable``) and what it covers;
    None: no index there, one whose newest commit (but a cleanup's) does not say, or one that two
    refreshes wrote at once (an append onto a version another append or rewrite had replaced)."""
    table = delta_log.open_table(path)
    if table is None:
        return None
    # The commits of the version opened, read by number (deltalake's history() gives the newest
    # commits whatever version was opened, numbered down from it).
    fs, log = delta_log.log_fs(path)
    version = int(table.version())
    try:
        for v in range(version, max(-1, version - 8), -1):  # the cleanup after a rewrite commits VACUUM START and END
            info: dict[str, Any] = next((a["commitInfo"] for a in delta_log.read_commit(fs, log, v)
                                         if "commitInfo" in a), {})
            if META in info:
                cov = Covered.from_json(info[META])
                return (table, cov) if v == cov.prev + 1 else None
            if not str(info.get("operation", "")).startswith("VACUUM"):
                return None
    except (OSError, KeyError, ValueError, TypeError):
        return None
    return None


def digest(base: TableSnapshot, upto: Position, columns: Collection[str]) -> str | None:
    """A digest of the base's data files that may hold a row at or before ``upto`` (by their ``pos``
    statistics; a file without them may), with the rows each one's deletion vector deletes (which
    rows, not how many: a restore and another delete may leave the count as it was), and of
    ``columns`` as its schema gives them (name, type, physical name: a rename under column mapping
    changes no file). None: no table, a file whose path the log gives twice, or a deletion vector
    whose file cannot be told by its name."""
    if base.table is None:
        return None
    held = sorted(files_in_range(base, None, upto.pos))
    if len(set(held)) != len(held):
        return None
    deleted = _deleted_per_file(base, set(held))
    if deleted is None:
        return None
    h = hashlib.sha256()
    for f in base.table.schema().fields:
        if f.name in columns:
            h.update(f"{f.name}\0{f.type}\0{(f.metadata or {}).get(delta_read.PHYSICAL_NAME, '')}\n".encode())
    for p in held:
        h.update(f"{p}\0{deleted.get(p, '')}\n".encode())
    return h.hexdigest()


def _deleted_per_file(base: TableSnapshot, paths: set[str]) -> dict[str, str] | None:
    """A digest of the rows a deletion vector deletes, per data file among ``paths`` (``{}`` without
    the feature); None: a vector whose file is not one name among ``paths`` (it cannot be told apart)."""
    table = base.table
    if table is None or "deletionVectors" not in set(table.protocol().reader_features or ()):
        return {}
    vectors = pa.table(table.deletion_vectors())
    by_name: dict[str, str] = {}
    for p in paths:
        by_name[p.rsplit("/", 1)[-1]] = p if p.rsplit("/", 1)[-1] not in by_name else ""
    out: dict[str, str] = {}
    selections = vectors.column("selection_vector").combine_chunks()
    for i, where in enumerate(vectors.column("filepath").to_pylist()):
        name = str(where).rsplit("/", 1)[-1]
        if name not in by_name:
            continue  # a file after upto (its rows are read from the base)
        if not by_name[name] or by_name[name] in out:
            return None
        deleted = pc.indices_nonzero(pc.invert(selections[i].values)).to_numpy()
        out[by_name[name]] = hashlib.sha256(deleted.tobytes()).hexdigest()
    return out


def usable(base: TableSnapshot, path: str, column: str, columns: Collection[str]) -> tuple[Any, Covered] | None:
    """The index at ``path`` and what it covers, where it holds exactly ``base``'s rows up to its
    ``upto`` with ``columns`` (module docstring); None: it does not (or is not there)."""
    found = covered(path)
    return found if found is not None and why_not(base, found[1], column, columns) is None else None


def why_not(base: TableSnapshot, cov: Covered, column: str, columns: Collection[str]) -> str | None:
    """Why an index covering ``cov`` does not hold exactly ``base``'s rows up to its ``upto`` with
    ``columns`` sorted by ``column``, in words; None: it does."""
    if base.table is None:
        return "no base table"
    if cov.column != column:
        return f"it is on {cov.column}"
    if missing := sorted(set(columns) - set(cov.columns)):
        return f"it lacks {', '.join(missing)}"
    if cov.base != base.table.metadata().id:
        return "it was written from another table"
    if digest(base, cov.upto, cov.columns) != cov.files:
        return "the base's files or columns it covers changed (a late row, a delete or update, a compaction, a rename)"
    return None


def rows_after(base: TableSnapshot, upto: Position, columns: Sequence[str], predicate: str | None = None) -> pa.Table:
    """The base's rows with ``pos`` at or after ``upto``'s (``columns``; ``predicate`` too, where
    given): a superset of its rows after ``upto``, read by ``deltalake`` (files pruned by ``pos``)."""
    assert base.table is not None  # noqa: S101 - callers pass a table
    cond = f"pos >= {delta_read.sql_literal(upto.pos - STATS_SLACK)}"  # (statistics truncated to milliseconds)
    return delta_read.scan(base.table, columns, predicate=f"({cond}) AND ({predicate})" if predicate else cond)


def _upto(rows: pa.Table) -> Position | None:
    """The largest ``(pos, id)`` among ``rows`` (each with both); None: no row."""
    if not rows.num_rows:
        return None
    top = pc.max(rows.column("pos"))
    same = rows.filter(pc.equal(rows.column("pos"), top))
    return Position(top.as_py(), int(pc.max(same.column("id")).as_py()))


def refresh(base_path: str, path: str, column: str, columns: Collection[str], *, dry_run: bool = False) -> str:
    """Bring the index at ``path`` of the base at ``base_path`` (on ``column``, holding ``columns``
    and ``pos``, ``id``) up to the base's newest version: append its rows after ``upto`` where the
    index is :func:`usable` and has fewer than :data:`MAX_PARTS` parts, else write it anew. Gives
    what it did, in words. The rows read are the base's through ``deltalake`` (deletion vectors and
    column mapping applied)."""
    from deltalake import CommitProperties, WriterProperties, write_deltalake

    base = TableSnapshot.open(base_path)
    if base.table is None:
        return f"not written: no base table at {base_path}"
    wanted = tuple(sorted({*columns, "pos", "id", column}))
    if missing := sorted(set(wanted) - base.columns):
        return f"not written: the base has no column {', '.join(missing)}"
    found = usable(base, path, column, wanted)
    if found is not None and found[1].columns != wanted:
        found = None  # (an index of more columns than needed: written anew, smaller)
    props = WriterProperties(max_row_group_size=ROW_GROUP, compression="ZSTD")
    opts = storage_options(path)
    if found is not None and found[1].parts < MAX_PARTS:
        _, cov = found
        if base.version == cov.version:
            return f"up to date (base version {cov.version}, {cov.rows:,} rows up to {cov.upto.label()})"
        new = rows_after(base, cov.upto, wanted)
        new = new.filter(position_filter(new.schema, after=cov.upto))
        if not new.num_rows:
            return f"up to date (base version {base.version}: no row after {cov.upto.label()})"
        upto = _upto(new) or cov.upto
        files = digest(base, upto, wanted)
        if files is None:
            return UNTOLD
        what = f"appended {new.num_rows:,} rows (base version {cov.version} -> {base.version})"
        if dry_run:
            return f"would be {what}"
        after = Covered(cov.base, int(base.version or 0), upto, column, wanted, files, cov.rows + new.num_rows,
                        cov.parts + 1, int(found[0].version()))
        write_deltalake(path, new.sort_by([(column, "ascending")]), mode="append", writer_properties=props,
                        storage_options=opts, commit_properties=CommitProperties(custom_metadata={META: after.to_json()}))
        return what
    why = "none yet" if covered(path) is None else "no longer matches the base" if found is None else "too many parts"
    if dry_run:
        return f"would be written anew ({why})"
    rows = delta_read.scan(base.table, list(wanted))
    rows = rows.filter(pc.and_(pc.is_valid(rows.column("pos")), pc.is_valid(rows.column("id"))))
    top = _upto(rows)
    if top is None:
        return "not written: no base row has a position"
    files = digest(base, top, wanted)
    if files is None:
        return UNTOLD
    before = delta_log.open_table(path)
    cov = Covered(base.table.metadata().id, int(base.version or 0), top, column, wanted, files, rows.num_rows, 0,
                  -1 if before is None else int(before.version()))
    write_deltalake(path, rows.sort_by([(column, "ascending")]), mode="overwrite", schema_mode="overwrite",
                    writer_properties=props, storage_options=opts,
                    commit_properties=CommitProperties(custom_metadata={META: cov.to_json()}))
    index = delta_log.open_table(path)
    if index is not None:  # the replaced files go now: an index is rebuilt from the base, never read back in time
        index.vacuum(retention_hours=0, dry_run=False, enforce_retention_duration=False)
    return f"written anew ({why}): {rows.num_rows:,} rows up to {top.label()}, base version {base.version}"
