"""The collector's durable incoming log (seed: ``events/incoming``), its writer and its reader.

Layout under ``$TIDEMARK_HOME/events/incoming/``::

    incoming.tok=<token id>.<start>.log          being written (one per token at a time)
    ready/incoming.tok=<token id>.<start>.log    closed: never written again; the processor's input
    .collector.lock                              held (flock) by the running collector

``<start>`` is the UTC time of the file's first event, ``YYYYmmddTHHMMSSffffffZ``, strictly
increasing per token, so sorting ready files by ``(start, token)`` gives the order they were
written in. A file is moved to ``ready/`` (an atomic rename, directories fsynced) after
``rotate_minutes`` since its first event, once it holds ``rotate_bytes``, on a graceful stop,
and, for a file left in ``incoming/`` by a crash (SIGKILL, power loss), when the collector starts
again, as it is.

Format: NDJSON, UTF-8. Every line is one enriched event (a JSON object, no raw newline inside)
ending in ``\\n``; the event's sequence number in its file is its line number (1-based), so
``(file, line)`` identifies an event for deduplication and resumption. Lines are written in
groups and the group is fsynced before any request whose events it holds is answered, so every
acknowledged event is on a complete line. What a crash can leave after the last fsync is
never-acknowledged data: an unterminated last line (a torn write), or after a power loss bytes
that are not JSON. :func:`read_events` drops an unterminated tail and skips lines that are not a
JSON object, and counts both in :class:`ReadStats`; it never raises for them. An event whose
request got no 2xx (killed, 503) may still be in the log; a client that retries it can add it
twice, so deduplicate on ``eventn_ctx.event_id`` where that matters. After a failed write or
fsync the file is closed (moved to ``ready/``), so a partial group can only be a file's torn tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from lineage.core.errors import TidemarkError
from lineage.intake.bodies import loads_exact
from resources.core.pidlock import PidFileLock

NAME_RE = re.compile(r"^incoming\.tok=(?P<token>[A-Za-z0-9_-]+)\.(?P<start>\d{8}T\d{12}Z)\.log$")
_TS_FORMAT = "%Y%m%dT%H%M%S%fZ"
GROUP_BYTES = 4 * 1024**2  # a group this large is written at once, without waiting fsync_group_ms


class IncomingLogLockedError(TidemarkError):
    """Another collector writes to the same incoming log."""


@dataclass(frozen=True)
class ReadyFile:
    path: Path
    token: str
    start: dt.datetime


@dataclass
class ReadStats:
    """What :func:`read_events` saw besides events."""

    events: int = 0
    torn_tail_bytes: int = 0  # an unterminated last line (never acknowledged), dropped
    corrupt_lines: list[int] = field(default_factory=list)  # line numbers that are not a JSON object, skipped


@dataclass
class LogMetrics:
    fsyncs: int = 0
    bytes_written: int = 0
    events_written: int = 0
    files_rotated: int = 0
    files_recovered: int = 0
    write_errors: int = 0


def incoming_dir(events_dir: Path) -> Path:
    return events_dir / "incoming"


def ready_dir(events_dir: Path) -> Path:
    return incoming_dir(events_dir) / "ready"


def file_name(token: str, start: dt.datetime) -> str:
    return f"incoming.tok={token}.{start.astimezone(dt.UTC).strftime(_TS_FORMAT)}.log"


def parse_name(name: str) -> tuple[str, dt.datetime] | None:
    m = NAME_RE.match(name)
    if not m:
        return None
    return m["token"], dt.datetime.strptime(m["start"], _TS_FORMAT).replace(tzinfo=dt.UTC)


def iter_ready_files(events_dir: Path) -> list[ReadyFile]:
    """The closed incoming files, oldest first (by start time, then token)."""
    folder = ready_dir(events_dir)
    out = []
    for p in folder.glob("incoming.tok=*.log") if folder.is_dir() else []:
        parsed = parse_name(p.name)
        if parsed:
            out.append(ReadyFile(p, parsed[0], parsed[1]))
    return sorted(out, key=lambda f: (f.start, f.token))


def read_events(path: Path, stats: ReadStats | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, event)`` of every complete line of an incoming file; an unterminated last
    line and lines that are not a JSON object are counted in ``stats`` and skipped."""
    stats = stats if stats is not None else ReadStats()
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                stats.torn_tail_bytes = len(line)
                break
            try:
                event = loads_exact(line)
            except orjson.JSONDecodeError:
                event = None
            if not isinstance(event, dict):
                stats.corrupt_lines.append(n)
                continue
            stats.events += 1
            yield n, event


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class IncomingLog:
    """The incoming folder of one collector: its lock, crash recovery and one writer per token."""

    def __init__(self, events_dir: Path, rotate_seconds: float, rotate_bytes: int, group_ms: float) -> None:
        self.events_dir = events_dir
        self.folder = incoming_dir(events_dir)
        self.ready = ready_dir(events_dir)
        self.rotate_seconds = rotate_seconds
        self.rotate_bytes = rotate_bytes
        self.group_ms = group_ms
        self.metrics = LogMetrics()
        self.writers: dict[str, TokenWriter] = {}
        self._lock: PidFileLock | None = None

    def open(self) -> list[Path]:
        """Take the lock and move files a crashed collector left behind to ``ready/``; returns them."""
        self.ready.mkdir(parents=True, exist_ok=True)
        folder = self.folder
        self._lock = PidFileLock(folder / ".collector.lock", lambda holder: IncomingLogLockedError(
            f"another collector (pid {holder}) writes to {folder}; stop it first, or give this one another TIDEMARK_HOME"))
        self._lock.acquire()
        moved = []
        for p in sorted(self.folder.glob("incoming.tok=*.log")):
            target = self.ready / p.name
            os.rename(p, target)
            moved.append(target)
        if moved:
            _fsync_dir(self.folder)
            _fsync_dir(self.ready)
        self.metrics.files_recovered += len(moved)
        return moved

    def writer(self, token: str) -> TokenWriter:
        w = self.writers.get(token)
        if w is None:
            w = self.writers[token] = TokenWriter(self, token)
        return w

    async def close(self) -> None:
        """Write what is pending, fsync, move every open file to ``ready/``, release the lock."""
        for w in self.writers.values():
            await w.close()
        if self._lock is not None:
            self._lock.release()

    def _last_start(self, token: str) -> dt.datetime | None:
        starts = [parsed[1] for folder in (self.folder, self.ready) for p in folder.glob(f"incoming.tok={token}.*.log")
                  if (parsed := parse_name(p.name))]
        return max(starts, default=None)


