"""``tidemark cdc run|status|assess|pause|resume|delete``: the replicators of the lineage's ``cdc:``
entries (issue 10). ``status``, ``assess``, ``pause`` and ``resume`` never start a JVM."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lineage.cdc.changes import format_lsn
from lineage.core.errors import TidemarkError, first_line
from lineage.core.positions import Position
from lineage.spec.model import Lineage, Replicator
from platform_assets.cli.common import engine_from, format_table, settings_from

#: ``tidemark cdc run --until-caught-up``'s exit status when a replica is paused (it is not caught up)
EXIT_PAUSED = 3
STATES = ("SNAPSHOTTING", "REPLICATING", "PAUSED", "FAILING", "DROPPED")


def _lineage(args: argparse.Namespace) -> tuple[Any, Lineage]:
    from lineage.spec.loader import load_lineage

    settings = settings_from(args)
    return settings, load_lineage(settings.lineage)


def _replicators(lineage: Lineage, names: list[str] | None) -> list[Replicator]:
    if not lineage.replicators:
        raise TidemarkError("the lineage has no cdc: replicators (see docs/cdc.md)")
    for n in names or []:
        if n not in lineage.replicators:
            raise TidemarkError(f"unknown replicator '{n}' (known: {', '.join(lineage.replicators)})")
    return [lineage.replicators[n] for n in names] if names else list(lineage.replicators.values())


def _replicator_of(lineage: Lineage, replica: str) -> Replicator:
    rep = lineage.replicator_of(replica)
    if rep is None:
        raise TidemarkError(f"'{replica}' is not a replica of any replicator (replicas' schemas: "
                            f"{', '.join(r.spec.schema_ for r in lineage.replicators.values()) or 'none'})")
    return rep


def cmd_run(args: argparse.Namespace) -> int:
    from platform_assets.cdc.run import run_replicator

    eng = engine_from(args)
    not_caught_up = 0
    for rep in _replicators(eng.lineage, args.names):
        told: set[str] = set()
        for result in run_replicator(eng, rep, until_caught_up=args.until_caught_up):
            counts = "; ".join(f"{t} " + ",".join(f"{k}={v}" for k, v in c.items()) for t, c in result.tables.items())
            snaps = "; ".join(f"{t} snapshot {n} rows" for t, n in result.snapshots.items())
            print(f"{rep.name}: {result.reason}" + (f" [{snaps}]" if snaps else "") + (f" [{counts}]" if counts else "")
                  + (f" acked {format_lsn(result.acked)}" if result.acked is not None else "")
                  + (f" lag {result.lag_s:.1f}s" if result.lag_s is not None else "") + f" ({result.duration_s:.1f}s)")
            for replica, why in result.paused.items():
                print(f"{rep.name}: PAUSED {replica}: {why}", file=sys.stderr)
                told.add(replica)
        paused = {r[0]: r[5] for r in status_rows(eng.store, rep) if r[1] == "PAUSED"}
        for replica, why in paused.items():
            if replica not in told:
                print(f"{rep.name}: PAUSED {replica}: {why}", file=sys.stderr)
        if paused:
            not_caught_up += 1
            print(f"{rep.name}: NOT caught up: {len(paused)} replica(s) paused ({', '.join(sorted(paused))}); each "
                  f"line above says why and what to run (tidemark cdc status {rep.name})", file=sys.stderr)
    return EXIT_PAUSED if not_caught_up and args.until_caught_up else 0


def status_rows(store: Any, rep: Replicator) -> list[tuple[Any, ...]]:
    """One row per replica: replica, state, applied, units, last run, note (JVM-free). While the
    replicator's last unit failed (e.g. the source is down), its active replicas show FAILING."""
    own = store.get(rep.spec.state_key)
    failing = own.state.partition(":")[2].strip() if own is not None and own.state.startswith("failing") else ""
    rows = []
    for rec in store.list():
        if rec.processor != "cdc" or rec.topic == rep.spec.state_key or not rep.spec.holds(rec.topic):
            continue
        word, _, why = rec.state.partition(":")
        state = {"committed": "REPLICATING", "new": "SNAPSHOTTING", "planned": "REPLICATING"}.get(word.strip(), word.strip().upper())
        applied = "-" if rec.last.is_zero() else format_lsn(rec.last.id)
        if failing and state in ("REPLICATING", "SNAPSHOTTING"):
            state, why = "FAILING", f"the replicator's last unit failed (retried with backoff): {failing}"
        rows.append((rec.topic, state, applied, rec.seq, rec.run, why.strip()))
    return rows


