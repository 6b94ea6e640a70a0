"""What a follower costs while nothing changes (issue 55's idle target: no Spark job, under 5 % of
one core).

    .venv/bin/python bench/follow_idle.py [--seconds 60] [--orders 3000]

On a fresh temporary state dir it seeds the demo's sources, follows the demo lineage in this
process (local Spark) until every topic waits, then measures for ``--seconds`` while nothing
changes: the CPU time of this process and of its Spark JVM (from /proc), and the Spark jobs started
meanwhile (the SparkContext's status tracker). It prints both against the targets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lineage.spec.loader import load_lineage  # noqa: E402
from resources.core.settings import Settings  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to measure while idle (default 60)")
    p.add_argument("--orders", type=int, default=3000, help="orders the demo's sources are seeded with (default 3000)")
    args = p.parse_args()
    home = Path(tempfile.mkdtemp(prefix="tidemark-follow-idle-"))
    os.environ["TIDEMARK_HOME"] = str(home)
    try:
        import subprocess

        subprocess.run([sys.executable, "-m", "platform_assets.demo.feeder", "--seed", str(args.orders), "--iterations",
                        "0"], cwd=ROOT, check=True, capture_output=True)
        from platform_assets.follow.loop import Follower

        settings = Settings.from_env(home=home, lineage=ROOT / "demo" / "lineage" / "shop.yaml")
        follower = Follower(settings, load_lineage(settings.lineage))
        stop = threading.Event()
        print(f"following the demo lineage ({len(follower.works)} topics) until every topic waits ...", flush=True)
        t0 = time.monotonic()
        units = follower.run(stop, until_idle_s=10, max_seconds=900)
        print(f"caught up: {units} units in {time.monotonic() - t0:.0f} s; now idle for {args.seconds:.0f} s", flush=True)
        sc = follower.spark.sparkContext
        jvm = int(sc._jvm.ProcessHandle.current().pid())
        jobs_before = len(sc.statusTracker().getJobIdsForGroup(None))
        cpu_before = cpu_seconds(os.getpid()) + cpu_seconds(jvm)
        stop = threading.Event()
        timer = threading.Timer(args.seconds, stop.set)
        timer.start()
        t1 = time.monotonic()
        idle_units = follower.run(stop) - units  # (run returns the units of the follower so far)
        elapsed = time.monotonic() - t1
        cpu = cpu_seconds(os.getpid()) + cpu_seconds(jvm) - cpu_before
        jobs = len(sc.statusTracker().getJobIdsForGroup(None)) - jobs_before
        share = 100 * cpu / elapsed
        print(f"idle {elapsed:.0f} s: units {idle_units}, Spark jobs {jobs} (target 0: {'PASS' if jobs == 0 else 'MISS'}), "
              f"CPU {cpu:.2f} s = {share:.1f} % of one core, Python and JVM (target < 5 %: "
              f"{'PASS' if share < 5 else 'MISS'})", flush=True)
        follower.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
