"""Positions ``(pos, id)`` and blocks ``(last, next]``: pure, no Spark."""

from __future__ import annotations

import datetime as dt

import pytest

from lineage.core.errors import TidemarkError
from lineage.core.positions import ZERO_TS, Block, Position, format_ts, parse_ts, to_naive_utc

T0 = dt.datetime(2026, 1, 31, 12, 0, 0)
MIN_ID = -(2**63)


def P(seconds: float = 0, id_: int = 0) -> Position:  # noqa: N802 - short helper
    return Position(T0 + dt.timedelta(seconds=seconds), id_)


# --- ordering -------------------------------------------------------------------------------


def test_orders_by_pos_first_then_id() -> None:
    assert P(0, 999) < P(1, 0)
    assert P(1, 0) > P(0, 999)
    assert sorted([P(2, 1), P(1, 5), P(1, 2), P(0, 9)]) == [P(0, 9), P(1, 2), P(1, 5), P(2, 1)]


def test_ties_on_pos_are_ordered_by_id() -> None:
    a, b, c = P(0, -5), P(0, 3), P(0, 4)
    assert a < b < c
    assert not b < b
    assert b <= b
    assert P(0, 3) == b
    assert P(0, 3) != c
    assert max([c, a, b]) == c


def test_ordering_compares_microseconds() -> None:
    assert Position(T0.replace(microsecond=1), MIN_ID) > Position(T0, 2**63 - 1)


def test_zero_sorts_before_every_position() -> None:
    zero = Position.zero()
    assert zero == Position(ZERO_TS, MIN_ID)
    assert zero.is_zero()
    assert not P(0, 0).is_zero()
    for p in (
        Position(ZERO_TS, MIN_ID + 1),
        Position(ZERO_TS, 0),
        Position(ZERO_TS + dt.timedelta(microseconds=1), MIN_ID),
        P(0, MIN_ID),
        P(0, -1),
        Position(dt.datetime(9999, 12, 31, 23, 59, 59), 2**63 - 1),
    ):
        assert zero < p, p
    assert sorted([P(0, 1), zero, Position(ZERO_TS, 0)])[0] == zero


def test_zero_sorts_before_rows_before_1970() -> None:
    assert Position.zero() < Position(dt.datetime(1969, 12, 31, 23, 59, 59), 1)


def test_position_is_hashable_and_frozen() -> None:
    p = P(0, 1)
    assert {p, P(0, 1), P(0, 2)} == {P(0, 1), P(0, 2)}
    with pytest.raises(AttributeError):
        p.id = 2  # type: ignore[misc]


# --- time zones --------------------------------------------------------------------------------


def test_aware_datetimes_are_normalised_to_naive_utc() -> None:
    plus2 = dt.timezone(dt.timedelta(hours=2))
    p = Position(dt.datetime(2026, 1, 31, 14, 0, tzinfo=plus2), 7)
    assert p.pos == dt.datetime(2026, 1, 31, 12, 0)
    assert p.pos.tzinfo is None
    assert p == Position(T0, 7)
    assert Position(T0.replace(tzinfo=dt.UTC), 7) == Position(T0, 7)


def test_aware_and_naive_positions_compare() -> None:
    minus5 = dt.timezone(dt.timedelta(hours=-5))
    # 07:00-05:00 is 12:00 UTC: the same instant as T0, so ties fall back on id
    assert Position(dt.datetime(2026, 1, 31, 7, 0, tzinfo=minus5), 1) < Position(T0, 2)
    assert Position(dt.datetime(2026, 1, 31, 7, 1, tzinfo=minus5), 1) > Position(T0, 2)


def test_to_naive_utc_keeps_naive_values() -> None:
    assert to_naive_utc(T0) is T0
    assert to_naive_utc(
        dt.datetime(2026, 6, 1, 3, 0, tzinfo=dt.timezone(dt.timedelta(hours=5)))
    ) == dt.datetime(2026, 5, 31, 22, 0)


def test_format_ts_has_microseconds_and_no_zone() -> None:
    assert format_ts(T0) == "2026-01-31T12:00:00.000000"
    assert format_ts(T0.replace(microsecond=42)) == "2026-01-31T12:00:00.000042"
    assert (
        format_ts(T0.replace(hour=13, tzinfo=dt.timezone(dt.timedelta(hours=1))))
        == "2026-01-31T12:00:00.000000"
    )


def test_parse_ts_accepts_space_and_z() -> None:
    assert parse_ts("2026-01-31 12:00:00") == T0
    assert parse_ts(" 2026-01-31T12:00:00Z ") == T0
    assert parse_ts("2026-01-31T14:00:00+02:00") == T0
    assert parse_ts("2026-01-31") == dt.datetime(2026, 1, 31)


# --- text form ---------------------------------------------------------------------------------


def test_str_and_to_text() -> None:
    p = Position(T0.replace(microsecond=123456), 42)
    assert p.to_text() == "2026-01-31T12:00:00.123456/42"
    assert str(p) == "(2026-01-31T12:00:00.123456, 42)"


def test_zero_shows_as_start_and_parses_back() -> None:
    assert str(Position.zero()) == "start"
    assert Position.parse(str(Position.zero())) == Position.zero()
    assert Position.zero().to_text() == "0001-01-01T00:00:00.000000/-9223372036854775808"  # stored form unchanged


def test_label_is_to_text_except_start() -> None:
    p = Position(T0.replace(microsecond=123456), 42)
    assert p.label() == p.to_text() == "2026-01-31T12:00:00.123456/42"
    assert Position.zero().label() == "start"
    assert Position.parse(Position.zero().label()) == Position.zero()
    assert Position.parse(p.label()) == p


