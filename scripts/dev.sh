#!/usr/bin/env bash
# Local Dagster for Tidemark: set up (if needed), start a warm Spark Connect server (so a block
# run does not start its own JVM), seed the demo sources once if they are empty, keep appending
# rows in the background (platform_assets.demo.feeder), and run `dagster dev` (webserver + daemon) on
# http://127.0.0.1:${PORT:-3000}. Ctrl-C or SIGTERM stops all of it within seconds.
#
#   ./scripts/dev.sh                    # state in ./.tidemark, Dagster's in ./.tidemark/dagster
#   PORT=3001 FEED_INTERVAL=10 FEED_ORDERS=20 ./scripts/dev.sh
#   FEED=0 ./scripts/dev.sh             # no background feeder
#   COLLECT=0 ./scripts/dev.sh          # no event collector (else on COLLECTOR_PORT, default 8421)
#   TIDEMARK_MODE=runs ./scripts/dev.sh # a Dagster run per unit, requested by the planner sensor; the
#                                       # default here is follow: one long-lived tidemark_follow run
#                                       # runs every unit as soon as it is due (docs/follow.md)
#   SPARK=local ./scripts/dev.sh        # every run starts its own local JVM (no Connect server)
#   SPARK_PORT=15010 ./scripts/dev.sh   # the Connect server's port (default 15002)
#   ./scripts/dev.sh --profile prod     # (or PROFILE=prod) Dagster's instance and the offsets in
#                                       # PostgreSQL: a local server under $TIDEMARK_HOME/postgres
#                                       # (port PG_PORT, default 15432), stopped on exit; or your own
#                                       # with TIDEMARK_DAGSTER_PG_URL=postgresql+psycopg2://... set
#
# Nothing is ever wiped: remove $TIDEMARK_HOME yourself to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
profile="${PROFILE:-embedded}"
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="${2:-}"; shift 2 || shift ;;
    --profile=*) profile="${1#--profile=}"; shift ;;
    *) echo "dev: unknown argument '$1' (usage: ./scripts/dev.sh [--profile embedded|prod])" >&2; exit 2 ;;
  esac
done
if [ "$profile" != embedded ] && [ "$profile" != prod ]; then
  echo "dev: --profile '$profile': use embedded (SQLite, the default) or prod (PostgreSQL)" >&2; exit 2
fi
./scripts/setup.sh

export TIDEMARK_HOME="${TIDEMARK_HOME:-$PWD/.tidemark}"
instance_yaml=dagster.yaml
if [ "$profile" = prod ]; then
  instance_yaml=dagster.prod.yaml  # the same settings, storage in PostgreSQL; a Dagster home of its own
  export DAGSTER_HOME="${DAGSTER_HOME:-$TIDEMARK_HOME/dagster-prod}"
fi
export DAGSTER_HOME="${DAGSTER_HOME:-$TIDEMARK_HOME/dagster}"
mkdir -p "$DAGSTER_HOME"
if [ ! -f "$DAGSTER_HOME/dagster.yaml" ]; then
  cp "$instance_yaml" "$DAGSTER_HOME/dagster.yaml"
fi
export TIDEMARK_MODE="${TIDEMARK_MODE:-follow}"
echo "dev: TIDEMARK_HOME=$TIDEMARK_HOME DAGSTER_HOME=$DAGSTER_HOME TIDEMARK_MODE=$TIDEMARK_MODE"
# The event collector's token secrets (demo/intake.yaml): throw-away ones unless you set yours.
export TIDEMARK_TOKEN_WEB="${TIDEMARK_TOKEN_WEB:-dev-web-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
export TIDEMARK_TOKEN_BACKEND="${TIDEMARK_TOKEN_BACKEND:-dev-backend-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')}"

