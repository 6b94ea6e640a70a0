"""The pgoutput decoder, the type mapping and the table selection, without a server (the server
tests in test_pg_cdc.py run the same code on real streams)."""

from __future__ import annotations

import datetime as dt
import fnmatch
import re
import struct
from decimal import Decimal

import pytest

from lineage.cdc.changes import Op, RowChange
from resources.cdc.pgoutput import (
    DecodeError,
    Decoder,
    Selection,
    column_of,
    glob_regex,
    numeric_type,
    parse_text,
)


@pytest.mark.parametrize("pattern", ["public.order_*", "s.t?", "s.[ab]x", "s.[!a]x", "a.b.c*", "s.x+y", "s.[]]"])
def test_glob_regex_matches_like_fnmatch(pattern: str) -> None:
    names = ["public.order_1", "public.orders", "s.t1", "s.tt1", "s.ax", "s.bx", "s.cx", "a.b.cd", "a.bxcd", "s.x+y",
             "s.xxy", "s.]", "s.a"]
    regex = glob_regex([pattern])
    assert regex is not None
    assert [n for n in names if re.match(regex, n)] == [n for n in names if fnmatch.fnmatchcase(n, pattern)]


def test_selection_defaults_to_public_and_never_takes_tidemark() -> None:
    sel = Selection(("customers", "*.order_*"), ("*.order_tmp*",))
    assert [t for t in ("public.customers", "x.customers", "s.order_1", "s.order_tmp1", "tidemark.order_1") if sel(t)] \
        == ["public.customers", "s.order_1"]
    assert not Selection(())("public.customers")


@pytest.mark.parametrize(("p", "s", "spark"), [(12, 2, "decimal(12,2)"), (5, -2, "decimal(7,0)"), (2, 5, "decimal(5,5)"),
                                               (38, 0, "decimal(38,0)"), (40, 2, "string")])
def test_numeric_types(p: int, s: int, spark: str) -> None:
    assert numeric_type(((p << 16) | (s & 0x7FF)) + 4) == spark


def test_special_values() -> None:
    ts, date, by = column_of("t", 1184, -1), column_of("d", 1082, -1), column_of("b", 17, -1)
    assert parse_text(ts, "infinity") == dt.datetime.max and parse_text(date, "-infinity") == dt.date.min
    assert parse_text(ts, "2024-06-01 23:30:00+00") == dt.datetime(2024, 6, 1, 23, 30)
    with pytest.raises(ValueError, match="before year 1"):
        parse_text(date, "0044-03-15 BC")
    with pytest.raises(ValueError, match="bytea_output=hex"):
        parse_text(by, "abc")


def _tuple(*values: bytes | None | str) -> bytes:
    out = struct.pack("!H", len(values))
    for v in values:
        out += b"n" if v is None else b"u" if v == "u" else b"t" + struct.pack("!I", len(v)) + v  # type: ignore[arg-type, operator]
    return out


def test_decoder_reads_a_transaction() -> None:
    dec = Decoder(Selection(("s.*",)), "tidemark.x_ddl")
    dec.feed(b"B" + struct.pack("!QqI", 100, 0, 7))
    dec.feed(b"R" + struct.pack("!I", 1) + b"s\0t\0d" + struct.pack("!H", 3)
             + b"\x01id\0" + struct.pack("!Ii", 23, -1) + b"\x00body\0" + struct.pack("!Ii", 25, -1)
             + b"\x00n\0" + struct.pack("!Ii", 1700, ((10 << 16) | 2) + 4))
    dec.feed(b"U" + struct.pack("!I", 1) + b"K" + _tuple(b"1", None, None) + b"N" + _tuple(b"2", "u", b"1.50"))
    tx = dec.feed(b"C" + struct.pack("!BQQq", 0, 100, 120, 86_400_000_000))
    assert tx is not None and (tx.xid, tx.lsn, tx.end_lsn, tx.commit_time) == (7, 100, 120, dt.datetime(2000, 1, 2))
    assert tx.changes == (RowChange("s.t", Op.UPDATE, after={"id": 2, "n": Decimal("1.50")}, before={"id": 1},
                                    unchanged=frozenset({"body"})),)
    with pytest.raises(DecodeError, match="before its Relation"):
        dec.feed(b"B" + struct.pack("!QqI", 200, 0, 8))
        dec.feed(b"I" + struct.pack("!I", 2) + b"N" + _tuple(b"1"))
    with pytest.raises(DecodeError, match="unknown pgoutput message"):
        dec.feed(b"S")