def cmd_status(args: argparse.Namespace) -> int:
    from resources.state.offset_sql import open_settings_store

    settings, lineage = _lineage(args)
    store = open_settings_store(settings)
    try:
        for rep in _replicators(lineage, args.names):
            rec = store.get(rep.spec.state_key)
            head = f"replicator {rep.name} ({rep.spec.source}, {rep.where}): "
            if rec is None:
                print(head + "never run")
                continue
            pending = f", unit {rec.seq} pending up to {format_lsn(rec.source_version or 0)}" if rec.pending else ""
            print(head + f"unit {rec.seq}, changes numbered up to {rec.inputs.get('changes', 0)}, state {rec.state}{pending}")
            rows = status_rows(store, rep)
            if rep.spec.source == "postgres":
                print("  " + _slot_line(rep, [r[0] for r in rows]))
            print(format_table([(*r[:5], r[5][:70] + ("…" if len(r[5]) > 70 else "")) for r in rows],
                               ["replica", "state", "applied", "units", "last run", "note"]))
            for r in rows:
                if r[1] in ("PAUSED", "FAILING"):
                    print(f"{r[0]} {r[1]}: {r[5]}")
    finally:
        store.close()
    return 0


def _slot_line(rep: Replicator, replicas: list[str]) -> str:
    """The main slot, and the slot of every parked (paused) replica: the WAL each holds."""
    from platform_assets.cdc.run import open_source

    try:
        src: Any = open_source(rep)
        try:
            pos, parked = src.position(), src.parked()
            of = {src.parked_slot(r): r for r in replicas}
        finally:
            src.close()
    except Exception as exc:  # noqa: BLE001 - status shows what it could not read
        return f"slot: cannot read ({first_line(exc)})"
    lines = [f"slot {rep.spec.slot}: acknowledged {format_lsn(pos.confirmed_flush)}, WAL at {format_lsn(pos.current)}, "
             f"{pos.behind_bytes:,} bytes behind, {pos.retained_bytes:,} bytes of WAL retained"
             + (", a reader is connected" if pos.active else "")]
    lines += [f"parked slot {slot} of {of.get(slot, 'an unknown replica')}: acknowledged {format_lsn(p.confirmed_flush)}, "
              f"{p.retained_bytes:,} bytes of WAL retained for it" for slot, p in sorted(parked.items())]
    return "\n  ".join(lines)


def cmd_assess(args: argparse.Namespace) -> int:
    from platform_assets.cdc.run import open_source

    _, lineage = _lineage(args)
    errors = 0
    for rep in _replicators(lineage, args.names):
        src = open_source(rep)
        try:
            problems = src.assess() if hasattr(src, "assess") else []
        finally:
            src.close()
        if not problems:
            print(f"replicator {rep.name}: ready (no problems found)")
        for p in problems:
            errors += p.severity == "error"
            print(f"replicator {rep.name}: {p.severity.upper()}: {p.what} ({p.where}); fix: {p.fix}")
    return 2 if errors else 0


def _table_lock(args: argparse.Namespace) -> tuple[Any, Any, Replicator]:
    from resources.state.offset_sql import make_owner, open_settings_store

    settings, lineage = _lineage(args)
    rep = _replicator_of(lineage, args.replica)
    store = open_settings_store(settings)
    if store.get(args.replica) is None:
        store.close()
        raise TidemarkError(f"replica {args.replica} has no state yet (run `tidemark cdc run {rep.name}` first)")
    owner = make_owner()
    store.acquire(args.replica, owner)
    return store, owner, rep


