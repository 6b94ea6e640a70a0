"""A row-wise unit's rows in the driver (platform_assets.views.in_hand): its checks, keys and MERGE
source, computed from Arrow as Spark's grouping would (pure; no Spark)."""

from __future__ import annotations

import datetime as dt
import decimal

import pyarrow as pa

from platform_assets.views import in_hand

PART, PRESENT = "_tm_part", "_tm_present"


def rows(parts: list[str], ids: list[int | None], names: list[str | None], **more: list[object]) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "name": pa.array(names, pa.string()),
                     **{k: pa.array(v) for k, v in more.items()}, PART: pa.array(parts, pa.string())})


def test_checks_count_the_rows_found_the_rows_made_alone_and_keys_given_twice():
    every = rows(["even", "odd", "odd", "alone", "old"], [2, 1, 2, 9, 1], ["a", "b", "c", "x", "b"])
    got = in_hand.checks(every, ["id"], PART, None)
    assert (got["rows"], got["alone"], got["twice"], got["most"], got["most_n"], got["differ"]) == \
        (3, 1, 1, {"id": 2}, 2, 0)


def test_checks_see_no_key_twice_where_every_key_is_one_row():
    every = rows(["even", "odd"], [2, 1], ["a", "b"])
    got = in_hand.checks(every, ["id"], PART, None)
    assert (got["rows"], got["twice"], got["most_n"]) == (2, 0, 1)


def test_null_keys_are_one_key_as_in_spark_grouping():
    every = rows(["even", "odd"], [None, None], ["a", "b"])
    got = in_hand.checks(every, ["id"], PART, None)
    assert (got["twice"], got["most"], got["most_n"]) == (1, {"id": None}, 2)


def test_no_rows_found_gives_no_key():
    every = rows([], [], [])
    got = in_hand.checks(every, ["id"], PART, None)
    assert (got["rows"], got["twice"], got["most"], got["most_n"]) == (0, 0, None, 0)


def test_differ_counts_the_rows_found_in_the_view_and_the_transform_disagree_on_as_a_multiset():
    every = rows(["old", "old", "old", "even"], [1, 1, 2, 1], ["a", "a", "b", "z"])
    view = pa.table({"id": pa.array([1, 1, 2], pa.int64()), "name": pa.array(["a", "a", "b"])})
    assert in_hand.checks(every, ["id"], PART, view)["differ"] == 0
    once = pa.table({"id": pa.array([1, 2], pa.int64()), "name": pa.array(["a", "b"])})
    assert in_hand.checks(every, ["id"], PART, once)["differ"] == 1  # a row the view holds once, not twice
    other = pa.table({"id": pa.array([1, 1, 2], pa.int64()), "name": pa.array(["a", "a", "B"])})
    assert in_hand.checks(every, ["id"], PART, other)["differ"] == 2


def test_nan_equals_nan_and_nested_values_compare_by_content():
    nested = pa.array([{"x": 1, "y": [1.0, float("nan")]}, None], pa.struct([("x", pa.int64()), ("y", pa.list_(pa.float64()))]))
    every = pa.table({"id": pa.array([1, 2], pa.int64()), "v": pa.array([float("nan"), -0.0]), "s": nested,
                      PART: pa.array(["old", "old"])})
    view = pa.table({"id": pa.array([1, 2], pa.int64()), "v": pa.array([float("nan"), 0.0]), "s": nested})
    assert in_hand.comparable(every, view)
    assert in_hand.checks(every, ["id"], PART, view)["differ"] == 0


