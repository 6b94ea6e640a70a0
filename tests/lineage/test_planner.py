"""The planner: offsets + marks + the clock + the rules -> ready (with a cutoff) or why it waits."""

from __future__ import annotations

import datetime as dt
import itertools
from typing import Any

import pytest

from lineage.core.errors import TidemarkError
from lineage.core.positions import Block, Position
from lineage.planning.planner import Decision, TableMark, TopicState, lag_seconds, plan_topic
from lineage.spec.model import TopicSpec

NOW = dt.datetime(2026, 1, 31, 12, 0, 0)
MIN = dt.timedelta(minutes=1)
SEC = dt.timedelta(seconds=1)


def spec(**fields: Any) -> TopicSpec:
    data: dict[str, Any] = {"table": "fact.x", "depends_on": ["stage.x"], "transforms": ["x.sql"]}
    data.update(fields)
    return TopicSpec.model_validate(data)


def at(delta: dt.timedelta = dt.timedelta(0), id_: int = 0) -> Position:
    """A position ``delta`` after NOW (use negative deltas for the past)."""
    return Position(NOW + delta, id_)


def plan(
    s: TopicSpec,
    state: TopicState,
    base: TableMark | None = None,
    deps: dict[str, dt.datetime | None] | None = None,
    now: dt.datetime = NOW,
) -> Decision:
    return plan_topic(s, state, base if base is not None else TableMark(at()), deps or {}, now)


# --- retry ---------------------------------------------------------------------------------------


def test_pending_block_is_retried_as_it_is() -> None:
    last, nxt = at(-60 * MIN, 5), at(-30 * MIN, 9)
    d = plan(spec(), TopicState(last=last, next=nxt, seq=7))
    assert d.ready is True
    assert d.retry == Block("fact.x", 7, last, nxt)
    assert d.cutoff == nxt.pos
    assert d.reason == f"retry block 7 {last}..{nxt}"
    assert d.topic == "fact.x"


def test_a_first_block_retried_names_its_start_not_the_sentinel() -> None:
    nxt = at(-30 * MIN, 9)
    d = plan(spec(), TopicState(last=Position.zero(), next=nxt, seq=1))
    assert d.reason == f"retry block 1 start..{nxt}"
    assert "0001-01-01" not in d.reason and str(-(2**63)) not in d.reason


def test_pending_block_is_retried_even_when_repeat_delay_deps_and_base_forbid() -> None:
    last, nxt = at(-10 * SEC, 1), at(-5 * SEC, 2)
    s = spec(depends_on=["stage.x", "dim.y"], delay="1h", repeat="1d")
    state = TopicState(last=last, next=nxt, seq=3, run=NOW - SEC)
    d = plan_topic(s, state, TableMark(None), {"dim.y": None}, NOW)
    assert d.ready is True
    assert d.retry == Block("fact.x", 3, last, nxt)
    assert (d.retry.last, d.retry.next, d.retry.seq) == (last, nxt, 3)
    assert d.cutoff == nxt.pos


def test_pending_block_of_a_reload_topic_is_retried() -> None:
    last, nxt = Position.zero(), at(-MIN, 1)
    d = plan(
        spec(processor="reload"), TopicState(last=last, next=nxt, seq=2, source_version=4), TableMark(None, 4)
    )
    assert d.ready is True
    assert d.retry == Block("fact.x", 2, last, nxt)


def test_corrupt_pending_block_is_an_error() -> None:
    with pytest.raises(TidemarkError, match="block 4 of 'fact.x': last .* is not before next"):
        plan(spec(), TopicState(last=at(0 * SEC, 5), next=at(0 * SEC, 5), seq=4))


# --- repeat --------------------------------------------------------------------------------------


def test_repeat_not_elapsed_waits_until_run_plus_repeat() -> None:
    d = plan(spec(repeat="5m"), TopicState(last=at(-60 * MIN), seq=1, run=NOW - 2 * MIN))
    assert d.ready is False
    assert d.reason == "repeat: next run after 2026-01-31 12:03:00"
    assert d.cutoff is None
    assert d.retry is None


def test_repeat_reason_keeps_microseconds() -> None:
    run = NOW - dt.timedelta(seconds=10, microseconds=250)
    d = plan(spec(repeat="1m"), TopicState(last=at(-60 * MIN), seq=1, run=run))
    assert d.reason == "repeat: next run after 2026-01-31 12:00:49.999750"


