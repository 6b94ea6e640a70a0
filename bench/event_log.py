"""Where a Spark application's job time went, from its event log: by job description and by job group.

    TIDEMARK_SPARK_CONF="spark.eventLog.enabled=true;spark.eventLog.dir=/tmp/ev;spark.eventLog.compress=false" \\
        .venv/bin/python bench/freshness.py --dev 6m --mode follow --home /tmp/fb
    .venv/bin/python bench/event_log.py /tmp/ev/eventlog_v2_local-*  [--since-s 180] [--top 25]

Reads one application's uncompressed event log (a JSON event per line; Spark 4 writes it as a
directory of rolled ``events_<n>_*`` files, read in order, or one file) and prints, per job description (Delta's
status texts such as ``Compute snapshot for version: N``, or Spark's call site; numbers shown as
``N``) and per job group (``tidemark follow`` puts each unit's jobs in the group
``tidemark:<topic>``): the jobs, their wall seconds (submission to completion, summed: jobs that
overlap count twice) and their task seconds (executor run time summed over tasks: what they took
of the cores). ``--since-s``: only jobs submitted that many seconds or more after the
application started (leave a warm-up out).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _describe(props: dict[str, str], stages: list[dict[str, Any]]) -> str:
    text = (props.get("spark.job.description") or props.get("callSite.short")
            or (stages[-1].get("Stage Name") if stages else None) or "?")
    return re.sub(r"\d+", "N", text.splitlines()[0])[:90]


def _events(path: Path) -> Iterator[dict[str, Any]]:
    files = [path] if path.is_file() else sorted(path.glob("events_*"), key=lambda p: int(p.name.split("_")[1]))
    if not files:
        raise SystemExit(f"{path}: no Spark event log there (spark.eventLog.compress=false?)")
    for file in files:
        with file.open(errors="replace") as f:
            for line in f:
                yield json.loads(line)


def summarize(path: Path, since_s: float = 0.0) -> tuple[dict[str, list[float]], dict[str, list[float]], float]:
    """Per description and per group: [jobs, wall s, task s]; and the seconds the log spans."""
    start = end = None
    jobs: dict[int, dict[str, object]] = {}
    stage_job: dict[int, int] = {}
    task_ms: collections.Counter[int] = collections.Counter()
    for e in _events(path):
        kind = e.get("Event")
        if kind == "SparkListenerApplicationStart":
            start = e["Timestamp"]
        elif kind == "SparkListenerJobStart":
            props = e.get("Properties") or {}
            jobs[e["Job ID"]] = {"t0": e["Submission Time"], "desc": _describe(props, e.get("Stage Infos") or []),
                                 "group": props.get("spark.jobGroup.id") or "(none)"}
            for sid in e.get("Stage IDs", []):
                stage_job[sid] = e["Job ID"]
        elif kind == "SparkListenerJobEnd" and e["Job ID"] in jobs:
            jobs[e["Job ID"]]["t1"] = e["Completion Time"]
            end = e["Completion Time"]
        elif kind == "SparkListenerTaskEnd":
            job = stage_job.get(e["Stage ID"])
            metrics = e.get("Task Metrics") or {}
            if job is not None:
                task_ms[job] += int(metrics.get("Executor Run Time", 0))
    by_desc: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    by_group: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    first = (start or 0) + since_s * 1000
    for jid, j in jobs.items():
        if "t1" not in j or int(j["t0"]) < first:  # type: ignore[call-overload]
            continue
        wall = (int(j["t1"]) - int(j["t0"])) / 1000  # type: ignore[call-overload]
        for key, table in ((str(j["desc"]), by_desc), (str(j["group"]), by_group)):
            row = table[key]
            row[0] += 1
            row[1] += wall
            row[2] += task_ms[jid] / 1000
    return by_desc, by_group, ((end or first) - first) / 1000


def _print(title: str, table: dict[str, list[float]], top: int) -> None:
    total = sum(r[2] for r in table.values())
    print(f"\n{title:<92} {'jobs':>5} {'wall s':>8} {'task s':>8} {'share':>6}")
    for key, (n, wall, task) in sorted(table.items(), key=lambda kv: -kv[1][2])[:top]:
        print(f"{key:<92} {int(n):>5} {wall:>8.1f} {task:>8.1f} {task / total if total else 0:>6.0%}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="an application's uncompressed Spark event log (its directory or file)")
    p.add_argument("--since-s", type=float, default=0.0, help="leave out jobs submitted in the first seconds")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    by_desc, by_group, span = summarize(args.log, args.since_s)
    n = sum(int(r[0]) for r in by_desc.values())
    task = sum(r[2] for r in by_desc.values())
    print(f"{args.log}: {n} jobs over {span:.0f} s; task time {task:.1f} s "
          f"({task / span if span else 0:.2f} cores busy on average)")
    _print("by job description", by_desc, args.top)
    _print("by job group", by_group, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