def test_the_same_rows_in_another_order_are_told_by_arrow_without_python_rows(monkeypatch):
    """The rows found in the view are mostly those the transform gives back: Arrow tells it, both
    sorted, with no row made a Python value; where they differ, or Arrow cannot tell, they are
    counted as before."""
    stamp = [dt.datetime(2026, 1, 1, tzinfo=dt.UTC), None, dt.datetime(2026, 1, 2, tzinfo=dt.UTC)]
    money = [decimal.Decimal("1.10"), decimal.Decimal("2.00"), None]
    view = pa.table({"id": pa.array([3, 1, 2], pa.int64()), "name": pa.array(["c", None, "b"]),
                     "at": pa.array(stamp, pa.timestamp("us", tz="UTC")), "m": pa.array(money, pa.decimal128(12, 2)),
                     "v": pa.array([0.0, 1.5, None])})
    again = view.take([2, 0, 1]).set_column(4, "v", pa.array([None, -0.0, 1.5]))  # -0.0 where the view has 0.0
    made: list[int] = []
    real = in_hand._tuples
    monkeypatch.setattr(in_hand, "_tuples", lambda t, cols: made.append(t.num_rows) or real(t, cols))
    assert in_hand.differ(again, view) == 0 and made == []
    assert in_hand.differ(again.slice(0, 2), view) == 1 and made  # a row the transform does not give: counted
    made.clear()
    zeros = pa.table({"v": pa.array([0.0, -0.0]), "s": pa.array(["a", "b"])})  # tied in the sort, told apart by s
    assert in_hand.differ(pa.table({"v": pa.array([0.0, -0.0]), "s": pa.array(["b", "a"])}), zeros) == 0 and not made
    nan = pa.table({"v": pa.array([float("nan"), 1.0])})
    assert in_hand.differ(nan.take([1, 0]), nan) == 0 and made  # a NaN: Arrow cannot tell, so counted


def test_comparable_needs_the_same_arrow_types():
    every = rows(["old"], [1], ["a"])
    assert not in_hand.comparable(every, pa.table({"id": pa.array([1], pa.int32()), "name": pa.array(["a"])}))
    assert not in_hand.comparable(every, pa.table({"other": pa.array([1], pa.int64())}))


def test_distinct_values_keep_the_raw_values_and_stop_past_the_limit():
    t = pa.table({"d": pa.array([dt.date(2026, 1, 1), None, dt.date(2026, 1, 1), dt.date(2026, 1, 2)])})
    assert in_hand.distinct_values(t, "d", 5) == [dt.date(2026, 1, 1), None, dt.date(2026, 1, 2)]
    assert in_hand.distinct_values(t, "d", 2) is None


def test_key_rows_are_distinct_across_tables_up_to_a_limit():
    a = pa.table({"k": [1, 2], "j": ["x", "y"]})
    b = pa.table({"k": [2, 3], "j": ["y", "z"]})
    assert in_hand.key_rows([a, b], ["k", "j"], 10) == [(1, "x"), (2, "y"), (3, "z")]
    assert in_hand.key_rows([a, b], ["k", "j"], 2) is None


def test_the_merge_source_gives_each_new_row_and_each_key_no_longer_made_once():
    made = pa.table({"id": pa.array([1, 2], pa.int64()), "amount": pa.array([decimal.Decimal("1.50"), None],
                                                                            pa.decimal128(12, 2))},
                    schema=pa.schema([pa.field("id", pa.int64(), nullable=False),
                                      pa.field("amount", pa.decimal128(12, 2))]))
    old = pa.table({"id": pa.array([2, 3, 3, None], pa.int64()), "amount": pa.array([None] * 4, pa.decimal128(12, 2))})
    src = in_hand.merge_source(made, old, ["id"], PRESENT)
    assert src.column_names == ["id", "amount", PRESENT]
    assert src.to_pylist() == [
        {"id": 1, "amount": decimal.Decimal("1.50"), PRESENT: True},
        {"id": 2, "amount": None, PRESENT: True},
        {"id": 3, "amount": None, PRESENT: None},
        {"id": None, "amount": None, PRESENT: None},
    ]


def test_the_merge_source_of_rows_all_still_made_is_those_rows():
    made = pa.table({"id": pa.array([1], pa.int64())})
    src = in_hand.merge_source(made, made, ["id"], PRESENT)
    assert src.to_pylist() == [{"id": 1, PRESENT: True}]


def test_part_keeps_only_the_named_parts():
    every = rows(["even", "old", "odd"], [1, 2, 3], ["a", "b", "c"])
    assert in_hand.part(every, PART, "even", "odd").column("id").to_pylist() == [1, 3]
    assert PART not in in_hand.part(every, PART, "old").column_names


def test_collated_strings_anywhere_in_a_schema_keep_a_unit_in_spark():
    from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType

    plain = StructType([StructField("id", LongType()), StructField("s", StringType())])
    assert in_hand.binary_strings(plain)
    nested = StructType([StructField("a", ArrayType(StructType([StructField("s", StringType("UTF8_LCASE"))])))])
    assert not in_hand.binary_strings(nested)