def test_repeat_elapsed_exactly_runs() -> None:
    d = plan(spec(repeat="5m"), TopicState(last=at(-60 * MIN), seq=1, run=NOW - 5 * MIN))
    assert d.ready is True
    assert d.cutoff == NOW


def test_repeat_elapsed_runs() -> None:
    d = plan(spec(repeat="5m"), TopicState(last=at(-60 * MIN), seq=1, run=NOW - 6 * MIN))
    assert d.ready is True
    assert d.reason == "new rows"


def test_repeat_ignored_without_a_previous_run_or_without_repeat() -> None:
    assert plan(spec(repeat="1d"), TopicState(last=Position.zero(), run=None)).ready is True
    assert plan(spec(), TopicState(last=at(-60 * MIN), seq=1, run=NOW - SEC)).ready is True


# --- base table ----------------------------------------------------------------------------------


def test_empty_base_table() -> None:
    d = plan(spec(), TopicState(last=Position.zero()), TableMark(None, 0))
    assert d.ready is False
    assert d.reason == "no new rows (stage.x is empty)"
    assert d.cutoff is None


@pytest.mark.parametrize("processor", ["step", "reload"])
def test_a_missing_base_table_is_not_an_empty_one(processor: str) -> None:
    missing = TableMark(None, None, exists=False, location="/wh/stage/x")
    d = plan(spec(processor=processor), TopicState(last=Position.zero()), missing)
    assert (d.ready, d.reason) == (False, "stage.x does not exist at /wh/stage/x; check the table name or the source's path")
    # A base some topic writes is simply not written yet.
    d = plan_topic(spec(processor=processor), TopicState(last=Position.zero()), missing, {}, NOW, base_produced=True)
    assert (d.ready, d.reason) == (False, "no new rows (stage.x not written yet by its topic; no Delta table at /wh/stage/x)")


@pytest.mark.parametrize(
    "base_max",
    [at(-60 * MIN, 5), at(-60 * MIN, 4), at(-61 * MIN, 99)],
    ids=["equal-to-last", "tie-lower-id", "earlier"],
)
def test_base_not_past_last_means_no_new_rows(base_max: Position) -> None:
    d = plan(spec(), TopicState(last=at(-60 * MIN, 5), seq=2), TableMark(base_max))
    assert d.ready is False
    assert d.reason == "no new rows"
    assert d.cutoff is None


def test_base_past_last_only_by_id_is_new() -> None:
    d = plan(spec(), TopicState(last=at(-60 * MIN, 5), seq=2), TableMark(at(-60 * MIN, 6)))
    assert d.ready is True
    assert d.cutoff == NOW


def test_first_run_from_zero() -> None:
    d = plan(spec(), TopicState(last=Position.zero()), TableMark(at(-MIN)))
    assert d == Decision("fact.x", True, "new rows", cutoff=NOW, limit="no eligible rows before now")


# --- delay ---------------------------------------------------------------------------------------


def test_delay_moves_the_cutoff_back() -> None:
    d = plan(spec(delay="30s"), TopicState(last=at(-60 * MIN), seq=1))
    assert d.ready is True
    assert d.reason == "new rows"
    assert d.cutoff == NOW - 30 * SEC
    assert d.limit.startswith("delay ")
    assert d.limit.endswith(": newest eligible row at 2026-01-31 11:59:30")


def test_delay_waits_when_last_is_past_the_cutoff() -> None:
    d = plan(spec(delay="30s"), TopicState(last=at(-10 * SEC), seq=1), TableMark(at()))
    assert d.ready is False
    assert d.reason.startswith("delay ")
    assert d.reason.endswith("newest eligible row at 2026-01-31 11:59:30")
    assert d.cutoff is None


def test_delay_cutoff_equal_to_last_pos_is_ready() -> None:
    # rows at last.pos with a larger id are still eligible
    d = plan(spec(delay="30s"), TopicState(last=at(-30 * SEC, 3), seq=1))
    assert d.ready is True
    assert d.cutoff == NOW - 30 * SEC


def test_delay_does_not_depend_on_base_max() -> None:
    # the base's newest row is recent, but older rows are eligible: the cutoff is now - delay
    d = plan(spec(delay="2h"), TopicState(last=at(-3 * 60 * MIN), seq=1), TableMark(at(-SEC)))
    assert d.ready is True
    assert d.cutoff == NOW - dt.timedelta(hours=2)


