"""The merge topic's choice between an incremental refresh (reverse join) and a full recompute."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lineage.spec.model import TopicSpec
from lineage.views.refresh import (
    FILTERED_SCAN,
    FULL_MARGIN,
    MERGE_FILE_COST,
    WRITE_COST,
    InputChange,
    RefreshRefused,
    Sizes,
    cluster_column,
    estimate,
)
from lineage.views.refresh import choose as choose_


def spec(**extra: object) -> TopicSpec:
    fields = {"table": "mart.v", "depends_on": ["stage.orders", "dim.c", "dim.d"], "processor": "merge",
              "transforms": ["v.sql"], "key": ["id"], "join_keys": {"dim.c": {"customer_id": "id"}}, **extra}
    return TopicSpec.model_validate(fields)


BASE = {"pos", "id", "customer_id", "amount"}


def choose(spec: TopicSpec, **kw: object) -> object:
    return choose_(spec, base_columns=BASE, **kw)  # type: ignore[arg-type]


def change(table: str = "dim.c", old: int | None = 3, new: int | None = 5, rows: int | None = 4,
           total: int | None = 1000, problem: str = "") -> InputChange:
    return InputChange(table, old, new, rows, total, problem)


def test_the_first_unit_builds_the_view_whole_even_when_strict() -> None:
    s = choose(spec(refresh="incremental_strict"), built=False, base_rows=5)
    assert (s.incremental, s.fallback) == (False, False)
    assert s.reason == "initial build: mart.v holds no commit of topic 'mart.v'"


def test_new_base_rows_and_a_reverse_joined_input_are_incremental() -> None:
    s = choose(spec(), built=True, base_rows=7, late_rows=2, changes=[change(), change("dim.d", 4, 4)])
    assert s.incremental and s.reverse == ("dim.c",)
    assert s.reason == ("incremental: 7 new base rows; 2 late base rows re-derived; reverse join of 4 changed rows "
                        "of dim.c (versions 4..5) on customer_id=id")


@pytest.mark.parametrize(("c", "why"), [
    (change("dim.d"), "dim.d changed (versions 4..5) and the spec declares no join_keys for it"),
    (change(problem="delta.enableChangeDataFeed is not set"),
     "dim.c changed (versions 4..5) but its change data feed cannot be read: delta.enableChangeDataFeed is not set"),
    (change(old=None), "dim.c has no offset yet (added to depends_on after the view was built)"),
    (change(rows=300), "300 rows of dim.c changed, more than full_above 0.5% of its 1000 rows (a full recompute is cheaper)"),
])
def test_a_fallback_says_why_and_strict_refuses_it(c: InputChange, why: str) -> None:
    s = choose(spec(), built=True, base_rows=0, changes=[c])
    assert (s.incremental, s.fallback, s.reason) == (False, True, f"full recompute because {why}")
    if "cheaper" in why:  # strict never falls back for cost: the reverse join is still exact
        assert choose(spec(refresh="incremental_strict"), built=True, base_rows=0, changes=[c]).incremental
        return
    with pytest.raises(RefreshRefused, match=r"refresh: incremental_strict refuses a full recompute because "):
        choose(spec(refresh="incremental_strict"), built=True, base_rows=0, changes=[c])


def test_full_above_is_the_spec_setting_and_refresh_full_always_rebuilds() -> None:
    assert choose(spec(full_above=0.5), built=True, base_rows=0, changes=[change(rows=300)]).incremental
    s = choose(spec(refresh="full"), built=True, base_rows=1, changes=[change()])
    assert (s.incremental, s.fallback, s.reason) == (False, False, "refresh: full (the spec asks for a full recompute every time)")
    # an unknown change count never forces a fallback
    assert choose(spec(), built=True, base_rows=0, changes=[change(rows=None)]).incremental


def test_join_keys_on_a_view_column_cannot_be_exact_and_say_so() -> None:
    """``{country: country}`` names a view column: a base row whose customer vanished moves to the
    NULL/'?' group, which no changed customer row names. A visible full recompute, refused if strict."""
    s = choose(spec(join_keys={"dim.c": {"country": "country"}}), built=True, base_rows=0, changes=[change()])
    assert (s.incremental, s.fallback) == (False, True)
    assert s.reason.startswith("full recompute because dim.c changed (versions 4..5) and its join_keys name country, "
                               "which the base stage.orders does not have, so the affected keys cannot be derived exactly")
    assert "declare the base's join column instead, e.g. {dim.c: {<stage.orders column>: country}}" in s.reason
    with pytest.raises(RefreshRefused, match="cannot be derived exactly"):
        choose(spec(join_keys={"dim.c": {"country": "country"}}, refresh="incremental_strict"), built=True, base_rows=0,
               changes=[change()])
    # an unchanged input with such a declaration costs nothing
    assert choose(spec(join_keys={"dim.c": {"country": "country"}}), built=True, base_rows=3,
                  changes=[change(old=5)]).incremental


def test_a_python_transform_cannot_read_the_previous_version() -> None:
    s = choose(spec(), built=True, base_rows=0, changes=[change()], python_transform=True)
    assert not s.incremental and "a Python transform reads dim.c by name" in s.reason
    assert choose(spec(), built=True, base_rows=2, changes=[change(old=5)], python_transform=True).incremental


MiB = 2**20


def sizes(*, base: int = 1000 * MiB, view: int = 1500 * MiB, files: int = 128, dim: int = 5 * MiB,
          view_rows: int = 50_000_000) -> Sizes:
    return Sizes(base_bytes=base, base_rows=50_000_000, view_bytes=view, view_files=files, view_rows=view_rows,
                 inputs_bytes={"dim.c": dim, "dim.d": dim})


def test_a_few_changed_rows_of_a_big_clustered_view_are_incremental_with_the_estimate_recorded() -> None:
    s = choose(spec(), built=True, base_rows=0, changes=[change(rows=10, total=200_000)], sizes=sizes())
    assert s.incremental and s.estimate is not None
    assert s.estimate.incremental < s.estimate.full
    assert 10 < s.estimate.files_rewritten < 20  # 20 clusters over 128 files: a few share one
    assert s.reason.endswith(f"({s.estimate.text()})") and "estimated " in s.reason


def test_a_change_that_rewrites_most_files_goes_full_when_that_is_cheaper_and_says_by_how_much() -> None:
    s = choose(spec(full_above=1), built=True, base_rows=0, changes=[change(rows=400, total=1000)],
               sizes=sizes(files=20))
    assert (s.incremental, s.fallback) == (False, True)
    assert s.estimate is not None and s.estimate.incremental > s.estimate.full
    assert s.estimate.files_rewritten == pytest.approx(20, abs=0.01)
    assert s.reason == f"full recompute because it is cheaper: {s.estimate.text()}"
    # strict never trades exactness of the reverse join for cost
    assert choose(spec(full_above=1, refresh="incremental_strict"), built=True, base_rows=0,
                  changes=[change(rows=400, total=1000)], sizes=sizes(files=20)).incremental
    # a caller whose incremental unit costs less than the estimate says (one in the driver) asks without the cost
    free = choose(spec(full_above=1), built=True, base_rows=0, changes=[change(rows=400, total=1000)],
                  sizes=sizes(files=20), by_cost=False)
    assert free.incremental and free.reverse == ("dim.c",) and free.estimate == s.estimate


def test_below_the_cost_floor_the_unit_stays_incremental_and_the_change_feed_small() -> None:
    small = sizes(base=MiB, view=2 * MiB, files=1, dim=MiB)
    s = choose(spec(full_above=1), built=True, base_rows=0, changes=[change(rows=400)], sizes=small)
    assert s.incremental and s.estimate is not None and s.estimate.incremental > s.estimate.full


def test_the_estimate_grows_with_the_change_and_new_base_rows_read_only_their_block() -> None:
    few = estimate(sizes(), base_rows=0, late_rows=0, changes=[change(rows=10)], reverse=["dim.c"])
    many = estimate(sizes(), base_rows=0, late_rows=0, changes=[change(rows=1000)], reverse=["dim.c"])
    assert few.incremental < many.incremental and few.full == many.full
    assert many.files_rewritten <= 128
    appended = estimate(sizes(), base_rows=10_000, late_rows=0, changes=[], reverse=[])
    # no reference changed: the block's share of the base read to find keys, the base once to
    # re-derive; a view of a row per base row gets new keys (inserts): no file rewritten
    assert appended.files_rewritten == 0 and appended.incremental < few.incremental < appended.full
    grouped = estimate(sizes(view=MiB, files=1, view_rows=20_000), base_rows=10_000, late_rows=0, changes=[], reverse=[])
    assert grouped.files_rewritten == pytest.approx(1)  # an aggregate: new rows update existing groups
    assert estimate(sizes(), base_rows=0, late_rows=0, changes=[], reverse=[]).files_rewritten == 0


def test_a_clustered_view_s_merge_reads_two_columns_and_the_files_of_few_keys_only() -> None:
    def cost(view: Sizes, rows: int) -> int:
        return estimate(view, base_rows=0, late_rows=0, changes=[change(rows=rows, total=200_000)],
                        reverse=["dim.c"]).incremental

    plain, clustered = sizes(), dataclasses.replace(sizes(), clustered=True, view_columns=8)
    assert cost(clustered, 10) < cost(plain, 10) - sizes().view_bytes // 2
    assert cost(clustered, 10_000) == cost(plain, 10_000)  # 20,000 keys: more than a literal list prunes by
    assert cluster_column(spec(), ["id", "customer_id", "amount"]) == "customer_id"
    assert cluster_column(spec(), ["country", "revenue"]) is None  # an aggregate without the join column


def test_a_touched_file_costs_its_read_and_its_write() -> None:
    """Each view file a MERGE touches counts as read and written again (with deletion vectors too:
    Delta reads each touched file again and writes a vector per file, measured at about a rewrite's
    cost per file), so a wide change of a view with deletion vectors goes to a full recompute."""
    def guess(view: Sizes, rows: int) -> Any:
        return estimate(view, base_rows=0, late_rows=0, changes=[change(rows=rows, total=1000)], reverse=["dim.c"])

    few, many = guess(sizes(files=20), 1), guess(sizes(files=20), 400)
    assert many.files_rewritten > few.files_rewritten
    files = many.files_rewritten - few.files_rewritten
    touched = sizes().view_bytes * files / 20
    assert many.incremental - few.incremental == pytest.approx((1 + WRITE_COST) * touched + MERGE_FILE_COST * files,
                                                               rel=1e-6)


def test_a_large_clustered_row_wise_view_goes_full_when_a_thousand_customers_touch_most_files() -> None:
    """As ``bench/view_scaling.py`` measured at 50M orders: a view of ~1 GiB in 2,000 clustered files
    of 25,000 rows over a base of 700 MiB. 1,200 changed customers touch most of its files, which
    Spark's MERGE rewrote in 102 s against a 47 s rebuild: full. 12 touch a few dozen: incremental.
    Without a cost a file, the bytes alone (1 GiB in files of 0.5 MiB) made the wide change look
    cheaper than a recompute."""
    view = dataclasses.replace(sizes(base=700 * MiB, view=1000 * MiB, files=2000, dim=10 * MiB),
                               clustered=True, view_columns=9)
    wide = choose(spec(row_wise=True), built=True, base_rows=0, changes=[change(rows=1200, total=200_000)], sizes=view)
    assert (wide.incremental, wide.fallback) == (False, True)
    assert wide.estimate is not None and wide.estimate.incremental > 2 * wide.estimate.full
    few = choose(spec(row_wise=True), built=True, base_rows=0, changes=[change(rows=12, total=200_000)], sizes=view)
    assert few.incremental and few.estimate is not None and 20 < few.estimate.files_rewritten < 30
    assert few.estimate.incremental < few.estimate.full / 2


def test_a_few_dozen_changed_rows_of_a_10m_clustered_view_stay_incremental_for_every_kind() -> None:
    """At 10M orders (a base of 140 MiB, a view of 200 MiB in 400 clustered files), a Spark unit of 10
    changed customers costs 1.5-2 s against an 11.5 s rebuild (``docs/limits.md``): 20 changed rows
    touch ~40 files, and the cost a file must not make that a full recompute."""
    view = dataclasses.replace(sizes(base=140 * MiB, view=200 * MiB, files=400, dim=10 * MiB),
                               clustered=True, view_columns=9)
    for kind in ({}, {"row_wise": True}, {"late_rows": "rederive", "additive": {"count": "n", "sums": ["total"]}}):
        s = choose(spec(**kind), built=True, base_rows=0, changes=[change(rows=20, total=200_000)], sizes=view)
        assert s.incremental and s.estimate is not None, (kind, s.reason)
        assert 30 < s.estimate.files_rewritten < 45


def test_an_additive_view_has_no_default_share_cap_and_reads_no_whole_groups() -> None:
    additive = {"late_rows": "rederive", "additive": {"count": "n", "sums": ["total"]}}
    wide = [change(rows=300, total=1000)]
    assert not choose(spec(), built=True, base_rows=0, changes=wide).incremental  # 0.5 % by default
    assert choose(spec(**additive), built=True, base_rows=0, changes=wide).incremental
    assert not choose(spec(**additive, full_above=0.1), built=True, base_rows=0, changes=wide).incremental  # a user's cap
    # an aggregate of 20,000 groups in one file over a 1,000 MiB base: re-derived, the affected groups
    # read the whole base again; additive, the base is read once (the rows joining a changed row)
    agg = sizes(view=MiB, files=1, view_rows=20_000)
    rederived = estimate(agg, base_rows=0, late_rows=0, changes=[change(rows=10)], reverse=["dim.c"])
    added = estimate(agg, base_rows=0, late_rows=0, changes=[change(rows=10)], reverse=["dim.c"], additive=True)
    assert rederived.incremental - added.incremental == pytest.approx(
        1000 * MiB * (2 - FILTERED_SCAN) + 256 * MiB - 96 * MiB - 10 * 48 * 2**10, abs=2)
    assert added.full == rederived.full and added.incremental < FULL_MARGIN * added.full
    s = choose(spec(**additive), built=True, base_rows=0, changes=[change(rows=10)], sizes=agg)
    assert s.incremental and s.estimate == added
    # over a base a tenth of that size, the fixed cost outweighs a recompute
    assert not choose(spec(**additive), built=True, base_rows=0, changes=[change(rows=10)],
                      sizes=sizes(base=100 * MiB, view=MiB, files=1, view_rows=20_000)).incremental
    assert not choose(spec(full_above=1), built=True, base_rows=0, changes=[change(rows=10)], sizes=agg).incremental


def test_a_row_wise_view_has_no_default_share_cap_reads_the_base_once_and_appends_new_rows() -> None:
    wide = [change(rows=300, total=1000)]
    assert not choose(spec(), built=True, base_rows=0, changes=wide).incremental  # 0.5 % by default
    assert choose(spec(row_wise=True), built=True, base_rows=0, changes=wide).incremental
    assert not choose(spec(row_wise=True, full_above=0.1), built=True, base_rows=0, changes=wide).incremental
    # a keyed view of 1,000 MiB in 100 files over a 1,000 MiB base: re-derived, the base is read
    # twice (to find the rows, then for the keys); row-wise, once, filtered
    view = sizes(view=1000 * MiB, files=100, view_rows=10_000_000)
    rederived = estimate(view, base_rows=0, late_rows=0, changes=[change(rows=10)], reverse=["dim.c"])
    rows = estimate(view, base_rows=0, late_rows=0, changes=[change(rows=10)], reverse=["dim.c"], row_wise=True)
    assert rederived.incremental - rows.incremental == pytest.approx(1000 * MiB * (2 - FILTERED_SCAN), abs=2)
    assert rows.files_rewritten == rederived.files_rewritten
    # new base rows alone are appended: no view file read or rewritten
    new = estimate(view, base_rows=10_000, late_rows=0, changes=[], reverse=[], row_wise=True)
    merged = estimate(view, base_rows=10_000, late_rows=0, changes=[], reverse=[])
    assert new.incremental < merged.incremental - 1000 * MiB and new.files_rewritten == 0
    both = spec(row_wise=True, late_rows="rederive", additive={"count": "n"}).merge_problems()
    assert ("row_wise", "an additive view sums several base rows into a row, so it cannot be row_wise; keep one of "
                        "the two") in both
