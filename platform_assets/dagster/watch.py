"""When the planner sensor must plan: the cheap look between two plannings.

The planner sensor ticks every few seconds (``TIDEMARK_PLANNER_INTERVAL``, default 5 s). A
tick first *looks*: the newest Delta version of every table of the lineage (one file lookup per
table, no JVM: :func:`resources.storage.delta_log.newest_version`) and the head of the offset log (one
query). It *plans* (the full tick: plans blocks, requests runs, frees dead locks, records
``offset_age``) only when that look differs from the last one, when a delay started by a change
has passed, or when the last planning is ``TIDEMARK_PLANNER_FULL_INTERVAL`` old (default 30 s:
what only the clock changes, such as a ``repeat`` or a retry's backoff). So a commit upstream,
by a topic or by anyone else writing a table, starts the topics that read it within one
interval, and an idle lineage costs one look per interval.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lineage.core.errors import ConfigError
from lineage.planning import look
from lineage.planning.look import is_quiet  # noqa: F401 - the sensor's name for it

#: How far below the offset log's head a planning looks for entries it has not seen: on a server,
#: a transaction that took an id first may commit after one that took a later id.
LOG_WINDOW = 200

#: Longest skip reason kept in the cursor (the waits of the last planning, shown on quiet ticks).
WAITS_KEPT = 2000


def env_seconds(name: str, default: int) -> int:
    """A whole number of seconds from the environment variable ``name`` (default when unset)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{name}={raw!r}: expected a whole number of seconds above 0")
    return value


@dataclass
class Look:
    """What one look saw, kept in the sensor's cursor between ticks."""

    versions: dict[str, int | None] = field(default_factory=dict)  # table -> newest Delta version
    log_head: int = 0  # the offset log's newest entry
    planned_at: float = 0.0  # unix seconds of the last planning (0: never)
    due: list[float] = field(default_factory=list)  # times a planning is due (delays started by a change)
    waits: str = ""  # the last planning's skip reason
    #: Topics that wait for their inputs only ("no new rows", a missing table), with that reason:
    #: only a change of a table they read or of their offsets (or a producer's) can move them, so
    #: a planning passes them over until one comes.
    quiet: dict[str, str] = field(default_factory=dict)
    rescanned_at: float = 0.0  # the last planning of every topic, quiet ones too
    recent: list[int] = field(default_factory=list)  # offset log ids seen within LOG_WINDOW below the head

    def to_json(self) -> dict[str, Any]:
        return {"versions": self.versions, "log_head": self.log_head, "planned_at": self.planned_at,
                "due": sorted(self.due), "waits": self.waits[:WAITS_KEPT], "quiet": self.quiet,
                "rescanned_at": self.rescanned_at, "recent": sorted(self.recent)}

    @classmethod
    def from_json(cls, raw: Any) -> Look | None:
        if not isinstance(raw, dict):
            return None
        try:
            return cls(versions={str(k): (None if v is None else int(v)) for k, v in dict(raw.get("versions", {})).items()},
                       log_head=int(raw.get("log_head", 0)), planned_at=float(raw.get("planned_at", 0.0)),
                       due=[float(d) for d in raw.get("due", [])], waits=str(raw.get("waits", "")),
                       quiet={str(k): str(v) for k, v in dict(raw.get("quiet", {})).items()},
                       rescanned_at=float(raw.get("rescanned_at", 0.0)), recent=[int(i) for i in raw.get("recent", [])])
        except (TypeError, ValueError):
            return None


def read_cursor(cursor: str | None) -> tuple[Look | None, dict[str, Any]]:
    """The last look and the ``offset_age`` states from the sensor's cursor. A cursor of the
    planner before looks existed held the states alone."""
    try:
        raw = json.loads(cursor) if cursor else {}
    except ValueError:
        raw = {}
    if not isinstance(raw, dict):
        return None, {}
    if "look" not in raw:
        return None, raw
    checks = raw.get("checks")
    return Look.from_json(raw["look"]), checks if isinstance(checks, dict) else {}


