"""When the planner sensor plans and when it only looks (pure logic of platform_assets.dagster.watch)."""

from __future__ import annotations

import pytest

from lineage.core.errors import ConfigError
from platform_assets.dagster.watch import (
    Look,
    changed_tables,
    delays_started,
    env_seconds,
    read_cursor,
    why_plan,
    write_cursor,
)


def test_a_look_plans_first_then_only_on_a_change_a_passed_delay_or_the_full_interval() -> None:
    assert why_plan(None, {"a.x": 1}, 5, 100.0, every_s=30) == "first look"
    last = Look(versions={"a.x": 1, "a.y": None}, log_head=5, planned_at=100.0, due=[120.0])
    assert why_plan(last, {"a.x": 1, "a.y": None}, 5, 110.0, every_s=30) is None
    assert why_plan(last, {"a.x": 2, "a.y": None}, 5, 110.0, every_s=30) == "a.x changed"
    assert why_plan(last, {"a.x": 1, "a.y": 0}, 5, 110.0, every_s=30) == "a.y changed"  # a table appeared
    assert why_plan(last, {"a.x": 1, "a.y": None, "a.z": 3}, 5, 110.0, every_s=30) == "a.z changed"  # new in the lineage
    assert why_plan(last, {"a.x": 1, "a.y": None}, 6, 110.0, every_s=30) == "the offset store changed"
    assert why_plan(last, {"a.x": 1, "a.y": None}, 5, 120.0, every_s=30) == "a delay passed"
    assert why_plan(Look(versions={"a.x": 1}, log_head=5, planned_at=100.0), {"a.x": 1}, 5, 130.0,
                    every_s=30) == "the last planning is 30s old"
    many = {f"s.t{i}": i + 1 for i in range(5)}
    assert why_plan(Look(versions={f"s.t{i}": i for i in range(5)}, planned_at=1.0), many, 0, 2.0,
                    every_s=30) == "s.t0, s.t1, s.t2 and 2 more changed"


def test_a_change_starts_the_delay_of_the_topics_that_read_the_table() -> None:
    reads = [(["stage.orders", "fact.orders"], 10.0), (["stage.orders", "dim.c"], 0.0), (["stage.items"], 60.0)]
    assert delays_started(reads, {"stage.orders"}, 1000.0) == [1011.0]
    assert delays_started(reads, {"stage.orders", "stage.items"}, 1000.0) == [1011.0, 1061.0]
    assert delays_started(reads, {"dim.c"}, 1000.0) == []  # no delay: planned at once anyway
    last = Look(versions={"a": 1, "b": None})
    assert changed_tables(last, {"a": 1, "b": 0, "c": None}) == {"b", "c"}
    assert changed_tables(None, {"a": 1, "b": None}) == {"a", "b"}  # a first look: every delay starts


def test_the_cursor_round_trips_and_a_cursor_from_before_looks_is_read_as_the_check_states() -> None:
    look = Look(versions={"a.x": 3, "a.y": None}, log_head=7, planned_at=12.5, due=[20.0, 15.0], waits="x" * 5000)
    again, checks = read_cursor(write_cursor(look, {"t": "pass"}))
    assert checks == {"t": "pass"}
    assert again is not None and again.versions == look.versions and again.log_head == 7 and again.due == [15.0, 20.0]
    assert len(again.waits) == 2000
    assert read_cursor('{"fact.orders": "fail"}') == (None, {"fact.orders": "fail"})
    assert read_cursor(None) == (None, {})
    assert read_cursor("not json") == (None, {})
    assert read_cursor('{"look": {"versions": "bad"}}')[0] is None


def test_interval_settings_are_whole_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIDEMARK_PLANNER_INTERVAL", raising=False)
    assert env_seconds("TIDEMARK_PLANNER_INTERVAL", 5) == 5
    monkeypatch.setenv("TIDEMARK_PLANNER_INTERVAL", "2")
    assert env_seconds("TIDEMARK_PLANNER_INTERVAL", 5) == 2
    for bad in ("0", "-1", "5s", "1.5"):
        monkeypatch.setenv("TIDEMARK_PLANNER_INTERVAL", bad)
        with pytest.raises(ConfigError, match=rf"TIDEMARK_PLANNER_INTERVAL='{bad}': expected a whole number of seconds"):
            env_seconds("TIDEMARK_PLANNER_INTERVAL", 5)


