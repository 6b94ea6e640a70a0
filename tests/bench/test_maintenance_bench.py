"""Smoke test of bench/maintenance.py at tiny sizes: the blocks are written, maintenance compacts the
fact, the query's results on the three tables (and the view) are equal (the script exits 1
otherwise), and the figures, ratios and verdicts are printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spark]
ROOT = Path(__file__).resolve().parents[2]


def test_maintenance_bench_runs_at_tiny_sizes() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # 18 blocks: above the 16 small files from which maintenance compacts.
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "maintenance.py"), "--blocks", "24", "--small-blocks", "18",
                           "--rows-per-block", "10", "--repeat", "1", "--plan-repeat", "1", "--driver-memory", "1g"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "compacted: 18 files -> 1 file(s)" in out and "compacted: 24 files -> 1 file(s)" in out, out
    for table in ("many blocks", "written once", "many blocks, maintained", "written once (again)"):
        assert re.search(rf"^{re.escape(table)}\s+\d+\.\d{{3}}\s", out, re.M), (table, out)
    assert re.search(r"target: after maintenance <= 1.2 x written once: \d+\.\d\d -> (PASS|MISS)", out), out
    for state in ("maintained", "maintained, steady"):
        assert re.search(rf"target: plan_block 24/18 blocks, {state}, <= 1.2: \d+\.\d\d -> (PASS|MISS)", out), out
    assert "plan_block 24/18 blocks, no maintenance:" in out, out
    for blocks in ("18", "24"):
        for state in ("no maintenance", "maintained", "maintained, steady"):
            assert re.search(rf"^\s+{blocks}  {state}\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d$", out, re.M), (blocks, state, out)
    assert "query results equal on all 4" in out and "mart.daily equals the query over fact.events" in out, out
    assert out.count("strategy incremental") == 2, out
    assert "to reproduce: PYTHONPATH=. .venv/bin/python bench/maintenance.py --blocks 24" in out, out
