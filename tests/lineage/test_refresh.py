"""The merge topic's choice between an incremental refresh (reverse join) and a full recompute."""

from __future__ import annotations

import pytest

from lineage.refresh import InputChange, RefreshRefused
from lineage.refresh import choose as choose_
from lineage.spec import TopicSpec


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