def test_a_planning_passes_over_quiet_topics_until_what_moves_them_changes() -> None:
    from platform_assets.dagster.watch import Reads, is_quiet, topics_to_plan

    assert is_quiet("no new rows") and is_quiet("no new rows (stage.x is empty)")
    assert is_quiet("stage.x does not exist at /w/stage/x; check the table name or the source's path")
    assert not is_quiet("delay 10s: newest eligible row at 2026-01-01 00:00:00")
    assert not is_quiet("repeat: next run after 2026-01-01 00:00:00")
    reads = {"fact.a": Reads(frozenset({"stage.a", "fact.a"}), frozenset()),
             "fact.b": Reads(frozenset({"fact.a", "dim.c", "fact.b"}), frozenset({"fact.a"})),
             "fact.c": Reads(frozenset({"stage.c", "fact.c"}), frozenset())}
    last = Look(quiet={"fact.a": "no new rows", "fact.b": "no new rows"})  # fact.c waits on the clock
    assert topics_to_plan(last, reads, set(), set(), rescan=False) == {"fact.c"}
    assert topics_to_plan(last, reads, {"stage.a"}, set(), rescan=False) == {"fact.a", "fact.c"}
    assert topics_to_plan(last, reads, {"dim.c"}, set(), rescan=False) == {"fact.b", "fact.c"}
    # fact.a committed: its offsets moved, so did the freshness fact.b depends on.
    assert topics_to_plan(last, reads, set(), {"fact.a"}, rescan=False) == {"fact.a", "fact.b", "fact.c"}
    assert topics_to_plan(last, reads, set(), set(), rescan=True) == set(reads)
    assert topics_to_plan(None, reads, set(), set(), rescan=False) == set(reads)


def test_runs_that_others_wait_for_go_first_in_the_queue() -> None:
    from platform_assets.dagster.watch import downstream_counts

    demo = {"dim.customers": ("dim.customers", ["stage.customers"]),
            "fact.orders": ("fact.orders", ["stage.orders", "dim.customers"]),
            "fact.order_items": ("fact.order_items", ["stage.order_items", "fact.orders"]),
            "mart.daily_revenue": ("mart.daily_revenue", ["fact.order_items"]),
            "fact.page_views": ("fact.page_views", ["stage.events_page_view"]),
            # two topics (tags) writing one table: each counts the other's readers, not itself
            "fact.orders#b": ("fact.orders", ["stage.orders_b"])}
    assert downstream_counts(demo) == {"dim.customers": 3, "fact.orders": 2, "fact.order_items": 1,
                                       "mart.daily_revenue": 0, "fact.page_views": 0, "fact.orders#b": 2}


def test_offset_log_entries_committed_out_of_id_order_are_not_missed() -> None:
    from platform_assets.dagster.watch import LOG_WINDOW, Reads, log_window, new_entries, topics_to_plan

    assert log_window(None) == 0 and log_window(Look(log_head=500)) == 500 - LOG_WINDOW
    topics, recent = new_entries(None, {1: "a", 2: "b"}, 2)
    assert topics == set() and recent == [1, 2]
    # Seen: ids 1, 2, 4 with head 4; id 3 (taken first, committed last) shows up only now.
    last = Look(log_head=4, recent=[1, 2, 4])
    topics, recent = new_entries(last, {1: "a", 2: "b", 3: "c", 4: "d", 5: "e"}, 5)
    assert topics == {"c", "e"} and recent == [1, 2, 3, 4, 5]
    # A head lower than before: a store restored or replaced, so every topic is planned.
    reads = {"q": Reads(frozenset({"s.q"}), frozenset())}
    assert topics_to_plan(Look(log_head=9, quiet={"q": "no new rows"}), reads, set(), set(), rescan=False, head=3) == {"q"}
    assert topics_to_plan(Look(log_head=9, quiet={"q": "no new rows"}), reads, set(), set(), rescan=False, head=9) == set()


def test_rows_dated_after_now_are_not_a_quiet_wait() -> None:
    import datetime as dt

    from lineage.core.positions import Position
    from lineage.planning.planner import TableMark, TopicState, plan_topic
    from lineage.spec.model import TopicSpec
    from platform_assets.dagster.watch import is_quiet

    now = dt.datetime(2026, 1, 1, 12)
    spec = TopicSpec.model_validate({"table": "fact.x", "depends_on": ["stage.x"], "transforms": ["x.sql"]})
    decision = plan_topic(spec, TopicState(last=Position(now - dt.timedelta(minutes=1), 5)),
                          TableMark(Position(now + dt.timedelta(minutes=5), 9), version=3), {}, now)
    assert decision.ready and decision.cutoff == now
    assert not is_quiet(decision.limit)  # what the block says when it finds no row: the clock ends it


def test_the_follower_and_the_sensor_share_one_look():
    """``tidemark follow`` and the planner sensor take changed tables and quiet waits from one place."""
    from lineage.planning import look
    from platform_assets.dagster import watch
    from platform_assets.follow import loop

    assert watch.is_quiet is look.is_quiet and loop.is_quiet is look.is_quiet
    assert look.is_quiet("incremental: nothing changed") and not look.is_quiet("rows dated after now wait")
    assert look.changed_tables({"a": 1, "b": None}, {"a": 1, "b": None, "c": 0}) == {"c"}
    assert look.changed_tables({"a": 1}, {"a": 2}) == {"a"} and look.changed_tables(None, {"a": 1}) == {"a"}
