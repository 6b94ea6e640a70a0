"""The persistent per-destination queue of stream mode (seed 002: ``events/queue.dst=<id>``).

The queue's data is the collector's incoming log itself: the events are durable once (the log's
group fsync acknowledges them), and a stream destination keeps only its read position in it.
No second copy, no second fsync path.

The read positions are a record of the offset store, like every processor's
(:func:`platform_assets.core.locks.intake_queue_key`, one per destination and events folder): its
``inputs`` hold, per incoming file, the bytes consumed (``<file>``), the lines consumed
(``<file>#lines``) and whether it was read to its end (``<file>#done``). A micro-batch is planned
there (``inputs_next``: where each file's range ends) before anything is written, and committed
once it landed: the plan fixes its byte ranges (:func:`planned_ranges`), so a crash anywhere
resumes the very same ranges. What this module keeps under ``events/queue.dst=<id>/`` is only
``pending.status``: the micro-batch's DestinationStatus (the batch processor's unit protocol, the
Delta versions of its tables).

Reading: files of ``incoming/`` (being written) and ``incoming/ready/`` (closed) in write order,
each from its consumed offset up to its last complete line. A file is *done* once it is in
``ready/`` and read to its end (an unterminated tail there is a torn write, never acknowledged).
A line the collector wrote but has not fsynced yet may be read: it is acknowledged a few
milliseconds later, or (power loss) never, and then its client sends it again.

Archiving an incoming file waits for every destination that reads it: the batch processor marks
its part done in the file's status file; the last one to finish (batch or stream) archives it,
under ``events/.archive.lock``. One stream loop per destination holds its lock, a record of the
offset store (:mod:`platform_assets.core.locks`), on whatever host it runs.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lineage.core.errors import TidemarkError
from resources.intake import event_store as store
from resources.intake.incoming_log import incoming_dir, parse_name, ready_dir


def queue_dir(events_dir: Path, dest: str) -> Path:
    return events_dir / f"queue.dst={dest}"


@dataclass(frozen=True)
class Range:
    """Bytes ``[start, end)`` of incoming file ``name``; its first line is line ``first_line``."""

    name: str
    start: int
    end: int
    first_line: int
    lines: int

    def to_json(self) -> list[Any]:
        return [self.name, self.start, self.end, self.first_line, self.lines]

    @classmethod
    def from_json(cls, v: list[Any]) -> Range:
        return cls(str(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]))


@dataclass
class QueueState:
    seq: int = 0
    offsets: dict[str, list[int]] = field(default_factory=dict)  # name -> [bytes, lines] consumed
    done: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "offsets": self.offsets, "done": self.done}


LINES, DONE = "#lines", "#done"  # the suffixes of a file's lines consumed and its "read to its end" in a record


def state_of(seq: int, inputs: Mapping[str, int]) -> QueueState:
    """The positions a queue record's ``inputs`` hold."""
    offsets: dict[str, list[int]] = {}
    done: list[str] = []
    for k, v in inputs.items():
        if k.endswith(DONE):
            done.append(k[:-len(DONE)])
        elif not k.endswith(LINES):
            offsets[k] = [v, inputs.get(k + LINES, 0)]
    return QueueState(seq, offsets, sorted(done, key=write_order))


def inputs_of(state: QueueState) -> dict[str, int]:
    """The record's ``inputs`` that hold ``state``'s positions (:func:`state_of`'s inverse)."""
    out: dict[str, int] = {}
    for name, (end, lines) in state.offsets.items():
        out[name], out[name + LINES] = end, lines
    out.update({n + DONE: 1 for n in state.done})
    return out


def file_of(key: str) -> str:
    """The incoming file a key of a queue record's ``inputs`` is about."""
    return key.split("#", 1)[0]


def positions(ranges: list[Range], done: list[str]) -> dict[str, int]:
    """The record's ``inputs_next`` of a micro-batch: where each range ends, and the files it
    finishes."""
    out: dict[str, int] = {}
    for r in ranges:
        out[r.name] = r.end
        out[r.name + LINES] = r.first_line - 1 + r.lines
    out.update({n + DONE: 1 for n in done})
    return out


def planned_ranges(inputs: Mapping[str, int], inputs_next: Mapping[str, int]) -> tuple[list[Range], list[str]]:
    """The byte ranges and finished files of the micro-batch a record has planned: each range
    from where the committed positions stand to where the plan ends, in write order."""
    ranges = []
    for name in sorted((k for k in inputs_next if not k.endswith((LINES, DONE))), key=write_order):
        start, lines = inputs.get(name, 0), inputs.get(name + LINES, 0)
        n = inputs_next.get(name + LINES, lines) - lines
        if inputs_next[name] > start and n > 0:
            ranges.append(Range(name, start, inputs_next[name], lines + 1, n))
    return ranges, sorted((k[:-len(DONE)] for k in inputs_next if k.endswith(DONE)), key=write_order)


