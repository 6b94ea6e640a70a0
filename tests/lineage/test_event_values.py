"""Nothing lost silently (issue 22): fields of one event that collide in a column, integers beyond
64 bits and non-finite numbers, from the request body to the typed rows; a property test that
rebuilds every event from its row and ``_unmapped_data``; and the same through real files and a
Delta stage table."""

from __future__ import annotations

import copy
import datetime as dt
import json
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from lineage.intake.bodies import BadRequest, dumps_exact, loads_exact, parse_body
from lineage.intake.columns import CoercionError, SqlType, coerce, parse_timestamp, to_text
from lineage.intake.destinations import DestinationSpec, UnmappedPolicy
from lineage.intake.pipeline import (
    RESERVED,
    UNMAPPED,
    BatchHeader,
    ColumnType,
    Destination,
    TypedBatch,
    column_name,
    flatten,
    pointer_segment,
    type_batch,
)

S, B, D, I, T = SqlType.STRING, SqlType.BOOLEAN, SqlType.DOUBLE, SqlType.BIGINT, SqlType.TIMESTAMP  # noqa: E741
COLUMN, FAIL = UnmappedPolicy.COLUMN, UnmappedPolicy.FAIL
BIG = 18446744073709551616  # 2**64: orjson.loads makes it 1.8446744073709552e+19


def dest(**kw: Any) -> Destination:
    return Destination(DestinationSpec.model_validate({"id": "d", **kw}))


def typed(events: list[dict[str, Any]], table: dict[str, ColumnType] | None = None, policy: UnmappedPolicy = COLUMN,
          **spec: Any) -> TypedBatch:
    d = dest(**spec)
    header, rows = BatchHeader("stage.t"), []
    for n, e in enumerate(events, start=1):
        row = d.map_event(e)
        header.add(row, d.explicit)
        rows.append((n, row))
    return type_batch(header, rows, table or {}, policy)


def row_of(batch: TypedBatch, i: int = 0) -> dict[str, Any]:
    return {name: values[i] for name, (_, values) in batch.columns.items()}


def unmapped(batch: TypedBatch, i: int = 0) -> dict[str, Any]:
    raw = row_of(batch, i).get(UNMAPPED)
    return json.loads(raw) if raw else {}


# -- collisions ---------------------------------------------------------------------------------

def test_the_issue_case_keeps_the_field_spelled_as_the_column_and_records_the_others():
    batch = typed([{"event_type": "odd", "a.b": 1, "a_b": 2, "A-B": 3, "a b": 4, "UPPER": 5}])
    row = row_of(batch)
    assert row["a_b"] == 2 and row["upper"] == 5 and row["event_type"] == "odd"
    why = "collides with /a_b in column a_b"
    assert unmapped(batch) == {"/a.b": {"value": 1, "reason": why}, "/A-B": {"value": 3, "reason": why},
                               "/a b": {"value": 4, "reason": why}}
    assert batch.collided_values == 3 and batch.unmapped_values == 0 and UNMAPPED in batch.added


def test_nested_object_against_dotted_key_and_the_reserved_rename():
    batch = typed([{"a": {"b": 6}, "a.b": 7}, {"pos": 1, "pos_": 2}, {"A.B": 8, "a-b": 9}])
    assert row_of(batch, 0)["a_b"] == 6
    assert unmapped(batch, 0) == {"/a.b": {"value": 7, "reason": "collides with /a/b in column a_b"}}
    assert row_of(batch, 1)["pos_"] == 2  # /pos is renamed to pos_, /pos_ is spelled as the column
    assert unmapped(batch, 1) == {"/pos": {"value": 1, "reason": "collides with /pos_ in column pos_"}}
    # no path spelled as the column: the first JSON Pointer in code-point order ("A" < "a")
    assert row_of(batch, 2)["a_b"] == 8 and unmapped(batch, 2)["/a-b"]["value"] == 9
    assert batch.collided_values == 3