class TokenWriter:
    """Group commit for one token's file: events of concurrent requests are gathered, written
    with one write and made durable with one fdatasync; then every request of the group is
    answered. Runs as one asyncio task; the blocking I/O runs in a worker thread."""

    def __init__(self, log: IncomingLog, token: str) -> None:
        self.log = log
        self.token = token
        self._pending: list[bytes] = []
        self._pending_events = 0
        self._pending_bytes = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._fd: int | None = None
        self._path: Path | None = None
        self._size = 0
        self._deadline = 0.0  # monotonic time the open file is rotated at
        self._last_start = log._last_start(token)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"incoming-writer-{token}")

    async def append(self, data: bytes, events: int) -> None:
        """Returns once ``data`` (complete lines) is durable in the log; raises ``OSError`` if it
        could not be written."""
        if self._closing or self._task.done():
            raise OSError("the collector is stopping" if self._closing else "the log writer has stopped")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(data)
        self._pending_events += events
        self._pending_bytes += len(data)
        self._waiters.append(fut)
        self._wake.set()
        await fut

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        await self._task

    async def _run(self) -> None:
        while True:
            timeout = max(0.0, self._deadline - time.monotonic()) if self._fd is not None else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            if self._pending and self.log.group_ms > 0 and not self._closing and self._pending_bytes < GROUP_BYTES:
                await asyncio.sleep(self.log.group_ms / 1000)
            if self._pending:
                data, waiters, count = b"".join(self._pending), self._waiters, self._pending_events
                self._pending, self._waiters, self._pending_events, self._pending_bytes = [], [], 0, 0
                try:
                    await asyncio.to_thread(self._write, data, count)
                except OSError as exc:
                    self.log.metrics.write_errors += 1
                    for f in waiters:
                        if not f.done():
                            f.set_exception(exc)
                    # after a failed write or fsync the file's state is unknown: close it for good
                    with contextlib.suppress(OSError):
                        await asyncio.to_thread(self._rotate)
                else:
                    for f in waiters:
                        if not f.done():
                            f.set_result(None)
            if self._fd is not None and (self._size >= self.log.rotate_bytes or time.monotonic() >= self._deadline
                                         or (self._closing and not self._pending)):
                try:
                    await asyncio.to_thread(self._rotate)
                except OSError as exc:  # the file is closed either way; its lines were fsynced before
                    self.log.metrics.write_errors += 1
                    print(f"incoming log: could not move {self.token}'s file to ready/: {exc}", file=sys.stderr, flush=True)
            if self._closing and not self._pending:
                return

    def _open(self) -> int:
        start = dt.datetime.now(dt.UTC)
        if self._last_start is not None and start <= self._last_start:
            start = self._last_start + dt.timedelta(microseconds=1)
        self._last_start = start
        path = self.log.folder / file_name(self.token, start)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        _fsync_dir(self.log.folder)  # the new name must survive a crash as well as its lines
        self._path, self._size = path, 0
        self._deadline = time.monotonic() + self.log.rotate_seconds
        return self._fd

    def _write(self, data: bytes, events: int) -> None:
        fd = self._fd if self._fd is not None else self._open()
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fdatasync(fd)
        self._size += len(data)
        m = self.log.metrics
        m.fsyncs += 1
        m.bytes_written += len(data)
        m.events_written += events

    def _rotate(self) -> None:
        fd, path = self._fd, self._path
        self._fd, self._path = None, None
        if fd is None or path is None:
            return
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(path, self.log.ready / path.name)
        _fsync_dir(self.log.folder)
        _fsync_dir(self.log.ready)
        self.log.metrics.files_rotated += 1
