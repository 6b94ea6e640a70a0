"""Stream mode (issue 11, seed 002 "Stream processing"): ``tidemark events stream`` applies the
events of ``mode: stream`` destinations continuously, in micro-batches, reading the collector's
incoming log through each destination's queue (:mod:`resources.intake.event_queue`).

A micro-batch is at most ``--max-events`` events, taken every ``--interval-ms`` (at once while a
backlog fills whole micro-batches). It is one unit of the shared commit protocol, in the offset
store like every processor's, so each byte range of the log lands in each table exactly once:

1. *plan*: in the destination's queue record for this events folder
   (:func:`platform_assets.core.locks.intake_queue_key`), the micro-batch's ``seq`` and where each
   file's range ends, before anything is written;
2. *land*: the batch processor's unit (:meth:`platform_assets.intake.batch.EventProcessor.run_unit`:
   the same steps, failed events, table patching and etl.log rows; planned and committed in
   ``intake:stream:<dest>``, a Delta transaction per table, its versions in ``pending.status``);
3. *commit*: the queue record's positions move to the plan's ends; ``pending.status`` goes.

A crash anywhere resumes the record's planned ranges; a table that holds the planned transaction
is not written again. The loop holds two locks of the store: the destination's (one loop per
destination, on any host) and its queue record's.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from lineage.core.errors import TidemarkError
from lineage.core.positions import ZERO_TS, Position
from lineage.intake.bodies import dumps_exact, loads_exact
from lineage.intake.config import Intake
from lineage.intake.destinations import DestinationMode
from platform_assets.core import locks
from platform_assets.core.faults import crashpoint
from platform_assets.intake.batch import EventProcessor, UnitResult
from platform_assets.intake.record import UnitRecord, folder_tag, held_record, stage_table_paths, streamed_by
from resources.core.settings import Settings
from resources.intake import event_queue as q
from resources.intake import event_store
from resources.intake.event_store import stage_app_id
from resources.intake.incoming_log import parse_name, ready_dir
from resources.state.lease import LeaseKeeper
from resources.state.offsets import STATE_COMMITTED, OffsetRecord
from resources.storage.warehouse import delta_tables

#: In a destination's queue folder from its first micro-batch on: the folder streamed (what
#: :meth:`StreamLoop._recover` needs to know when neither the store nor a Delta log says where).
STREAMED = "streamed"


@dataclass
class MicroBatch:
    dest: str
    seq: int
    result: UnitResult
    full: bool  # it took max_events: more may be waiting
    seconds: float


class StreamLoop:
    """The stream destinations of one intake config (all, or ``dest_ids``)."""

    def __init__(self, settings: Settings, intake: Intake, dest_ids: list[str] | None = None, *,
                 interval_ms: int = 500, max_events: int = 10_000) -> None:
        specs = [d for d in intake.spec.destinations if d.mode is DestinationMode.STREAM]
        if dest_ids:
            for d in dest_ids:
                spec = intake.spec.destination(d)
                if spec.mode is not DestinationMode.STREAM:
                    raise TidemarkError(f"destination {d!r} is in {spec.mode} mode; `tidemark events stream` runs "
                                        "destinations with `mode: stream` (batch ones: `tidemark events process`)")
            specs = [s for s in specs if s.id in dest_ids]
        if not specs:
            raise TidemarkError(f"{intake.file}: no destination has `mode: stream`; set it on a destination to stream it")
        if interval_ms < 1 or max_events < 1:
            raise TidemarkError("--interval-ms and --max-events must be at least 1")
        self.settings = settings
        self.events_dir = settings.events_dir()
        self.tag = folder_tag(self.events_dir)  # in its micro-batches' unit names
        self.specs = specs
        self.interval = interval_ms / 1000
        self.max_events = max_events
        self.all_stream_ids = [d.id for d in intake.spec.destinations if d.mode is DestinationMode.STREAM]
        self.has_batch = any(d.mode is DestinationMode.BATCH for d in intake.spec.destinations)
        self.procs = {s.id: EventProcessor(settings, [s], modes=(DestinationMode.STREAM,)) for s in specs}
        self.stage_tables = stage_table_paths(settings, intake.spec.destinations)
        self.queues: dict[str, LeaseKeeper] = {}  # per destination, its queue record's lock
        self.stopping = False

    def step(self, dest: str) -> MicroBatch | None:
        """Plan (or resume) and apply one micro-batch of ``dest``; None when nothing waits."""
        t0 = time.monotonic()
        folder = q.queue_dir(self.events_dir, dest)
        queue = self.queues[dest]
        rec = held_record(queue)
        if rec.pending:  # planned before a crash: its very ranges
            ranges, done = q.planned_ranges(rec.inputs, rec.inputs_next or {})
        else:
            state = q.state_of(rec.seq, rec.inputs)
            ranges, done = q.next_ranges(self.events_dir, state, self.max_events)
            done = [n for n in done if n not in state.done]  # files closed after their last line was consumed
            if not ranges and not done:
                return None
            (folder / "pending.status").unlink(missing_ok=True)  # a committed micro-batch's
            rec = queue.store.plan(queue.topic, queue.owner, last=rec.last, next=Position(ZERO_TS, rec.seq + 1),
                                   seq=rec.seq + 1, source_version=None, inputs_next=q.positions(ranges, done))
            crashpoint("stream_planned")
        if ranges and not (folder / STREAMED).exists():
            event_store.write_json_atomic(folder / STREAMED, {"first_micro_batch": rec.seq, "tag": self.tag})
        result = self._land(dest, rec, ranges) if ranges else None
        queue.store.commit(queue.topic, queue.owner, seq=rec.seq, last=rec.last, next=rec.next or rec.last,
                           rows=result.written if result else 0, forget=self._gone(rec),
                           note=f"micro-batch {rec.seq}: {sum(r.lines for r in ranges)} lines of {len(ranges)} files"
                                + (f", {len(done)} read to their end" if done else ""))
        crashpoint("stream_committed")
        (folder / "pending.status").unlink(missing_ok=True)
        self._archive(dest, done)
        if result is None:  # it only finished files: look again (a micro-batch may wait behind them)
            return self.step(dest)
        return MicroBatch(dest, rec.seq, result, sum(r.lines for r in ranges) >= self.max_events, time.monotonic() - t0)

    def _land(self, dest: str, rec: OffsetRecord, ranges: list[q.Range]) -> UnitResult:
        """The micro-batch ``rec`` plans: its ranges' events into the destination's tables, each
        commit carrying the plan (:meth:`_recover` reads it back)."""
        seq = rec.seq
        index: list[tuple[str, int]] = []  # unit line -> (incoming file, its line)
        events: list[tuple[int, dict[str, Any]]] = []
        for r in ranges:
            for k, line in enumerate(q.read_range(self.events_dir, r).split(b"\n")[:-1]):
                index.append((r.name, r.first_line + k))
                with contextlib.suppress(orjson.JSONDecodeError):
                    ev = loads_exact(line)
                    if isinstance(ev, dict):  # a line that is not an event is skipped, as the batch reader does
                        events.append((len(index), ev))

        def failure_id(line: int, d: str) -> str:
            name, file_line = index[line - 1]
            return f"{name}:{file_line}:{d}"

        snapshot = {n: dumps_exact(ev) for n, ev in events}  # the steps change events in place
        result = self.procs[dest].run_unit(
            self._unit(dest, seq), q.queue_dir(self.events_dir, dest) / "pending.status",
            lambda: ((n, loads_exact(b)) for n, b in snapshot.items()),
            lambda lines: {n: loads_exact(snapshot[n]) for n in lines if n in snapshot},
            failure_ids=failure_id,
            queue={"tag": self.tag, "seq": seq, "before": dict(rec.inputs), "next": dict(rec.inputs_next or {}),
                   "ranges": [r.to_json() for r in ranges]})
        crashpoint("stream_landed")
        return result

    def _unit(self, dest: str, seq: int) -> str:
        """Micro-batch ``seq``'s unit name: the folder's tag in it, as a table's commits name their
        units and another host's loop numbers its own."""
        return f"stream.dst={dest}.{seq:012d}.{self.tag}"

    def _recover(self, dest: str) -> None:
        """Catch the queue record up with the Delta log when the log holds a later micro-batch of
        this folder than the record knows (the offset store was restored from a backup, or lost:
        DESIGN.md, the store is never the master). Every commit of a micro-batch carries its plan,
        the positions before it and where it ends. When ``pending.status`` still names that
        micro-batch, it may not have landed everywhere: the record takes the positions before it
        and plans it again as it was, so it resumes with the same ranges and line numbers (the
        tables that hold it are not written again). Otherwise it was committed before (the status
        goes only after the commit, and files are archived only after it): the record takes the
        positions where it ends. Later micro-batches that wrote nothing are read again, and again
        write nothing."""
        queue = self.queues[dest]
        rec = held_record(queue)
        found = self._newest_landed(dest)
        if found is None:
            self._refuse_lost_positions(dest, rec)
            return
        plan, where, version = found
        seq = int(plan["seq"])
        if seq <= rec.seq:
            return  # the record knows it (a later micro-batch may have written nothing)
        store, key, owner = queue.store, queue.topic, queue.owner
        why = f"micro-batch {seq} is in {where}, the record was at {rec.seq}: the offset store was behind the Delta log"
        before = {k: int(v) for k, v in plan["before"].items()}
        ends = {**before, **{k: int(v) for k, v in plan["next"].items()}}
        status = q.queue_dir(self.events_dir, dest) / "pending.status"
        if (event_store.read_json(status) or {}).get("unit") != self._unit(dest, seq):
            store.recover(key, who=owner, expected_seq=rec.seq, seq=seq, last=rec.last, rows=0, run=None,
                          state=STATE_COMMITTED, source_version=None, delta_version=version, inputs=ends,
                          note=f"{why}; it was committed (its status file is gone): positions where it ends, from the log")
            print(f"stream {dest}: {why}; positions taken from the log", file=sys.stderr, flush=True)
            return
        if rec.pending and rec.seq == seq - 1:  # planned before the later one: it landed then
            rec = store.commit(key, owner, seq=rec.seq, last=rec.last, next=rec.next or rec.last, rows=0, note=why)
        if rec.seq < seq - 1 or rec.pending:
            rec = store.recover(key, who=owner, expected_seq=rec.seq, seq=seq - 1, last=rec.last, rows=0, run=None,
                                state=STATE_COMMITTED, source_version=None, delta_version=version, inputs=before,
                                note=f"{why}; positions before micro-batch {seq} taken from the log")
        store.plan(key, owner, last=rec.last, next=Position(ZERO_TS, seq), seq=seq, source_version=None,
                   inputs_next={k: int(v) for k, v in plan["next"].items()})
        print(f"stream {dest}: {why}; micro-batch {seq} planned again as it was, from the log", file=sys.stderr, flush=True)

    def _refuse_lost_positions(self, dest: str, rec: OffsetRecord) -> None:
        """Refuse to read this folder's incoming files from their start when the store holds no
        position of the queue (lost) and no table's log holds a micro-batch of it any more (log
        retention, a dropped table), though the folder streamed before (:data:`STREAMED`): where
        the queue stood is then known nowhere, and its events would land again."""
        marker = q.queue_dir(self.events_dir, dest) / STREAMED
        if rec.seq or rec.inputs or not marker.exists():
            return  # the record's positions stand; or the folder never streamed: its start is right
        ranges, done = q.next_ranges(self.events_dir, q.state_of(0, {}), 1)
        if not ranges and not done:
            return  # no incoming file is left to read again
        raise TidemarkError(
            f"stream {dest}: the offset store holds no read position of {self.events_dir} "
            f"(record {self.queues[dest].topic}), and no table's Delta log holds one of its micro-batches any "
            f"more (log retention, or a dropped table), though it streamed before ({marker}). Reading its "
            f"incoming files from their start would land again events that landed. Restore the offset store "
            f"from a backup that holds the record; or, to read them from their start anyway (events that landed "
            f"land twice), remove {marker}")

    def _newest_landed(self, dest: str) -> tuple[dict[str, Any], str, int] | None:
        """The plan of the newest micro-batch of ``dest`` from this events folder that a table
        holds (its stage tables' logs and its failed events'), where it was found and the Delta
        version of that commit. Each table's log is read down to its newest commit from this
        folder; one from before micro-batches carried their plan says nothing."""
        spec = next(s for s in self.specs if s.id == dest)
        prefix, suffix = f"stream.dst={dest}.", f".{self.tag}"

        def ours(m: dict[str, Any]) -> bool:
            unit = str(m.get("unit", ""))
            return unit.startswith(prefix) and unit.endswith(suffix)

        places = [(self.settings.table_path(t), stage_app_id(dest, t), t)
                  for t in delta_tables(self.settings.warehouse, [spec.schema_])]
        places.append((self.settings.table_path(event_store.FAILED_EVENTS), event_store.failed_app_id(dest),
                       event_store.FAILED_EVENTS))
        best: tuple[dict[str, Any], str, int] | None = None
        for path, app, table in places:
            found = event_store.newest_unit_meta(path, app, ours)
            plan = found[0].get("queue") if found else None
            if (found is None or not isinstance(plan, dict) or not isinstance(plan.get("before"), dict)
                    or not isinstance(plan.get("next"), dict)):
                continue
            if best is None or int(plan["seq"]) > int(best[0]["seq"]):
                best = plan, f"{table} v{found[1]}", found[1]
        return best

    def _gone(self, rec: OffsetRecord) -> list[str]:
        """The record's positions in files that are gone (archived): forgotten, so it stays small."""
        gone = {f for f in {q.file_of(k) for k in rec.inputs} if q.find_file(self.events_dir, f) is None}
        return [k for k in rec.inputs if q.file_of(k) in gone]

    def _adopt(self, dest: str, queue: LeaseKeeper) -> None:
        """Move the positions a queue kept in files (``state.json``, ``pending.json``, before they
        were a record of the offset store) into its record, once. The files go only when the
        record holds them: a crash in between adopts them again, from where it stopped."""
        folder = q.queue_dir(self.events_dir, dest)
        state, pending = q.legacy_files(folder)
        if state is None and pending is None:
            return
        store, key, owner = queue.store, queue.topic, queue.owner
        if pending is not None and int(pending["seq"]) > (state.seq if state else 0):
            unit = self._unit(dest, int(pending["seq"]))
            if pending.get("unit") != unit:  # its tables' commits name the unit: it must keep its name
                raise TidemarkError(
                    f"{folder / 'pending.json'}: the micro-batch under way was planned by an older Tidemark as "
                    f"unit {pending.get('unit')!r}, which this one would name {unit!r}; finish it with the "
                    "version that planned it (`tidemark events stream --once`), then start this one")
        rec = held_record(queue)
        if state is not None:
            if rec.pending and rec.seq == state.seq:  # an adoption a crash cut short: only it plans this seq
                rec = store.commit(key, owner, seq=rec.seq, last=rec.last, next=rec.next or rec.last, rows=0,
                                   note=f"adopted {folder / 'state.json'}")
            elif not rec.pending and state.seq > rec.seq:
                store.plan(key, owner, last=rec.last, next=Position(ZERO_TS, state.seq), seq=state.seq, source_version=None,
                           inputs_next=q.inputs_of(state))
                crashpoint("stream_adopting")
                rec = store.commit(key, owner, seq=state.seq, last=rec.last, next=Position(ZERO_TS, state.seq), rows=0,
                                   note=f"adopted {folder / 'state.json'}")
        if pending is not None and not rec.pending and int(pending["seq"]) > rec.seq:
            seq = int(pending["seq"])
            store.plan(key, owner, last=rec.last, next=Position(ZERO_TS, seq), seq=seq, source_version=None,
                       inputs_next=q.positions([q.Range.from_json(r) for r in pending["ranges"]], list(pending.get("done", []))))
        (folder / "state.json").unlink(missing_ok=True)
        (folder / "pending.json").unlink(missing_ok=True)

    def _archive(self, dest: str, names: list[str]) -> None:
        streamed = streamed_by(self.queues[dest].store, self.events_dir, self.all_stream_ids)
        for name in names:
            path = ready_dir(self.events_dir) / name
            parsed = parse_name(name)
            if parsed and path.exists():
                q.finish_file(self.events_dir, path, parsed[1].date(), batch=False, streamed=streamed,
                              has_batch=self.has_batch)

    def run(self, *, once: bool = False) -> Iterator[MicroBatch]:
        """Apply micro-batches until SIGTERM/SIGINT (the one under way finishes first), or, with
        ``once``, until nothing waits."""
        previous = signal.getsignal(signal.SIGTERM)

        def stop(*_: object) -> None:
            self.stopping = True

        signal.signal(signal.SIGTERM, stop)
        try:
            with contextlib.ExitStack() as held:
                for s in self.specs:  # one stream loop per destination, on whatever host it runs
                    q.queue_dir(self.events_dir, s.id).mkdir(parents=True, exist_ok=True)
                    keeper = held.enter_context(locks.holding_in(
                        self.settings, locks.intake_stream_key(s.id), processor="intake",
                        note=f"the stream loop of destination {s.id}"))
                    self.procs[s.id].record = UnitRecord(keeper, self.events_dir, self.stage_tables)
                    self.queues[s.id] = held.enter_context(locks.holding(
                        keeper.store, locks.intake_queue_key(s.id, self.tag), keeper.owner, processor="intake",
                        note=f"the read positions of destination {s.id} in {self.events_dir}"))
                    self._adopt(s.id, self.queues[s.id])
                    self._recover(s.id)
                    # files read to their end whose archiving a crash cut short
                    self._archive(s.id, q.state_of(0, held_record(self.queues[s.id]).inputs).done)
                while not self.stopping:
                    t0 = time.monotonic()
                    full = did = False
                    for s in self.specs:
                        mb = self.step(s.id)
                        if mb is not None:
                            did, full = True, full or mb.full
                            yield mb
                    if once and not did:
                        return
                    if not full:
                        deadline = t0 + self.interval
                        while not self.stopping and time.monotonic() < deadline:
                            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        except KeyboardInterrupt:
            return
        finally:
            signal.signal(signal.SIGTERM, previous)


def describe(mb: MicroBatch) -> str:
    r = mb.result
    tables = ", ".join(f"{k.split(':', 1)[1]} +{e.get('rows') or 0}" for k, e in r.tables.items())
    return (f"{dt.datetime.now():%H:%M:%S} {mb.dest} #{mb.seq}: {r.events_in} events -> {r.written} rows"
            + (f" ({tables})" if tables else "") + (f", {r.failed} failed" if r.failed else "") + f" in {mb.seconds * 1000:.0f} ms")
