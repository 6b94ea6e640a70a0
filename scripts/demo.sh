#!/usr/bin/env bash
# Set up (if needed) and run the demo pipeline on embedded defaults:
# local Spark, a local Delta warehouse and a SQLite offset store under .tidemark/.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/tidemark demo "$@"
