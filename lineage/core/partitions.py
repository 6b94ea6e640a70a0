"""Dagster partition keys for blocks: stable, ordered, and mapped back to ``(topic, seq)``.

A table built by one topic uses ``00000012``; a table built by several topics (``#tag`` or
``:shard``) prefixes the topic: ``fact.orders#web:1@00000012``. Zero-padding keeps keys in
block order when sorted as text.
"""

from __future__ import annotations

import re

from lineage.core.errors import TidemarkError

_KEY = re.compile(r"^(?:(?P<topic>[^@]+)@)?(?P<seq>\d{8,})$")


def block_key(topic: str, seq: int, *, qualified: bool) -> str:
    if seq < 1:
        raise TidemarkError(f"block numbers start at 1, got {seq} for topic '{topic}'")
    return f"{topic}@{seq:08d}" if qualified else f"{seq:08d}"


def parse_block_key(key: str) -> tuple[str | None, int]:
    """``(topic or None, seq)`` of a block partition key."""
    m = _KEY.match(key)
    if not m:
        raise TidemarkError(f"{key!r} is not a block partition key (expected 00000012 or topic@00000012)")
    return m["topic"], int(m["seq"])


def partitions_name(table: str) -> str:
    """Name of the dynamic partitions definition of a destination table."""
    return "tidemark_blocks__" + table.replace(".", "__")


def expired_block_keys(keys: list[str], keep: int) -> list[str]:
    """The keys beyond the newest ``keep`` blocks of each topic (retention of block
    partitions; the history stays in etl.log and the materialization events). Keys that are
    not block keys are left alone."""
    if keep < 1:
        raise TidemarkError(f"partition retention must keep at least 1 block, got {keep}")
    by_topic: dict[str | None, list[tuple[int, str]]] = {}
    for key in keys:
        try:
            topic, seq = parse_block_key(key)
        except TidemarkError:
            continue
        by_topic.setdefault(topic, []).append((seq, key))
    out: list[str] = []
    for items in by_topic.values():
        items.sort()
        out.extend(key for _, key in items[:-keep])
    return out
