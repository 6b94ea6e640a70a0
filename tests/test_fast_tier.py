"""The fast tier (``./scripts/test.sh --fast``, ``pytest -m fast``) reaches every test module: each
``tests/**/test_*.py`` has at least one test in it, so a change anywhere meets at least one test of
its module in the inner loop. (Which tests are in the tier: ``tests/conftest.py: in_fast_tier``.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Test modules the fast tier leaves out on purpose, each with its reason.
OUTSIDE = {
    "tests/ui/test_browser.py": "drives Chromium against `dagster dev` (the fast tier installs no browser)",
    "tests/platform_assets/test_crash.py": "SIGKILLs tidemark processes at every crash point (minutes)",
    "tests/platform_assets/test_dagster_crash.py": "SIGKILLs a `dagster asset materialize` process, then retries it",
    "tests/platform_assets/test_cluster.py": "starts a standalone Spark master and worker",
    "tests/platform_assets/test_merge_property.py": "the property test: hundreds of random units against a recompute",
    "tests/platform_assets/test_dagster_postgres.py": "the prod profile end to end: Dagster, Spark and PostgreSQL at once",
    "tests/platform_assets/test_cdc.py": "whole replicators from seed changes through Spark (35 s or more each); "
                                          "the fast tier applies changes in test_cdc_apply.py",
    "tests/platform_assets/test_cdc_columns.py": "whole replicators on both paths through Spark (1-2 min each); the fast "
                                                  "tier checks the columnar reduction and read in tests/lineage and "
                                                  "tests/resources",
    "tests/platform_assets/test_cleanup.py": "rounds of OPTIMIZE and VACUUM of bases under running topics (30 s or more each)",
    "tests/platform_assets/test_cdc_lost_store.py": "whole replicators with PostgreSQL, the offset store lost between "
                                                    "units (40 s or more each)",
    "tests/platform_assets/test_lost_store_units.py": "cuts units short after their Delta write, then loses the store "
                                                      "(about a minute)",
    "tests/platform_assets/test_databricks_sources.py": "two rounds of five topics on Spark-written sources with deletion "
                                                         "vectors and column mapping (about a minute per mode); the fast "
                                                         "tier reads such tables in tests/resources/test_delta_read.py",
    "tests/bench/test_cdc_apply_bench.py": "runs the benchmark script in its own process (a JVM and PostgreSQL)",
    "tests/bench/test_cdc_big_tx_bench.py": "runs the benchmark script in its own processes (JVMs and PostgreSQL)",
    "tests/bench/test_maintenance_bench.py": "runs the benchmark script in its own process (a JVM)",
}


def fast_test_files(request: pytest.FixtureRequest) -> set[str]:
    """The test modules with at least one fast test: from this session's items when it collected
    the whole suite (with or without ``-m fast``), else from a collection of its own."""
    config = request.config
    whole = [str(Path(a).resolve()) for a in config.args] in ([str(ROOT / "tests")], [str(ROOT)])
    if whole and not config.getoption("keyword"):
        return {Path(str(i.path)).resolve().relative_to(ROOT).as_posix()
                for i in request.session.items if i.get_closest_marker("fast")}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "fast", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return {line.split("::", 1)[0] for line in out.stdout.splitlines() if "::" in line}


def test_every_test_module_has_a_test_in_the_fast_tier(request):
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    fast = fast_test_files(request)
    missing = sorted(modules - fast - set(OUTSIDE))
    assert not missing, ("these test modules have no test in the fast tier: mark one quick real-engine test in each "
                         f"@pytest.mark.fast, or add the module to OUTSIDE with a reason: {missing}")
    assert not set(OUTSIDE) & fast, "a module in OUTSIDE has fast tests: take it out of OUTSIDE"
