"""``tidemark maintain`` and ``tidemark tables``: which tables there are, what each consumer still
needs of them (from the offset store), and the maintenance of each (``resources/storage/maintenance.py``).

A topic needs, of every table it reads, the versions its offsets start from: a step topic the
commits and files of its base added after ``source_version`` (its late-row check reads them), a
merge topic its base from ``source_version`` and every other input from its per-input offset (the
reverse join reads the rows up to it and the change feed after it), a pending unit the versions it
planned. A reload topic reads only the newest version of its base.
A whole maintenance also prunes the offset store's log (its history of plans, commits and locks,
never the records) to ``TIDEMARK_OFFSET_LOG_RETENTION`` (:func:`prune_offset_log`).
Of the table it writes it needs the commit of its last unit (offset recovery reads its bounds), a
log entry only: cleanup keeps that commit, not the data files of that version.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import EllipsisType
from typing import TYPE_CHECKING

from lineage.core.durations import format_size
from lineage.core.errors import ConfigError, OffsetError
from lineage.core.positions import Position
from lineage.spec.model import Processor
from lineage.views.refresh import CLUSTER_ROWS, cluster_column
from platform_assets.core import protocol
from platform_assets.core.faults import crashpoint
from platform_assets.maintenance.purge import purger
from resources.state.offsets import LogRetention, OffsetRecord, OffsetStore
from resources.storage import delta_meta, delta_read, maintenance
from resources.storage.maintenance import Health, Need, Report
from resources.storage.meta_tables import META_TABLES
from resources.storage.warehouse import delta_tables, storage_options

if TYPE_CHECKING:
    from lineage.spec.model import Topic
    from platform_assets.core.context import TopicContext


def consumer_needs(eng: TopicContext, records: dict[str, OffsetRecord] | None = None) -> dict[str, list[Need]]:
    """Per table, what the lineage's topics still need of it (see the module docstring)."""
    recs = records if records is not None else {r.topic: r for r in eng.store.list()}
    out: dict[str, list[Need]] = {}

    def need(table: str, version: int | None, who: str, why: str, files: bool = True) -> None:
        if version is None or version < 0:
            return
        needs = out.setdefault(table, [])
        for i, n in enumerate(needs):  # one claim per topic and table: the oldest version, every reason
            if n.who == who:
                reasons = n.why if why in n.why.split("; ") else f"{n.why}; {why}"
                needs[i] = Need(min(n.version, int(version)), who, reasons, n.files or files)
                return
        needs.append(Need(int(version), who, why, files))

    for topic in eng.lineage.topics.values():
        rec = _as_delta_records(eng, topic, recs.get(topic.name))
        if rec is None:
            continue
        spec = topic.spec
        if spec.processor is Processor.STEP and rec.source_version is not None:
            if rec.pending:  # the planned block reads the base as it was when planned
                need(spec.base, rec.source_version, topic.name, f"its planned block {rec.seq} reads this version")
            else:  # the late-row check reads the commits and files added after the version its last block read
                need(spec.base, rec.source_version + 1, topic.name, f"late-row check of what was added after "
                                                                    f"v{rec.source_version}")
        if spec.processor is Processor.MERGE:
            need(spec.base, rec.source_version, topic.name, "base version of its last unit")
            for table, version in rec.inputs.items():
                need(table, version, topic.name, "input offset (the reverse join reads the rows up to it and the change feed after it)")
            for table, version in (rec.inputs_next or {}).items():
                need(table, version, topic.name, "pending unit")
        need(spec.destination, rec.delta_version, topic.name, "the commit of its last unit (offset recovery reads it)",
             files=False)
    return out


