"""A unit cut short between its Delta write and its statistics, and then the offset store lost
(issue 57's worst moment, mid-unit): the store comes back from the Delta log with that unit pending,
exactly as its commit records it, so the unit finishes as after any crash: its ``etl.log`` row is
written and its ``after`` SQL runs, once; the step fact and the view equal their recompute."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from lineage.spec.loader import load_lineage
from platform_assets.engine.runner import Engine
from platform_assets.facts import step as step_mod
from platform_assets.views import merge as merge_mod
from resources.core.settings import Settings
from resources.storage.meta_tables import logged_seq, read_etl_log
from tests.platform_assets.test_cleanup import WIDE, assert_equals_recompute, customers, make_engine, orders

pytestmark = pytest.mark.spark


def _fact(audit: Path) -> str:
    return f"""\
- table: fact.orders
  depends_on: [stage.orders]
  transforms: [sql/fact.sql]
  maxstep: 10
  after: "INSERT INTO delta.`{audit}` SELECT min(id) AS lo, max(id) AS hi FROM block"
"""


def test_a_unit_cut_short_after_its_write_is_finished_after_a_lost_store(spark, settings: Settings, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    audit = tmp_path / "audit"
    write_deltalake(str(audit), pa.table({"lo": pa.array([], pa.int64()), "hi": pa.array([], pa.int64())}))
    eng, _ = make_engine(spark, settings, tmp_path, _fact(audit) + WIDE)
    customers(eng)
    orders(eng, [(i, i) for i in range(1, 11)])
    eng.run_until_caught_up()
    orders(eng, [(i, i) for i in range(11, 21)])

    def cut(*_a: object, **_k: object) -> bool:
        raise RuntimeError("killed after the write")

    monkeypatch.setattr(step_mod, "write_etl_log", cut)
    monkeypatch.setattr(merge_mod, "write_etl_log", cut)
    for topic in ("fact.orders", "mart.wide"):
        with pytest.raises(RuntimeError, match="killed after the write"):
            eng.run_topic(topic)
    monkeypatch.undo()
    cut_at = {t: eng.store.get(t).seq for t in ("fact.orders", "mart.wide")}  # the pending units, landed in Delta
    assert all(logged_seq(eng.settings, t) == seq - 1 for t, seq in cut_at.items())
    eng.close()

    lost = eng.settings.with_(offsets_url=f"sqlite:///{tmp_path / 'lost.db'}")
    eng = Engine(lost, load_lineage(lost.lineage), spark=spark)
    try:
        eng.run_until_caught_up()
        for topic, seq in cut_at.items():
            assert logged_seq(lost, topic) >= seq  # the statistics of the cut unit were written
            assert [r["seq"] for r in read_etl_log(lost, topic, limit=100)].count(seq) == 1
            notes = [h.note for h in eng.store.history(topic)]
            assert any("planned again from its commit" in n for n in notes), notes
            assert_equals_recompute(eng, topic)
        ranges = sorted((r["lo"], r["hi"]) for r in DeltaTable(str(audit)).to_pyarrow_table().to_pylist())
        assert ranges == [(1, 10), (11, 20)]  # the cut block's after SQL ran, once
    finally:
        eng.close()
