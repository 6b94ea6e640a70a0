"""What each topic still needs of the tables it reads and writes (no Spark): the horizon that
``tidemark maintain`` keeps."""

from __future__ import annotations

import dataclasses
import datetime as dt
import textwrap
from types import SimpleNamespace

from lineage.core.positions import Position
from lineage.spec.loader import load_lineage
from platform_assets.maintenance.tables import consumer_needs
from resources.state.offsets import OffsetRecord
from resources.storage.maintenance import Need

LINEAGE = """\
sources:
  - table: stage.orders
  - table: dim.customers
topics:
  - table: fact.orders
    depends_on: [stage.orders]
    transforms: [fact.sql]
  - table: mart.wide
    depends_on: [stage.orders, dim.customers]
    processor: merge
    transforms: [wide.sql]
    key: [id]
    join_keys: {dim.customers: {customer_id: id}}
  - table: dim.countries
    depends_on: [dim.customers]
    processor: reload
    transforms: [countries.sql]
"""
T = dt.datetime(2026, 3, 1)


def record(topic: str, processor: str, **kw: object) -> OffsetRecord:
    base = OffsetRecord(topic=topic, last=Position(T, 5), next=None, rows=1, seq=3, run=T, processor=processor,
                        state="committed", owner="", owner_since=None, source_version=None, updated_at=T)
    return dataclasses.replace(base, **kw)


def needs_of(tmp_path, records: list[OffsetRecord]) -> dict[str, list[Need]]:  # noqa: ANN001
    (tmp_path / "lineage.yaml").write_text(textwrap.dedent(LINEAGE))
    for name, sql in {"fact": "SELECT * FROM block", "countries": "SELECT DISTINCT country FROM block",
                      "wide": "SELECT b.id, c.country FROM block b JOIN dim.customers c ON b.customer_id = c.id"}.items():
        (tmp_path / f"{name}.sql").write_text(sql + "\n")
    # no destination table exists: the needs come from the records alone (test_maintain covers the log)
    eng = SimpleNamespace(lineage=load_lineage(tmp_path / "lineage.yaml"), path=lambda t: str(tmp_path / "wh" / t),
                          clock=lambda: T)
    return consumer_needs(eng, {r.topic: r for r in records})  # type: ignore[arg-type]


def test_each_topic_needs_what_its_next_unit_and_its_recovery_read(tmp_path):
    needs = needs_of(tmp_path, [
        record("fact.orders", "step", source_version=7, delta_version=3),
        record("mart.wide", "merge", source_version=6, delta_version=9, inputs={"dim.customers": 4},
               inputs_next={"dim.customers": 5}, next=Position(T, 9)),
        record("dim.countries", "reload", source_version=4, delta_version=2),
    ])
    assert needs["stage.orders"] == [Need(8, "fact.orders", "late-row check of what was added after v7"),
                                     Need(6, "mart.wide", "base version of its last unit")]
    assert needs["dim.customers"] == [Need(4, "mart.wide", "input offset (the reverse join reads the rows up to it "
                                                           "and the change feed after it); pending unit")]
    assert needs["fact.orders"] == [Need(3, "fact.orders", "the commit of its last unit (offset recovery reads it)", files=False)]
    assert needs["mart.wide"] == [Need(9, "mart.wide", "the commit of its last unit (offset recovery reads it)", files=False)]
    assert needs["dim.countries"] == [Need(2, "dim.countries", "the commit of its last unit (offset recovery reads it)", files=False)]
    assert all(n.who != "dim.countries" for n in needs["dim.customers"])  # a reload reads only the newest version


def test_a_planned_step_block_needs_the_base_version_it_was_planned_on(tmp_path):
    needs = needs_of(tmp_path, [record("fact.orders", "step", source_version=7, next=Position(T, 9))])
    assert needs["stage.orders"] == [Need(7, "fact.orders", "its planned block 3 reads this version")]


def test_a_topic_that_never_ran_needs_nothing(tmp_path):
    assert needs_of(tmp_path, []) == {}