def _as_delta_records(eng: TopicContext, topic: Topic, rec: OffsetRecord | None) -> OffsetRecord | None:
    """``rec`` (None: no record) as the topic's destination log has it when the store is behind or lost
    (issue 57: a lost or restored store must not let maintenance remove what a topic still needs).
    Nothing is written: the topic's own next unit recovers its record under its lock. A log whose
    newest commit of the topic is gone (retention) leaves ``rec`` as it is: that topic is refused
    when it runs, saying what to do."""
    found = None
    try:
        found = protocol.landed(topic, eng.path(topic.spec.destination), rec)
    except OffsetError:
        pass
    if found is None or found.commit is None:
        return rec
    meta = found.commit.user_metadata
    sv = meta.get("source_version")
    inputs = {str(k): int(v) for k, v in (meta.get("inputs") or {}).items()}
    if rec is None:
        now = eng.clock()
        return OffsetRecord(topic.name, Position.zero(), None, found.commit.rows, found.seq, found.commit.timestamp,
                            topic.spec.processor.value, "committed", "", None, int(sv) if sv is not None else None, now,
                            delta_version=found.commit.version, inputs=inputs)
    merged = {**rec.inputs, **{k: max(v, rec.inputs.get(k, v)) for k, v in inputs.items()}}
    return dataclasses.replace(rec, seq=found.seq, next=None, inputs_next=None, inputs=merged,
                               source_version=int(sv) if sv is not None else rec.source_version,
                               delta_version=found.commit.version)


def warehouse_tables(eng: TopicContext) -> list[str]:
    """Every Delta table under the warehouse (``<schema>/<table>``): destinations, replicas, stage
    tables, meta tables and the sources kept there."""
    return delta_tables(eng.settings.warehouse)


def all_tables(eng: TopicContext) -> list[str]:
    """The lineage's tables, the meta tables and every other table in the warehouse, once each."""
    out: list[str] = []
    for table in [*eng.lineage.tables(), *META_TABLES, *warehouse_tables(eng)]:
        if table not in out:
            out.append(table)
    return out


def jvm_free_reads(eng: TopicContext, tables: Iterable[str] | None = None) -> list[tuple[str, int | str, int]]:
    """Each table (default: every Delta table in the warehouse) as ``(table, rows the deltalake
    reader counts or its error, rows Spark counts)``: what pandas, polars and JVM-free tools see
    (a table with deletion vectors or column mapping through deltalake's DataFusion reader)."""
    from deltalake import DeltaTable

    out: list[tuple[str, int | str, int]] = []
    for table in (list(tables) if tables is not None else warehouse_tables(eng)):
        path = eng.path(table)
        jvm_free: int | str
        try:
            jvm_free = delta_read.count_rows(DeltaTable(path, storage_options=storage_options(path) or None))
        except Exception as exc:  # noqa: BLE001 - the reader's own words are the finding
            jvm_free = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        out.append((table, jvm_free, eng.spark.read.format("delta").load(path).count()))
    return out


def health_of(eng: TopicContext, table: str, needs: dict[str, list[Need]],
              view_column: str | None | EllipsisType = ...) -> Health:
    """``table``'s health with what the consumers (``needs``, from :func:`consumer_needs`) need of it;
    a view clustered by its join column is kept in files of about ``CLUSTER_ROWS`` rows.
    ``view_column``: that column when the caller looked it up already (:func:`view_cluster_column`)."""
    if view_column is ...:
        view_column = view_cluster_column(eng, table)
    return maintenance.health(table, eng.path(table), needs.get(table, []), now=eng.clock(),
                              rows_per_file=CLUSTER_ROWS if view_column else None)


def view_cluster_column(eng: TopicContext, table: str) -> str | None:
    """The column a view (a merge topic's table) is clustered by: the first view column of its
    ``join_keys`` the view has (its reverse joins' MERGEs are pruned by it); None for other tables."""
    for topic in eng.lineage.producers(table):
        if topic.spec.processor is Processor.MERGE and topic.spec.join_keys:
            columns = delta_meta.TableSnapshot.open(eng.path(table)).columns
            return cluster_column(topic.spec, columns or ())
    return None


