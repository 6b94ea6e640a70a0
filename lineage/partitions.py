"""Dagster partition keys for blocks: stable, ordered, and mapped back to ``(topic, seq)``.

A table built by one topic uses ``00000012``; a table built by several topics (``#tag`` or
``:shard``) prefixes the topic: ``fact.orders#web:1@00000012``. Zero-padding keeps keys in
block order when sorted as text.
"""

from __future__ import annotations

import re

from lineage.errors import TidemarkError

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
