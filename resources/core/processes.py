"""Local server processes Tidemark starts and stops (the Spark Connect server, a standalone
cluster's daemons, the prod profile's PostgreSQL): ports on 127.0.0.1, liveness of a recorded
pid, process groups, log tails. One set of helpers for all of them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path


def port_taken(port: int) -> str | None:
    """Why ``port`` on 127.0.0.1 cannot be bound (the OS's reason), or None when it is free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As servers bind (PostgreSQL, uvicorn): connections of a stopped server lingering in TIME_WAIT do not
        # count; a listening socket still does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def process_alive(pid: int, markers: tuple[bytes, ...]) -> bool:
    """Whether ``pid`` runs and its command line holds one of ``markers`` (not a reused pid). A
    dead child of this process is reaped here, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid
    return any(m in cmdline for m in markers)


def signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def log_tail(log: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a server's log (for error messages)."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])