def healths(eng: TopicContext, tables: Iterable[str] | None = None, *, existing_only: bool = True) -> list[Health]:
    """The health of ``tables`` (default: :func:`all_tables`) with their consumers' needs."""
    needs = consumer_needs(eng)
    out = []
    for table in (list(tables) if tables is not None else all_tables(eng)):
        h = health_of(eng, table, needs)
        if h.exists or not existing_only:
            out.append(h)
    return out


def retention_warnings(eng: TopicContext) -> list[str]:
    """:attr:`Health.warnings` of every table a topic needs something of: where the table's own
    retention lets a plain VACUUM or log cleanup remove it. A table whose log cannot be read is a
    line saying so."""
    needs = consumer_needs(eng)
    out: list[str] = []
    for table in sorted(needs):
        try:
            out += health_of(eng, table, needs).warnings
        except Exception as exc:  # noqa: BLE001 - one table's problem is its line
            out.append(f"{table}: its retention could not be checked: {type(exc).__name__}: {exc}")
    return out


def writers_idle(eng: TopicContext, table: str) -> bool:
    """Whether no topic writing ``table`` holds its lock now (its unit's files may not be committed yet)."""
    producers = eng.lineage.producers(table)
    for topic in producers:
        rec = eng.store.get(topic.name)
        if rec is not None and (rec.owner or rec.pending):
            return False
    return True


def cluster_columns(eng: TopicContext, table: str, view_column: str | None) -> tuple[str, ...]:
    """What ``--cluster`` Z-orders a view by: its join column when it has one (``view_column``: a
    reverse join's MERGE is pruned by it, :func:`view_cluster_column`), else its key (the column its
    MERGE matches on)."""
    if view_column:
        return (view_column,)
    for topic in eng.lineage.producers(table):
        if topic.spec.processor is Processor.MERGE and topic.spec.key:
            return tuple(topic.spec.key)
    return ()


@dataclass(frozen=True)
class Options:
    retain_hours: float | None = None
    dry_run: bool = False
    compact: bool = True
    cleanup: bool = True
    cluster: bool = False
    writers_idle: bool = False  # the caller knows that nothing else writes these tables now


def run(eng: TopicContext, tables: list[str] | None, opts: Options,
        on_report: Callable[[Health, Report | None, Exception | None], None] | None = None) -> list[Report]:
    """Maintain ``tables`` (default: every table, see :func:`all_tables`), each on its own: a table that
    fails is reported and the others go on."""
    if tables:
        known = set(all_tables(eng))
        unknown = [t for t in tables if t not in known and maintenance.health(t, eng.path(t)).version is None]
        if unknown:
            raise ConfigError(f"no Delta table for {', '.join(unknown)} (at {', '.join(eng.path(t) for t in unknown)})")
    reports = []
    needs = consumer_needs(eng)
    purge = purger(eng)
    for table in (tables or all_tables(eng)):
        h = Health(table, eng.path(table), None)
        try:
            # Read inside the try: a table whose log cannot be read (an object store error, a file
            # deltalake cannot parse) fails alone, like one whose maintenance fails.
            column = view_cluster_column(eng, table)  # (the view's log opened once for both uses)
            h = health_of(eng, table, needs, column)
            if not h.exists:
                continue
            idle = opts.writers_idle or (bool(eng.lineage.producers(h.table)) and writers_idle(eng, h.table))
            r = maintenance.maintain(h, retain_hours=opts.retain_hours, writers_idle=idle, dry_run=opts.dry_run,
                                     compact=opts.compact, cleanup=opts.cleanup,
                                     # a view kept in small clustered files is clustered again when
                                     # a file outgrew them, --cluster or not
                                     cluster_by=cluster_columns(eng, h.table, column) if opts.cluster or h.kept_small else (),
                                     purge=purge, point=crashpoint)
        except Exception as exc:  # noqa: BLE001 - one table's failure is its line
            if on_report:
                on_report(h, None, exc)
            continue
        reports.append(r)
        if on_report:
            on_report(h, r, None)
    return reports


