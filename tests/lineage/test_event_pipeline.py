"""The intake's pure pipeline steps (no Spark, no Delta): destinations config, routing, table
name templates, LookupEnrichment, mapping, flattening, the typecast tree and typed batches."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from lineage.intake.columns import CoercionError, SqlType, coerce, promote
from lineage.intake.config import IntakeConfigError, load_intake
from lineage.intake.destinations import DestinationSpec, UnmappedPolicy
from lineage.intake.pipeline import (
    UNMAPPED,
    BatchHeader,
    ColumnType,
    Destination,
    EventFailure,
    flatten,
    geo_fields,
    lookup_enrichment,
    route,
    type_batch,
)

S, B, D, I, T = SqlType.STRING, SqlType.BOOLEAN, SqlType.DOUBLE, SqlType.BIGINT, SqlType.TIMESTAMP  # noqa: E741
CHROME = "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/120.0.0.0 Safari/537.36"


def dest(**kw) -> Destination:
    return Destination(DestinationSpec.model_validate({"id": "d", **kw}))


def test_typecast_tree_lowest_common_ancestor():
    assert promote(B, I) is I and promote(I, D) is D and promote(B, D) is D
    assert promote(D, T) is S and promote(B, T) is S and promote(T, T) is T and promote(I, S) is S


def test_coerce_follows_the_tree_and_refuses_losses():
    assert coerce(True, I) == 1 and coerce(3, D) == 3.0 and coerce(2.0, I) == 2 and coerce(1.5, S) == "1.5"
    assert coerce(False, S) == "false" and coerce([1, "a"], S) == '[1,"a"]'
    assert coerce("2026-01-31T12:00:00Z", T) == dt.datetime(2026, 1, 31, 12, tzinfo=dt.UTC)
    assert coerce("2026-01-31T13:00:00+01:00", T) == dt.datetime(2026, 1, 31, 12, tzinfo=dt.UTC)
    for value, to in (("7", I), (2.5, I), ("x", D), (1, B), ("yesterday", T), (2**40, I)):
        with pytest.raises(CoercionError):
            coerce(value, to, int_bits=32 if value == 2**40 else 64)


def test_flatten_joins_with_underscore_replaces_special_characters_and_keeps_arrays_as_json():
    row = flatten({"User Info": {"E-Mail": "a@b", "Geo": {"lat": 1.5}}, "tags": ["x", {"y": 1}], "empty": {},
                   "id": 7, "pos": "p", "ok": True})
    assert row == {"user_info_e_mail": "a@b", "user_info_geo_lat": 1.5, "tags": '["x",{"y":1}]', "ok": True,
                   "id_": 7, "pos_": "p"}


def test_mapping_actions_move_remove_cast_constant():
    d = dest(mappings={"keep_unmapped": True, "rules": [
        {"src": "/user/email", "action": "remove"},
        {"src": "/user/name", "dst": "/customer/name", "action": "move"},
        {"src": "/price", "action": "cast", "type": "string"},
        {"src": "/props", "action": "cast", "type": "string"},
        {"dst": "/source", "action": "constant", "value": "web"},
    ]})
    row = d.map_event({"user": {"email": "a@b", "name": "Ann", "age": 3}, "price": 10, "props": {"a": [1]}, "x": 1})
    assert row == {"user_age": 3, "customer_name": "Ann", "price": 10, "props": '{"a":[1]}', "source": "web", "x": 1}
    assert d.explicit["price"] is S and d.explicit["_timestamp"] is T
    h = BatchHeader("t")
    h.add(row, d.explicit)
    assert h.fields["price"] is S  # cast: the configured type, whatever the node
    strict = dest(mappings={"keep_unmapped": False, "rules": [{"src": "/a/b", "dst": "/c", "action": "move"}]})
    assert strict.map_event({"a": {"b": 1, "z": 2}, "y": 3}) == {"c": 1}


def test_promotion_inside_one_batch_int_then_float_then_string():
    d = dest()
    h = BatchHeader("stage.t")
    rows = [{"v": 1, "flag": True, "ts": "2026-01-01T00:00:00Z"}, {"v": 1.5, "flag": 2}, {"v": "n/a", "flag": None}]
    for r in rows:
        h.add(r, d.explicit)
    assert h.fields == {"v": S, "flag": I, "ts": S} and h.promotions == 3
    batch = type_batch(h, list(enumerate(rows, start=1)), {}, UnmappedPolicy.COLUMN)
    assert batch.columns["v"][1] == ["1", "1.5", "n/a"] and batch.columns["flag"][1] == [1, 2, None]
    assert sorted(batch.added) == ["flag", "ts", "v"] and batch.unmapped_values == 0 and UNMAPPED not in batch.columns
    h2 = BatchHeader("stage.t")
    for r in ({"_timestamp": "2026-01-01T00:00:00Z"}, {"_timestamp": "garbage"}):
        h2.add(r, d.explicit)
    assert h2.fields == {"_timestamp": T}  # an explicit (implicit-cast) type is never promoted


def test_typed_batch_against_an_existing_table_unmapped_column_or_failed_event():
    h = BatchHeader("stage.t")
    rows = [(1, {"n": 5, "s": "a"}), (2, {"n": "five", "s": "b"}), (3, {"n": 2.0, "s": 3})]
    for _, r in rows:
        h.add(r, {})
    table = {"n": ColumnType(I), "s": ColumnType(S)}
    batch = type_batch(h, rows, table, UnmappedPolicy.COLUMN)
    assert batch.columns["n"][1] == [5, None, 2] and batch.columns["s"][1] == ["a", "b", "3"]
    assert batch.added == [UNMAPPED] and batch.unmapped_values == 1 and batch.lines == [1, 2, 3]
    assert batch.columns[UNMAPPED][1][0] is None and '"value":"five"' in batch.columns[UNMAPPED][1][1]
    assert "does not fit a bigint column" in batch.columns[UNMAPPED][1][1]
    failing = type_batch(h, rows, table, UnmappedPolicy.FAIL)
    assert failing.lines == [1, 3] and failing.failed[0][0] == 2 and "n:" in failing.failed[0][1]
    narrow = type_batch(h, [(1, {"n": 2**40})], {"n": ColumnType(I, 32)}, UnmappedPolicy.COLUMN)
    assert narrow.columns["n"][1] == [None] and narrow.unmapped_values == 1


def test_table_name_template_empty_skips_error_fails_and_is_sandboxed():
    d = dest(table_name_template="{{ 'events_' ~ event_type if event_type != 'ignore' else '' }}")
    assert d.table_name({"event_type": "Page View"}) == "stage.events_page_view"
    assert d.table_name({"event_type": "ignore"}) is None
    with pytest.raises(EventFailure, match="'event_type' is undefined"):
        d.table_name({})
    with pytest.raises(EventFailure, match="unsafe|not safely|access"):
        dest(table_name_template="{{ ''.__class__.__mro__ }}").table_name({})


def test_routing_by_only_keys():
    a, b = dest(), Destination(DestinationSpec.model_validate({"id": "b", "only_keys": ["srv"]}))
    assert route({"api_key": "web"}, [a, b]) == [a] and route({"api_key": "srv"}, [a, b]) == [a, b]


def test_lookup_enrichment_user_agent_and_geo(tmp_path: Path):
    import maxminddb
    from mmdb_writer import MMDBWriter
    from netaddr import IPSet

    w = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-City")
    w.insert_network(IPSet(["81.2.69.0/24"]), {"country": {"iso_code": "GB"}, "city": {"names": {"en": "London"}},
                                               "location": {"latitude": 51.5, "longitude": -0.1}})
    db = tmp_path / "tiny.mmdb"
    w.to_db_file(str(db))
    geo = maxminddb.open_database(str(db)).get
    event = {"source_ip": "81.2.69.160", "eventn_ctx": {"user_agent": CHROME}}
    lookup_enrichment(event, user_agent=True, geo=geo)
    assert event["eventn_ctx"]["parsed_ua"]["ua_family"] == "Chrome"
    assert event["eventn_ctx"]["parsed_ua"]["os_family"] == "Windows"
    assert event["eventn_ctx"]["location"] == {"country": "GB", "city": "London", "latitude": 51.5, "longitude": -0.1}
    other = {"source_ip": "10.0.0.1"}
    lookup_enrichment(other, user_agent=True, geo=geo)
    assert other == {"source_ip": "10.0.0.1"}
    bad = {"source_ip": "not-an-ip"}
    lookup_enrichment(bad, user_agent=False, geo=geo)
    assert "eventn_ctx" not in bad and geo_fields(None) is None


def test_destination_config_errors_name_file_line_and_field(tmp_path: Path):
    p = tmp_path / "intake.yaml"
    p.write_text("""\