def test_no_delay_cutoff_is_now() -> None:
    d = plan(spec(), TopicState(last=at(-MIN), seq=1))
    assert d.ready is True
    assert d.cutoff == NOW
    assert d.limit == "no eligible rows before now"  # rows dated after now: the clock ends that wait


def test_wait_always_has_a_reason_when_last_is_in_the_future() -> None:
    d = plan(spec(), TopicState(last=at(10 * MIN), seq=1), TableMark(at(20 * MIN)))
    assert d.ready is False
    assert d.reason != ""


# --- depends_on ----------------------------------------------------------------------------------


def test_dependency_without_data_waits() -> None:
    s = spec(depends_on=["stage.x", "dim.y"])
    d = plan(s, TopicState(last=at(-60 * MIN), seq=1), deps={"dim.y": None})
    assert d.ready is False
    assert d.reason == "waiting for dim.y (no data yet)"
    assert d.cutoff is None


def test_stale_dependency_lowers_the_cutoff_and_is_named() -> None:
    s = spec(depends_on=["stage.x", "dim.y"])
    d = plan(s, TopicState(last=at(-60 * MIN), seq=1), deps={"dim.y": NOW - 10 * MIN})
    assert d.ready is True
    assert d.cutoff == NOW - 10 * MIN
    assert d.limit == "waiting for dim.y (at 2026-01-31 11:50:00)"


def test_fresh_dependency_does_not_limit() -> None:
    s = spec(depends_on=["stage.x", "dim.y"], delay="1m")
    d = plan(s, TopicState(last=at(-60 * MIN), seq=1), deps={"dim.y": NOW + MIN})
    assert d.ready is True
    assert d.cutoff == NOW - MIN
    assert d.limit.startswith("delay ")


def test_dependency_behind_last_waits() -> None:
    s = spec(depends_on=["stage.x", "dim.y"])
    d = plan(s, TopicState(last=at(-60 * MIN), seq=1), deps={"dim.y": NOW - 120 * MIN})
    assert d.ready is False
    assert d.reason == "waiting for dim.y (at 2026-01-31 10:00:00)"
    assert d.cutoff is None


def test_dependency_exactly_at_last_is_ready() -> None:
    s = spec(depends_on=["stage.x", "dim.y"])
    d = plan(s, TopicState(last=at(-60 * MIN, 1), seq=1), deps={"dim.y": NOW - 60 * MIN})
    assert d.ready is True
    assert d.cutoff == NOW - 60 * MIN


def test_dependency_limit_shows_microseconds() -> None:
    s = spec(depends_on=["stage.x", "dim.y"])
    fresh = NOW - dt.timedelta(minutes=10, microseconds=5)
    d = plan(s, TopicState(last=at(-60 * MIN), seq=1), deps={"dim.y": fresh})
    assert d.limit == "waiting for dim.y (at 2026-01-31 11:49:59.999995)"


DEPS = {"dim.a": NOW - 10 * MIN, "dim.b": NOW - 20 * MIN, "dim.c": NOW - 2 * MIN}


@pytest.mark.parametrize("order", list(itertools.permutations(DEPS)))
def test_smallest_limit_wins_whatever_the_order(order: tuple[str, ...]) -> None:
    s = spec(depends_on=["stage.x", *order], delay="5m")
    deps = {name: DEPS[name] for name in order}
    d = plan(s, TopicState(last=at(-60 * MIN), seq=1), deps=deps)
    assert d.ready is True
    assert d.cutoff == NOW - 20 * MIN
    assert d.limit == "waiting for dim.b (at 2026-01-31 11:40:00)"


def test_delay_wins_over_fresher_dependencies() -> None:
    s = spec(depends_on=["stage.x", "dim.a", "dim.c"], delay="30m")
    d = plan(s, TopicState(last=at(-60 * MIN), seq=1), deps={"dim.a": NOW - 10 * MIN, "dim.c": NOW - 2 * MIN})
    assert d.cutoff == NOW - 30 * MIN
    assert d.limit.startswith("delay ")
    assert d.limit.endswith("newest eligible row at 2026-01-31 11:30:00")


