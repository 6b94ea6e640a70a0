"""Fault injection for the crash tests: ``TIDEMARK_CRASH_AT=point[,point]`` kills the process
with SIGKILL when it reaches a named point; ``TIDEMARK_PAUSE_AT=point:seconds`` sleeps there.

Points of a step, in order: ``planned`` (next stored, nothing written), ``transformed`` (before
SQL ran, output computed), ``written`` (Delta commit done, offset not committed), ``logged``
(etl.log written), ``committed`` (offset committed, lock still held). Of ``tidemark maintain``
(per table): ``maintain:compacted``, ``maintain:checkpointed``, ``maintain:vacuumed``,
``maintain:log-cleaning`` (the first old log file deleted, the others not yet).
"""

from __future__ import annotations

import os
import signal
import time


def crashpoint(point: str) -> None:
    crash = os.environ.get("TIDEMARK_CRASH_AT", "")
    if crash and point in crash.split(","):
        os.kill(os.getpid(), signal.SIGKILL)
    pause = os.environ.get("TIDEMARK_PAUSE_AT", "")
    if pause:
        name, _, seconds = pause.partition(":")
        if name == point:
            time.sleep(float(seconds or 30))
