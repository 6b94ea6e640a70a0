"""Typed lineage specs: the seed's ``LineageSource`` row as a Pydantic model.

A topic's name is ``schema.table[#tag][:shard]``: the destination table, then optionally a tag
(another source/transform set for the same table) and a shard (a share of the work with offsets
of its own).
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lineage.cdc.replicas import ReplicatorSpec
from lineage.core.checks import ChecksSpec
from lineage.core.durations import parse_duration

TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$")
TOPIC_RE = re.compile(
    r"^(?P<table>[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*)"
    r"(?:#(?P<tag>[A-Za-z0-9_]+))?(?::(?P<shard>[A-Za-z0-9_-]+))?$"
)
COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PYTHON_PREFIX = "python:"
DEFAULT_MAXSTEP = 1_000_000


class Processor(StrEnum):
    STEP = "step"
    RELOAD = "reload"
    MERGE = "merge"


class Refresh(StrEnum):
    """How a merge topic may bring its view up to date."""

    INCREMENTAL = "incremental"  # only the keys that changed; a full recompute when that is impossible or dearer
    STRICT = "incremental_strict"  # only the keys that changed; fail instead of falling back to a full recompute
    FULL = "full"  # every unit recomputes the whole view


class LateRows(StrEnum):
    """What a topic does with base rows that land at or below its ``last`` after that block committed."""

    QUARANTINE = "quarantine"
    REDERIVE = "rederive"  # merge topics: re-derive the keys the late rows touch


@dataclass(frozen=True)
class TopicName:
    table: str
    tag: str | None
    shard: str | None

    @classmethod
    def parse(cls, text: str) -> TopicName:
        m = TOPIC_RE.match(text)
        if not m:
            raise ValueError(
                f"{text!r} is not a topic name: expected schema.table, optionally followed by #tag and :shard "
                "(e.g. fact.orders#web:1)"
            )
        return cls(m["table"], m["tag"], m["shard"])


def _split_list(value: Any) -> Any:
    """Accept the seed's comma-separated strings as well as YAML lists."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def split_sql(text: str) -> list[str]:
    """Split semicolon-delimited statements (the seed's before/after columns), ignoring
    semicolons inside quotes and ``--`` comments."""
    out, buf, quote, i = [], [], "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            buf.append(ch)
            if ch == quote:
                quote = ""
        elif ch in "'\"`":
            quote = ch
            buf.append(ch)
        elif text.startswith("--", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
            continue
        elif ch == ";":
            out.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
        i += 1
    out.append("".join(buf))
    return [s.strip() for s in out if s.strip()]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class SourceSpec(_Strict):
    """A table Tidemark reads but does not produce (a stage table loaded by someone else)."""

    table: str = Field(description="schema.table")
    path: str | None = Field(None, description="Delta table location; default <warehouse>/<schema>/<table>")
    comment: str = ""
    owner: str | None = None
    freshness: Literal["auto", "static"] = Field(
        "auto", description="as a dependency: auto = fresh up to its newest pos, or without a pos column as of its "
                            "newest Delta commit; static = never changes, always fresh")

    @field_validator("table")
    @classmethod
    def _table(cls, v: str) -> str:
        if not TABLE_RE.match(v):
            raise ValueError(f"{v!r} is not a table name: expected schema.table")
        return v


class AdditiveSpec(_Strict):
    """merge: the view is a ``GROUP BY`` of the base whose columns are sums over the group's base
    rows, so a unit adds the moved rows' contributions (new ones, minus old ones) instead of
    re-deriving whole groups from the full base (:mod:`lineage.views.refresh`, "additive")."""

    count: str = Field(description="the view column holding count(*) of the group's base rows: a group whose count "
                                   "reaches 0 is deleted")
    sums: list[str] = Field(default_factory=list, description="view columns holding sum(...) of a base row expression "
                                                               "(integer or decimal; count(x) counts too)")

    @property
    def columns(self) -> list[str]:
        return [self.count, *self.sums]


class TopicSpec(_Strict):
    """One row of the seed's Lineage table."""

    table: str = Field(description="topic name: destination schema.table[#tag][:shard]")
    depends_on: list[str] = Field(description="tables needed; the first is the base table read block by block")
    processor: Processor = Processor.STEP
    transforms: list[str] = Field(description="Spark SQL files reading the `block` view, or python:module:function")
    delay: dt.timedelta = Field(dt.timedelta(0), description="rows must be at least this old (clock drift, OLTP lag)")
    repeat: dt.timedelta = Field(dt.timedelta(0), description="minimum time between two runs of the topic")
    maxstep: int = Field(DEFAULT_MAXSTEP, gt=0, description="at most this many base rows per block")
    before: list[str] = Field(default_factory=list, description="SQL statements run before the transforms")
    after: list[str] = Field(default_factory=list, description="SQL statements run after the write")
    comment: str = ""
    owner: str | None = None
    checks: ChecksSpec = Field(default_factory=lambda: ChecksSpec.model_validate({}), description="thresholds for the per-block asset checks")
    # merge topics (materialized views) only; the loader refuses them on other processors
    key: list[str] = Field(default_factory=list, description="merge: the unique key of the transform's output")
    join_keys: dict[str, dict[str, str]] = Field(
        default_factory=dict, description="merge: per input table (not the base), view column -> input column; a change "
                                          "of that input re-derives only the view rows whose columns match")
    refresh: Refresh = Field(Refresh.INCREMENTAL, description="merge: incremental | incremental_strict | full")
    full_above: float | None = Field(None, gt=0, le=1, description="merge: recompute the whole view instead of a "
                                                                  "reverse join when more than this share of an input's "
                                                                  "rows changed (default 0.005; none for an additive or "
                                                                  "row_wise view)")
    late_rows: LateRows = Field(LateRows.QUARANTINE, description="quarantine | rederive (merge): base rows landing "
                                                                "at or below last after their block committed")
    delete_missing: bool = Field(True, description="merge: remove view rows whose inputs were deleted")
    additive: AdditiveSpec | None = Field(None, description="merge: the view's non-key columns are a count(*) and sums "
                                                            "over base rows, maintained by adding the moved rows' "
                                                            "contributions")
    row_wise: bool = Field(False, description="merge: every view row comes from one base row, and rows of different "
                                              "base rows have different keys (no aggregation over base rows, no row "
                                              "from another input alone): a unit re-derives only the base rows that "
                                              "are new or joined a changed row, not the full base")
    deletion_vectors: bool = Field(False, description="merge: opt in to Delta deletion vectors on the view (a MERGE "
                                                      "marks the rows it replaces instead of rewriting their files); "
                                                      "the `deltalake` reader cannot read such a view's rows")
    join_index: bool = Field(False, description="merge (additive or row_wise): keep a copy of the base columns the "
                                                "transform reads, sorted by each join column (join_keys), beside the "
                                                "warehouse; `tidemark maintain` brings it up to date. A unit then finds "
                                                "the base rows joining a changed row there instead of scanning the base")

    @property
    def name(self) -> str:
        return self.table

    @property
    def topic(self) -> TopicName:
        return TopicName.parse(self.table)

    @property
    def destination(self) -> str:
        return self.topic.table

    @property
    def base(self) -> str:
        return self.depends_on[0]

    def freshness_windows(self) -> tuple[dt.timedelta, dt.timedelta]:
        """``(warn, fail)`` windows for the asset's freshness: a topic is expected to land a
        block every ``delay + repeat`` plus the sensor's tick (30 s) and a run (≈ 2 min); warn
        after twice that (at least 10 minutes), fail after four times."""
        expected = self.delay + self.repeat + dt.timedelta(seconds=150)
        warn = max(2 * expected, dt.timedelta(minutes=10))
        return warn, 2 * warn

    @field_validator("table")
    @classmethod
    def _topic(cls, v: str) -> str:
        TopicName.parse(v)
        return v

    @field_validator("depends_on", "transforms", mode="before")
    @classmethod
    def _lists(cls, v: Any) -> Any:
        return _split_list(v)

    @field_validator("depends_on")
    @classmethod
    def _deps(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("needs at least one table (the first is the base table)")
        for t in v:
            if not TABLE_RE.match(t):
                raise ValueError(f"{t!r} is not a table name: expected schema.table")
        if len(set(v)) != len(v):
            raise ValueError(f"lists a table twice: {v}")
        return v

    @field_validator("transforms")
    @classmethod
    def _transforms(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("needs at least one transform (a .sql file or python:module:function)")
        for t in v:
            if t.startswith(PYTHON_PREFIX):
                if not re.fullmatch(r"python:[A-Za-z_][\w.]*:[A-Za-z_]\w*", t):
                    raise ValueError(f"{t!r}: python transforms are written python:package.module:function")
            elif not t.endswith(".sql"):
                raise ValueError(f"{t!r}: a transform is a .sql file or python:module:function")
        return v

    @field_validator("delay", "repeat", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        if isinstance(v, dt.timedelta):
            return v
        return parse_duration(v)

    @field_validator("key", mode="before")
    @classmethod
    def _key(cls, v: Any) -> Any:
        return _split_list(v)

    @field_validator("key")
    @classmethod
    def _key_columns(cls, v: list[str]) -> list[str]:
        for col in v:
            if not COLUMN_RE.match(col):
                raise ValueError(f"{col!r} is not a column name")
        if len(set(v)) != len(v):
            raise ValueError(f"lists a column twice: {v}")
        return v

    @field_validator("join_keys")
    @classmethod
    def _join_keys(cls, v: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        for table, cols in v.items():
            if not TABLE_RE.match(table):
                raise ValueError(f"{table!r} is not a table name: expected schema.table (an input in depends_on)")
            if not cols:
                raise ValueError(f"{table}: needs at least one view column: input column pair, e.g. {{customer_id: id}}")
            for a, b in cols.items():
                for col in (a, b):
                    if not COLUMN_RE.match(str(col)):
                        raise ValueError(f"{table}: {col!r} is not a column name")
        return v

    def merge_problems(self) -> list[tuple[str, str]]:
        """``(field, problem)`` for merge settings that contradict the processor or depends_on."""
        out: list[tuple[str, str]] = []
        if self.processor is Processor.MERGE:
            if not self.key:
                out.append(("key", "a merge topic needs the unique key of its output, e.g. key: [day, country]"))
            if self.additive is not None:
                a = self.additive
                both = sorted(set(self.key) & set(a.columns))
                if both:
                    out.append(("additive", f"{', '.join(both)} cannot be both a key column and an additive column"))
                if len(set(a.columns)) < len(a.columns):
                    out.append(("additive", f"a column is named twice in count and sums ({', '.join(a.columns)})"))
                if not self.delete_missing:
                    out.append(("additive", "an additive view deletes a group whose count reaches 0 (a recompute has "
                                            "no such group); delete_missing: false cannot be kept with it"))
                if self.late_rows is not LateRows.REDERIVE:
                    out.append(("additive", "an additive view needs late_rows: rederive (a late base row must be added "
                                            "to its group; quarantined, it would later be subtracted without having "
                                            "been added)"))
            if self.row_wise and self.additive is not None:
                out.append(("row_wise", "an additive view sums several base rows into a row, so it cannot be row_wise; "
                                        "keep one of the two"))
            if self.join_index and not (self.join_keys and (self.additive is not None or self.row_wise)):
                out.append(("join_index", "a join index serves the reverse join of an additive or row_wise view: give "
                                          "join_keys and additive or row_wise: true, or drop join_index"))
            for table in self.join_keys:
                if table == self.base:
                    out.append(("join_keys", f"{table} is the base table (read block by block by (pos, id)); join_keys "
                                              f"are for the other inputs, whose changes are found by Delta version"))
                elif table not in self.depends_on:
                    out.append(("join_keys", f"{table} is not in depends_on ({', '.join(self.depends_on)})"))
            return out
        merge_only = {"key": bool(self.key), "join_keys": bool(self.join_keys),
                      "refresh": self.refresh is not Refresh.INCREMENTAL, "delete_missing": not self.delete_missing,
                      "late_rows": self.late_rows is not LateRows.QUARANTINE, "deletion_vectors": self.deletion_vectors,
                      "additive": self.additive is not None, "row_wise": self.row_wise,
                      "join_index": self.join_index}
        for name, set_ in merge_only.items():
            if set_:
                out.append((name, f"only merge topics take '{name}' (this is a {self.processor.value} topic)"))
        return out

    @field_validator("maxstep", mode="before")
    @classmethod
    def _maxstep(cls, v: Any) -> Any:
        if v is None or v == "":
            return DEFAULT_MAXSTEP
        bad = ValueError(f"{v!r} is not a row count (a whole number, e.g. 100000, 500k, 1m)")
        if isinstance(v, bool):
            raise bad
        if isinstance(v, str):
            s = v.replace("_", "").strip().lower()
            mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
            try:
                n = float(s[:-1] if mult > 1 else s) * mult
            except ValueError:
                raise bad from None
            if n != int(n):
                raise bad
            return int(n)
        return v

    @field_validator("before", "after", mode="before")
    @classmethod
    def _sql(cls, v: Any) -> Any:
        if v is None:
            return []
        if isinstance(v, str):
            return split_sql(v)
        return v


@dataclass(frozen=True)
class Transform:
    """A resolved transform: SQL text from a file, or a Python callable reference."""

    ref: str  # as written in the spec
    sql: str | None = None
    path: Path | None = None
    python: tuple[str, str] | None = None  # (module, function)


@dataclass(frozen=True)
class Topic:
    """A validated topic: its spec, where it was declared and its resolved transforms."""

    spec: TopicSpec
    file: Path
    line: int | None
    transforms: tuple[Transform, ...]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.line else str(self.file)

    @property
    def python(self) -> bool:
        """Whether a transform is Python code (it reads any table by name, at its newest version)."""
        return any(t.python is not None for t in self.transforms)


@dataclass(frozen=True)
class Source:
    spec: SourceSpec
    file: Path
    line: int | None

    @property
    def name(self) -> str:
        return self.spec.table


@dataclass(frozen=True)
class Replicator:
    """A validated ``cdc:`` entry and where it was declared."""

    spec: ReplicatorSpec
    file: Path
    line: int | None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.line else str(self.file)


@dataclass(frozen=True)
class Lineage:
    """The validated lineage: topics in dependency order and declared sources."""

    topics: dict[str, Topic]  # by topic name, in dependency (topological) order
    sources: dict[str, Source]
    files: tuple[Path, ...]
    replicators: dict[str, Replicator] = field(default_factory=dict)  # ``cdc:`` entries by name

    def topic(self, name: str) -> Topic:
        from lineage.core.errors import UnknownTopicError

        try:
            return self.topics[name]
        except KeyError:
            known = ", ".join(self.topics) or "none"
            raise UnknownTopicError(f"unknown topic '{name}' (known topics: {known})") from None

    @functools.cached_property
    def _producers(self) -> dict[str, tuple[Topic, ...]]:
        """Topics by destination, in topic order; built once, as a sensor tick asks per topic."""
        out: dict[str, list[Topic]] = {}
        for t in self.topics.values():
            out.setdefault(t.spec.destination, []).append(t)
        return {table: tuple(topics) for table, topics in out.items()}

    def producers(self, table: str) -> list[Topic]:
        return list(self._producers.get(table, ()))

    def destinations(self) -> dict[str, list[str]]:
        """Every destination table with the names of the topics that build it, in topic order."""
        return {table: [t.name for t in topics] for table, topics in self._producers.items()}

    def block_key(self, topic: str, seq: int) -> str:
        """The Dagster partition key of block ``seq`` of ``topic``: topic-qualified only when
        several topics build the same table (the one place this rule lives)."""
        from lineage.core.partitions import block_key

        table = self.topic(topic).spec.destination
        return block_key(topic, seq, qualified=len(self.producers(table)) > 1)

    def block_of(self, table: str, key: str) -> tuple[str, int]:
        """``(topic, seq)`` of block partition ``key`` of ``table`` (the inverse of
        :meth:`block_key`: an unqualified key belongs to the table's only topic)."""
        from lineage.core.partitions import parse_block_key

        topic, seq = parse_block_key(key)
        return topic or self._producers[table][0].name, seq

    def replicator_of(self, table: str) -> Replicator | None:
        """The replicator whose replicas' schema holds ``table`` (``replica.customers``)."""
        return next((r for r in self.replicators.values() if r.spec.holds(table)), None)

    def tables(self) -> list[str]:
        """Every table the lineage names: sources first, then destinations."""
        out = list(self.sources)
        for t in self.topics.values():
            for name in (*t.spec.depends_on, t.spec.destination):
                if name not in out:
                    out.append(name)
        return out
