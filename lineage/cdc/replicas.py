"""``cdc:`` entries of a lineage file: replicators that keep Delta replicas of source database tables
(issue 10, seed 004). Pure: validated models and the naming rules.

::

    cdc:
      - name: shop                          # slot and publication tidemark_shop
        source: postgres                    # or debezium (JSON change events in files under `path`)
        dsn_env: SHOP_PG_DSN                # the connection string comes from this environment variable
        tables: [public.customers, "public.order_*"]   # names and fnmatch patterns
        schema: replica                     # public.customers -> replica.customers, sales.x -> replica.sales__x
        options:
          public.customers: {scd: 2}        # per table (or pattern): key, deletes, scd, change_feed,
                                            # deletion_vectors
"""

from __future__ import annotations

import fnmatch
import re
from enum import IntEnum, StrEnum
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lineage.core.checks import ChecksSpec

NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,40}$")
SOURCE_TABLE_RE = re.compile(r"^[A-Za-z_*?\[\]][A-Za-z0-9_$*?\[\]-]*\.[A-Za-z_*?\[\]][A-Za-z0-9_$*?\[\]-]*$")
DEFAULT_CDC_MAXSTEP = 100_000
STATE_KEY_PREFIX = "cdc:"  # offset-store record of a replicator: cdc:<name>


class Deletes(StrEnum):
    HARD = "hard"  # the replica row is removed
    SOFT = "soft"  # the replica row stays with _deleted = true


class Scd(IntEnum):
    TYPE1 = 1  # the replica holds the current rows
    TYPE2 = 2  # every state: _valid_from, _valid_to, _is_current


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class TableOptions(_Strict):
    key: list[str] = Field(default_factory=list, description="replica key columns; default: the source's primary key")
    deletes: Deletes | None = Field(None, description="hard | soft (default: the replicator's)")
    scd: Scd | None = Field(None, description="1 | 2 (default: the replicator's)")
    change_feed: bool | None = Field(None, description="keep Delta's Change Data Feed on the replica (default: the "
                                                       "replicator's)")
    deletion_vectors: bool | None = Field(None, description="let the replica's MERGEs write Delta deletion vectors "
                                                            "(default: the replicator's)")


class TableLayoutOptions(NamedTuple):
    """How one source table is replicated, its options resolved (:meth:`ReplicatorSpec.table_options`)."""

    key: list[str]
    deletes: Deletes
    scd: Scd
    change_feed: bool
    #: None: off while the replica is small, on once it is not (platform_assets.cdc.apply.ensure_replica)
    deletion_vectors: bool | None


