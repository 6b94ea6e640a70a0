"""An exclusive lock on a file that names its holder's pid: one collector per incoming log (a file
on the collector's own disk, which only processes of that host append to), one process at a time
resolving Spark jars into the user's Ivy cache (:func:`resources.spark.session.ivy_resolution`).
``flock`` releases it when the holder closes it or dies (SIGKILL included), so a crash never
leaves it held.

The processors do not use it: the intake's batch processor and stream loops, like every other
processor, lock a record of the offset store (:mod:`platform_assets.core.locks`), which holds
across hosts."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path


class PidFileLock:
    """Taken without waiting: a second holder gets ``refused(holder_pid)`` raised."""

    def __init__(self, path: Path, refused: Callable[[str], Exception]) -> None:
        self.path = path
        self.refused = refused
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise self.refused(holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> PidFileLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