def write_cursor(look: Look, checks: Mapping[str, Any]) -> str:
    return json.dumps({"look": look.to_json(), "checks": dict(checks)}, sort_keys=True)


def why_plan(last: Look | None, versions: Mapping[str, int | None], log_head: int, now: float, *,
             every_s: float) -> str | None:
    """Why this tick must plan, or None when nothing it could act on changed since ``last``."""
    if last is None or not last.planned_at:
        return "first look"
    changed = sorted(changed_tables(last, versions))
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return f"{', '.join(changed[:3])}{more} changed"
    if log_head != last.log_head:
        return "the offset store changed"
    if any(d <= now for d in last.due):
        return "a delay passed"
    if now - last.planned_at >= every_s:
        return f"the last planning is {now - last.planned_at:.0f}s old"
    return None


def delays_started(topics: Iterable[tuple[Iterable[str], float]], changed: set[str], now: float) -> list[float]:
    """When the rows of the tables in ``changed`` become old enough for the topics reading them:
    ``topics`` are (tables read, delay in seconds). A block waits until its rows are ``delay``
    old; a planning one second after that catches them without waiting for the full interval."""
    return sorted({now + delay + 1.0 for tables, delay in topics if delay > 0 and changed.intersection(tables)})


def changed_tables(last: Look | None, versions: Mapping[str, int | None]) -> set[str]:
    """The tables whose version differs from ``last``; on a first look, all of them."""
    return look.changed_tables(None if last is None else last.versions, versions)


@dataclass(frozen=True)
class Reads:
    """What moves a topic: the tables it reads (inputs and its own table) and the topics producing its inputs."""

    tables: frozenset[str]
    producers: frozenset[str]


def topics_to_plan(last: Look | None, reads: Mapping[str, Reads], changed: set[str], logged: set[str], *,
                   rescan: bool, head: int = 0) -> set[str]:
    """The topics a planning looks at: all of them on a rescan (or a first look, or an offset
    log shorter than before: a store restored or replaced), else every topic not quiet at the last
    planning, and the quiet ones whose tables changed or whose own or producers' offsets were
    logged since."""
    if rescan or last is None or head < last.log_head:
        return set(reads)
    return {name for name, r in reads.items()
            if name not in last.quiet or r.tables & changed or name in logged or r.producers & logged}


def downstream_counts(topics: Mapping[str, tuple[str, Iterable[str]]]) -> dict[str, int]:
    """For each topic (name -> (its table, the tables it reads)): how many other topics read its
    table, directly or through others. The planner gives a run this as its queue priority, so
    when runs wait for a slot the ones that others wait for go first."""
    readers: dict[str, set[str]] = {}
    for name, (_, reads) in topics.items():
        for table in reads:
            readers.setdefault(table, set()).add(name)
    out: dict[str, int] = {}
    for name, (table, _) in topics.items():
        seen: set[str] = set()
        stack = [table]
        while stack:
            for reader in readers.get(stack.pop(), ()):
                if reader != name and reader not in seen:
                    seen.add(reader)
                    stack.append(topics[reader][0])
        out[name] = len(seen)
    return out


def log_window(last: Look | None) -> int:
    """The id after which a planning reads the offset log (None: no planning before)."""
    return 0 if last is None else max(0, last.log_head - LOG_WINDOW)


def new_entries(last: Look | None, entries: Mapping[int, str], head: int) -> tuple[set[str], list[int]]:
    """The topics of the offset log ``entries`` (read after :func:`log_window`) this planning has
    not seen, and the ids to remember as seen (those within ``LOG_WINDOW`` of ``head``)."""
    recent = sorted(i for i in entries if i > head - LOG_WINDOW)
    if last is None:
        return set(), recent
    seen = set(last.recent)
    return {t for i, t in entries.items() if i > last.log_head or i not in seen}, recent
