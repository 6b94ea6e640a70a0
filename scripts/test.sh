#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests, real Spark + Delta, a real
# PostgreSQL started by the tests, and the SIGKILL crash tests (marked slow).
# Pass pytest arguments through, e.g.  ./scripts/test.sh -m "not slow"
# The main pass runs on two pytest-xdist workers (TIDEMARK_TEST_WORKERS=N, 1 for none).
# Then the engine's tests run once more against a local Spark Connect server
# (TIDEMARK_TEST_SPARK=connect): skipped when the arguments select tests (a path, -k) or with
# TIDEMARK_TEST_CONNECT=0. The main pass's own session evaluates expressions interpreted (no code
# generation: tests/conftest.py interpreted_conf, TIDEMARK_TEST_CODEGEN=on to generate); the
# Connect pass, the CLI's own JVMs and the Dagster runs generate code, as Spark does by default.
# Likewise the Dagster tests that use its storage (sensor ticks and partitions, runs and their
# events, the crash retry, the pools' concurrency slots) run once more on a PostgreSQL-backed
# instance (TIDEMARK_TEST_DAGSTER=postgres; TIDEMARK_TEST_PG_DAGSTER=0 skips).
#
# ./scripts/test.sh --fast [pytest args]: the fast tier, for every change (about 4 minutes on 2
# cores): ruff, mypy, every test that starts nothing heavy plus one real-engine test per module
# (marked fast: see tests/conftest.py), with no Connect or PostgreSQL second pass and no browser.
set -euo pipefail
cd "$(dirname "$0")/.."
# Every JVM the tests start (the tests' Spark, Connect servers, a cluster's master and workers, the
# CLI's and Dagster runs' sessions) compiles with C1 only and collects with the serial collector:
# the tests' tables are tiny and most JVMs live for seconds, so C2's compiler threads and the
# parallel collector's only compete for the two cores (measured: 20-36 % off a pair of test files
# run side by side). Not the product's default: a long-lived driver over big tables wants C2.
export JAVA_TOOL_OPTIONS="${JAVA_TOOL_OPTIONS:+$JAVA_TOOL_OPTIONS }-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
if [ "${1:-}" = "--fast" ]; then
  shift
  ./scripts/setup.sh
  .venv/bin/ruff check lineage resources platform_assets tests bench
  .venv/bin/mypy lineage resources platform_assets
  exec .venv/bin/pytest -m "fast" "$@"
fi
./scripts/setup.sh --with-browser
.venv/bin/ruff check lineage resources platform_assets tests bench
.venv/bin/mypy lineage resources platform_assets

selective=0
parallel=("-n" "${TIDEMARK_TEST_WORKERS:-2}" "--dist" "loadfile" "--no-loadscope-reorder")
for arg in "$@"; do
  if [ "$arg" = "-k" ] || [ -e "${arg%%::*}" ]; then selective=1; fi
  case "$arg" in -n|-n*|--numprocesses*|-p) parallel=() ;; esac
done
# The main pass on TIDEMARK_TEST_WORKERS pytest-xdist workers (default 2; 1 = no workers), a test
# file to a worker so module fixtures are built once; a selection (a path, -k) runs in-process.
if [ "$selective" = "1" ] || [ "${TIDEMARK_TEST_WORKERS:-2}" = "1" ]; then parallel=(); fi
.venv/bin/pytest ${parallel[@]+"${parallel[@]}"} "$@"
if [ "${TIDEMARK_TEST_CONNECT:-1}" != "0" ] && [ "$selective" = "0" ]; then
  echo "test: the engine's tests again, over Spark Connect (TIDEMARK_TEST_SPARK=connect)"
  # (on the main pass's workers too: each starts a Connect server of its own)
  # (not the ties property: it checks the planner's bounds, not the session; 2.5 min over Connect;
  # nor the additive view's unit-by-unit test, 5-7 min a case over Connect, nor two of the reverse
  # join's three cases: the driver's MERGE and Spark's over Connect are the keyed MERGE's test here,
  # a view's transform and MERGE in Spark over Connect the reverse join's and the late rows' tests)
  TIDEMARK_TEST_SPARK=connect .venv/bin/pytest ${parallel[@]+"${parallel[@]}"} -m "not slow" --durations=10 \
    --deselect tests/platform_assets/test_engine.py::test_incremental_equals_full_recompute_with_ties \
    tests/platform_assets/test_engine.py tests/platform_assets/test_recovery.py tests/platform_assets/test_spark_io.py \
    "tests/platform_assets/test_merge.py::test_reverse_join_rederives_only_the_affected_keys[keys-narrowed]" \
    tests/platform_assets/test_merge.py::test_late_rows_are_rederived_into_the_view_and_counted \
    tests/platform_assets/test_keyed_merge.py::test_rederived_rows_merged_from_the_driver_equal_sparks_merge \
    tests/platform_assets/test_cdc.py::test_seed_examples_replicated_exactly_once_and_resumed \
    tests/platform_assets/test_cdc.py::test_a_unit_never_splits_a_transaction \
    "tests/platform_assets/test_cdc.py::test_the_replicas_of_a_unit_land_at_once_each_on_a_session_of_its_own[columns]" \
    tests/platform_assets/test_cdc_apply.py::test_an_empty_arrow_batch_becomes_an_empty_frame_of_its_schema
fi
if [ "${TIDEMARK_TEST_PG_DAGSTER:-1}" != "0" ] && [ "$selective" = "0" ]; then
  echo "test: the Dagster storage tests again, on PostgreSQL (TIDEMARK_TEST_DAGSTER=postgres)"
  # "$@": e.g. -m "not slow" leaves out the crash and pool tests (each starts JVMs) here too
  TIDEMARK_TEST_DAGSTER=postgres .venv/bin/pytest ${parallel[@]+"${parallel[@]}"} --durations=10 "$@" tests/platform_assets/test_sensor.py \
    tests/platform_assets/test_dagster_crash.py tests/platform_assets/test_dagster_follow.py \
    tests/platform_assets/test_io_manager.py::test_two_concurrent_runs_of_a_topic_wait_for_its_pool
fi
