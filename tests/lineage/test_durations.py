"""Durations as written in the lineage: ``30s``, ``5m``, ``1h30m``, ``2d``, ``0``."""

from __future__ import annotations

import datetime as dt

import pytest

from lineage.core.durations import format_duration, parse_duration

S = dt.timedelta(seconds=1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", 30 * S),
        ("5m", 300 * S),
        ("1h", 3600 * S),
        ("1h30m", 5400 * S),
        ("2d", 2 * 86400 * S),
        ("1w", 7 * 86400 * S),
        ("500ms", dt.timedelta(milliseconds=500)),
        ("1m500ms", dt.timedelta(seconds=60, milliseconds=500)),
        ("1d2h3m4s", dt.timedelta(days=1, hours=2, minutes=3, seconds=4)),
        ("1.5h", 5400 * S),
        ("0.5s", dt.timedelta(milliseconds=500)),
        ("0s", dt.timedelta(0)),
        ("0", dt.timedelta(0)),
        ("", dt.timedelta(0)),
        ("   ", dt.timedelta(0)),
        ("90", 90 * S),
        ("2.5", dt.timedelta(seconds=2.5)),
    ],
)
def test_parses_text(text: str, expected: dt.timedelta) -> None:
    assert parse_duration(text) == expected


def test_none_is_no_duration() -> None:
    assert parse_duration(None) == dt.timedelta(0)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, dt.timedelta(0)), (45, 45 * S), (1.5, dt.timedelta(seconds=1.5)), (0.0, dt.timedelta(0))],
)
def test_numbers_are_seconds(value: float, expected: dt.timedelta) -> None:
    assert parse_duration(value) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (" 30s ", 30 * S),
        ("1h 30m", 5400 * S),
        ("1 h 30 m", 5400 * S),
        ("30S", 30 * S),
        ("1H30M", 5400 * S),
        ("2D", 2 * 86400 * S),
        ("500MS", dt.timedelta(milliseconds=500)),
    ],
)
def test_spaces_and_upper_case(text: str, expected: dt.timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["5x", "-1", "-5m", "m5", "1h 30", "h", "1.2.3s", "30sec", "1h30", "abc"])
def test_rejects_bad_text_showing_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_duration(text)
    msg = str(exc.value)
    assert repr(text) in msg
    assert "is not a duration" in msg
    assert "30s, 5m, 1h30m, 2d" in msg
    assert "units ms s m h d w" in msg


@pytest.mark.parametrize("value", [-1, -0.5])
def test_rejects_negative_numbers(value: float) -> None:
    with pytest.raises(ValueError, match="is negative; durations are >= 0"):
        parse_duration(value)


@pytest.mark.parametrize("value", [True, False])
def test_rejects_booleans(value: bool) -> None:
    # YAML turns `delay: yes` into True; that must not silently mean 1 second
    with pytest.raises(ValueError) as exc:
        parse_duration(value)
    assert f"{value!r} is not a duration" in str(exc.value)
    assert "30s, 5m, 1h30m, 2d" in str(exc.value)


@pytest.mark.parametrize("value", ["1000000000d", float("inf"), 1e20])
def test_out_of_range_duration_is_a_value_error(value: str | float) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (dt.timedelta(0), "0"),
        (30 * S, "30s"),
        (300 * S, "5m"),
        (5400 * S, "1h30m"),
        (2 * 86400 * S, "2d"),
        (dt.timedelta(days=1, hours=2, minutes=3, seconds=4), "1d2h3m4s"),
        (dt.timedelta(days=1, seconds=5), "1d5s"),
        (7 * 86400 * S, "7d"),
    ],
)
def test_format_duration(value: dt.timedelta, text: str) -> None:
    assert format_duration(value) == text
    assert parse_duration(text) == value


@pytest.mark.parametrize("text", ["30s", "5m", "1h30m", "2d", "1w", "0", "90", "1h0m5s", "25h"])
def test_parse_format_round_trip(text: str) -> None:
    value = parse_duration(text)
    assert parse_duration(format_duration(value)) == value


def test_format_duration_drops_fractions_of_a_second() -> None:
    assert format_duration(dt.timedelta(seconds=61, milliseconds=500)) == "1m1s"
    assert format_duration(dt.timedelta(milliseconds=500)) == "0"


def test_format_size_reads_as_people_read_bytes() -> None:
    from lineage.core.durations import format_size

    assert [format_size(n) for n in (0, 1023, 1024, 396 * 2**20, 5 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "396.0 MiB", "5120.0 GiB"]
