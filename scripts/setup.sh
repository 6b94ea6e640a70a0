#!/usr/bin/env bash
# Install what Tidemark needs on a fresh Debian machine, idempotently:
#   - Debian packages: Java 17 (Spark 4), PostgreSQL (offset store / tests), python3-venv,
#     and with --with-browser Chromium + chromedriver (UI tests)
#   - a virtualenv in .venv with tidemark and its dev tools
# Delta's jars come from Maven Central through Spark on first use (cached in ~/.ivy2.5.2).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
python3 -c "import venv, ensurepip" >/dev/null 2>&1 || need+=(python3-venv)
# --with-browser (the test script): Debian's chromium and its matching chromedriver for the
# Dagster UI tests; Selenium is pointed at /usr/bin/chromium{,driver}, nothing is downloaded.
if [ "${1:-}" = "--with-browser" ]; then
  [ -x /usr/bin/chromium ] || need+=(chromium)
  [ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
fi
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing Debian packages: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.tidemark-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing Python packages into .venv (first time takes a few minutes)"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e ".[dev]"
  touch "$stamp"
fi
