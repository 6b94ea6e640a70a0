"""The prod profile's settings: how it is selected, what it requires, where its Dagster
instance lives, and that its shipped instance file stays in step with dagster.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lineage.core.errors import ConfigError
from resources.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PG = "postgresql+psycopg2://tm:s3cret@db.example:5432/tidemark"


def test_embedded_by_default_and_prod_when_the_dagster_url_is_set(tmp_path):
    embedded = Settings.from_env({}, home=tmp_path)
    assert embedded.profile == "embedded" and embedded.offsets_url.startswith("sqlite:///")
    prod = Settings.from_env({"TIDEMARK_DAGSTER_PG_URL": PG}, home=tmp_path)
    assert prod.profile == "prod" and prod.dagster_pg_url == PG
    assert prod.offsets_url == "postgresql://tm:s3cret@db.example:5432/tidemark"  # the same database
    own = Settings.from_env({"TIDEMARK_DAGSTER_PG_URL": PG, "TIDEMARK_OFFSETS_URL": "postgresql://x@y/offsets"}, home=tmp_path)
    assert own.offsets_url == "postgresql://x@y/offsets"


@pytest.mark.parametrize(("env", "message"), [
    ({"TIDEMARK_PROFILE": "prod"}, "TIDEMARK_DAGSTER_PG_URL is not set. Fix: export TIDEMARK_DAGSTER_PG_URL=postgresql\\+psycopg2://"),
    ({"TIDEMARK_PROFILE": "staging"}, "TIDEMARK_PROFILE='staging': use one of embedded, prod"),
    ({"TIDEMARK_DAGSTER_PG_URL": "postgresql://tm:s3cret@db/x"}, "needs the driver in the URL: postgresql\\+psycopg2://"),
    ({"TIDEMARK_PROFILE": "embedded", "TIDEMARK_DAGSTER_PG_URL": PG}, "unset one of them"),
])
def test_bad_profile_settings_are_refused_with_the_fix(tmp_path, env, message):
    with pytest.raises(ConfigError, match=message) as err:
        Settings.from_env(env, home=tmp_path)
    assert "s3cret" not in str(err.value)  # the password never lands in a message or a log


def test_each_profile_has_its_own_dagster_home_with_its_shipped_instance_file(tmp_path, monkeypatch):
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    embedded = Settings.from_env({}, home=tmp_path).dagster_home()
    prod = Settings.from_env({"TIDEMARK_DAGSTER_PG_URL": PG}, home=tmp_path).dagster_home()
    assert (embedded, prod) == (tmp_path / "dagster", tmp_path / "dagster-prod")
    assert (embedded / "dagster.yaml").read_text() == (ROOT / "dagster.yaml").read_text()
    assert (prod / "dagster.yaml").read_text() == (ROOT / "dagster.prod.yaml").read_text()


def test_the_prod_instance_file_is_dagster_yaml_plus_postgres_storage():
    """Concurrency, run monitoring and telemetry are the same in both profiles: a change to
    dagster.yaml must be made to dagster.prod.yaml too."""
    embedded = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    prod = yaml.safe_load((ROOT / "dagster.prod.yaml").read_text())
    assert prod.pop("storage") == {"postgres": {"postgres_url": {"env": "TIDEMARK_DAGSTER_PG_URL"}}}
    assert "storage" not in embedded and prod == embedded