def cmd_pause(args: argparse.Namespace) -> int:
    store, owner, rep = _table_lock(args)
    try:
        why = f"paused: by the user: {args.reason or 'no reason given'}"
        store.set_state(args.replica, owner, why)
        _record_state(args, rep, args.replica, why)
    finally:
        store.release(args.replica, owner)
        store.close()
    print(f"{args.replica}: PAUSED (its changes are kept in the source until it is resumed)")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    store, owner, rep = _table_lock(args)
    try:
        if args.resync:
            from platform_assets.cdc import ddl as cdc_ddl

            settings, _ = _lineage(args)
            path = settings.table_path(args.replica)
            from resources.storage.delta_log import open_table

            if open_table(path) is not None:
                cdc_ddl.remove_table(path)
            store.reset(args.replica, Position.zero(), who=owner, reason="cdc resume --resync: copied again")
        store.set_state(args.replica, owner, "replicating" if not args.resync else "snapshotting")
        _record_state(args, rep, args.replica, None if args.resync else "replicating")
    finally:
        store.release(args.replica, owner)
        store.close()
    print(f"{args.replica}: " + ("will be copied again by the next run" if args.resync else "resumed")
          + f" (tidemark cdc run {rep.name})")
    return 0


def _record_state(args: argparse.Namespace, rep: Replicator, replica: str, state: str | None) -> None:
    """The replicator's positions table (``etl.cdc_positions__<name>``) told of a pause or resume by
    the user, so a lost offset store recovers it; ``None``: the replica is copied again (forgotten there)."""
    from resources.storage import cdc_positions

    settings, _ = _lineage(args)
    if state is None:
        cdc_positions.drop(settings, rep.name, [replica])
    else:
        cdc_positions.set_state(settings, rep.name, replica, state)


def cmd_delete(args: argparse.Namespace) -> int:
    from platform_assets.cdc import ddl as cdc_ddl
    from platform_assets.cdc.run import open_source
    from resources.state.offset_sql import open_settings_store
    from resources.storage import cdc_positions

    settings, lineage = _lineage(args)
    rep = _replicators(lineage, [args.name])[0]
    store = open_settings_store(settings)
    try:
        replicas = [r[0] for r in status_rows(store, rep)]
        src = open_source(rep)
        try:
            if hasattr(src, "drop"):
                src.drop()
        finally:
            src.close()
        for replica in replicas:
            if args.drop_replicas:
                from resources.storage.delta_log import open_table

                path = settings.table_path(replica)
                if open_table(path) is not None:
                    cdc_ddl.remove_table(path)
            store.forget(replica, who="tidemark cdc delete", reason=f"replicator {rep.name} deleted")
        store.forget(rep.spec.state_key, who="tidemark cdc delete", reason=f"replicator {rep.name} deleted")
        cdc_positions.drop(settings, rep.name)
    finally:
        store.close()
    print(f"replicator {rep.name}: deleted (source slot/publication dropped; replicas "
          + ("removed" if args.drop_replicas else "kept") + ")")
    return 0


def register(sub: Any) -> None:
    cdc = sub.add_parser("cdc", help="CDC replicators: run, status, assess, pause, resume, delete").add_subparsers(
        dest="action", required=True)
    run = cdc.add_parser("run", help="apply the sources' changes to the replicas (one unit each, or until caught up)")
    run.add_argument("names", nargs="*", help="replicators (default: all)")
    run.add_argument("--until-caught-up", action="store_true",
                     help=f"run units until nothing is left; exits {EXIT_PAUSED} when a replica is paused (not caught up)")
    run.set_defaults(func=cmd_run)
    st = cdc.add_parser("status", help="per replica: state (SNAPSHOTTING, REPLICATING, PAUSED, FAILING, DROPPED), "
                                       "applied position, last error; the slot's backlog")
    st.add_argument("names", nargs="*")
    st.set_defaults(func=cmd_status)
    assess = cdc.add_parser("assess", help="check a source before anything runs; lists every problem with a fix")
    assess.add_argument("names", nargs="*")
    assess.set_defaults(func=cmd_assess)
    pause = cdc.add_parser("pause", help="stop applying changes to a replica (kept in the source)")
    pause.add_argument("replica")
    pause.add_argument("--reason")
    pause.set_defaults(func=cmd_pause)
    resume = cdc.add_parser("resume", help="apply a paused replica's changes again")
    resume.add_argument("replica")
    resume.add_argument("--resync", action="store_true", help="copy the table again from a fresh snapshot")
    resume.set_defaults(func=cmd_resume)
    delete = cdc.add_parser("delete", help="drop a replicator's slot and publication and forget its state")
    delete.add_argument("name")
    delete.add_argument("--drop-replicas", action="store_true", help="also remove the replica tables")
    delete.set_defaults(func=cmd_delete)
