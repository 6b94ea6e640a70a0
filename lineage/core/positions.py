"""Positions ``(pos, id)`` and blocks ``(last, next]``.

A position is ordered as a tuple: first by the timestamp ``pos``, then by ``id``, so rows that
share a timestamp are still totally ordered and a block boundary never splits a tie.
Timestamps are naive and mean UTC (Spark runs with ``spark.sql.session.timeZone=UTC``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from lineage.core.errors import TidemarkError

#: The ``pos`` of :meth:`Position.zero`: before every timestamp a row can carry.
ZERO_TS = dt.datetime(1, 1, 1)


def to_naive_utc(value: dt.datetime) -> dt.datetime:
    """Normalise a datetime to naive UTC (aware values are converted, naive ones are kept)."""
    if value.tzinfo is not None:
        return value.astimezone(dt.UTC).replace(tzinfo=None)
    return value


def format_ts(value: dt.datetime) -> str:
    """ISO-8601 with microseconds, no zone: sorts as text in time order."""
    return to_naive_utc(value).isoformat(sep="T", timespec="microseconds")


def parse_ts(text: str, *, what: str = "timestamp") -> dt.datetime:
    try:
        return to_naive_utc(dt.datetime.fromisoformat(text.strip().replace(" ", "T").removesuffix("Z")))
    except ValueError as exc:
        raise TidemarkError(
            f"{what}: cannot parse {text!r} as a timestamp (expected e.g. 2026-01-31T12:00:00)"
        ) from exc


@dataclass(frozen=True, order=True)
class Position:
    """A point in a source table's ``(pos, id)`` order."""

    pos: dt.datetime
    id: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "pos", to_naive_utc(self.pos))

    @classmethod
    def zero(cls) -> Position:
        """Before every row: the start of a topic that processes all history."""
        return cls(ZERO_TS, -(2**63))

    def is_zero(self) -> bool:
        return self == Position.zero()

    def __str__(self) -> str:
        """How messages show a position; :meth:`zero` shows as ``start`` (which :meth:`parse`
        reads back), not as its internal sentinel values."""
        return "start" if self.is_zero() else f"({format_ts(self.pos)}, {self.id})"

    def to_text(self) -> str:
        """Compact form used on the command line and in partition keys' metadata."""
        return f"{format_ts(self.pos)}/{self.id}"

    def label(self) -> str:
        """:meth:`to_text` for people to read (the UI's metadata, ``explain``): :meth:`zero` shows
        as ``start``, which :meth:`parse` reads back."""
        return "start" if self.is_zero() else self.to_text()

    @classmethod
    def parse(cls, text: str) -> Position:
        """Parse ``2026-01-31T12:00:00[/42]`` (id defaults to the lowest, i.e. before every
        row at that instant) or ``zero``."""
        text = text.strip()
        if text in ("zero", "start", "0"):
            return cls.zero()
        ts_text, sep, id_text = text.partition("/")
        ts = parse_ts(ts_text, what="position")
        if not sep:
            return cls(ts, -(2**63))
        try:
            return cls(ts, int(id_text))
        except ValueError as exc:
            raise TidemarkError(f"position: id {id_text!r} in {text!r} is not an integer") from exc


@dataclass(frozen=True)
class Block:
    """The half-open range ``(last, next]`` of one step of a topic; ``seq`` numbers the
    topic's blocks from 1 and is the Delta ``txnVersion`` of the block's commit."""

    topic: str
    seq: int
    last: Position
    next: Position
    #: A merge unit whose base has no new rows (only another input changed) has ``next == last``.
    may_be_empty: bool = False

    def __post_init__(self) -> None:
        if not (self.last < self.next or (self.may_be_empty and self.last == self.next)):
            raise TidemarkError(f"block {self.seq} of '{self.topic}': last {self.last} is not before next {self.next}")

    def contains(self, p: Position) -> bool:
        return self.last < p <= self.next