def test_pointers_are_escaped_and_a_collision_joins_a_type_mismatch_of_the_same_row():
    assert pointer_segment("x~/y") == "x~0~1y"
    batch = typed([{"a_b": "text", "a.b": 1, "x~/y": [BIG], "x__y": True}], {"a_b": ColumnType(I)})
    assert row_of(batch)["a_b"] is None and row_of(batch)["x__y"] is True
    assert unmapped(batch) == {
        "a_b": {"value": "text", "reason": "a string value (text) does not fit a bigint column"},
        "/a.b": {"value": 1, "reason": "collides with /a_b in column a_b"},
        "/x~0~1y": {"value": f"[{BIG}]", "reason": "collides with /x__y in column x__y"},
    }
    assert batch.collided_values == 2 and batch.unmapped_values == 1


def test_a_collision_fails_the_event_with_unmapped_fail_and_keep_unmapped_false_keeps_only_kept_columns():
    batch = typed([{"a_b": 2, "a.b": 1}, {"a_b": 3}], policy=FAIL)
    assert batch.failed == [(1, "values fit no column: /a.b: collides with /a_b in column a_b")]
    assert batch.lines == [2] and batch.collided_values == 0
    kept = typed([{"a_b": 2, "a.b": 1, "x": 1, "X": 2}],
                 mappings={"keep_unmapped": False, "rules": [{"src": "/a_b", "action": "cast", "type": "bigint"}]})
    assert set(row_of(kept)) == {"a_b", UNMAPPED} and list(unmapped(kept)) == ["/a.b"]


def test_an_event_without_collision_takes_the_fast_path_unchanged():
    row = flatten({"a": {"b": 1}, "c": [1], "pos": 2, "e": {}})
    assert row == {"a_b": 1, "c": "[1]", "pos_": 2} and UNMAPPED not in row


# -- numbers ------------------------------------------------------------------------------------

def test_integers_beyond_64_bits_stay_exact_as_text_or_in_unmapped_data():
    body = b'[{"n2": 18446744073709551616, "neg": -9223372036854775809, "l": [18446744073709551616, 1], "ok": 7}]'
    events = parse_body(body)
    assert events == [{"n2": BIG, "neg": -(2**63) - 1, "l": [BIG, 1], "ok": 7}]
    batch = typed(copy.deepcopy(events))
    assert row_of(batch) == {"n2": "18446744073709551616", "neg": "-9223372036854775809", "l": "[18446744073709551616,1]",
                             "ok": 7}
    assert batch.columns["n2"][0].type is S
    into = typed(copy.deepcopy(events), {"n2": ColumnType(I), "neg": ColumnType(D)})
    assert row_of(into)["n2"] is None and row_of(into)["neg"] is None
    assert unmapped(into)["n2"]["value"] == BIG and unmapped(into)["neg"]["value"] == -(2**63) - 1
    assert "beyond 64 bits" in unmapped(into)["neg"]["reason"]
    assert to_text(BIG) == "18446744073709551616" and to_text(-BIG) == "-18446744073709551616"


def test_loads_and_dumps_exact():
    ndjson = parse_body(b'{"a": 1}\n{"n": 18446744073709551616}\n', "application/x-ndjson")
    assert ndjson == [{"a": 1}, {"n": BIG}]
    huge = int("9" * 400)  # beyond a double's range: orjson refuses it, the stdlib reads it
    assert loads_exact(b'{"h": ' + str(huge).encode() + b"}") == {"h": huge}
    assert loads_exact(dumps_exact({"n": -BIG, "s": "é", "f": 0.1})) == {"n": -BIG, "s": "é", "f": 0.1}
    assert dumps_exact({"s": "é"}) == orjson.dumps({"s": "é"})
    for bad in (b'{"a": NaN}', b'{"a": Infinity}', b'{"a": 1e400, "b": 12345678901234567890}'):
        with pytest.raises(orjson.JSONDecodeError):
            loads_exact(bad)


