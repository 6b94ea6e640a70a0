"""Where Tidemark keeps things, from environment variables with embedded defaults.

| variable | default | meaning |
|---|---|---|
| ``TIDEMARK_HOME`` | ``./.tidemark`` | state dir: offset store, Dagster home, Spark scratch |
| ``TIDEMARK_WAREHOUSE`` | ``$TIDEMARK_HOME/warehouse`` | root of the Delta tables (``<root>/<schema>/<table>``) |
| ``TIDEMARK_OFFSETS_URL`` | ``sqlite:///$TIDEMARK_HOME/offsets.db`` | offset store (``sqlite:///…`` or ``postgresql://…``) |
| ``TIDEMARK_LINEAGE`` | ``./demo/lineage`` | lineage YAML file or directory |
| ``TIDEMARK_SPARK_MASTER`` | ``local[*]`` | Spark master URL, or ``sc://host:port`` for Spark Connect |
| ``TIDEMARK_SPARK_CONF`` | (none) | extra Spark settings, ``key=value`` pairs separated by ``;`` |
| ``TIDEMARK_LOCK_LEASE`` | ``5m`` | a topic lock expires this long after its holder's last heartbeat (``resources.offset_sql``) |
| ``TIDEMARK_OWNER_HOST`` | the hostname | host part of lock owner ids (e.g. a pod name) |
| ``TIDEMARK_S3_*`` | the ``AWS_*`` variables | object store of an ``s3://`` warehouse: see ``resources.storage`` |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from lineage.errors import ConfigError


@dataclass(frozen=True)
class Settings:
    home: Path
    warehouse: str
    offsets_url: str
    lineage: Path
    spark_master: str = "local[*]"
    spark_conf: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: str | Path | None) -> Settings:
        env = os.environ if env is None else env
        home = Path(str(overrides.get("home") or env.get("TIDEMARK_HOME") or ".tidemark")).absolute()
        warehouse = str(overrides.get("warehouse") or env.get("TIDEMARK_WAREHOUSE") or home / "warehouse")
        if "://" not in warehouse:
            warehouse = str(Path(warehouse).absolute())
        offsets = str(overrides.get("offsets_url") or env.get("TIDEMARK_OFFSETS_URL") or f"sqlite:///{home / 'offsets.db'}")
        lineage = Path(str(overrides.get("lineage") or env.get("TIDEMARK_LINEAGE") or "demo/lineage")).absolute()
        master = str(overrides.get("spark_master") or env.get("TIDEMARK_SPARK_MASTER") or "local[*]")
        conf = parse_spark_conf(env.get("TIDEMARK_SPARK_CONF", ""))
        return cls(home=home, warehouse=warehouse, offsets_url=offsets, lineage=lineage, spark_master=master, spark_conf=conf)

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
        """``$DAGSTER_HOME``, else ``<home>/dagster`` (created, with the repo's dagster.yaml)."""
        env = os.environ.get("DAGSTER_HOME")
        path = Path(env) if env else self.home / "dagster"
        path.mkdir(parents=True, exist_ok=True)
        shipped = Path(__file__).resolve().parents[1] / "dagster.yaml"
        if not (path / "dagster.yaml").exists() and shipped.exists():
            (path / "dagster.yaml").write_text(shipped.read_text())
        return path

    def table_path(self, table: str, override: str | None = None) -> str:
        """Location of a Delta table: ``<warehouse>/<schema>/<table>`` unless the source spec says otherwise."""
        if override:
            return override if "://" in override or Path(override).is_absolute() else str(Path(override).absolute())
        schema, _, name = table.partition(".")
        return f"{self.warehouse.rstrip('/')}/{schema}/{name}"


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
