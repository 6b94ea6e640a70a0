"""The intake's ``destinations:`` (issue 11, seed 002): where events go, how their tables are
named, mapped and typed. Validated with the rest of the intake file (``lineage/intake/config.py``).

::

    destinations:
      - id: events                   # part of file names (failed.dst=<id>.log) and txn ids
        mode: batch                  # batch: rotated files -> Delta (tidemark events process, the Dagster job);
                                     # stream: micro-batches within seconds (tidemark events stream)
        only_keys: [web, backend]    # token ids whose events go here (empty: every token)
        table_name_template: "events_{{ event_type }}"   # Jinja2 sandbox; empty result = skip the event
        schema: stage                # warehouse schema of the tables
        mappings:
          keep_unmapped: true        # fields no rule names are kept (false: dropped)
          rules:
            - {src: /user/email, action: remove}
            - {src: /eventn_ctx/utc_time, dst: /utc_time, action: move}
            - {src: /price, action: cast, type: double}
            - {dst: /source, action: constant, value: web}
        lookups: {user_agent: true, geo_db: /path/GeoLite2-City.mmdb}
        unmapped: column             # column: a value that fits no column goes to _unmapped_data; fail: the event fails
        failed_share_threshold: 0.05 # a batch with more failed events than this share is reported
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

from jinja2 import StrictUndefined, TemplateSyntaxError
from jinja2.sandbox import SandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lineage.intake.columns import SqlType

DEST_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
IDENT_RE = re.compile(r"^[a-z_][a-z0-9_]*$")
POINTER_RE = re.compile(r"^/?[^/]+(/[^/]+)*$")
#: ``table_name_template``'s Jinja2 environment: sandboxed, an unknown name is an error.
TEMPLATES = SandboxedEnvironment(undefined=StrictUndefined, autoescape=False)


def compile_template(text: str) -> Any:
    """The sandboxed Jinja2 template; ``ValueError`` (a config error) on a syntax error."""
    try:
        return TEMPLATES.from_string(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"table_name_template {text!r} is not a valid Jinja2 template: {exc.message} "
                         f"(line {exc.lineno})") from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class DestinationMode(StrEnum):
    BATCH = "batch"
    STREAM = "stream"  # `tidemark events stream` applies it continuously; `events process` skips it


class MappingAction(StrEnum):
    MOVE = "move"
    REMOVE = "remove"
    CAST = "cast"
    CONSTANT = "constant"


class UnmappedPolicy(StrEnum):
    COLUMN = "column"
    FAIL = "fail"


def _pointer(v: str | None, what: str) -> str | None:
    if v is None:
        return None
    if not POINTER_RE.match(v):
        raise ValueError(f"{what} {v!r} is not a path: write /a/b (JSON-pointer-like, no empty parts)")
    return v if v.startswith("/") else "/" + v


class MappingRule(_Strict):
    """One rule of the Mapping step (seed: move / remove / cast / constant)."""

    src: str | None = Field(None, description="path of the source node, /a/b")
    dst: str | None = Field(None, description="path of the target node (move, constant)")
    action: MappingAction
    type: SqlType | None = Field(None, description="column type for cast (required) and move (optional)")
    value: Any = Field(None, description="the constant's value")

    @field_validator("src", "dst")
    @classmethod
    def _paths(cls, v: str | None) -> str | None:
        return _pointer(v, "path")

    @model_validator(mode="after")
    def _needs(self) -> MappingRule:
        a = self.action
        if a in (MappingAction.MOVE, MappingAction.REMOVE, MappingAction.CAST) and not self.src:
            raise ValueError(f"action {a.value} needs src")
        if a in (MappingAction.MOVE, MappingAction.CONSTANT) and not self.dst:
            raise ValueError(f"action {a.value} needs dst")
        if a is MappingAction.CAST and self.type is None:
            raise ValueError("action cast needs type (one of: " + ", ".join(t.value for t in SqlType) + ")")
        if a is MappingAction.CONSTANT and self.value is None:
            raise ValueError("action constant needs value")
        return self


class MappingsSpec(_Strict):
    keep_unmapped: bool = Field(True, description="keep fields that no rule names")
    rules: list[MappingRule] = Field(default_factory=list)


class LookupsSpec(_Strict):
    user_agent: bool = Field(True, description="parse eventn_ctx.user_agent into eventn_ctx.parsed_ua")
    geo_db: str | None = Field(None, description="MaxMind-format .mmdb: source_ip -> eventn_ctx.location")


class DestinationSpec(_Strict):
    """One destination of the intake: a set of stage tables in one warehouse schema."""

    id: str
    mode: DestinationMode = DestinationMode.BATCH
    only_keys: list[str] = Field(default_factory=list, description="token ids whose events go here (empty: all)")
    table_name_template: str = Field("events", description="Jinja2 (sandboxed) over the event; empty result = skip")
    schema_: str = Field("stage", alias="schema", description="warehouse schema of the tables")
    mappings: MappingsSpec = Field(default_factory=lambda: MappingsSpec.model_validate({}))
    lookups: LookupsSpec = Field(default_factory=lambda: LookupsSpec.model_validate({}))
    unmapped: UnmappedPolicy = UnmappedPolicy.COLUMN
    failed_share_threshold: float = Field(0.05, ge=0, le=1, description="share of failed events reported as a problem")

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True, populate_by_name=True)

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not DEST_ID_RE.match(v):
            raise ValueError(f"{v!r} is not a destination id: use 1-64 letters, digits, '_' or '-' (it is part of file names)")
        return v

    @field_validator("schema_")
    @classmethod
    def _schema(cls, v: str) -> str:
        if not IDENT_RE.match(v):
            raise ValueError(f"{v!r} is not a schema name: use lower-case letters, digits and '_'")
        return v

    @field_validator("table_name_template")
    @classmethod
    def _template(cls, v: str) -> str:
        compile_template(v)  # a syntax error is a config error, not a failed event
        return v


def check_destinations(destinations: list[DestinationSpec], token_ids: set[str]) -> list[tuple[tuple[Any, ...], str]]:
    """Problems across destinations and tokens: ``[(loc, message)]``."""
    out: list[tuple[tuple[Any, ...], str]] = []
    seen: set[str] = set()
    for i, d in enumerate(destinations):
        if d.id in seen:
            out.append((("destinations", i, "id"), f"destination id {d.id!r} is used twice; ids must be unique"))
        seen.add(d.id)
        for j, k in enumerate(d.only_keys):
            if k not in token_ids:
                out.append((("destinations", i, "only_keys", j),
                            f"unknown token id {k!r} (tokens: {', '.join(sorted(token_ids))})"))
    return out
