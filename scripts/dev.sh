#!/usr/bin/env bash
# Local Dagster for Tidemark: set up (if needed), seed the demo sources once if they are empty,
# keep appending rows in the background (platform_assets.feeder), and run `dagster dev`
# (webserver + daemon) on http://127.0.0.1:${PORT:-3000}. Ctrl-C stops both.
#
#   ./scripts/dev.sh                    # state in ./.tidemark, Dagster's in ./.tidemark/dagster
#   PORT=3001 FEED_INTERVAL=10 FEED_ORDERS=20 ./scripts/dev.sh
#   FEED=0 ./scripts/dev.sh             # no background feeder
#
# Nothing is ever wiped: remove $TIDEMARK_HOME yourself to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

export TIDEMARK_HOME="${TIDEMARK_HOME:-$PWD/.tidemark}"
export DAGSTER_HOME="${DAGSTER_HOME:-$TIDEMARK_HOME/dagster}"
mkdir -p "$DAGSTER_HOME"
if [ ! -f "$DAGSTER_HOME/dagster.yaml" ]; then
  cp dagster.yaml "$DAGSTER_HOME/dagster.yaml"
fi
echo "dev: TIDEMARK_HOME=$TIDEMARK_HOME DAGSTER_HOME=$DAGSTER_HOME"

# Seed the demo's history once (only if stage.orders is empty; never removes anything).
.venv/bin/python -m platform_assets.feeder --seed "${SEED_ORDERS:-3000}" --iterations 0

feeder_pid=""
stop_feeder() {
  if [ -n "$feeder_pid" ] && kill -0 "$feeder_pid" 2>/dev/null; then
    kill "$feeder_pid" 2>/dev/null || true
    wait "$feeder_pid" 2>/dev/null || true
  fi
  feeder_pid=""
}
trap stop_feeder EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if [ "${FEED:-1}" != "0" ]; then
  .venv/bin/python -m platform_assets.feeder --interval "${FEED_INTERVAL:-5}" --orders "${FEED_ORDERS:-50}" &
  feeder_pid=$!
  echo "dev: feeder running (pid $feeder_pid), one line per append"
fi

# In the foreground (Ctrl-C reaches it), not exec: the EXIT trap stops the feeder afterwards.
.venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "${PORT:-3000}"
