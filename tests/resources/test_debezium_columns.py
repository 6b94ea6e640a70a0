"""The columnar read of the Debezium file source gives read()'s answer exactly, as one Arrow table,
or None (the caller then calls read()) wherever it could not."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from lineage.cdc.changes import Op, RowChange, TableSchema, Transaction
from lineage.cdc.columns import arrow_type
from resources.cdc import debezium as debezium_source
from resources.cdc.debezium import ColumnRead, DebeziumFileSource, DebeziumFormatError, position

MICRO = "io.debezium.time.MicroTimestamp"
DATE = "io.debezium.time.Date"
#: the test tables: column -> (Connect type, logical name); key columns
TABLES: dict[str, tuple[dict[str, tuple[str, str | None]], tuple[str, ...]]] = {
    "public.a": ({"id": ("int64", None), "name": ("string", None), "amount": ("float64", None),
                  "at": ("int64", MICRO), "day": ("int32", DATE), "flag": ("boolean", None)}, ("id",)),
    "public.b": ({"k1": ("string", None), "k2": ("int32", None), "note": ("string", None)}, ("k1", "k2")),
    "inv.c": ({"id": ("int64", None), "qty": ("int16", None)}, ("id",)),
    "other.z": ({"id": ("int64", None), "junk": ("string", None)}, ("id",)),  # not selected
}


def selects(table: str) -> bool:
    return not table.startswith("other.")


def envelope(table: str) -> dict[str, Any]:
    fields = [{"field": n, "type": t, **({"name": name} if name else {})} for n, (t, name) in TABLES[table][0].items()]
    return {"type": "struct", "fields": [{"field": "before", "type": "struct", "fields": fields},
                                         {"field": "after", "type": "struct", "fields": fields}]}


def event(table: str, op: str, *, after: dict[str, Any] | None, before: dict[str, Any] | None, key: dict[str, Any],
          tx: int | str | None, ts: int, tx_in: str = "source", with_schema: bool = True) -> str:
    schema, name = table.split(".")
    source: dict[str, Any] = {"connector": "postgresql", "schema": schema, "table": name, "ts_ms": ts - 5}
    payload: dict[str, Any] = {"op": op, "before": before, "after": after, "ts_ms": ts, "source": source}
    if tx is not None and tx_in == "source":
        source["txId"] = tx
    elif tx is not None:
        payload["transaction"] = {"id": str(tx), "total_order": 1}
    value: dict[str, Any] = {"payload": payload}
    if with_schema:
        value["schema"] = envelope(table)
    return json.dumps({"key": key, "value": value}) + "\n"


def tombstone(key: dict[str, Any]) -> str:
    return json.dumps({"key": key, "value": None}) + "\n"


def random_row(rng: random.Random, table: str, key: dict[str, Any], *, partial: bool = True) -> dict[str, Any]:
    row = dict(key)
    for col, (t, name) in TABLES[table][0].items():
        if col in key:
            continue
        if rng.random() < 0.1:
            row[col] = None
        elif name == MICRO:
            row[col] = rng.choice([rng.randrange(10**12, 2 * 10**12), rng.randrange(10**15, 2 * 10**15)])
        elif name == DATE:
            row[col] = rng.randrange(-1000, 30000)
        elif t == "string":
            row[col] = rng.choice(["x", "ü", "", "a\"b", "{}", f"s{rng.randrange(100)}"])
        elif t == "float64":
            row[col] = rng.choice([rng.random() * 100, 3, -0.0])
        elif t == "boolean":
            row[col] = rng.random() < 0.5
        else:
            row[col] = rng.randrange(-1000, 1000)
    if partial and rng.random() < 0.2:  # an after-image that lacks a column (an UPDATE's: see test_none_for_an_update_without_every_column)
        row.pop(rng.choice([c for c in TABLES[table][0] if c not in key]), None)
    return row


def random_key(rng: random.Random, table: str) -> dict[str, Any]:
    if table == "public.b":
        return {"k1": rng.choice("pqr"), "k2": rng.randrange(5)}
    return {"id": rng.randrange(50)}


def random_lines(rng: random.Random, n: int) -> list[str]:
    lines: list[str] = []
    tx, ts = 100, 1_700_000_000_000
    for _ in range(3):  # the snapshot: op r without txId
        t = rng.choice(["public.a", "public.b", "inv.c"])
        k = random_key(rng, t)
        lines.append(event(t, "r", after=random_row(rng, t, k), before=None, key=k, tx=None, ts=ts))
    while len(lines) < n:
        tx += 1
        ts += rng.randrange(0, 3000)
        txid: int | None = None if rng.random() < 0.15 else tx
        tx_in = rng.choice(["source", "source", "transaction"])
        for _ in range(rng.randrange(1, 10)):
            t = rng.choice(["public.a", "public.b", "inv.c", "other.z"])
            k = random_key(rng, t)
            op = rng.choice("cuuud")
            if op == "d":
                before = dict(k) if rng.random() < 0.5 else random_row(rng, t, k)
                lines.append(event(t, "d", after=None, before=before, key=k, tx=txid, ts=ts, tx_in=tx_in))
                if rng.random() < 0.5:
                    lines.append(tombstone(k))
            elif op == "u":
                new = random_key(rng, t) if rng.random() < 0.3 else k  # a key-changing update
                before = None if rng.random() < 0.4 else dict(k)
                lines.append(event(t, "u", after=random_row(rng, t, new, partial=False), before=before, key=new, tx=txid, ts=ts,
                                   tx_in=tx_in))
            else:
                lines.append(event(t, "c", after=random_row(rng, t, k), before=None, key=k, tx=txid, ts=ts,
                                   tx_in=tx_in))
            if txid is None:
                ts += 1
    return lines


def write(root: Path, files: list[list[str]]) -> None:
    for i, lines in enumerate(files):
        (root / f"{i:04d}.json").write_text("".join(lines))


def flatten(src: DebeziumFileSource, after: int, *, upto: int | None, max_changes: int,
            wanted_after: Mapping[str, int | None]) -> ColumnRead:
    """read()'s answer flattened, in Python, into read_columns' columns."""
    positions: list[int] = []

    def wanted(t: str, pos: int) -> bool:
        p = wanted_after[t]
        if p is not None and pos > p:
            positions.append(pos)
            return True
        return False

    schemas = src.tables()
    txs = src.read(after, upto=upto, max_changes=max_changes, wanted=wanted)
    return ColumnRead(frame_from(txs, schemas, positions), len(txs), txs[-1].lsn if txs else 0)


def frame_from(txs: Sequence[Transaction], schemas: Mapping[str, TableSchema], positions: Sequence[int], *,
               only: str | None = None) -> pa.Table:
    """Transactions of row changes (read()'s answer) flattened, in Python, into read_columns' frame;
    ``positions``: each change's ``_tm_pos``. ``only``: that table's part (with ``_tm_row``)."""
    rows: list[dict[str, Any]] = []
    for n, tx in enumerate(txs):
        for ch in tx.changes:
            assert isinstance(ch, RowChange)
            rows.append({"_tm_row": len(rows), "_tm_lsn": tx.lsn, "_tm_time": tx.commit_time, "_tm_tx": n,
                         "_tm_table": ch.table, "_tm_op": ch.op.value, "after": ch.after, "before": ch.before})
    assert len(rows) == len(positions)
    if only is not None:
        positions = [p for p, r in zip(positions, rows, strict=True) if r["_tm_table"] == only]
        rows = [r for r in rows if r["_tm_table"] == only]
    in_frame = list(dict.fromkeys(r["_tm_table"] for r in rows))
    types = {c.name: c.type for t in in_frame for c in schemas[t].columns}
    keys = list(dict.fromkeys(k for t in in_frame for k in schemas[t].key))
    cols: dict[str, pa.Array] = {
        **({"_tm_row": pa.array([r["_tm_row"] for r in rows], pa.int64())} if only is not None else {}),
        "_tm_pos": pa.array(positions, pa.int64()), "_tm_lsn": pa.array([r["_tm_lsn"] for r in rows], pa.int64()),
        "_tm_time": pa.array([r["_tm_time"] for r in rows], pa.timestamp("us")),
        "_tm_tx": pa.array([r["_tm_tx"] for r in rows], pa.int64()),
        "_tm_table": pa.array([r["_tm_table"] for r in rows], pa.string()),
        "_tm_op": pa.array([r["_tm_op"] for r in rows], pa.string())}
    for name, t in types.items():
        cols[name] = pa.array([(r["after"] or {}).get(name) for r in rows], arrow_type(t))
    for k in keys:
        cols[f"_tm_before_{k}"] = pa.array([(r["before"] or {}).get(k) if k in schemas[r["_tm_table"]].key else None
                                            for r in rows], arrow_type(types[k]))
    cols["_tm_has_before"] = pa.array([r["before"] is not None for r in rows], pa.bool_())
    return pa.table(cols)


def same(src: DebeziumFileSource, after: int = 0, *, upto: int | None = None, max_changes: int = 100_000,
         wanted_after: Mapping[str, int | None]) -> ColumnRead:
    got = src.read_columns(after, upto=upto, max_changes=max_changes, wanted_after=wanted_after)
    assert got is not None
    want = flatten(src, after, upto=upto, max_changes=max_changes, wanted_after=wanted_after)
    assert (got.transactions, got.lsn) == (want.transactions, want.lsn)
    assert got.frame.num_rows == want.frame.num_rows
    if want.frame.num_rows:
        assert sorted(got.frame.column_names) == sorted(want.frame.column_names)
        for name in want.frame.column_names:
            a, b = got.frame.column(name), want.frame.column(name)
            assert a.type == b.type, name
            assert a.to_pylist() == b.to_pylist(), name
    return got


@pytest.mark.parametrize("batch", [50_000, 5])
def test_random_histories_read_like_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int) -> None:
    """(Also with the lines parsed 5 at a time, at least a little more than max_changes.)"""
    monkeypatch.setattr(debezium_source, "BATCH_LINES", batch)
    rng = random.Random(7)
    lines = random_lines(rng, 900)
    write(tmp_path, [lines[:300], lines[300:310], lines[310:]])
    src = DebeziumFileSource(tmp_path, name="t", selects=selects)
    assert set(src.tables()) == {"public.a", "public.b", "inv.c"}
    assert src.tables()["public.a"].column("at").type == "timestamp"  # type: ignore[union-attr]
    seen_rows = 0
    for _ in range(60):
        f = rng.randrange(3)
        after = position(f, rng.randrange(0, 320)) if rng.random() < 0.8 else 0
        upto = position(rng.randrange(f, 3), rng.randrange(1, 600)) if rng.random() < 0.3 else None
        max_changes = rng.choice([0, 1, 3, 7, 40, 100_000])
        wanted_after = {t: rng.choice([None, 0, after, position(1, 5), position(2, 100)])
                        for t in ("public.a", "public.b", "inv.c")}
        seen_rows += same(src, after, upto=upto, max_changes=max_changes, wanted_after=wanted_after).frame.num_rows
    assert seen_rows > 1000


def test_partly_written_last_line_is_not_read(tmp_path: Path) -> None:
    lines = random_lines(random.Random(3), 50)
    (tmp_path / "0000.json").write_text("".join(lines) + lines[0][:40])
    (tmp_path / "0001.json.tmp").write_text("not json\n")
    src = DebeziumFileSource(tmp_path, name="t", selects=selects)
    wanted = dict.fromkeys(("public.a", "public.b", "inv.c"), 0)
    assert same(src, 0, wanted_after=wanted).frame.num_rows > 10
    assert same(src, position(0, 20), max_changes=5, wanted_after=wanted).frame.num_rows >= 5


def test_the_benchmark_shape(tmp_path: Path) -> None:
    from bench.cdc_apply import make_events, write_debezium

    write_debezium(make_events(5_000, 20_000, 1), tmp_path / "0001.json")
    src = DebeziumFileSource(tmp_path, name="t", selects=lambda t: True)
    got = same(src, 0, wanted_after={"public.items": 0})
    assert got.frame.num_rows == 20_000 and got.frame.column("_tm_tx").to_pylist()[-1] == got.transactions - 1
    same(src, position(0, 777), max_changes=1000, wanted_after={"public.items": position(0, 900)})


def test_record_value_without_envelope(tmp_path: Path) -> None:
    """``{"key": .., "value": {payload}}`` (schemas.enable=false)."""
    lines = [json.dumps({"key": {"id": i}, "value": {"op": "c", "after": {"id": i, "x": f"v{i}"}, "ts_ms": 5 + i,
                                                    "source": {"schema": "s", "table": "t", "txId": i // 3}}}) + "\n"
             for i in range(20)]
    write(tmp_path, [lines])
    src = DebeziumFileSource(tmp_path, name="t", selects=lambda t: True)
    assert same(src, 0, max_changes=4, wanted_after={"s.t": 0}).transactions == 2


def test_a_column_added_in_the_range_is_read_change_by_change_then_a_column_of_the_frame(tmp_path: Path) -> None:
    """The UPDATEs before a column appears lack it, and read() carries it from the row's earlier state:
    from before the column appeared, None; from where it did, a column of the frame."""
    k = {"id": 1}
    upd = lambda qty, tx, **extra: event("inv.c", "u", after={"id": 1, "qty": qty, **extra}, before=None, key=k, tx=tx,  # noqa: E731
                                         ts=10 + tx, with_schema=False)
    write(tmp_path, [[event("inv.c", "c", after={"id": 1, "qty": 2}, before=None, key=k, tx=1, ts=10, with_schema=False),
                      upd(3, 2), upd(3, 3, extra="new"), upd(4, 4, extra="newer")]])
    src = DebeziumFileSource(tmp_path, name="t", selects=lambda t: True)
    assert src.read_columns(0, wanted_after={"inv.c": 0}) is None
    got = same(src, position(0, 3), wanted_after={"inv.c": 0})
    assert got.frame.column("extra").to_pylist() == ["newer"]


def test_columns_first_seen_after_a_delete_are_columns_of_the_frame(tmp_path: Path) -> None:
    """A first DELETE (its before-image only the key) teaches the key alone; the INSERTs and UPDATEs
    after it bring the other columns, and no UPDATE lacked them: the frame holds them."""
    k = {"id": 1}
    write(tmp_path, [[event("inv.c", "d", after=None, before=k, key=k, tx=1, ts=10, with_schema=False),
                      event("inv.c", "c", after={"id": 1, "qty": 2}, before=None, key=k, tx=2, ts=11, with_schema=False),
                      event("inv.c", "u", after={"id": 1, "qty": 3}, before=None, key=k, tx=3, ts=12, with_schema=False)]])
    src = DebeziumFileSource(tmp_path, name="t", selects=lambda t: True)
    assert same(src, 0, wanted_after={"inv.c": 0}).frame.column("qty").to_pylist() == [None, 2, 3]


def test_none_for_an_update_without_every_column(tmp_path: Path) -> None:
    """read() carries a column an UPDATE's after-image lacks from the row's earlier state; Arrow's null
    cannot say so. Reads starting after that UPDATE are columns again."""
    k = {"id": 1}
    lines = [event("inv.c", "c", after={"id": 1, "qty": 2}, before=None, key=k, tx=1, ts=10, with_schema=False),
             event("inv.c", "u", after={"id": 1}, before=None, key=k, tx=2, ts=11, with_schema=False),
             event("inv.c", "u", after={"id": 1, "qty": 5}, before=None, key=k, tx=3, ts=12, with_schema=False)]
    write(tmp_path, [lines])
    src = DebeziumFileSource(tmp_path, name="t", selects=lambda t: True)
    src.tables()
    assert src.read_columns(0, wanted_after={"inv.c": 0}) is None
    assert src.read(0)[1].changes[0].after == {"id": 1}  # type: ignore[union-attr]
    assert same(src, position(0, 2), wanted_after={"inv.c": 0}).frame.column("qty").to_pylist() == [5]


# ------------------------------------------------------------------ None: the caller reads with read()
def none_case(tmp_path: Path, lines: list[str], wanted_after: Mapping[str, int | None] | None = None) -> DebeziumFileSource:
    write(tmp_path, [lines])
    src = DebeziumFileSource(tmp_path, name="t", selects=selects)
    try:
        src.tables()
    except DebeziumFormatError:
        pass
    assert src.read_columns(0, wanted_after=wanted_after or {"public.a": 0, "public.b": 0, "inv.c": 0}) is None
    return src


def good(i: int = 1, **row: Any) -> str:
    return event("inv.c", "c", after={"id": i, "qty": 1, **row}, before=None, key={"id": i}, tx=i, ts=10)


@pytest.mark.parametrize("bad", ["{not json\n", '{"key": {"id": 1}, "value": {"payload": {"op": "x"}}}\n',
                                 '{"key": {"id": 1}, "value": {"payload": {"after": {}}}}\n',
                                 '{"key": {"id": 1}}\n', '{"key": {"id": 1}, "value": {"payload": null}}\n',
                                 '{"key": {"id": 1}, "value": {"payload": {"op": "c", "ts_ms": NaN}}}\n',
                                 good(3)[:-3] + ', "skipped": -Infinity}}\n', good(4).replace('"c"', '"c\xff"', 1)])
def test_none_where_read_raises(tmp_path: Path, bad: str) -> None:
    """Also where Arrow's parser is laxer than orjson (NaN, Infinity, invalid UTF-8 in a skipped field):
    tables(), called first, parses every line with orjson and raises."""
    (tmp_path / "0000.json").write_bytes((good(1) + bad + good(2)).encode("utf-8", "surrogateescape")
                                         .replace("\xff".encode(), b"\xff"))
    src = DebeziumFileSource(tmp_path, name="t", selects=selects)
    with pytest.raises(DebeziumFormatError):
        src.read(0)
    assert src.read_columns(0, wanted_after={"inv.c": 0}) is None


@pytest.mark.parametrize("blank", ["\n", "   \n", "\t\r\n"])
def test_none_for_a_blank_line(tmp_path: Path, blank: str) -> None:
    src = none_case(tmp_path, [good(1), blank, good(2)])
    assert [t.changes[0].after for t in src.read(0)] == [{"id": 1, "qty": 1}, {"id": 2, "qty": 1}]  # type: ignore[union-attr]


def test_none_for_an_unchanged_toast_value(tmp_path: Path) -> None:
    line = event("public.b", "u", after={"k1": "p", "k2": 1, "note": "__debezium_unavailable_value"}, before=None,
                 key={"k1": "p", "k2": 1}, tx=2, ts=10)
    src = none_case(tmp_path, [good(1), line])
    assert src.read(0)[1].changes[0].unchanged == {"note"}  # type: ignore[union-attr]


def test_none_for_a_truncate(tmp_path: Path) -> None:
    line = json.dumps({"key": None, "value": {"payload": {"op": "t", "ts_ms": 11, "source": {
        "schema": "inv", "table": "c", "txId": 9}}}}) + "\n"
    src = none_case(tmp_path, [good(1), line])
    assert src.read(0)[1].changes[0].op is Op.TRUNCATE  # type: ignore[union-attr]


def test_none_for_a_value_of_another_type(tmp_path: Path) -> None:
    src = none_case(tmp_path, [good(1), good(2, qty="many")])
    assert src.read(0)[1].changes[0].after == {"id": 2, "qty": "many"}  # type: ignore[union-attr]


def test_none_for_an_iso_timestamp(tmp_path: Path) -> None:
    k = {"id": 1}
    row = random_row(random.Random(1), "public.a", k) | {"at": "2024-01-02T03:04:05Z"}
    src = none_case(tmp_path, [event("public.a", "c", after=row, before=None, key=k, tx=1, ts=10)])
    assert src.read(0)[0].changes[0].after["at"].year == 2024  # type: ignore[union-attr, index]


@pytest.mark.parametrize("connect", [{"type": "bytes", "name": "org.apache.kafka.connect.data.Decimal",
                                      "parameters": {"scale": "2"}}, {"type": "bytes"}])
def test_none_for_decimal_and_binary_columns(tmp_path: Path, connect: dict[str, Any]) -> None:
    value = {"schema": {"fields": [{"field": "after", "fields": [{"field": "id", "type": "int64"},
                                                                 {"field": "m", **connect}]}]},
             "payload": {"op": "c", "after": {"id": 1, "m": "AQ=="}, "ts_ms": 1,
                         "source": {"schema": "inv", "table": "c", "txId": 1}}}
    src = none_case(tmp_path, [json.dumps({"key": {"id": 1}, "value": value}) + "\n"])
    assert src.read(0)[0].changes[0].after is not None  # type: ignore[union-attr]


def test_none_for_one_name_of_two_types(tmp_path: Path) -> None:
    other = event("public.b", "c", after={"k1": "p", "k2": 1, "qty": "text"}, before=None,
                  key={"k1": "p", "k2": 1}, tx=2, ts=10, with_schema=False)
    src = none_case(tmp_path, [good(1), other])
    assert len(src.read(0)) == 2


def test_none_for_a_table_without_key_or_a_new_table(tmp_path: Path) -> None:
    bare = json.dumps({"payload": {"op": "c", "after": {"id": 1}, "ts_ms": 1,
                                   "source": {"schema": "inv", "table": "c", "txId": 1}}}) + "\n"
    src = none_case(tmp_path, [bare])
    assert src.tables()["inv.c"].key == () and len(src.read(0)) == 1
    (tmp_path / "0000.json").write_text(good(1))
    src = DebeziumFileSource(tmp_path, name="t", selects=selects)
    assert src.read_columns(0, wanted_after={"public.a": 0}) is None  # inv.c is new to the caller
    assert src.read_columns(0, wanted_after={"inv.c": None}) is not None


def test_none_for_a_key_that_changed(tmp_path: Path) -> None:
    a = event("public.b", "c", after={"k1": "p", "k2": 1}, before=None, key={"k1": "p"}, tx=1, ts=1, with_schema=False)
    b = event("public.b", "c", after={"k1": "p", "k2": 2}, before=None, key={"k1": "p", "k2": 2}, tx=2, ts=2,
              with_schema=False)
    none_case(tmp_path, [a, b], {"public.b": 0})


def test_none_for_a_null_value_that_is_not_a_tombstone(tmp_path: Path) -> None:
    src = none_case(tmp_path, [good(1), '{"value": null, "key": {"id": 1}}\n'])
    assert len(src.read(0)) == 1


def test_none_for_a_commit_time_beyond_datetime(tmp_path: Path) -> None:
    (tmp_path / "0000.json").write_text(good(1) + good(2).replace('"ts_ms": 10,', '"ts_ms": 10000000000000000,'))
    src = DebeziumFileSource(tmp_path, name="t", selects=selects)
    assert src.read_columns(0, wanted_after={"inv.c": 0}) is None
    with pytest.raises(OverflowError):
        src.read(0)


def test_none_for_a_column_named_like_ours(tmp_path: Path) -> None:
    src = none_case(tmp_path, [good(1, _tm_pos=5)])
    assert src.read(0)[0].changes[0].after == {"id": 1, "qty": 1, "_tm_pos": 5}  # type: ignore[union-attr]


def test_many_small_files_and_a_transaction_across_files(tmp_path: Path) -> None:
    lines = random_lines(random.Random(11), 400)
    write(tmp_path, [lines[i:i + 13] for i in range(0, len(lines), 13)])
    src = DebeziumFileSource(tmp_path, name="t", selects=selects)
    wanted = dict.fromkeys(("public.a", "public.b", "inv.c"), 0)
    for max_changes in (1, 10, 50, 10**6):
        for after in (0, position(3, 4), position(7, 13)):
            same(src, after, max_changes=max_changes, wanted_after=wanted)


def test_none_for_before_image_without_key_values(tmp_path: Path) -> None:
    line = event("inv.c", "d", after=None, before={"id": None}, key={"id": 1}, tx=3, ts=1, with_schema=False)
    src = none_case(tmp_path, [good(1), line])
    assert src.read(0)[1].changes[0].before == {"id": None}  # type: ignore[union-attr]


def timing(events: int = 400_000) -> None:
    """read() against read_columns() on the benchmark's line format (print, no assert)."""
    import tempfile

    from bench.cdc_apply import make_events, write_debezium

    with tempfile.TemporaryDirectory() as d:
        write_debezium(make_events(2_000_000, events, 10), Path(d) / "0001.json")
        src = DebeziumFileSource(d, name="t", selects=lambda t: True)
        t0 = time.perf_counter()
        src.tables()
        t1 = time.perf_counter()
        cols = src.read_columns(0, max_changes=10**9, wanted_after={"public.items": 0})
        t2 = time.perf_counter()
        txs = src.read(0, max_changes=10**9, wanted=lambda t, pos: True)
        t3 = time.perf_counter()
        again = src.read_columns(0, max_changes=10**9, wanted_after={"public.items": 0})
        t4 = time.perf_counter()
        assert cols is not None and again is not None and cols.transactions == again.transactions == len(txs)
        print(f"{events} events: tables() {t1 - t0:.2f}s, read_columns() {t2 - t1:.2f}s (again, imports done: "
              f"{t4 - t3:.2f}s), read() {t3 - t2:.2f}s")


if __name__ == "__main__":
    timing()
