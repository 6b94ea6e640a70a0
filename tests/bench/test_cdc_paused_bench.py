"""Smoke test of bench/cdc_paused.py at a tiny size: every unit of the others reads exactly its new
row (the script asserts it), the parked slot holds the backlog while the main slot moves past it,
and the catch-up read returns the paused table's whole backlog."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.postgres]
ROOT = Path(__file__).resolve().parents[2]


def test_cdc_paused_bench_runs_at_a_tiny_size() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cdc_paused.py"), "--rows", "3000", "--units", "2"],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    held = re.search(r"held: .*main slot holds ([\d,]+) bytes", out)
    parked = re.search(r"parked: .*main slot holds ([\d,]+) bytes; the parked slot ([\d,]+)\)", out)
    assert held and parked, out
    backlog = int(held.group(1).replace(",", ""))
    assert int(parked.group(1).replace(",", "")) < backlog <= int(parked.group(2).replace(",", "")), out
    assert "the parked replica's catch-up read: 3,000 changes" in out and "ratio held/parked:" in out, out