class ReplicatorSpec(_Strict):
    name: str = Field(description="lower-case identifier; names the slot and publication (tidemark_<name>)")
    source: Literal["postgres", "debezium"] = "postgres"
    dsn_env: str | None = Field(None, description="postgres: environment variable holding the connection string")
    dsn: str | None = Field(None, description="postgres: connection string (no password: use dsn_env for secrets)")
    path: str | None = Field(None, description="debezium: directory of Debezium JSON change-event files")
    tables: list[str] = Field(description="source tables: schema.table names and fnmatch patterns")
    exclude: list[str] = Field(default_factory=list, description="names and patterns left out of `tables`")
    schema_: str = Field("replica", alias="schema", description="the replicas' schema in the warehouse")
    maxstep: int = Field(DEFAULT_CDC_MAXSTEP, gt=0, description="at most about this many row changes per unit "
                                                                "(whole transactions: a big one may pass it)")
    deletes: Deletes = Deletes.HARD
    scd: Scd = Scd.TYPE1
    change_feed: bool = Field(True, description="keep Delta's Change Data Feed on the replicas: views that join a "
                                                "replica refresh by the rows it changed; false: every unit's MERGE "
                                                "writes no change files (faster), and such views recompute in full")
    deletion_vectors: bool | None = Field(None, description="Delta deletion vectors on the replicas: a MERGE marks the "
                                                             "rows it replaces instead of rewriting their files (a "
                                                             "10,000-change unit onto 10M rows: 9.8 s against 15.8 s). "
                                                             "Unset: off while a replica holds at most 1,000,000 rows "
                                                             "(a keyed SCD1 replica's MERGEs then run from the driver, "
                                                             "without Spark), "
                                                             "turned on once it holds more, never turned off; true or "
                                                             "false: set on every replica. Read a table with them with "
                                                             "Spark or deltalake's DataFusion reader (QueryBuilder), "
                                                             "not its pyarrow dataset (to_pandas, to_pyarrow_table)")
    on_drop: Literal["keep", "drop"] = Field("keep", description="a table dropped in the source: keep its replica "
                                                                 "(no more changes) or drop it")
    options: dict[str, TableOptions] = Field(default_factory=dict, description="per table name or pattern")
    checks: ChecksSpec = Field(default_factory=lambda: ChecksSpec.model_validate({}))
    comment: str = ""
    owner: str | None = None

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True, populate_by_name=True)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"{v!r}: a replicator name is lower-case letters, digits and _ (it names a replication slot)")
        return v

    @field_validator("tables", "exclude")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        for t in v:
            if not SOURCE_TABLE_RE.match(t):
                raise ValueError(f"{t!r} is not a source table: expected schema.table or a pattern like public.order_*")
        return v

    @field_validator("schema_")
    @classmethod
    def _schema(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"{v!r} is not a schema name")
        return v

    @model_validator(mode="after")
    def _source_settings(self) -> ReplicatorSpec:
        if not self.tables:
            raise ValueError("tables: list at least one source table or pattern, e.g. [public.customers]")
        if self.source == "postgres" and not (self.dsn_env or self.dsn):
            raise ValueError("a postgres replicator needs dsn_env (the environment variable with the connection "
                             "string) or dsn")
        if self.source == "debezium" and not self.path:
            raise ValueError("a debezium replicator needs path (the directory of its JSON change-event files)")
        for pattern, opts in self.options.items():
            if opts.scd is Scd.TYPE2 and opts.deletes is Deletes.SOFT:
                raise ValueError(f"options of {pattern}: scd 2 closes a deleted key's row; deletes: soft applies to scd 1")
        return self

    # ------------------------------------------------------------------ naming and selection
    @property
    def state_key(self) -> str:
        """The replicator's record in the offset store."""
        return f"{STATE_KEY_PREFIX}{self.name}"

    @property
    def slot(self) -> str:
        return f"tidemark_{self.name}"

    def selects(self, table: str) -> bool:
        return any(fnmatch.fnmatchcase(table, p) for p in self.tables) and not any(
            fnmatch.fnmatchcase(table, p) for p in self.exclude)

    def holds(self, table: str) -> bool:
        """Whether warehouse table ``table`` is in this replicator's schema (replica names are lower case)."""
        return table.partition(".")[0].lower() == self.schema_.lower()

    def replica(self, table: str) -> str:
        """The warehouse table of source table ``schema.table``: ``<schema_>.<table>`` for the
        default schema ``public``, ``<schema_>.<schema>__<table>`` otherwise (lower case)."""
        src_schema, _, name = table.partition(".")
        name = re.sub(r"[^A-Za-z0-9_]", "_", name)
        part = name if src_schema == "public" else f"{re.sub(r'[^A-Za-z0-9_]', '_', src_schema)}__{name}"
        return f"{self.schema_}.{part}".lower()

    def table_options(self, table: str) -> TableLayoutOptions:
        """The options of a source table (its key override, deletes, scd, change feed, deletion
        vectors): the first matching ``options`` entry (exact names before patterns), each option it
        leaves out the replicator's; no entry: the replicator's."""
        entries = sorted(self.options.items(), key=lambda kv: any(ch in kv[0] for ch in "*?["))
        for pattern, opts in entries:
            if fnmatch.fnmatchcase(table, pattern):
                return TableLayoutOptions(
                    list(opts.key), opts.deletes or self.deletes, opts.scd or self.scd,
                    self.change_feed if opts.change_feed is None else opts.change_feed,
                    self.deletion_vectors if opts.deletion_vectors is None else opts.deletion_vectors)
        return TableLayoutOptions([], self.deletes, self.scd, self.change_feed, self.deletion_vectors)

    def explicit_replicas(self) -> list[str]:
        """Replicas named without a pattern (known before the source is asked)."""
        return [self.replica(t) for t in self.tables if not any(ch in t for ch in "*?[")]
