"""Durations written as in the seed's Lineage table: ``30s``, ``5m``, ``1h30m``, ``2d``, ``0``; and byte
sizes as people read them (``12.3 MiB``)."""

from __future__ import annotations

import datetime as dt
import re

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


def parse_duration(text: str | int | float | None) -> dt.timedelta:
    """Parse a duration; raises ``ValueError`` with a message that shows the accepted forms.

    Bare numbers are seconds. An empty value or ``0`` is no duration.
    """
    if text is None:
        return dt.timedelta(0)
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a duration (use e.g. 30s, 5m, 1h30m, 2d)")
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError(f"{text!r} is negative; durations are >= 0")
        return _seconds(text, text)
    s = text.strip().lower().replace(" ", "")
    if s in ("", "0"):
        return dt.timedelta(0)
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return _seconds(float(s), text)
    pos, total = 0, 0.0
    for m in _PART.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s) or pos == 0:
        raise ValueError(f"{text!r} is not a duration (use e.g. 30s, 5m, 1h30m, 2d; units ms s m h d w)")
    return _seconds(total, text)


def _seconds(value: float, text: object) -> dt.timedelta:
    try:
        return dt.timedelta(seconds=value)
    except (OverflowError, ValueError):
        raise ValueError(f"{text!r} is out of range (at most {dt.timedelta.max.days} days)") from None


def format_duration(value: dt.timedelta) -> str:
    """Inverse of :func:`parse_duration` for whole seconds (``1h30m``), ``0`` for none."""
    secs = int(value.total_seconds())
    if secs == 0:
        return "0"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if secs >= size:
            out.append(f"{secs // size}{unit}")
            secs %= size
    return "".join(out)


def format_size(n: float) -> str:
    """Bytes as people read them: ``512 B``, ``12.3 MiB``, at most ``GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            break
        size /= 1024
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