def write_order(name: str) -> tuple[Any, ...]:
    """An incoming file's place in write order: its start time, then its token."""
    parsed = parse_name(name)
    return (0, parsed[1], parsed[0], name) if parsed else (1, name)


def legacy_files(folder: Path) -> tuple[QueueState | None, dict[str, Any] | None]:
    """The ``state.json`` and ``pending.json`` a stream queue kept before its positions moved to
    the offset store (None where absent), to adopt them once."""
    raw, pending = store.read_json(folder / "state.json"), store.read_json(folder / "pending.json")
    state = None if raw is None else QueueState(int(raw.get("seq", 0)), {k: list(v) for k, v in (raw.get("offsets") or {}).items()},
                                                list(raw.get("done") or []))
    return state, pending


def find_file(events_dir: Path, name: str) -> Path | None:
    """An incoming file by name, wherever it is now (written, or closed in ``ready/``)."""
    for folder in (ready_dir(events_dir), incoming_dir(events_dir)):
        p = folder / name
        if p.exists():
            return p
    p = ready_dir(events_dir) / name  # renamed between the two looks
    return p if p.exists() else None


def incoming_files(events_dir: Path) -> list[tuple[str, bool]]:
    """``(name, closed)`` of every incoming file, in write order (start time, then token)."""
    out = []
    for folder, closed in ((incoming_dir(events_dir), False), (ready_dir(events_dir), True)):
        if not folder.is_dir():
            continue
        for p in folder.glob("incoming.tok=*.log"):
            parsed = parse_name(p.name)
            if parsed:
                out.append((parsed[1], parsed[0], p.name, closed))
    seen: dict[str, bool] = {}
    for _, _, name, closed in sorted(out):
        seen[name] = seen.get(name, False) or closed  # listed in both during a rename: closed
    return list(seen.items())


def next_ranges(events_dir: Path, state: QueueState, max_events: int,
                max_bytes: int = 64 * 1024**2) -> tuple[list[Range], list[str]]:
    """What to read next (at most ``max_events`` complete lines, about ``max_bytes``) and the
    files that are done (closed, and read to their end)."""
    ranges: list[Range] = []
    done: list[str] = []
    budget, room = max_events, max_bytes
    for name, closed in incoming_files(events_dir):
        if budget <= 0 or room <= 0:
            break
        if name in state.done:
            continue
        off, lines = state.offsets.get(name, [0, 0])
        path = find_file(events_dir, name)
        if path is None:
            continue
        closed = closed or path.parent == ready_dir(events_dir)
        size = path.stat().st_size  # before reading: a file being written only grows
        with open(path, "rb") as f:
            f.seek(off)
            data = f.read(max(0, min(size - off, room)))
        chunk = data[:data.rfind(b"\n") + 1]
        n = chunk.count(b"\n")
        cut = n > budget
        if cut:  # more lines than the budget: end after the budget's last line
            pos = -1
            for _ in range(budget):
                pos = chunk.index(b"\n", pos + 1)
            chunk, n = chunk[:pos + 1], budget
        if n:
            ranges.append(Range(name, off, off + len(chunk), lines + 1, n))
            budget -= n
            room -= len(chunk)
        if closed and not cut and off + len(data) >= size:
            done.append(name)  # read to its end (an unterminated tail is a torn write, never acknowledged)
    return ranges, done


def read_range(events_dir: Path, r: Range) -> bytes:
    path = find_file(events_dir, r.name)
    if path is None:
        raise TidemarkError(f"incoming file {r.name} of a planned stream micro-batch is gone from "
                            f"{ready_dir(events_dir)}; it was archived or removed by hand before the stream consumed it")
    with open(path, "rb") as f:
        f.seek(r.start)
        return f.read(r.end - r.start)


@contextmanager
def archive_lock(events_dir: Path) -> Iterator[None]:
    """Serializes "my part of this file is done; is everyone's? then archive it"."""
    events_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(events_dir / ".archive.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def batch_done(file: Path) -> bool:
    status = store.read_json(store.status_path(file))
    return bool(status and status.get("batch_done"))


def finish_file(events_dir: Path, file: Path, day: Any, *, batch: bool, streamed: Callable[[str], bool] | None,
                has_batch: bool) -> bool:
    """Record that the batch processor (``batch``) or a stream destination finished ``file``;
    archive it if every reader has. ``streamed(name)``: every stream destination read the file to
    its end (None: there are none). Returns whether it was archived."""
    with archive_lock(events_dir):
        if not file.exists():
            return False
        if batch and streamed is not None and not streamed(file.name):
            status = store.read_json(store.status_path(file)) or {}
            store.write_json_atomic(store.status_path(file), {**status, "batch_done": True})
            return False
        if not batch and ((streamed is not None and not streamed(file.name)) or (has_batch and not batch_done(file))):
            return False
        store.archive_file(events_dir, file, day)
        return True
