"""Event intake configuration (issue 11): the collector's settings and its API tokens, read from
a YAML file and validated before the server starts.

::

    collector:
      host: 127.0.0.1          # bind address (loopback by default; put a load balancer in front)
      port: 8421
      max_body: 1MiB           # larger bodies get 413
      max_events_per_request: 10000
      rotate_minutes: 5        # incoming log files are closed after this long ...
      rotate_bytes: 64MiB      # ... or this size, whichever comes first
      fsync_group_ms: 2        # how long the log writer gathers events of concurrent requests per fsync
      trust_proxy: false       # true: source_ip from X-Forwarded-For (only behind your own proxy)
    tokens:
      - id: web                # goes into every event as api_key; never the secret
        kind: browser          # browser: POST /api/v1/event; server: POST /api/v1/s2s/event
        secret_env: TIDEMARK_TOKEN_WEB   # the secret comes from this environment variable
    destinations: []           # where events go: see lineage/intake/destinations.py

The file is ``--config PATH``, else ``$TIDEMARK_INTAKE``, else the repo's ``demo/intake.yaml``.
Every problem is reported at once as ``file:line: field 'x': what is wrong``. Secrets are read
from the environment here and only their SHA-256 digest is kept (:attr:`Token.digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lineage.core.errors import ConfigError
from lineage.core.yaml_lines import LineLoader, field_line, strip_lines, yaml_problem
from lineage.intake.destinations import (
    DestinationSpec,
    LookupsSpec,
    MappingRule,
    MappingsSpec,
    check_destinations,
)

DEFAULT_INTAKE = Path(__file__).resolve().parents[2] / "demo" / "intake.yaml"
TOKEN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # it is part of file names: no dots, no slashes
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*(b|kb|kib|mb|mib|gb|gib)?$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2, "gb": 1000**3, "gib": 1024**3}


class IntakeConfigError(ConfigError):
    """The intake configuration is invalid; ``problems`` lists every problem, each with its location."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        head = "invalid intake config" if len(self.problems) == 1 else f"invalid intake config ({len(self.problems)} problems)"
        super().__init__(head + ":\n  - " + "\n  - ".join(self.problems))