@pytest.mark.parametrize(
    "p",
    [
        Position(T0, 0),
        Position(T0.replace(microsecond=123456), 42),
        Position(T0.replace(microsecond=1), -7),
        Position(T0, MIN_ID),
        Position(T0, 2**63 - 1),
        Position.zero(),
    ],
    ids=["plain", "micros", "negative-id", "min-id", "max-id", "zero"],
)
def test_to_text_parse_round_trip(p: Position) -> None:
    back = Position.parse(p.to_text())
    assert back == p
    assert back.pos == p.pos
    assert back.id == p.id


@pytest.mark.parametrize("text", ["zero", "start", "0", "  zero  "])
def test_parse_zero_aliases(text: str) -> None:
    assert Position.parse(text) == Position.zero()
    assert Position.parse(text).is_zero()


def test_parse_negative_id() -> None:
    assert Position.parse("2026-01-31T12:00:00/-42") == Position(T0, -42)


def test_parse_bare_timestamp_is_lowest_id_at_that_instant() -> None:
    p = Position.parse("2026-01-31T12:00:00")
    assert p == Position(T0, MIN_ID)
    # before every row at that instant, after every row of the previous microsecond
    assert p < Position(T0, MIN_ID + 1)
    assert p < Position(T0, 0)
    assert p > Position(T0 - dt.timedelta(microseconds=1), 2**63 - 1)


def test_parse_accepts_space_separator_and_zone() -> None:
    assert Position.parse("2026-01-31 12:00:00.5/3") == Position(T0.replace(microsecond=500000), 3)
    assert Position.parse("2026-01-31T14:00:00+02:00/3") == Position(T0, 3)
    assert Position.parse("2026-01-31T12:00:00Z/3") == Position(T0, 3)


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("yesterday", "yesterday"),
        ("2026-13-01T00:00:00/1", "2026-13-01T00:00:00"),
        ("2026-01-31T12:00:00/abc", "abc"),
        ("2026-01-31T12:00:00/1.5", "1.5"),
        ("2026-01-31T12:00:00/", "2026-01-31T12:00:00/"),
        ("", "''"),
    ],
)
def test_parse_errors_are_tidemark_errors_naming_the_text(text: str, bad: str) -> None:
    with pytest.raises(TidemarkError) as exc:
        Position.parse(text)
    msg = str(exc.value)
    assert bad in msg
    assert msg.startswith("position:")


def test_parse_error_for_bad_timestamp_says_what_is_expected() -> None:
    with pytest.raises(
        TidemarkError, match=r"cannot parse 'nope' as a timestamp \(expected e\.g\. 2026-01-31T12:00:00\)"
    ):
        Position.parse("nope")


def test_parse_error_for_bad_id_says_not_an_integer() -> None:
    with pytest.raises(TidemarkError, match=r"id 'x' in '2026-01-31T12:00:00/x' is not an integer"):
        Position.parse("2026-01-31T12:00:00/x")


# --- blocks ----------------------------------------------------------------------------------


def test_block_keeps_its_fields() -> None:
    b = Block("fact.x", 3, P(0, 1), P(10, 2))
    assert (b.topic, b.seq, b.last, b.next) == ("fact.x", 3, P(0, 1), P(10, 2))


def test_block_rejects_last_equal_to_next() -> None:
    with pytest.raises(TidemarkError) as exc:
        Block("fact.x", 4, P(0, 1), P(0, 1))
    msg = str(exc.value)
    assert "block 4 of 'fact.x'" in msg
    assert "is not before next" in msg


@pytest.mark.parametrize(
    ("last", "nxt"), [(P(5, 0), P(0, 0)), (P(0, 2), P(0, 1))], ids=["later-pos", "tie-larger-id"]
)
def test_block_rejects_last_after_next(last: Position, nxt: Position) -> None:
    with pytest.raises(TidemarkError, match="block 1 of 'fact.y'"):
        Block("fact.y", 1, last, nxt)


def test_block_accepts_tie_with_larger_next_id() -> None:
    b = Block("fact.x", 1, P(0, 1), P(0, 2))
    assert b.contains(P(0, 2))
    assert not b.contains(P(0, 1))


def test_block_contains_is_half_open_last_excluded_next_included() -> None:
    b = Block("fact.x", 1, P(0, 10), P(60, 20))
    assert not b.contains(P(0, 10))  # last: already processed
    assert b.contains(P(0, 11))  # same instant, later id
    assert b.contains(P(30, MIN_ID))
    assert b.contains(P(60, 20))  # next: included
    assert not b.contains(P(60, 21))  # same instant as next, later id
    assert not b.contains(P(0, 9))
    assert not b.contains(P(61, 0))


def test_consecutive_blocks_cover_each_position_exactly_once() -> None:
    bounds = [Position.zero(), P(0, 5), P(0, 9), P(10, 0), P(20, 3)]
    blocks = [Block("fact.x", i + 1, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
    rows = [P(s, i) for s in (0, 10, 20) for i in range(0, 10)]
    for row in rows:
        n = sum(b.contains(row) for b in blocks)
        expected = 1 if row <= bounds[-1] else 0
        assert n == expected, row


def test_block_from_zero() -> None:
    b = Block("fact.x", 1, Position.zero(), P(0, 0))
    assert b.contains(Position(ZERO_TS, 0))
    assert not b.contains(Position.zero())