def prune_offset_log(store: OffsetStore, retention: LogRetention, *, dry_run: bool) -> tuple[int | None, str]:
    """Prune the offset log's history to ``retention``: the entries removed (or with ``dry_run``
    that would be; None: pruning failed) and a line that says so. A failure (the store
    unreachable, a lock not granted) is that line, not an exception: what maintenance did to the
    tables is reported all the same."""
    if not retention.age:
        return 0, f"offset log: nothing pruned ({retention.describe()})"
    try:
        n = retention.prune(store, dry_run=dry_run)
    except Exception as exc:  # noqa: BLE001 - said, and counted as a failure by the caller
        return None, f"offset log: FAILED: {type(exc).__name__}: {exc}"
    return n, f"offset log: {n} entr{'y' if n == 1 else 'ies'} {'would be ' if dry_run else ''}removed ({retention.describe()})"


def heading(h: Health, r: Report) -> str:
    """A maintained table's first line: its version and files before, and the time it took."""
    took = "" if r.dry_run else f" ({r.seconds:.1f}s)"
    return f"v{h.version}: {h.files} files, {h.small_files} small{took}"


def totals(reports: list[Report]) -> dict[str, int]:
    """What a maintenance run did over all its tables."""
    return {"small_files_compacted": sum(int(r.compacted.get("numFilesRemoved", 0)) for r in reports),
            "deletion_vector_files_purged": sum(int(r.purged.get("numFilesRemoved", 0)) for r in reports),
            "data_files_removed": sum(len(r.vacuumed) for r in reports),
            "log_files_removed": sum(len(r.logs_removed) for r in reports)}


def describe(h: Health, r: Report) -> list[str]:
    """Lines saying what maintenance did to a table: compacted, checkpointed, removed, kept and for whom."""
    verb = "would " if r.dry_run else ""
    lines = []
    if r.purged:
        rows = r.purged.get("numDeletedRowsRemoved")
        lines.append(f"{verb}purge{'d' if not verb else ''} deletion vectors: {r.purged.get('numFilesRemoved', 0)} files -> "
                     f"{r.purged.get('numFilesAdded', '?')} file(s) without {rows if rows is not None else '?'} deleted rows")
    if r.compacted:
        removed = r.compacted.get("numFilesRemoved", 0)
        added = r.compacted.get("numFilesAdded")
        how = f" Z-ordered by {', '.join(r.clustered_by)}" if r.clustered_by else ""
        lines.append(f"{verb}compact{'ed' if not verb else ''}{how}: {removed} files -> "
                     f"{added if added is not None else '?'} file(s){', in pos order' if r.in_pos_order else ''}")
    if r.horizon_checkpoint is not None:
        lines.append(f"{verb}checkpoint at the consumers' horizon v{r.horizon_checkpoint}")
    if r.checkpoint is not None:
        lines.append(f"{verb}checkpoint at v{r.checkpoint}")
    lines.append(f"{verb}remove{'d' if not verb else ''} {len(r.vacuumed)} unreferenced data file(s), "
                 f"{len(r.logs_removed)} log file(s)")
    lines += [f"kept {k}" for k in r.kept]
    lines += [f"skipped {s}" for s in r.skipped]
    lines += [f"warning: {w}" for w in h.warnings]
    return lines


def health_row(h: Health) -> tuple:
    horizon = h.horizon
    return (h.table, h.version, h.files, h.small_files, format_size(h.bytes), h.since_checkpoint,
            horizon.describe() if horizon else None, "; ".join(h.reasons()) or "ok")


HEALTH_COLUMNS = ["table", "version", "files", "small", "bytes", "since checkpoint", "oldest version needed", "maintenance"]


def health_metadata(h: Health) -> dict[str, object]:
    """A table's health as Dagster metadata values (plain numbers and text)."""
    horizon = h.horizon
    return {"files": h.files, "small_files": h.small_files, "bytes": h.bytes, "deleted_rows": h.deleted_rows,
            "versions_since_checkpoint": h.since_checkpoint if h.since_checkpoint is not None else -1,
            "oldest_version_needed": horizon.describe() if horizon else "none",
            "maintenance": "; ".join(h.reasons()) or "ok"}
