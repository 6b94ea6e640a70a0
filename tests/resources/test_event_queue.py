"""The stream queue's read positions as a record's ``inputs`` (pure: no files, no store)."""

from __future__ import annotations

import datetime as dt

from resources.intake import event_queue as q
from resources.intake.incoming_log import file_name

T0 = dt.datetime(2026, 3, 1, 12, 0)
A, B = file_name("web", T0), file_name("api", T0 + dt.timedelta(seconds=5))


def test_a_plan_round_trips_to_its_very_ranges_in_write_order():
    committed = q.positions([q.Range(A, 0, 100, 1, 4)], [])
    state = q.state_of(1, committed)
    assert state.offsets == {A: [100, 4]} and state.done == [] and state.seq == 1
    ranges = [q.Range(B, 0, 30, 1, 2), q.Range(A, 100, 160, 5, 3)]  # handed over out of order
    plan = q.positions(ranges, [A])
    assert plan == {A: 160, A + "#lines": 7, A + "#done": 1, B: 30, B + "#lines": 2}
    got, done = q.planned_ranges(committed, plan)
    assert got == [q.Range(A, 100, 160, 5, 3), q.Range(B, 0, 30, 1, 2)] and done == [A]  # A started first
    after = q.state_of(2, {**committed, **plan})
    assert after.offsets == {A: [160, 7], B: [30, 2]} and after.done == [A]
    assert q.inputs_of(after) == {**committed, **plan} and q.file_of(A + "#lines") == A  # the inverse, and a key's file


def test_a_file_only_finished_by_a_plan_has_no_range():
    committed = q.positions([q.Range(A, 0, 100, 1, 4)], [])
    assert q.planned_ranges(committed, q.positions([], [A])) == ([], [A])
