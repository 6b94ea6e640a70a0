"""Smoke test of bench/cdc_big_tx.py at a tiny size: one transaction over every row of a table, applied
on the columnar path in a process of its own, equal to the source (the script exits 1 otherwise),
and its figures printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.postgres]
ROOT = Path(__file__).resolve().parents[2]


def test_big_transaction_bench_runs_at_a_tiny_size() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIDEMARK_CDC_SPILL_ROWS": "5000"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cdc_big_tx.py"), "--rows", "20000", "--paths", "columns",
                           "--driver-memory", "1g"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "one transaction of 21,000 row changes (1,000 key changes)" in out, out
    line = next(x for x in out.splitlines() if x.startswith("columns "))
    assert "equal to the source" in line and "peak RSS" in out and "target < 1,536 MB" in line, out
    assert line.split()[1] == "spilled", out  # TIDEMARK_CDC_SPILL_ROWS below the transaction
