"""Fixtures of the browser tests: a real ``dagster dev`` (webserver + daemon) on a free loopback
port over temporary Dagster and Tidemark homes with seeded demo sources, and a headless
Debian Chromium driven by Selenium through ``/usr/bin/chromedriver``.

A missing browser is a failure, not a skip: ``./scripts/setup.sh`` installs it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
CHROMIUM = Path(os.environ.get("TIDEMARK_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("TIDEMARK_CHROMEDRIVER", "/usr/bin/chromedriver"))
ARTIFACTS = ROOT / "artifacts" / "ui"
START_TIMEOUT_S = 180


def pytest_configure(config: pytest.Config) -> None:
    # Until pyproject.toml registers the marker (--strict-markers rejects unknown ones).
    if not any(line.split(":")[0].strip() == "ui" for line in config.getini("markers")):
        config.addinivalue_line("markers", "ui: drives the Dagster UI in a headless Chromium (dagster dev subprocess)")


@dataclass(frozen=True)
class DagsterDev:
    url: str
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes]

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=3) as r:
            return r.status == 200 and b"dagster_webserver_version" in r.read()
    except OSError:
        return False


_LOCATIONS_QUERY = """{ workspaceOrError { __typename ... on PythonError { message }
  ... on Workspace { locationEntries { name loadStatus locationOrLoadError { __typename
    ... on PythonError { message stack } } } } } }"""


def _location_status(url: str) -> tuple[bool, str]:
    """(loaded, error): whether every code location finished loading, and its load error if any."""
    req = urllib.request.Request(f"{url}/graphql", data=json.dumps({"query": _LOCATIONS_QUERY}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            data = json.loads(r.read())["data"]["workspaceOrError"]
    except (OSError, ValueError, KeyError, TypeError):
        return False, ""
    if data.get("__typename") == "PythonError":
        return True, data.get("message", "")
    entries = data.get("locationEntries") or []
    errors = [f"{e['name']}: {e['locationOrLoadError'].get('message', '')}{''.join(e['locationOrLoadError'].get('stack') or [])}"
              for e in entries if (e.get("locationOrLoadError") or {}).get("__typename") == "PythonError"]
    loaded = bool(entries) and all(e.get("loadStatus") == "LOADED" for e in entries)
    return loaded, "\n".join(errors)


def _default_sigint() -> None:
    # A parent started in the background may ignore SIGINT; dagster dev maps SIGTERM onto the
    # SIGINT handler, so restore the default or it would ignore both.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_group(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """Terminate the process group of ``proc`` (dagster dev, its webserver, daemon and code
    servers); SIGKILL whatever is left after ``timeout``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived dagster dev
    except ProcessLookupError:
        pass
    proc.wait(10)


@pytest.fixture(scope="module")
def browser_binaries() -> tuple[Path, Path]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not (p.is_file() and os.access(p, os.X_OK))]
    if missing:
        pytest.fail(f"browser tests need Debian chromium and chromium-driver, missing: {', '.join(missing)}; "
                    "run ./scripts/setup.sh (it installs them)", pytrace=False)
    return CHROMIUM, CHROMEDRIVER


@pytest.fixture(scope="module", autouse=True)
def _require_browser(browser_binaries: tuple[Path, Path]) -> None:
    """Fail fast, before starting anything, when the browser is missing."""


