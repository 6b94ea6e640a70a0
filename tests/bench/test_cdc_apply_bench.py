"""Smoke test of bench/cdc_apply.py at tiny sizes: both throughput sides end equal (the script exits
1 otherwise), the lag part replicates a real PostgreSQL under load, and the table is printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.postgres]
ROOT = Path(__file__).resolve().parents[2]


def test_cdc_bench_runs_at_tiny_sizes() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cdc_apply.py"), "--rows", "3000", "--events", "2000",
                           "--maxstep", "700", "--lag-seconds", "4", "--lag-rate", "200", "--lag-rows", "500",
                           "--no-sdp-probe", "--driver-memory", "1g"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "-> EQUAL" in out and "cdc processor (columns, feed on)" in out, out
    assert "unit(s)" in out and "target: cdc >= 1.5x AUTO CDC" in out, out
    assert "replica equal to the source after the load" in out and "target: lag p95 < 60 s" in out, out