def test_a_number_beyond_a_double_is_refused_saying_where_nan_stays_malformed():
    with pytest.raises(BadRequest) as exc:
        parse_body(b'{"a": 1, "b": 1e400}')
    assert exc.value.status == 400 and exc.value.reason == "number_out_of_range"
    assert "1e400" in exc.value.message and "char 14 of the body" in exc.value.message
    assert "send it as a string" in exc.value.message
    with pytest.raises(BadRequest) as exc:
        parse_body(b'{"a": 1}\n{"b": -2e999}\n', "application/x-ndjson")
    assert exc.value.reason == "number_out_of_range" and "line 2 of the NDJSON body" in exc.value.message
    with pytest.raises(BadRequest) as exc:
        parse_body(b'{"a": NaN}')
    assert exc.value.reason == "malformed_json"
    for to in (S, D, I):  # a non-finite float never comes from JSON; if one did, it would not be stored silently
        if to is not D:
            with pytest.raises(CoercionError):
                coerce(float("inf"), to)


# -- the property: every leaf found exactly once ------------------------------------------------

KEYS = st.sampled_from(["a", "A", "a.b", "a_b", "a b", "A-B", "b", "c", "n", "s", "t", "pos", "pos_", "id", "id_",
                        "_unmapped_data", "_unmapped_data_", "_unmapped", "data", "é", "É", "x/y", "x~y", "x_y", " a",
                        "", "_timestamp"]) | st.text(max_size=3)
INTS = st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from(
    [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30])
SCALARS = st.none() | st.booleans() | INTS | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5) \
    | st.sampled_from(["2026-01-31T12:00:00Z", "2026-01-31T12:00:00+01:00"])
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=4),
                      max_leaves=12)
EVENTS = st.dictionaries(KEYS, VALUES, min_size=1, max_size=8)
#: columns the table already has, of other types than many values sent to them
TABLE = {"a": ColumnType(I), "a_b": ColumnType(D), "b": ColumnType(B), "c": ColumnType(T), "s": ColumnType(S),
         "n": ColumnType(I, int_bits=32), "pos_": ColumnType(I)}


def leaves(node: dict[str, Any], prefix: str = "", pointer: str = "") -> list[tuple[str, str, Any]]:
    """``(JSON Pointer, column, value)`` of every leaf, written independently of ``flatten``."""
    out = []
    for k, v in node.items():
        name, ptr = prefix + column_name(k), pointer + "/" + k.replace("~", "~0").replace("/", "~1")
        if isinstance(v, dict):
            out += leaves(v, name + "_", ptr)
        else:
            out.append((ptr, name + "_" if name in RESERVED else name, v))
    return out


def spelled_as_column(pointer: str, column: str) -> bool:
    segs = [s.replace("~1", "/").replace("~0", "~") for s in pointer.split("/")[1:]]
    return all(column_name(s) == s for s in segs) and "_".join(segs) == column


def same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def flat(value: Any) -> Any:
    return dumps_exact(value).decode() if isinstance(value, list) else value


def fits(stored: Any, value: Any, t: SqlType | None) -> bool:
    """``stored`` (a column's value) is ``value`` after the column's type."""
    if t is S:
        return stored == to_text(value)
    if t is T:
        return stored == parse_timestamp(value)
    if t is D:
        return stored == float(value)
    if t is I:
        return stored == value and not isinstance(value, str)  # 2.0 fits: the tree lets a lossless float in
    return same(stored, value)


