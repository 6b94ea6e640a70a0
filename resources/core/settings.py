"""Where Tidemark keeps things, from environment variables with embedded defaults.

| variable | default | meaning |
|---|---|---|
| ``TIDEMARK_HOME`` | ``./.tidemark`` | state dir: offset store, Dagster home, Spark scratch |
| ``TIDEMARK_WAREHOUSE`` | ``$TIDEMARK_HOME/warehouse`` | root of the Delta tables (``<root>/<schema>/<table>``) |
| ``TIDEMARK_OFFSETS_URL`` | ``sqlite:///$TIDEMARK_HOME/offsets.db``; prod: the database of ``TIDEMARK_DAGSTER_PG_URL`` | offset store (``sqlite:///…`` or ``postgresql://…``) |
| ``TIDEMARK_PROFILE`` | ``embedded``; ``prod`` when ``TIDEMARK_DAGSTER_PG_URL`` is set | ``prod``: the Dagster instance in PostgreSQL (``dagster.prod.yaml``, Dagster home ``$TIDEMARK_HOME/dagster-prod``) |
| ``TIDEMARK_DAGSTER_PG_URL`` | (none; required by ``prod``) | ``postgresql+psycopg2://user:password@host:port/db`` of the Dagster instance (runs, event logs, schedules, sensor ticks, concurrency slots) |
| ``TIDEMARK_LINEAGE`` | ``./demo/lineage`` | lineage YAML file or directory |
| ``TIDEMARK_SPARK_MASTER`` | ``local[*]`` | Spark master URL, or ``sc://host:port`` for Spark Connect |
| ``TIDEMARK_SPARK_CONF`` | (none) | extra Spark settings, ``key=value`` pairs separated by ``;`` |
| ``TIDEMARK_LOCK_LEASE`` | ``5m`` | a topic lock expires this long after its holder's last heartbeat (``resources.state.offset_sql``) |
| ``TIDEMARK_OFFSET_LOG_RETENTION`` | ``30d`` | ``tidemark maintain`` prunes offset log entries older than this (``0``: never; at least ``1h``) |
| ``TIDEMARK_OFFSET_LOG_KEEP`` | ``1000`` | each topic's newest offset log entries kept whatever their age |
| ``TIDEMARK_OWNER_HOST`` | the hostname | host part of lock owner ids (e.g. a pod name) |
| ``TIDEMARK_INTAKE`` | ``./demo/intake.yaml`` | event collector config (``lineage.intake.config``); its log is ``$TIDEMARK_HOME/events`` |
| ``TIDEMARK_S3_*`` | the ``AWS_*`` variables | object store of an ``s3://`` warehouse: see ``resources.storage.warehouse`` |
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from lineage.core.errors import ConfigError


@dataclass(frozen=True)
class Settings:
    home: Path
    warehouse: str
    offsets_url: str
    lineage: Path
    spark_master: str = "local[*]"
    spark_conf: dict[str, str] = field(default_factory=dict)
    profile: str = "embedded"  # or "prod": see PROFILES
    dagster_pg_url: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: str | Path | None) -> Settings:
        env = os.environ if env is None else env
        home = Path(str(overrides.get("home") or env.get("TIDEMARK_HOME") or ".tidemark")).absolute()
        warehouse = str(overrides.get("warehouse") or env.get("TIDEMARK_WAREHOUSE") or home / "warehouse")
        if "://" not in warehouse:
            warehouse = str(Path(warehouse).absolute())
        profile, dagster_pg_url = _profile(env)
        offsets = str(overrides.get("offsets_url") or env.get("TIDEMARK_OFFSETS_URL")
                      or (offsets_url_of(dagster_pg_url) if dagster_pg_url else f"sqlite:///{home / 'offsets.db'}"))
        lineage = Path(str(overrides.get("lineage") or env.get("TIDEMARK_LINEAGE") or "demo/lineage")).absolute()
        master = str(overrides.get("spark_master") or env.get("TIDEMARK_SPARK_MASTER") or "local[*]")
        conf = parse_spark_conf(env.get("TIDEMARK_SPARK_CONF", ""))
        return cls(home=home, warehouse=warehouse, offsets_url=offsets, lineage=lineage, spark_master=master, spark_conf=conf,
                   profile=profile, dagster_pg_url=dagster_pg_url)

    def default_offsets_url(self) -> str:
        """The embedded offset store under the state dir (its folder may be created)."""
        return f"sqlite:///{self.home / 'offsets.db'}"

    def offsets_defaulted(self) -> bool:
        """Whether the offset store is the default one, whose folder may be created (a folder
        missing from a URL the user gave is an error, see ``open_offset_store``)."""
        return self.offsets_url == self.default_offsets_url()

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]

    def dagster_home(self) -> Path:
        """``$DAGSTER_HOME``, else ``<home>/dagster`` (created, with the repo's dagster.yaml); in
        the prod profile ``<home>/dagster-prod`` with dagster.prod.yaml (a folder of its own, so
        switching profiles never leaves the other profile's instance settings in place)."""
        env = os.environ.get("DAGSTER_HOME")
        prod = self.profile == "prod"
        path = Path(env) if env else self.home / ("dagster-prod" if prod else "dagster")
        path.mkdir(parents=True, exist_ok=True)
        shipped = Path(__file__).resolve().parents[2] / ("dagster.prod.yaml" if prod else "dagster.yaml")
        if not (path / "dagster.yaml").exists() and shipped.exists():
            (path / "dagster.yaml").write_text(shipped.read_text())
        return path

    def events_dir(self) -> Path:
        """The event intake's files (``incoming/``, later ``archive/``, ``failed/``): ``<home>/events``."""
        return self.home / "events"

    def table_path(self, table: str, override: str | None = None) -> str:
        """Location of a Delta table: ``<warehouse>/<schema>/<table>`` unless the source spec says otherwise."""
        if override:
            return override if "://" in override or Path(override).is_absolute() else str(Path(override).absolute())
        schema, _, name = table.partition(".")
        return f"{self.warehouse.rstrip('/')}/{schema}/{name}"


PROFILES = ("embedded", "prod")
DAGSTER_PG_SCHEME = "postgresql+psycopg2://"


def _profile(env: Mapping[str, str]) -> tuple[str, str]:
    """``TIDEMARK_PROFILE`` (default: ``prod`` when ``TIDEMARK_DAGSTER_PG_URL`` is set, else
    ``embedded``) and the Dagster instance's PostgreSQL URL, checked together."""
    pg_url = env.get("TIDEMARK_DAGSTER_PG_URL", "").strip()
    profile = env.get("TIDEMARK_PROFILE", "").strip() or ("prod" if pg_url else "embedded")
    if profile not in PROFILES:
        raise ConfigError(f"TIDEMARK_PROFILE={profile!r}: use one of {', '.join(PROFILES)}")
    if profile == "prod" and not pg_url:
        raise ConfigError("TIDEMARK_PROFILE=prod keeps the Dagster instance in PostgreSQL but TIDEMARK_DAGSTER_PG_URL "
                          f"is not set. Fix: export TIDEMARK_DAGSTER_PG_URL={DAGSTER_PG_SCHEME}user:password@host:port/db "
                          "(`tidemark postgres up` starts a local server and prints it)")
    if pg_url and not pg_url.startswith(DAGSTER_PG_SCHEME):
        # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, which dagster-postgres 0.29 does
        # not support (its NOTIFY fails at the first event): the driver must be spelled out.
        raise ConfigError(f"TIDEMARK_DAGSTER_PG_URL={_redact(pg_url)!r}: Dagster's storage needs the driver in the URL: "
                          f"{DAGSTER_PG_SCHEME}user:password@host:port/db (`tidemark postgres up` prints one)")
    if profile == "embedded" and pg_url:
        raise ConfigError("TIDEMARK_PROFILE=embedded keeps the Dagster instance in SQLite, but TIDEMARK_DAGSTER_PG_URL "
                          "is set. Fix: unset one of them")
    return profile, pg_url


def _redact(url: str) -> str:
    """``url`` without its password (for error messages)."""
    return re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", url)


def offsets_url_of(dagster_pg_url: str) -> str:
    """The offset store's URL (psycopg) for the database of ``TIDEMARK_DAGSTER_PG_URL``."""
    return dagster_pg_url.replace(DAGSTER_PG_SCHEME, "postgresql://", 1)


def parse_spark_conf(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"TIDEMARK_SPARK_CONF: {part!r} is not key=value (pairs are separated by ';')")
        out[key.strip()] = value.strip()
    return out


def whole_number_setting(name: str, default: int, what: str, env: Mapping[str, str] | None = None) -> int:
    """The setting ``$name`` (``default`` when unset or empty) as a whole number of ``what`` >= 1;
    anything else is refused, naming the variable and its value."""
    raw = (os.environ if env is None else env).get(name, "").strip() or str(default)
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{name}={raw!r}: expected a whole number of {what} >= 1")
    return value
