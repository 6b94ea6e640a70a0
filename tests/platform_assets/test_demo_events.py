"""The demo's events: the feeder posts page views and cart events to a real collector (a
``tidemark collect`` subprocess on a free loopback port); after a graceful stop every
acknowledged event is in the demo's stage tables, once."""

from __future__ import annotations

from pathlib import Path

import pytest
from deltalake import DeltaTable

from lineage.intake.config import load_intake
from platform_assets.demo import feeder
from platform_assets.demo.events import CollectorProcess, ensure_tokens
from platform_assets.intake.units import process_ready
from resources.core.settings import Settings
from resources.intake.incoming_log import iter_ready_files

ROOT = Path(__file__).resolve().parents[2]


def test_feeder_posts_events_to_a_real_collector_and_they_reach_the_stage_tables(settings: Settings, monkeypatch,
                                                                                 capsys: pytest.CaptureFixture[str]):
    monkeypatch.delenv("TIDEMARK_TOKEN_WEB", raising=False)
    monkeypatch.setenv("TIDEMARK_TOKEN_BACKEND", "backend-secret-for-the-test")
    tokens = ensure_tokens()  # a throw-away web secret is generated; a set one is kept
    assert tokens["web"].startswith("demo-") and tokens["backend"] == "backend-secret-for-the-test"
    collector = CollectorProcess(settings)
    try:
        code = feeder.main(["--home", str(settings.home), "--warehouse", settings.warehouse, "--iterations", "1",
                            "--orders", "5", "--interval", "1", "--collector", collector.url, "--events", "30"])
    finally:
        out = collector.stop()
    assert code == 0
    printed = capsys.readouterr().out
    assert "posted 30 page views and 10 cart events" in printed and "40 acknowledged" in printed
    assert "collector stopped: 40 events accepted" in out
    assert len(iter_ready_files(settings.events_dir())) == 2  # one file per token, rotated by the stop
    results = process_ready(settings, load_intake(ROOT / "demo" / "intake.yaml", secrets=False))
    assert sum(r.written for r in results) == 40 and sum(r.failed for r in results) == 0
    pv = DeltaTable(settings.table_path("stage.events_page_view")).to_pyarrow_table().to_pylist()
    cart = DeltaTable(settings.table_path("stage.events_cart")).to_pyarrow_table().to_pylist()
    assert len(pv) == 30 and len(cart) == 10
    assert {r["api_key"] for r in pv} == {"web"} and all(r["eventn_ctx_parsed_ua_ua_family"] for r in pv)
    assert {r["src"] for r in cart} == {"api"} and len({r["id"] for r in pv + cart}) == 40