def test_smallest_limit_behind_last_names_that_dependency() -> None:
    s = spec(depends_on=["stage.x", "dim.a", "dim.b"], delay="5m")
    d = plan(
        s, TopicState(last=at(-15 * MIN), seq=1), deps={"dim.a": NOW - 10 * MIN, "dim.b": NOW - 20 * MIN}
    )
    assert d.ready is False
    assert d.reason == "waiting for dim.b (at 2026-01-31 11:40:00)"


@pytest.mark.parametrize("order", [("dim.a", "dim.n"), ("dim.n", "dim.a")])
def test_any_dependency_without_data_waits(order: tuple[str, str]) -> None:
    values = {"dim.a": NOW - 10 * MIN, "dim.n": None}
    s = spec(depends_on=["stage.x", *order])
    d = plan(s, TopicState(last=at(-60 * MIN), seq=1), deps={n: values[n] for n in order})
    assert d.ready is False
    assert d.reason == "waiting for dim.n (no data yet)"


def test_base_checks_come_before_dependency_checks() -> None:
    s = spec(depends_on=["stage.x", "dim.y"])
    d = plan(s, TopicState(last=at(-60 * MIN), seq=1), TableMark(at(-60 * MIN)), deps={"dim.y": None})
    assert d.reason == "no new rows"


# --- reload --------------------------------------------------------------------------------------


def test_reload_first_run_is_ready() -> None:
    d = plan(spec(processor="reload"), TopicState(last=Position.zero(), seq=0), TableMark(None, 3))
    assert d.ready is True
    assert d.reason == "first reload"
    assert d.retry is None


def test_reload_runs_when_base_version_changed() -> None:
    d = plan(
        spec(processor="reload"),
        TopicState(last=Position.zero(), seq=2, source_version=5),
        TableMark(at(), 6),
    )
    assert d.ready is True
    assert d.reason == "stage.x changed (version 5 -> 6)"


def test_reload_waits_when_base_version_unchanged() -> None:
    d = plan(
        spec(processor="reload"),
        TopicState(last=Position.zero(), seq=2, source_version=5),
        TableMark(at(), 5),
    )
    assert d.ready is False
    assert d.reason == "no new rows (stage.x unchanged since version 5)"


def test_reload_waits_when_later_versions_only_compacted() -> None:
    state = TopicState(last=Position.zero(), seq=2, source_version=5)
    d = plan(spec(processor="reload"), state, TableMark(at(), 8, data_version=5))
    assert d.ready is False
    assert d.reason == "no new rows (stage.x unchanged since version 5; versions up to 8 only compacted or cleaned up)"
    d = plan(spec(processor="reload"), state, TableMark(at(), 8, data_version=7))
    assert d.ready is True and d.reason == "stage.x changed (version 5 -> 8)"


def test_reload_ignores_delay_and_dependencies() -> None:
    s = spec(processor="reload", depends_on=["stage.x", "dim.y"], delay="1d")
    d = plan_topic(
        s, TopicState(last=Position.zero(), seq=1, source_version=1), TableMark(None, 2), {"dim.y": None}, NOW
    )
    assert d.ready is True
    assert d.reason == "stage.x changed (version 1 -> 2)"


def test_repeat_applies_to_reload() -> None:
    s = spec(processor="reload", repeat="1h")
    state = TopicState(last=Position.zero(), seq=2, run=NOW - 15 * MIN, source_version=5)
    d = plan(s, state, TableMark(at(), 9))
    assert d.ready is False
    assert d.reason == "repeat: next run after 2026-01-31 12:45:00"
    d = plan(s, state, TableMark(at(), 9), now=NOW + 45 * MIN)
    assert d.ready is True
    assert d.reason == "stage.x changed (version 5 -> 9)"


# --- lag -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("last", "source_max", "expected"),
    [
        (Position.zero(), None, 0.0),
        (at(-MIN), None, 0.0),
        (Position.zero(), at(), float("inf")),
        (at(-90 * SEC), at(), 90.0),
        (at(-dt.timedelta(milliseconds=500)), at(), 0.5),
        (at(), at(-MIN), 0.0),
        (at(0 * SEC, 1), at(0 * SEC, 99), 0.0),
        (at(-2 * dt.timedelta(days=1)), at(), 172800.0),
    ],
)
def test_lag_seconds(last: Position, source_max: Position | None, expected: float) -> None:
    assert lag_seconds(last, source_max) == expected
