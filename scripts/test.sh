#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests, real Spark + Delta, a real
# PostgreSQL started by the tests, and the SIGKILL crash tests (marked slow).
# Pass pytest arguments through, e.g.  ./scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --with-browser
.venv/bin/ruff check lineage resources platform_assets tests bench
.venv/bin/mypy lineage resources platform_assets
exec .venv/bin/pytest "$@"