tokens:
  - {id: web, kind: browser, secret_env: T}
destinations:
  - id: d
    only_keys: [web, nope]
    table_name_template: "{{ broken"
    mappings:
      rules:
        - {src: /a, action: cast}
        - {src: /b, action: rename}
    unmaped: column
""")
    with pytest.raises(IntakeConfigError) as err:
        load_intake(p, {}, secrets=False)
    text = str(err.value)
    assert f"{p}:6: field 'destinations.0.table_name_template'" in text and "not a valid Jinja2 template" in text
    assert f"{p}:9: field 'destinations.0.mappings.rules.0': action cast needs type" in text
    assert f"{p}:10: field 'destinations.0.mappings.rules.1.action'" in text
    assert f"{p}:11: field 'destinations.0.unmaped': unknown field" in text and "unmapped" in text
    p.write_text(p.read_text().replace('"{{ broken"', "x").replace("action: cast}", "action: cast, type: string}")
                 .replace("rename", "remove").replace("unmaped", "unmapped"))
    with pytest.raises(IntakeConfigError, match=rf"{p}:5: field 'destinations.0.only_keys.1': unknown token id 'nope'"):
        load_intake(p, {}, secrets=False)


def test_a_huge_integer_is_a_string_and_does_not_fit_a_bigint_column():
    h = BatchHeader("t")
    h.add({"n": 2**70}, {})
    assert h.fields == {"n": S}
    batch = type_batch(h, [(1, {"n": 2**70})], {"n": ColumnType(I)}, UnmappedPolicy.COLUMN)
    assert batch.columns["n"][1] == [None] and batch.unmapped_values == 1


def test_template_results_are_cached_per_field_values_and_failures_stay_failures():
    d = dest(table_name_template="{{ 'e_' ~ event_type }}")
    assert d.table_name({"event_type": "a", "x": 1}) == d.table_name({"event_type": "a", "x": 2}) == "stage.e_a"
    for _ in range(2):
        with pytest.raises(EventFailure, match="undefined"):
            d.table_name({"x": 1})
    assert d.table_name({"event_type": ["list"]}) == "stage.e___list__"  # unhashable: rendered each time


def test_type_batch_takes_a_column_whole_only_when_every_value_fits():
    h = BatchHeader("stage.t")
    rows = [(1, {"n": 1, "s": "a"}), (2, {"n": 2**70, "s": "b"}), (3, {"s": None})]
    for _, r in rows:
        h.add(r, {})
    assert h.pytypes == {"n": {int, object}, "s": {str}} and h.rows == 3
    batch = type_batch(h, rows, {"n": ColumnType(I)}, UnmappedPolicy.COLUMN)
    assert batch.columns["s"][1] == ["a", "b", None]  # taken whole
    assert batch.columns["n"][1] == [1, None, None] and '"value":1180591620717411303424' in batch.columns[UNMAPPED][1][1]
    # a header that did not see these rows never vouches for them: the values are checked one by one
    other = [(1, {"n": "x"}), (2, {"n": 3})]
    checked = type_batch(h, other, {"n": ColumnType(I)}, UnmappedPolicy.COLUMN)
    assert checked.columns["n"][1] == [None, 3] and checked.unmapped_values == 1
