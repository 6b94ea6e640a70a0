"""``tidemark follow``: continuous mode, one resident process running every unit as it becomes due
(:mod:`platform_assets.follow.loop`). Stops on SIGINT or SIGTERM after the units running finish."""

from __future__ import annotations

import argparse
import datetime as dt
import signal
import sys
import threading
from typing import Any

from lineage.core.errors import first_line
from platform_assets.cli.common import format_cell, settings_from


def _line(event: Any) -> str:
    at = dt.datetime.fromtimestamp(event.at).strftime("%H:%M:%S")
    r = event.result
    if event.error is not None:
        return f"{at} {event.work:<24} FAILED: {first_line(event.error)} [{event.wait}]"
    if r is None:
        return f"{at} {event.work:<24} waits: {event.wait}"
    if hasattr(r, "results"):  # the intake's units
        return f"{at} {event.work:<24} {r.reason}"
    if hasattr(r, "replicator"):  # a replicator's unit
        counts = "; ".join(f"{t} " + ",".join(f"{k}={v}" for k, v in c.items()) for t, c in r.tables.items())
        lag = f" lag {r.lag_s:.1f}s" if r.lag_s is not None else ""
        return f"{at} {event.work:<24} {r.reason}" + (f" [{counts}]" if counts else "") + f"{lag} ({r.duration_s:.1f}s)"
    rng = f" {format_cell(r.block.last)} .. {format_cell(r.block.next)}" if r.block else ""
    extra = " [recovered: data had landed, offset caught up]" if r.recovered else ""
    phases = r.stats.get("phases_s") or {}
    where = " (" + " ".join(f"{k} {v:.1f}" for k, v in phases.items() if v >= 0.05) + ")" if phases else ""
    return (f"{at} {event.work:<24} {r.reason:<10} rows={r.rows:<7} delta v{r.delta_version} {r.duration_s:5.1f}s"
            f"{where}{rng}{extra}")


def cmd_follow(args: argparse.Namespace) -> int:
    from lineage.spec.loader import load_lineage
    from platform_assets.follow.loop import Follower, batch_intake

    settings = settings_from(args)
    lineage = load_lineage(settings.lineage)
    follower = Follower(settings, lineage, names=args.names or None, interval_s=args.interval, intake=batch_intake(),
                        report=lambda e: print(_line(e), flush=True,
                                               file=sys.stderr if e.error is not None else sys.stdout))
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        print(f"follow: {signal.Signals(signum).name}: stopping after the units running now", file=sys.stderr, flush=True)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(f"follow: {len(follower.works)} topic(s) and replicator(s) on {follower.threads} thread(s), looking every "
          f"{args.interval:g} s (stop: Ctrl-C or SIGTERM)", flush=True)
    for name, why in follower.left_out.items():
        print(f"follow: {name} not followed: {why}", file=sys.stderr, flush=True)
    try:
        units = follower.run(stop, until_idle_s=args.until_idle, max_seconds=args.max_seconds)
    finally:
        follower.close()
    print(f"follow: stopped after {units} unit(s)", flush=True)
    failing = [w.name for w in follower.works.values() if w.failures]
    if failing:  # a script or test that follows until idle must not take a failing topic for done
        print(f"error: follow stopped with {len(failing)} topic(s) failing: {', '.join(failing)} (tidemark lag says "
              f"why)", file=sys.stderr, flush=True)
        return 1
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("follow", help="continuous mode: one resident process runs every unit (topics, replicators) "
                                      "the moment it is due, until stopped")
    p.add_argument("names", nargs="*", help="topics, replicators (cdc:NAME) and the event intake (events) to follow "
                                            "(default: all; events when an intake config is set or present)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between two looks at the inputs (default 0.5)")
    p.add_argument("--until-idle", type=float, default=None, metavar="SECONDS",
                   help="stop once no unit ran for this long and none is due (for scripts and tests)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this long")
    p.set_defaults(func=cmd_follow)