@pytest.fixture(scope="module")
def ui_env(tmp_path_factory: pytest.TempPathFactory, cli_spark_server: str) -> Iterator[dict[str, str]]:
    """Environment for dagster dev and the CLI: temporary TIDEMARK_HOME and DAGSTER_HOME (with
    the repo's dagster.yaml, queue held), the demo lineage, and demo sources seeded with ShopFeeder.

    Spark: the session's shared Connect server (fixture ``cli_spark_server``, what a production
    deployment runs, docs/production.md), so each ``dagster asset materialize`` and ``tidemark run``
    connects in about a second instead of starting a JVM of its own; its catalog is emptied after
    the module. ``TIDEMARK_TEST_CLI_SPARK=local`` gives every process its own local[2] JVM."""
    from platform_assets.demo.feeder import seed_if_empty
    from resources.core.settings import Settings
    from tests.platform_assets.shop import reset_cli_catalog

    base = tmp_path_factory.mktemp("ui")
    tidemark_home, dagster_home = base / "tidemark", base / "dagster"
    dagster_home.mkdir(parents=True)
    # The repo's instance settings, except that queued runs never launch: the planner sensor
    # (running by default) would otherwise start a Spark run per topic on its own, competing
    # for the cores and the topics' locks with the one-off run the test makes. Runs executed
    # in-process by `dagster asset materialize` do not go through the queue.
    instance = yaml.safe_load((ROOT / "dagster.yaml").read_text()) or {}
    instance.setdefault("concurrency", {}).setdefault("runs", {})["max_concurrent_runs"] = 0
    (dagster_home / "dagster.yaml").write_text(yaml.safe_dump(instance, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDEMARK_", "DAGSTER_"))}
    env.update({
        "TIDEMARK_HOME": str(tidemark_home),
        "TIDEMARK_LINEAGE": str(ROOT / "demo" / "lineage"),
        "TIDEMARK_SPARK_MASTER": cli_spark_server,
        "TIDEMARK_DRIVER_MEMORY": "1g",
        "DAGSTER_HOME": str(dagster_home),
        "PYTHONPATH": str(ROOT),
        "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
    })
    settings = Settings.from_env(env)
    made = seed_if_empty(settings, orders=300, customers=40)
    assert made and made["orders"] == 300, made
    # One append through the feeder's command line too, as scripts/dev.sh runs it.
    fed = subprocess.run([sys.executable, "-m", "platform_assets.demo.feeder", "--iterations", "1", "--interval", "2",
                          "--orders", "10"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert fed.returncode == 0 and "feeder: appended 10 orders" in fed.stdout, fed.stdout + fed.stderr
    yield env
    reset_cli_catalog(cli_spark_server)


@pytest.fixture(scope="module")
def dagster_dev(ui_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterDev]:
    """``dagster dev -w workspace.yaml`` on a free port, up once ``/server_info`` answers."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("dagster-dev") / "dagster-dev.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(VENV_BIN / "dagster"), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
            cwd=ROOT, env=ui_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_default_sigint,  # noqa: PLW1509 - only resets one signal
        )
    dev = DagsterDev(url, ui_env, log, proc)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(url):
            if proc.poll() is not None:
                pytest.fail(f"dagster dev exited with code {proc.returncode} before serving:\n{dev.log_tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"dagster dev did not answer {url}/server_info within {START_TIMEOUT_S}s:\n{dev.log_tail()}")
            time.sleep(1)
        while True:  # the webserver answers before the code location has loaded
            loaded, error = _location_status(url)
            if error:
                pytest.fail(f"the code location of workspace.yaml failed to load in dagster dev:\n{error}", pytrace=False)
            if loaded:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the code location did not load within {START_TIMEOUT_S}s:\n{dev.log_tail()}")
            time.sleep(1)
        yield dev
    finally:
        _stop_group(proc)


@pytest.fixture(scope="module")
def driver(browser_binaries: tuple[Path, Path]) -> Iterator[Any]:
    """Headless Chromium (run as root: no sandbox) with a fresh profile directory."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = browser_binaries
    profile = tempfile.mkdtemp(prefix="tidemark-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1600,1000", f"--user-data-dir={profile}"):
        options.add_argument(arg)
    # An explicit driver path: Selenium Manager never runs (and never tries to download).
    service = Service(executable_path=str(chromedriver))
    browser = webdriver.Chrome(service=service, options=options)
    browser.set_page_load_timeout(60)
    try:
        yield browser
    finally:
        browser.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
