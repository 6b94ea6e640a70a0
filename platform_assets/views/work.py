"""What a merge unit carries from its derivation to its write (:class:`MergeWork`), the marker
columns and limits its strategies share, and the small reads and checks they all use: the
temporary views a unit makes, the view's newest commit of the topic, and ``incremental_strict``.

Shared by :mod:`platform_assets.views.merge` and its strategies (:mod:`~platform_assets.views.additive`,
:mod:`~platform_assets.views.reverse`, :mod:`~platform_assets.views.row_wise`); imports none of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lineage.spec.model import Topic
from lineage.views.refresh import InputChange, Strategy
from platform_assets.core import protocol, table_reads
from platform_assets.core.keyed_merge import TargetFilter
from platform_assets.core.protocol import data_app_id
from resources.storage import delta_log, delta_meta

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame

    from platform_assets.core.context import UnitContext

PART = "_tm_part"  # a row-wise unit's output rows: which part of its base rows made them
PRESENT = "_tm_present"  # marks a re-derived row in the MERGE source (null: the key is no longer produced)
#: Up to this many affected keys (or changed input rows) are collected and joined as a local relation.
LOCAL_KEYS = 200_000


@dataclass
class MergeWork:
    """What an opened merge unit carries to :meth:`MergeProcessor.finish`."""

    strategy: Strategy
    changes: tuple[InputChange, ...]
    late_rows: int
    columns: list[str] = field(default_factory=list)
    views: list[str] = field(default_factory=list)  # temporary views to drop when done
    built: bool = True  # the view holds a commit of this topic
    #: Incremental: the affected keys by where they come from (label, keys), see MergeProcessor.derive.
    affected: list[tuple[str, DataFrame]] = field(default_factory=list)
    #: Incremental: what every row of an affected key in the view satisfies; the MERGE adds it to its
    #: condition so that it reads only the files that may hold such rows (empty: no filter).
    prune: TargetFilter = field(default_factory=TargetFilter)
    #: The view as the unit was derived (its table None before the first build), read again by the write.
    view: delta_meta.TableSnapshot | None = None
    #: Incremental, additive view: the transform's output over the rows that move, by where they
    #: come from (label, sign, rows): +1 the groups rows join, -1 the groups rows leave.
    contributions: list[tuple[str, int, DataFrame]] = field(default_factory=list)
    #: Additive, a changed input: the transform over no base rows at the old and the new versions
    #: (must be empty: an additive view is a sum over base rows; checked with the contributions).
    alone: list[DataFrame] = field(default_factory=list)
    #: The view columns' SQL types (an additive MERGE casts its sums back to them).
    types: dict[str, str] = field(default_factory=dict)
    #: An additive view's sums that may be null (``sum(x)``; not ``coalesce(sum(x), 0)``).
    nullable: frozenset[str] = frozenset()
    #: Incremental, row-wise view: the base rows to re-derive, by where they come from (label, rows).
    rows: list[tuple[str, DataFrame]] = field(default_factory=list)
    #: Incremental, row-wise view: the transform's output over ``rows`` (every affected key's new row):
    #: the MERGE's rows instead of the full view narrowed to the affected keys.
    rederived: DataFrame | None = None
    #: Incremental, row-wise view of new base rows only, the view holding none of them: the rows are
    #: appended (with the unit's txn id) instead of MERGEd (:func:`platform_assets.views.row_wise.appends`).
    append: bool = False
    #: Incremental: the view's column types as the unit found them (name -> Spark type).
    view_types: dict[str, Any] = field(default_factory=dict)
    #: Incremental, row-wise view, a changed input: the keys' old rows are the transform over these
    #: base rows (those up to ``last`` joining a changed row) with these tables (the versions applied).
    left: tuple[str, DataFrame, dict[str, str]] | None = None
    #: Incremental, row-wise view: the values of the view's clustering column in the view's rows of
    #: the affected keys, when the unit knows them without reading the view (None: it reads them).
    held: list[Any] | None = None
    #: Incremental, row-wise view, a changed input: the view's rows whose base columns joined a
    #: changed row, when the unit found them in the view instead of scanning the base (see
    #: :func:`platform_assets.views.row_wise.found_in_view`); checked against the transform over their
    #: own base columns.
    found: DataFrame | None = None
    #: Incremental: the MERGE's source when the unit holds it in the driver already (Arrow), so that
    #: ``deltalake``'s MERGE needs no Spark job: an additive view's summed contributions per group; a
    #: row-wise view's every affected key's new row (``PRESENT`` true) or the key alone (``PRESENT``
    #: null), with the affected keys (None: more than ``LOCAL_KEYS``; :mod:`platform_assets.views.in_hand`).
    source: pa.Table | None = None
    key_rows: list[tuple[Any, ...]] | None = None
    #: The unit ran its transform in the driver (:mod:`platform_assets.views.driver_unit`): ``source``
    #: is all it writes (appended, or added to an additive view's groups); no Spark output.
    driver: bool = False

    @property
    def adds(self) -> bool:
        """The unit adds contributions to the view's groups (else it MERGEs re-derived rows or overwrites)."""
        return bool(self.contributions) and self.strategy.incremental

    def temp_view(self, name: str, df: DataFrame) -> DataFrame:
        """``df`` as the temporary view ``name`` (added to ``views``, dropped with the unit's)."""
        df.createOrReplaceTempView(name)
        self.views.append(name)
        return df

    def pin(self, eng: UnitContext, topic: Topic, versions: dict[str, int], prefix: str) -> dict[str, str]:
        """Temporary views of the inputs ``topic``'s SQL reads, each at the given Delta version:
        lineage table -> view name (for :func:`spark_io.transform`'s ``tables``)."""
        return table_reads.pin_inputs(eng, topic, versions, prefix, self.views)


def newest_commit(topic: Topic, dest: str) -> delta_log.CommitStats | None:
    """The newest commit of ``topic`` in the view's log (None: none, or it cannot be read)."""
    seq = protocol.recorded_seq(dest, topic.name)
    try:
        return delta_log.find_txn_commit(dest, data_app_id(topic.name), seq) if seq else None
    except delta_log.CommitUnavailableError:
        return None


def holds_as_committed(commit: delta_log.CommitStats, view_version: int | None, dest: str) -> bool:
    """Whether the view at ``view_version`` holds the rows its ``commit`` left: that commit is the
    version, or only rewrites came after it (a compaction, the re-sort of a MERGE's files:
    :func:`~resources.storage.delta_log.data_version`)."""
    return view_version is not None and view_version >= commit.version and (
        view_version == commit.version or delta_log.data_version(dest, view_version, commit.version) == commit.version)


def refuse_strict(topic: Topic, strategy: Strategy) -> None:
    """``refresh: incremental_strict`` refuses a unit that is not incremental (``RefreshRefused``)."""
    from lineage.spec.model import Refresh
    from lineage.views.refresh import RefreshRefused

    if topic.spec.refresh is Refresh.STRICT and not strategy.incremental:
        raise RefreshRefused(f"topic '{topic.name}': refresh: incremental_strict refuses a {strategy.reason}")