def check_event(event: dict[str, Any], row: dict[str, Any], types: dict[str, SqlType | None]) -> tuple[int, int]:
    """Every leaf of ``event`` found exactly once in ``row`` (its columns and ``_unmapped_data``).

    "Equal" means: a leaf in a column equals the value after the column's type (a string column
    holds ``to_text(value)``; bigint the integer (an integral float like 2.0 too); double ``float(value)``; boolean the bool;
    timestamp the parsed ISO time); a leaf in ``_unmapped_data`` is there exactly, with its JSON
    type (``1`` is not ``1.0`` nor ``true``; an integer of any size keeps every digit), an array
    as its JSON text. An array is one leaf; a null equals absent; an empty object has no leaf.
    Each column's winner must follow the rule: spelled as the column first, then the first JSON
    Pointer. Returns (collided, type mismatches) found, for the counters."""
    raw = row.get(UNMAPPED)
    extra = json.loads(raw) if raw else {}
    by_pointer = {k: v for k, v in extra.items() if k.startswith("/")}
    by_column = {k: v for k, v in extra.items() if not k.startswith("/")}
    groups: dict[str, list[tuple[str, Any]]] = {}
    for ptr, col, value in leaves(event):
        groups.setdefault(col, []).append((ptr, flat(value)))
    for col, found in groups.items():
        winner = min(found, key=lambda f: (0 if spelled_as_column(f[0], col) else 1, f[0]))
        for ptr, value in found:
            if ptr == winner[0]:
                assert ptr not in by_pointer, (ptr, extra)
                continue
            rec = by_pointer.pop(ptr)
            assert same(rec["value"], value), (ptr, rec, value)
            assert rec["reason"] == f"collides with {winner[0]} in column {col}"
        value = winner[1]
        stored = row.get(col)
        if value is None:
            assert stored is None and col not in by_column, (col, row, extra)
        elif col in by_column:
            assert stored is None and same(by_column[col]["value"], value), (col, by_column[col], value)
        else:
            assert stored is not None and fits(stored, value, types[col]), (col, stored, value, types[col])
    invented = {c for c, v in row.items() if v is not None and c != UNMAPPED and c not in groups}
    assert not invented and not by_pointer and not set(by_column) - set(groups), (invented, by_pointer, by_column)
    return len(extra) - len(by_column), len(by_column)


def pylist(pair: Any) -> list[dict[str, Any]]:
    return pair.data.to_pylist() if pair.data.num_columns else [{} for _ in pair.lines]  # only nulls: no column


def check_unit(events: list[dict[str, Any]], policy: UnmappedPolicy) -> None:
    from platform_assets.intake.workers import type_events

    originals = [copy.deepcopy(e) for e in events]
    # the way an event travels: serialized by the collector, read back by the processor
    parsed = [(n, loads_exact(dumps_exact(e))) for n, e in enumerate(events, start=1)]
    unit = type_events(parsed, [dest(table_name_template="values", unmapped=policy.value)], {},
                       lambda table: dict(TABLE))
    assert not unit.failures
    pair = unit.pairs[("d", "stage.values")]
    rows = pylist(pair)
    assert len(rows) == len(pair.lines) and len(pair.lines) + len(pair.failed) == len(events)
    collided = mismatched = 0
    for line, row in zip(pair.lines, rows, strict=True):
        c, m = check_event(originals[line - 1], row, pair.types)
        collided, mismatched = collided + c, mismatched + m
    assert (pair.collided_values, pair.unmapped_values) == (collided, mismatched)
    if policy is FAIL:  # a failed event keeps the original whole; it failed because something did not fit
        assert not mismatched and not collided
        again = type_events([(n, loads_exact(dumps_exact(e))) for n, e in enumerate(originals, start=1)],
                            [dest(table_name_template="values")], {}, lambda table: dict(TABLE))
        p = again.pairs[("d", "stage.values")]
        had_extra = {line for line, row in zip(p.lines, pylist(p), strict=True) if row.get(UNMAPPED)}
        assert {line for line, _ in pair.failed} == had_extra


@hsettings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(EVENTS, min_size=1, max_size=6), st.sampled_from([COLUMN, FAIL]))
def test_no_value_is_lost_or_changed_without_a_record(events: list[dict[str, Any]], policy: UnmappedPolicy):
    check_unit(events, policy)


