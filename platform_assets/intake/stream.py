"""Stream mode (issue 11, seed 002 "Stream processing"): ``tidemark events stream`` applies the
events of ``mode: stream`` destinations continuously, in micro-batches, reading the collector's
incoming log through each destination's queue (:mod:`resources.intake.event_queue`).

A micro-batch is at most ``--max-events`` events, taken every ``--interval-ms`` (at once while a
backlog fills whole micro-batches). It is one unit of the batch processor's commit protocol
(:meth:`platform_assets.intake.batch.EventProcessor.run_unit`: the same steps, failed events, table
patching and etl.log rows), so each byte range of the log lands in each table exactly once:

1. *plan*: the byte ranges and ``seq`` go to ``pending.json`` before anything is written;
2. *land*: ``run_unit`` (a Delta transaction per table, versions fixed in ``pending.status``);
3. *commit*: the consumed offsets and ``seq`` go to ``state.json``; then ``pending.*`` is removed.

A crash anywhere resumes ``pending.json``'s very ranges; a table that holds the planned
transaction is not written again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from lineage.core.errors import TidemarkError
from lineage.intake.bodies import dumps_exact, loads_exact
from lineage.intake.config import Intake
from lineage.intake.destinations import DestinationMode
from platform_assets.core import locks
from platform_assets.core.faults import crashpoint
from platform_assets.intake.batch import EventProcessor, UnitResult
from platform_assets.intake.record import UnitRecord, folder_tag
from resources.core.settings import Settings
from resources.intake import event_queue as q
from resources.intake import event_store as store
from resources.intake.incoming_log import parse_name, ready_dir


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
        self.stopping = False

    def step(self, dest: str) -> MicroBatch | None:
        """Plan (or resume) and apply one micro-batch of ``dest``; None when nothing waits."""
        t0 = time.monotonic()
        folder = q.queue_dir(self.events_dir, dest)
        state = q.read_state(folder)
        pending = store.read_json(folder / "pending.json")
        if pending is not None and int(pending["seq"]) <= state.seq:  # committed just before a crash
            self._clear(folder)
            pending = None
        if pending is None:
            ranges, done = q.next_ranges(self.events_dir, state, self.max_events)
            new_done = [n for n in done if n not in state.done]
            if not ranges:
                if new_done:  # files closed after their last line was consumed: nothing to apply
                    state.done += new_done
                    self._write_state(folder, state)
                    self._archive(dest, new_done)
                return None
            # the folder's tag: a table's commits name their units, and another host's loop numbers its own
            pending = {"seq": state.seq + 1, "unit": f"stream.dst={dest}.{state.seq + 1:012d}.{self.tag}",
                       "ranges": [r.to_json() for r in ranges], "done": new_done}
            store.write_json_atomic(folder / "pending.json", pending)
            crashpoint("stream_planned")
        ranges = [q.Range.from_json(r) for r in pending["ranges"]]
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
            pending["unit"], folder / "pending.status",
            lambda: ((n, loads_exact(b)) for n, b in snapshot.items()),
            lambda lines: {n: loads_exact(snapshot[n]) for n in lines if n in snapshot},
            failure_ids=failure_id)
        crashpoint("stream_landed")
        for r in ranges:
            state.offsets[r.name] = [r.end, r.first_line - 1 + r.lines]
        state.done += [n for n in pending.get("done", []) if n not in state.done]
        state.seq = int(pending["seq"])
        self._write_state(folder, state)
        crashpoint("stream_committed")
        self._clear(folder)
        self._archive(dest, list(pending.get("done", [])))
        return MicroBatch(dest, state.seq, result, sum(r.lines for r in ranges) >= self.max_events,
                          time.monotonic() - t0)

    def _write_state(self, folder: Any, state: q.QueueState) -> None:
        # forget files that are gone (archived): the state stays small
        live = {n for n in [*state.offsets, *state.done] if q.find_file(self.events_dir, n) is not None}
        state.offsets = {n: v for n, v in state.offsets.items() if n in live}
        state.done = [n for n in state.done if n in live]
        store.write_json_atomic(folder / "state.json", state.to_json())

    @staticmethod
    def _clear(folder: Any) -> None:
        (folder / "pending.status").unlink(missing_ok=True)
        (folder / "pending.json").unlink(missing_ok=True)

    def _archive(self, dest: str, names: list[str]) -> None:
        for name in names:
            path = ready_dir(self.events_dir) / name
            parsed = parse_name(name)
            if parsed and path.exists():
                q.finish_file(self.events_dir, path, parsed[1].date(), batch=False, stream_ids=self.all_stream_ids,
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
                    self.procs[s.id].record = UnitRecord(keeper, self.events_dir)
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
