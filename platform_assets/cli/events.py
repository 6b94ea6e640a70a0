"""``tidemark events process|status|replay|stream``: the batch event processor's commands (issue 11).
``status`` never starts a JVM (and neither do the others: the intake writes with ``deltalake``).
The operations they run (``process_ready``, ``replay``, ``status``) are in
:mod:`platform_assets.intake.units`, which the Dagster intake job runs too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orjson

from lineage.intake.columns import parse_timestamp
from lineage.intake.config import Intake, IntakeConfigError, intake_path, load_intake
from platform_assets.cli.common import settings_from
from platform_assets.intake.units import process_ready, replay, status


def _intake(args: argparse.Namespace) -> Intake:
    return load_intake(intake_path(args.config), secrets=False)


def cmd_events(args: argparse.Namespace) -> int:
    try:
        intake = _intake(args)
    except IntakeConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = settings_from(args)
    if args.action == "process":
        results = process_ready(settings, intake, until_empty=args.until_empty)
        for r in results:
            print(f"{r.unit}" + (f" (+{r.files - 1} files)" if r.files > 1 else "") + f": {r.events_in} events, {r.written} rows written, {r.failed} failed, {r.skipped} skipped"
                  + "".join(f"\n  {k}: v{e['version']} {e.get('rows')} rows"
                            + (f", +{len(e['columns_added'])} columns" if e.get("columns_added") else "")
                            + (f", {e['unmapped_values']} unmapped values" if e.get("unmapped_values") else "")
                            + (f", {e['collided_values']} collided values" if e.get("collided_values") else "")
                            for k, e in r.tables.items()))
            for spec in intake.spec.destinations:
                n = r.failed_by_dest.get(spec.id, 0)
                if n and r.events_in and n / r.events_in > spec.failed_share_threshold:
                    print(f"  warning: {n} of {r.events_in} events failed for destination {spec.id} (over its "
                          f"failed_share_threshold {spec.failed_share_threshold:.0%}); see `tidemark events status`, "
                          "fix the config, then `tidemark events replay`", file=sys.stderr)
        print(f"{sum(r.files for r in results)} file(s) processed in {len(results)} unit(s)")
        return 0
    if args.action == "stream":
        from platform_assets.intake.stream import StreamLoop, describe

        loop = StreamLoop(settings, intake, args.destination or None, interval_ms=args.interval_ms,
                          max_events=args.max_events)
        print(f"streaming destination(s) {', '.join(s.id for s in loop.specs)} from {settings.events_dir() / 'incoming'} "
              f"(a micro-batch every {args.interval_ms} ms or {args.max_events} events); SIGTERM or Ctrl-C stops",
              flush=True)
        n = 0
        for mb in loop.run(once=args.once):
            n += 1
            print(describe(mb), flush=True)
        print(f"stream stopped after {n} micro-batch(es)", flush=True)
        return 0
    if args.action == "status":
        print(orjson.dumps(status(settings, intake), option=orjson.OPT_INDENT_2).decode())
        return 0
    since = None
    if args.since:
        try:
            since = parse_timestamp(args.since)
        except ValueError:
            print(f"error: --since {args.since!r} is not an ISO 8601 time (e.g. 2026-01-31T12:00:00Z)", file=sys.stderr)
            return 2
    done = replay(settings, intake, args.destination, since)
    for d, r in done.items():
        print(f"{d}: {r.events_in} failed events replayed: {r.written} rows written, {r.failed} still failing")
    if not done:
        print("no failed events to replay")
    return 0


def register(sub: Any) -> None:
    ev = sub.add_parser("events", help="process the collector's incoming files into Delta stage tables")
    acts = ev.add_subparsers(dest="action", required=True)
    p = acts.add_parser("process", help="process the ready incoming files in order")
    p.add_argument("--until-empty", action="store_true", help="also files that become ready meanwhile, until none is left")
    acts.add_parser("status", help="files pending / processed and failed events per destination (JSON; no JVM)")
    r = acts.add_parser("replay", help="send failed events through the pipeline again (after fixing the config)")
    r.add_argument("--destination", help="only this destination's failed events")
    r.add_argument("--since", help="only events that failed at or after this time (ISO 8601)")
    st = acts.add_parser("stream", help="apply the events of `mode: stream` destinations continuously, in micro-batches")
    st.add_argument("--destination", action="append", help="only this stream destination (repeatable)")
    st.add_argument("--interval-ms", type=int, default=500, help="a micro-batch at most this often (default 500)")
    st.add_argument("--max-events", type=int, default=10_000, help="at most this many events per micro-batch (default 10000)")
    st.add_argument("--once", action="store_true", help="apply what waits now, then exit")
    for a in (p, acts.choices["status"], r, st):
        a.add_argument("--config", help="intake YAML (env TIDEMARK_INTAKE; default demo/intake.yaml)")
        a.set_defaults(func=cmd_events)
