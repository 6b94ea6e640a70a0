"""The Debezium file source learns schemas incrementally: a later call of ``tables()`` sees what was
appended since (a new column, a new table) without reading the old files again."""

from __future__ import annotations

import json
from pathlib import Path

from resources.cdc.debezium import DebeziumFileSource


def line(table: str, tx: int, after: dict) -> str:
    payload = {"op": "c", "before": None, "after": after, "ts_ms": 1000 + tx,
               "source": {"schema": "public", "table": table, "txId": tx}}
    return json.dumps({"key": {"id": after["id"]}, "value": {"payload": payload}}) + "\n"


def test_tables_learns_what_was_appended_since_the_last_call(tmp_path: Path) -> None:
    src = DebeziumFileSource(tmp_path, name="t", selects=lambda t: t.startswith("public."))
    (tmp_path / "0001.json").write_text(line("a", 1, {"id": 1, "x": 1}) + line("a", 2, {"id": 2, "x": 2}))
    first = src.tables()
    assert first["public.a"].names == ["id", "x"] and first["public.a"].key == ("id",)
    (tmp_path / "0001.json").write_text("not json: the file was read already and is never read again\n")
    (tmp_path / "0002.json").write_text(line("a", 3, {"id": 3, "x": 3, "y": "new"}) + line("b", 4, {"id": 9}))
    second = src.tables()
    assert second["public.a"].names == ["id", "x", "y"] and second["public.a"].key == ("id",)
    assert second["public.b"].names == ["id"]
    assert [t.xid for t in src.read(1 << 32)] and src.read(1 << 32)[0].changes[0].after == {"id": 3, "x": 3, "y": "new"}
