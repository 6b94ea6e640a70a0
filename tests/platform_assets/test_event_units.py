"""Units of ready files (pure): the byte budget, files that go alone, planned groups, lines."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from lineage.core.errors import TidemarkError
from platform_assets.intake.batch import Members, plan_units
from resources.intake.incoming_log import ReadyFile

T0 = dt.datetime(2026, 3, 1, tzinfo=dt.UTC)


def files(*sizes: int) -> tuple[list[ReadyFile], dict[Path, int]]:
    rfs = [ReadyFile(Path(f"/r/f{i}.log"), "web", T0 + dt.timedelta(seconds=i)) for i in range(len(sizes))]
    return rfs, {rf.path: s for rf, s in zip(rfs, sizes, strict=True)}


def names(units: list[list[ReadyFile]]) -> list[list[str]]:
    return [[rf.path.stem for rf in u] for u in units]


def test_small_files_fill_units_to_the_budget_and_large_ones_go_alone():
    rfs, size = files(10, 10, 10, 50, 10, 10, 10, 10)
    units = plan_units(rfs, lambda p: None, size.__getitem__, budget=30, alone=40)
    assert names(units) == [["f0", "f1", "f2"], ["f3"], ["f4", "f5", "f6"], ["f7"]]
    # files under ``alone`` fill a unit past it, up to the budget
    assert names(plan_units(rfs, lambda p: None, size.__getitem__, budget=100, alone=25)) == [
        ["f0", "f1", "f2"], ["f3"], ["f4", "f5", "f6", "f7"]]
    assert names(plan_units(rfs, lambda p: None, size.__getitem__, budget=30, alone=40, max_files=2)) == [
        ["f0", "f1"], ["f2"], ["f3"], ["f4", "f5"], ["f6", "f7"]]


def test_a_planned_unit_is_taken_as_its_status_says_and_a_gone_member_is_named():
    rfs, size = files(10, 10, 10, 10)
    status = {Path("/r/f0.log"): {"files": ["f0.log", "f1.log"]}}
    units = plan_units(rfs, status.get, size.__getitem__, budget=100, alone=100)
    assert names(units) == [["f0", "f1"], ["f2", "f3"]]  # not regrouped although the budget has room
    status = {Path("/r/f1.log"): {"files": ["f1.log", "f9.log"]}}
    with pytest.raises(TidemarkError, match=r"f9.log of the unit planned in /r/f1.log.status is gone"):
        plan_units(rfs, status.get, size.__getitem__, budget=100, alone=100)
    status = {Path("/r/f1.log"): {"files": ["f1.log", "f9.log"], "batch_done": True}}  # done: f9 was archived
    assert names(plan_units(rfs, status.get, size.__getitem__, budget=100, alone=100)) == [["f0"], ["f1"], ["f2", "f3"]]


def test_members_number_lines_one_file_after_another():
    m = Members.of(["a", "b", "c"], [3, 0, 2])
    assert [m.where(n) for n in (1, 3, 4, 5)] == [("a", 1), ("a", 3), ("c", 1), ("c", 2)]
    assert Members.single("u").where(7) == ("u", 7)
