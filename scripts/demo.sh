#!/usr/bin/env bash
# Set up (if needed) and run the demo pipeline on embedded defaults:
# local Spark, a local Delta warehouse and a SQLite offset store under .tidemark/.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Throw-away secrets for the demo's event collector tokens (demo/intake.yaml), unless you set yours.
export TIDEMARK_TOKEN_WEB="${TIDEMARK_TOKEN_WEB:-demo-web-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
export TIDEMARK_TOKEN_BACKEND="${TIDEMARK_TOKEN_BACKEND:-demo-backend-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
exec .venv/bin/tidemark demo "$@"