def parse_size(value: Any) -> int:
    """``1MiB``, ``64MB``, ``500kb``, ``1048576`` -> bytes; raises ``ValueError`` naming the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size (use e.g. 1048576, 512KiB, 1MiB, 64MB)")
    if isinstance(value, int | float):
        n = float(value)
    else:
        m = _SIZE_RE.match(str(value).strip())
        if not m:
            raise ValueError(f"{value!r} is not a size (use e.g. 1048576, 512KiB, 1MiB, 64MB)")
        n = float(m[1]) * _SIZE_UNITS[(m[2] or "b").lower()]
    if n < 1:
        raise ValueError(f"{value!r}: a size must be at least 1 byte")
    return int(n)


class TokenKind(StrEnum):
    BROWSER = "browser"  # JavaScript endpoint /api/v1/event; user agent recorded
    SERVER = "server"  # server-to-server endpoint /api/v1/s2s/event; src=api, event_id generated


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class CollectorSpec(_Strict):
    """The HTTP collector's settings."""

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8421, ge=0, le=65535, description="TCP port (0: any free port)")
    max_body: int = Field(1024**2, description="largest request body in bytes (size strings like 1MiB allowed)")
    max_events_per_request: int = Field(10_000, ge=1, description="more events in one request get 413")
    rotate_minutes: float = Field(5.0, gt=0, description="an incoming log file is closed this long after its first event")
    rotate_bytes: int = Field(64 * 1024**2, description="... or once it holds this many bytes")
    fsync_group_ms: float = Field(2.0, ge=0, le=1000, description="how long the writer gathers events per fsync")
    trust_proxy: bool = Field(False, description="take source_ip from X-Forwarded-For (only behind a proxy you run)")

    @field_validator("max_body", "rotate_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)


class TokenSpec(_Strict):
    """An API token: its public id (recorded as ``api_key``), its kind and where its secret is."""

    id: str = Field(description="public id, recorded in events as api_key and in log file names")
    kind: TokenKind
    secret_env: str = Field(description="environment variable that holds the secret")

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not TOKEN_ID_RE.match(v):
            raise ValueError(f"{v!r} is not a token id: use 1-64 letters, digits, '_' or '-' (it is part of file names)")
        return v

    @field_validator("secret_env")
    @classmethod
    def _env(cls, v: str) -> str:
        if not ENV_NAME_RE.match(v):
            raise ValueError(f"{v!r} is not an environment variable name")
        return v


class IntakeSpec(_Strict):
    """The whole intake file: the collector, its tokens and the destinations of the event processor."""

    collector: CollectorSpec = Field(default_factory=lambda: CollectorSpec.model_validate({}))
    tokens: list[TokenSpec] = Field(min_length=1, description="at least one token")
    destinations: list[DestinationSpec] = Field(default_factory=list, description="where events go (tidemark events process)")

    @model_validator(mode="after")
    def _unique_ids(self) -> IntakeSpec:
        seen: set[str] = set()
        for t in self.tokens:
            if t.id in seen:
                raise ValueError(f"token id {t.id!r} is used twice; ids must be unique")
            seen.add(t.id)
        return self

    def destination(self, dest_id: str) -> DestinationSpec:
        for d in self.destinations:
            if d.id == dest_id:
                return d
        raise IntakeConfigError(f"unknown destination {dest_id!r} (configured: "
                                f"{', '.join(d.id for d in self.destinations) or 'none'})")


@dataclass(frozen=True)
class Token:
    """A configured token with its secret's SHA-256 digest (the secret itself is not kept)."""

    id: str
    kind: TokenKind
    digest: bytes = field(repr=False)

    def matches(self, presented: str) -> bool:
        return hmac.compare_digest(self.digest, hashlib.sha256(presented.encode()).digest())


@dataclass(frozen=True)
class Intake:
    spec: IntakeSpec
    tokens: tuple[Token, ...]
    file: Path

    @property
    def collector(self) -> CollectorSpec:
        return self.spec.collector

    def find_token(self, presented: str | None) -> Token | None:
        """The token whose secret is ``presented``; every token is compared (constant time each)."""
        if not presented:
            return None
        found = None
        for t in self.tokens:
            if t.matches(presented):
                found = t
        return found


def intake_path(arg: str | Path | None, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(arg or env.get("TIDEMARK_INTAKE") or DEFAULT_INTAKE).absolute()


def configured_intake(file: str | Path | None = None, env: Mapping[str, str] | None = None) -> Intake | None:
    """The intake config ``file`` names, or else ``$TIDEMARK_INTAKE``'s, or else the default file
    when it exists (None when there is none), read for the processor (no secrets)."""
    env = os.environ if env is None else env
    path = intake_path(file, env)
    if file is None and "TIDEMARK_INTAKE" not in env and not path.exists():
        return None
    return load_intake(path, env, secrets=False)


def load_intake(path: str | Path, env: Mapping[str, str] | None = None, *, secrets: bool = True) -> Intake:
    """Read and validate the intake file at ``path`` and the token secrets from ``env``; raise
    :class:`IntakeConfigError` listing every problem. ``secrets=False`` (the event processor):
    the secrets are not needed, not read, and ``Intake.tokens`` is empty."""
    env = os.environ if env is None else env
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise IntakeConfigError(f"{file}: cannot read the intake config ({exc.strerror}); set --config or TIDEMARK_INTAKE") from exc
    try:
        doc = yaml.load(text, Loader=LineLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        raise IntakeConfigError(yaml_problem(file, exc)) from exc
    if not isinstance(doc, dict):
        raise IntakeConfigError(f"{file}: expected a mapping with 'collector' and 'tokens'")
    try:
        spec = IntakeSpec.model_validate(strip_lines(doc))
    except ValidationError as exc:
        raise IntakeConfigError(_problems(exc, file, doc)) from exc
    problems, tokens = [], []
    for loc, msg in check_destinations(spec.destinations, {t.id for t in spec.tokens}):
        problems.append(f"{file}:{field_line(doc, loc)}: field '{'.'.join(str(p) for p in loc)}': {msg}")
    for i, t in enumerate(spec.tokens if secrets else []):
        secret = env.get(t.secret_env, "")
        if not secret:
            line = field_line(doc, ("tokens", i, "secret_env"))
            problems.append(f"{file}:{line}: token '{t.id}': environment variable {t.secret_env} is "
                            f"{'empty' if t.secret_env in env else 'not set'}; export {t.secret_env}=<the secret>")
            continue
        tokens.append(Token(t.id, t.kind, hashlib.sha256(secret.encode()).digest()))
    digests = [t.digest for t in tokens]
    if len(set(digests)) != len(digests):
        problems.append(f"{file}: two tokens have the same secret; give each token its own")
    if problems:
        raise IntakeConfigError(problems)
    return Intake(spec=spec, tokens=tuple(tokens), file=file)


def _problems(exc: ValidationError, file: Path, doc: dict[str, Any]) -> list[str]:
    out: list[tuple[int, str]] = []
    for err in exc.errors():
        loc = err["loc"]
        line = field_line(doc, loc)
        field = ".".join(str(p) for p in loc)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            msg = "unknown field (check the spelling; allowed: " + ", ".join(parent.model_fields) + ")"
        elif err["type"] == "missing":
            msg = "is required"
        out.append((line or 0, f"{file}:{line}" + (f": field '{field}'" if field else "") + f": {msg}"))
    return [text for _, text in sorted(out, key=lambda p: p[0])]  # in file order


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The model of the mapping at ``loc`` (for the list of allowed fields)."""
    models: dict[tuple[str, ...], type[BaseModel]] = {
        (): IntakeSpec, ("collector",): CollectorSpec, ("tokens",): TokenSpec, ("destinations",): DestinationSpec,
        ("destinations", "mappings"): MappingsSpec, ("destinations", "lookups"): LookupsSpec,
        ("destinations", "mappings", "rules"): MappingRule,
    }
    return models.get(tuple(str(p) for p in loc if not isinstance(p, int)), IntakeSpec)
