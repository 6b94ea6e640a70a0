"""The join indexes views declare (``join_index: true``, :mod:`resources.storage.join_index`): one per
base column a view's ``join_keys`` joins on, holding the base columns its transform reads (as
:mod:`~platform_assets.views.driver_sql` translates it: a unit in the driver is what reads the
index), brought up to date by ``tidemark maintain`` (:func:`refresh`). Imports ``driver_unit``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from platform_assets.views import driver_sql, driver_unit
from resources.storage import delta_meta, join_index

if TYPE_CHECKING:
    from lineage.spec.model import Topic
    from platform_assets.core.context import TopicContext


@dataclasses.dataclass(frozen=True)
class Refreshed:
    """One index's refresh: the view, the base column, what was done (words) and whether it failed."""

    view: str
    column: str
    text: str
    failed: bool = False

    def line(self) -> str:
        return f"{self.view}: join index on {self.column}: {'FAILED: ' if self.failed else ''}{self.text}"


def columns_of(topic: Topic) -> list[str]:
    """The base columns ``topic``'s join indexes are on (the view-side columns of its ``join_keys``,
    which name the base's columns), sorted."""
    return sorted({c for pairs in topic.spec.join_keys.values() for c in pairs})


def declared(eng: TopicContext, tables: list[str] | None = None) -> list[Topic]:
    """The topics that declare a join index (where ``tables`` are given, those writing one of them
    or reading one as their base)."""
    return [t for t in eng.lineage.topics.values()
            if t.spec.join_index and (tables is None or t.spec.destination in tables or t.spec.base in tables)]


def refresh(eng: TopicContext, tables: list[str] | None = None, *, dry_run: bool = False) -> list[Refreshed]:
    """Bring every declared join index (of ``tables``' views, where given) up to its base's newest
    version, each on its own: one that fails is reported and the others go on."""
    out: list[Refreshed] = []
    for topic in declared(eng, tables):
        view = topic.spec.destination
        base_path = eng.path(topic.spec.base)
        try:
            base = delta_meta.TableSnapshot.open(base_path)
            inputs = {t: delta_meta.TableSnapshot.open(eng.path(t)) for t in topic.spec.depends_on[1:]}
            if base.table is None or any(s.table is None for s in inputs.values()):
                out += [Refreshed(view, c, "not written: the base or an input has no table yet") for c in columns_of(topic)]
                continue
            if (unfit := driver_unit.unfit_spec(topic)) is not None:
                raise driver_sql.Declined(unfit)
            read = driver_unit.block_columns(topic, base, inputs)
        except driver_sql.Declined as why:
            out += [Refreshed(view, c, f"not written: a unit of this view does not run in the driver ({why}), and only "
                                       f"that unit reads the index") for c in columns_of(topic)]
            continue
        for column in columns_of(topic):
            path = join_index.index_path(eng.settings.warehouse, view, column)
            try:
                out.append(Refreshed(view, column, join_index.refresh(base_path, path, column, read, dry_run=dry_run)))
            except Exception as exc:  # noqa: BLE001 - one index's failure is its line
                out.append(Refreshed(view, column, f"{type(exc).__name__}: {exc}", failed=True))
    return out


def explained(eng: TopicContext, topic: Topic, base: delta_meta.TableSnapshot) -> list[str]:
    """``tidemark explain``'s lines on ``topic``'s join indexes against the base version ``base``:
    what each covers and whether a unit reads it, or why not."""
    if not topic.spec.join_index or base.table is None:
        return []
    try:
        inputs = {t: delta_meta.TableSnapshot.open(eng.path(t)) for t in topic.spec.depends_on[1:]}
        read: set[str] | None = driver_unit.block_columns(topic, base, inputs)
    except driver_sql.Declined:
        read = None
    out = []
    for column in columns_of(topic):
        found = join_index.covered(join_index.index_path(eng.settings.warehouse, topic.spec.destination, column))
        head = f"  join index on {column}: "
        if found is None:
            out.append(head + "none (tidemark maintain writes it); a unit scans the base")
            continue
        cov = found[1]
        what = f"{cov.rows:,} rows up to {cov.upto.label()} (base version {cov.version}, {cov.parts} appended part(s))"
        why = "the transform is not run in the driver" if read is None else \
            join_index.why_not(base, cov, column, {*read, "pos", "id", column})
        out.append(head + what + ("; a unit reads it, and the base after it" if why is None else
                                  f"; not read: {why} (tidemark maintain writes it anew; a unit scans the base)"))
    return out
