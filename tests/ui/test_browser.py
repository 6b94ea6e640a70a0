"""The Dagster UI in a real browser: the code location of ``workspace.yaml`` loads in ``dagster
dev``, the global asset lineage shows the demo's tables, a materialization of the reload
asset ``dim/customers`` shows on the asset's page, a fact's block partition shows with its checks,
and a merge view's units show on its Events tab with their strategies, and its checks on its Checks
tab; a unit run by the follow job (continuous mode) shows as its block partition's materialization in
that run, with its checks. Screenshots go to ``artifacts/ui/``."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from resources.core.settings import Settings
from tests.ui.conftest import ROOT, VENV_BIN, DagsterDev

pytestmark = [pytest.mark.ui, pytest.mark.slow]

DEMO_ASSETS = ["customers", "orders", "order_items", "daily_revenue"]
GROUPS = ["stage", "dim", "fact", "mart"]


def _text(driver: Any) -> str:
    from selenium.webdriver.common.by import By

    try:
        return str(driver.find_element(By.TAG_NAME, "body").text)
    except Exception:  # noqa: BLE001 - the page may be re-rendering
        return ""


def _wait_for(driver: Any, what: str, check: Callable[[str], bool], timeout: float = 60) -> str:
    """Poll the page's visible text until ``check`` passes; fail with the text seen last."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = _text(driver)
        if check(text):
            return text
        time.sleep(0.5)
    pytest.fail(f"page {driver.current_url} never showed {what} within {timeout}s; it showed:\n{text[:3000]}")


def _open(driver: Any, dev: DagsterDev, path: str) -> None:
    """Open a page of the UI with the one-time "Join the Dagster community" dialog already
    dismissed (it covers the page 1 s after load when served from 127.0.0.1)."""
    if not driver.current_url.startswith(dev.url):
        driver.get(f"{dev.url}/server_info")
        driver.execute_script("window.localStorage.setItem('communityNux', JSON.stringify('1'))")
    driver.get(f"{dev.url}{path}")


def _follows(text: str, label: str, value: str) -> bool:
    """Whether the page's line ``label`` (a metadata key) is followed by the line ``value``."""
    lines = text.split("\n")
    return any(a == label and b == value for a, b in zip(lines, lines[1:], strict=False))


def _settle(seconds: float = 1.5) -> None:
    time.sleep(seconds)  # graph layout animation / late-arriving live data, before a screenshot


