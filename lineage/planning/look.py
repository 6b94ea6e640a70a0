"""The cheap look between two plannings, shared by the planner sensor
(:mod:`platform_assets.dagster.watch`) and ``tidemark follow`` (:mod:`platform_assets.follow.loop`):
which tables changed, and which waits only a change can end. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping


def is_quiet(reason: str) -> bool:
    """A wait that only a change of the topic's tables or offsets can end (no clock in it). Rows
    dated after now wait for the clock: the planner says so in other words."""
    return reason.startswith("no new rows") or " does not exist at " in reason or "nothing changed" in reason


def changed_tables(known: Mapping[str, int | None] | None, versions: Mapping[str, int | None]) -> set[str]:
    """The tables whose newest version in ``versions`` differs from ``known`` (None: nothing looked
    at yet, so all of them: when their rows landed is unknown, and every delay starts now). A table
    ``known`` has not seen counts as changed."""
    if known is None:
        return set(versions)
    return {t for t, v in versions.items() if t not in known or known[t] != v}