# -- end to end: real files, the batch processor, a Delta stage table ----------------------------

def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(11 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([rng.randint(-1000, 1000), 2**64, -(2**63) - 1, 10**25, 2**63 - 1, rng.randint(-(2**70), 2**70)])
    if kind == 3:
        return rng.choice([rng.uniform(-1e6, 1e6), 1e300, -0.0, 5e-324])
    if kind in (4, 5):
        return rng.choice(["x", "é", "", "2026-01-31T12:00:00Z", str(rng.random())])
    if kind == 6:
        return rng.choice([1, "a", 2.5])
    if kind in (7, 8):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return random_event(rng, depth + 1)


def random_event(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    keys = ["a", "A", "a.b", "a_b", "a b", "A-B", "b", "c", "s", "pos", "pos_", "id", "_unmapped_data", "é", "x/y",
            "x~y", "x_y", "Mixed Case"]
    return {rng.choice(keys): random_value(rng, depth) for _ in range(rng.randrange(0 if depth else 1, 6))}


def test_random_events_through_files_the_processor_and_delta(settings: Any, tmp_path: Path, monkeypatch: Any):
    from deltalake import DeltaTable

    from lineage.intake.config import load_intake
    from platform_assets.intake.units import process_ready
    from resources.intake.incoming_log import file_name, ready_dir
    from tests.platform_assets.test_events import T0, config

    monkeypatch.setenv("TIDEMARK_EVENT_UNIT_BYTES", "1")  # a unit per file: the first one fixes the columns
    cfg = load_intake(config(tmp_path, template="values"), secrets=False)
    rng = random.Random(22)
    first = [{"a": 1, "a_b": 1.5, "b": True, "s": "x", "pos_": 3}]  # the table's columns before the random events
    events = first + [random_event(rng) for _ in range(200)]
    folder = ready_dir(settings.events_dir())
    folder.mkdir(parents=True, exist_ok=True)
    for k, chunk in enumerate((events[:1], events[1:])):
        for i, e in enumerate(chunk):
            e["api_key"] = "web"
            e["_timestamp"] = (T0 + dt.timedelta(minutes=k, milliseconds=i)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        (folder / file_name("web", T0 + dt.timedelta(minutes=k))).write_bytes(b"".join(dumps_exact(e) + b"\n" for e in chunk))
    originals = [copy.deepcopy(e) for e in events]
    done = process_ready(settings, cfg, until_empty=True)
    assert [r.written for r in done] == [1, 200] and not any(r.failed for r in done)
    table = DeltaTable(settings.table_path("stage.values")).to_pyarrow_table()
    kinds = {"string": S, "int64": I, "double": D, "bool": B, "timestamp[us, tz=UTC]": T}
    types = {f.name: kinds.get(str(f.type)) for f in table.schema}
    got = sorted(table.to_pylist(), key=lambda r: r["id"])
    assert len(got) == len(originals)
    collided = 0
    for event, row in zip(originals, got, strict=True):
        row = {k: v for k, v in row.items() if k not in ("pos", "id")}
        collided += check_event(event, row, types)[0]
    assert collided > 20  # the random events did collide


def test_worker_chunks_count_collided_values_and_merge_sums_them():
    from platform_assets.intake.workers import merge_chunks, type_events

    d = [dest(table_name_template="values")]
    chunks = [type_events([(n, {"a_b": 1, "a.b": 2, "A-B": n})], d, {}, lambda table: {}) for n in (1, 2)]
    assert [c.pairs[("d", "stage.values")].collided_values for c in chunks] == [2, 2]
    merged, forced, _ = merge_chunks(chunks)
    assert not forced and merged.pairs[("d", "stage.values")].collided_values == 4
    assert merged.pairs[("d", "stage.values")].unmapped_values == 0