def test_asset_lineage_shows_demo_tables(dagster_dev: DagsterDev, driver: Any, artifacts: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    # "Lineage" in the navigation: the global asset graph. With several groups it starts with
    # every group collapsed; "Expand all groups" is the graph's Alt+E shortcut.
    _open(driver, dagster_dev, "/asset-groups")
    _wait_for(driver, f"the groups {GROUPS}", lambda t: "Global asset lineage" in t and all(g in t.split("\n") for g in GROUPS),
              timeout=90)
    _settle(1)
    ActionChains(driver).key_down(Keys.ALT).send_keys("e").key_up(Keys.ALT).perform()
    text = _wait_for(driver, f"the assets {DEMO_ASSETS}", lambda t: all(a in t.split("\n") for a in DEMO_ASSETS))
    _settle()
    driver.save_screenshot(str(artifacts / "asset_lineage.png"))
    lines = text.split("\n")
    assert lines.count("customers") >= 2 and lines.count("orders") >= 2, "stage and dim/fact nodes both shown"
    assert "expanded=" in driver.current_url, driver.current_url


def test_materialized_dim_customers_shows_on_asset_page(dagster_dev: DagsterDev, driver: Any, artifacts: Path) -> None:
    _open(driver, dagster_dev, "/assets/dim/customers")
    _wait_for(driver, "dim/customers not materialized yet",
              lambda t: "Latest materialization" in t and "Never materialized" in t, timeout=90)
    _settle(0.5)
    driver.save_screenshot(str(artifacts / "dim_customers_before.png"))

    # A one-off run in the same instance and warehouse (its Spark: the tests' Connect server, tests/ui/conftest.py).
    done = subprocess.run(
        [str(VENV_BIN / "dagster"), "asset", "materialize", "-m", "platform_assets.dagster.definitions",
         "--select", "dim/customers"],
        cwd=ROOT, env=dagster_dev.env, capture_output=True, text=True, timeout=240,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"dagster asset materialize failed ({done.returncode}):\n{output[-5000:]}"
    m = re.search(r" - ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}) - .*RUN_SUCCESS", output)
    assert m, f"no RUN_SUCCESS in the output:\n{output[-5000:]}"
    run_id = m.group(1)

    # It really rebuilt the dimension from the seeded stage layer: one row per customer.
    settings = Settings.from_env(dagster_dev.env)
    stage = DeltaTable(settings.table_path("stage.customers")).to_pyarrow_table(columns=["customer_id"])
    dim = DeltaTable(settings.table_path("dim.customers")).to_pyarrow_table(columns=["customer_id"])
    assert dim.num_rows == len(set(stage.column("customer_id").to_pylist())) > 0

    _open(driver, dagster_dev, "/assets/dim/customers")
    _wait_for(driver, "a latest materialization",
              lambda t: re.search(r"Latest materialization\n[^\n]*\bago\b", t) is not None and "Never materialized" not in t)
    _settle()
    driver.save_screenshot(str(artifacts / "dim_customers_materialized.png"))

    _open(driver, dagster_dev, "/assets/dim/customers?view=events")
    _wait_for(driver, f"the materialization of run {run_id[:8]}", lambda t: f"Materialized in run {run_id[:8]}" in t)
    _settle()
    driver.save_screenshot(str(artifacts / "dim_customers_events.png"))


def _cli(dev: DagsterDev, *args: str, timeout: float = 240) -> str:
    done = subprocess.run(list(args), cwd=ROOT, env=dev.env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(args[:4])} failed ({done.returncode}):\n{output[-5000:]}"
    return done.stdout


def test_a_materialized_block_and_a_view_unit_show_with_their_checks_on_the_asset_pages(dagster_dev: DagsterDev, driver: Any,
                                                                     artifacts: Path) -> None:
    # The planner sensor (running by default) plans blocks and queues their runs on its own;
    # the queue is held here, but a queued run already announces its checks, and the checks tab
    # shows each check's latest execution: a run the sensor queues after ours would show our
    # checks as "In Progress" forever. Stop it as a user pausing automation would, and let a
    # tick already under way finish before the run whose checks the page must show.
    _cli(dagster_dev, str(VENV_BIN / "dagster"), "sensor", "stop", "tidemark_planner", "-m", "platform_assets.dagster.definitions")
    time.sleep(20)
    # fact.orders waits for dim.customers to be fresh: rebuild it first (a no-op if it is).
    _cli(dagster_dev, str(VENV_BIN / "dagster"), "asset", "materialize", "-m", "platform_assets.dagster.definitions",
         "--select", "dim/customers")
    # The documented path: plan the next block (adds its partition), then materialize it.
    key = _cli(dagster_dev, str(VENV_BIN / "tidemark"), "plan", "fact.orders", timeout=120).split()[-1]
    assert re.fullmatch(r"\d{8}", key), key
    _cli(dagster_dev, str(VENV_BIN / "dagster"), "asset", "materialize", "-m", "platform_assets.dagster.definitions",
         "--select", "fact/orders", "--partition", key)

    _open(driver, dagster_dev, "/assets/fact/orders?view=events")
    _wait_for(driver, f"the materialization of block partition {key}", lambda t: f"Partition {key} materialized in run" in t, timeout=90)
    _settle()
    driver.save_screenshot(str(artifacts / "fact_orders_block_events.png"))

    _open(driver, dagster_dev, "/assets/fact/orders?view=checks")
    text = _wait_for(driver, "the block checks rows, lag and nulls with results",
                     lambda t: all(c in t.split("\n") for c in ("rows", "lag", "nulls")) and ("Passed" in t or "Failed" in t),
                     timeout=90)
    _settle()
    driver.save_screenshot(str(artifacts / "fact_orders_checks.png"))
    assert "Passed" in text

    # A merge view is one unpartitioned asset (docs/dagster.md, "Why a merge view has no
    # partitions"): each of its units is a materialization with its strategy and figures, and its
    # checks. Two units: the first builds the view, the second, after a new block of its base,
    # re-derives only what that block touches.
    strategies = []
    for unit in (1, 2):
        if unit == 2:  # new orders and lines, older than fact.order_items' 5 s delay when it runs
            _cli(dagster_dev, sys.executable, "-m", "platform_assets.demo.feeder", "--iterations", "1", "--interval", "1",
                 "--orders", "10")
            time.sleep(6)
        # The view's base caught up by the command line, then the view's unit through Dagster.
        _cli(dagster_dev, str(VENV_BIN / "tidemark"), "run", "--until-caught-up", "dim.customers", "fact.orders",
             "fact.order_items")
        _cli(dagster_dev, str(VENV_BIN / "dagster"), "asset", "materialize", "-m", "platform_assets.dagster.definitions",
             "--select", "mart/daily_revenue")
        _open(driver, dagster_dev, "/assets/mart/daily_revenue?view=events")
        text = _wait_for(driver, f"unit {unit}'s materialization with its strategy and figures",
                         lambda t, n=unit: _follows(t, "block", str(n)) and "strategy" in t.split("\n")
                         and "rows_inserted" in t.split("\n"), timeout=90)
        _settle()
        driver.save_screenshot(str(artifacts / f"daily_revenue_unit{unit}_events.png"))
        lines = text.split("\n")
        strategies.append(lines[lines.index("strategy") + 1])
    assert strategies[0].startswith("full") and strategies[1].startswith("incremental"), strategies

    _open(driver, dagster_dev, "/assets/mart/daily_revenue?view=checks")
    text = _wait_for(driver, "the unit checks offset_age, late_rows and refresh with results",
                     lambda t: all(c in t.split("\n") for c in ("offset_age", "late_rows", "refresh"))
                     and "Passed" in t, timeout=90)
    _settle()
    driver.save_screenshot(str(artifacts / "daily_revenue_checks.png"))


def test_a_followed_unit_shows_as_its_partitions_materialization_with_its_checks(dagster_dev: DagsterDev, driver: Any,
                                                                                artifacts: Path, tmp_path: Path) -> None:
    # New orders, then the lineage followed by one run of the tidemark_follow job (continuous mode,
    # docs/dagster.md) until it has been idle for 5 s: every unit it runs is a materialization of its
    # asset in that run, as a run's unit is.
    _cli(dagster_dev, sys.executable, "-m", "platform_assets.demo.feeder", "--iterations", "1", "--interval", "1",
         "--orders", "10")
    config = tmp_path / "follow.yaml"
    config.write_text("ops:\n  follow:\n    config: {until_idle_s: 5.0, max_seconds: 300.0}\n")
    out = subprocess.run([str(VENV_BIN / "dagster"), "job", "execute", "-m", "platform_assets.dagster.definitions",
                          "-j", "tidemark_follow", "-c", str(config)],
                         cwd=ROOT, env=dagster_dev.env, capture_output=True, text=True, timeout=420)
    output = out.stdout + out.stderr
    assert out.returncode == 0, f"the follow run failed ({out.returncode}):\n{output[-5000:]}"
    m = re.search(r" - ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}) - .*RUN_SUCCESS", output)
    assert m, f"no RUN_SUCCESS in the output:\n{output[-5000:]}"
    run = m.group(1)[:8]

    _open(driver, dagster_dev, "/assets/fact/orders?view=events")
    text = _wait_for(driver, f"a block partition materialized in the follow run {run}",
                     lambda t: re.search(rf"Partition \d{{8}} materialized in run {run}", t) is not None, timeout=90)
    _settle()
    driver.save_screenshot(str(artifacts / "fact_orders_followed_events.png"))
    assert "base_rows" in text.split("\n"), "the block's metadata, as a run's"

    _open(driver, dagster_dev, "/assets/fact/orders?view=checks")
    _wait_for(driver, "the followed block's checks rows, lag and nulls with results",
              lambda t: all(c in t.split("\n") for c in ("rows", "lag", "nulls")) and ("Passed" in t or "Failed" in t)
              and "In Progress" not in t, timeout=90)
    _settle()
    driver.save_screenshot(str(artifacts / "fact_orders_followed_checks.png"))

    _open(driver, dagster_dev, f"/runs/{m.group(1)}")
    _wait_for(driver, "the follow run's page naming its job", lambda t: "tidemark_follow" in t, timeout=60)
    _settle()
    driver.save_screenshot(str(artifacts / "follow_run.png"))