feeder_pid=""
collector_pid=""
dagster_pid=""
spark_started=0
pg_started=0
cleanup() {
  trap - INT TERM EXIT
  # Ctrl-C also ends a `| tee` reading this output: a write to it must not kill the cleanup.
  trap '' PIPE
  if [ -n "$dagster_pid" ] && kill -0 "$dagster_pid" 2>/dev/null; then
    echo "dev: stopping dagster dev (pid $dagster_pid)" 2>/dev/null || true
    kill -TERM "$dagster_pid" 2>/dev/null || true
    for _ in $(seq 1 25); do kill -0 "$dagster_pid" 2>/dev/null || break; sleep 0.2; done  # 5 s to shut down
    # Its process group: the webserver, the daemon, code servers and any run still going.
    kill -KILL -- "-$dagster_pid" 2>/dev/null || true
  fi
  if [ -n "$feeder_pid" ] && kill -0 "$feeder_pid" 2>/dev/null; then
    kill "$feeder_pid" 2>/dev/null || true
    wait "$feeder_pid" 2>/dev/null || true
  fi
  if [ -n "$collector_pid" ] && kill -0 "$collector_pid" 2>/dev/null; then  # SIGTERM: its files rotate to ready/
    kill -TERM "$collector_pid" 2>/dev/null || true
    wait "$collector_pid" 2>/dev/null || true
  fi
  if [ "$spark_started" = 1 ]; then
    .venv/bin/tidemark spark down 2>/dev/null || true
  fi
  if [ "$pg_started" = 1 ]; then  # after Dagster: its processes write to it until they stop
    .venv/bin/tidemark postgres down 2>/dev/null || true
  fi
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM

if [ "$profile" = prod ]; then
  if [ -z "${TIDEMARK_DAGSTER_PG_URL:-}" ]; then
    # A server already running under this state dir (tidemark postgres up) is used and left running.
    pg=$(.venv/bin/tidemark postgres status 2>/dev/null || true)
    if [ -z "$(sed -n 's/^export TIDEMARK_DAGSTER_PG_URL=//p' <<<"$pg")" ]; then
      echo "dev: starting PostgreSQL under $TIDEMARK_HOME/postgres (the Dagster instance and the offsets)"
      pg_started=1
      pg=$(.venv/bin/tidemark postgres up --port "${PG_PORT:-15432}")
    fi
    TIDEMARK_DAGSTER_PG_URL=$(sed -n 's/^export TIDEMARK_DAGSTER_PG_URL=//p' <<<"$pg")
    export TIDEMARK_DAGSTER_PG_URL  # the offsets default to the same database (resources/core/settings.py)
  fi
  export TIDEMARK_PROFILE=prod
  echo "dev: prod profile: Dagster instance in PostgreSQL at ${TIDEMARK_DAGSTER_PG_URL#*@} (offsets: the same database unless TIDEMARK_OFFSETS_URL says otherwise)"
fi

# Seed the demo's history once (only if stage.orders is empty; never removes anything).
.venv/bin/python -m platform_assets.demo.feeder --seed "${SEED_ORDERS:-3000}" --iterations 0

if [ "${SPARK:-connect}" = "connect" ]; then
  # A server already running under this state dir (tidemark spark up) is used and left running.
  url=$(.venv/bin/tidemark spark status 2>/dev/null | sed -n 's/^export TIDEMARK_SPARK_MASTER=//p' || true)
  if [ -z "$url" ]; then
    echo "dev: starting the Spark Connect server (a warm JVM for every run; SPARK=local to skip)"
    spark_started=1
    url=$(.venv/bin/tidemark spark up --port "${SPARK_PORT:-15002}" | sed -n 's/^export TIDEMARK_SPARK_MASTER=//p')
  fi
  export TIDEMARK_SPARK_MASTER="$url"
  echo "dev: runs use the Spark Connect server at $TIDEMARK_SPARK_MASTER"
fi

collector_url=""
if [ "${COLLECT:-1}" != "0" ]; then
  .venv/bin/tidemark collect --port "${COLLECTOR_PORT:-8421}" &
  collector_pid=$!
  collector_url="http://127.0.0.1:${COLLECTOR_PORT:-8421}"
  echo "dev: event collector (pid $collector_pid) on $collector_url; the tidemark_intake_files sensor processes its rotated files"
fi

if [ "${FEED:-1}" != "0" ]; then
  .venv/bin/python -m platform_assets.demo.feeder --interval "${FEED_INTERVAL:-5}" --orders "${FEED_ORDERS:-50}" \
    ${collector_url:+--collector "$collector_url"} &
  feeder_pid=$!
  echo "dev: feeder running (pid $feeder_pid), one line per append"
fi

# In the background in its own process group, and waited for: a signal to this script runs the
# traps at once (bash defers traps while a foreground child runs) and they stop the whole group.
setsid .venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "${PORT:-3000}" &
dagster_pid=$!
wait "$dagster_pid"
