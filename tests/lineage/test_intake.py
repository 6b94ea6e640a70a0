"""The intake config (file:line:field errors, secrets from the environment) and the collector's
pure request handling: body forms, what a bad body's message says, ContextEnrichment."""

from __future__ import annotations

import datetime as dt
import re
import uuid
from pathlib import Path

import pytest

from lineage.intake.bodies import BadRequest, RequestContext, enrich, parse_body, utc_timestamp
from lineage.intake.config import DEFAULT_INTAKE, IntakeConfigError, TokenKind, load_intake, parse_size

GOOD = """\
collector:
  port: 9000
  max_body: 512KiB
  rotate_minutes: 1
tokens:
  - id: web
    kind: browser
    secret_env: T_WEB
  - id: api
    kind: server
    secret_env: T_API
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "intake.yaml"
    p.write_text(text)
    return p


def test_good_config_keeps_only_digests(tmp_path):
    intake = load_intake(write(tmp_path, GOOD), {"T_WEB": "s-web", "T_API": "s-api"})
    assert intake.collector.port == 9000 and intake.collector.max_body == 512 * 1024
    assert intake.collector.host == "127.0.0.1" and intake.collector.rotate_bytes == 64 * 1024**2
    assert [(t.id, t.kind) for t in intake.tokens] == [("web", TokenKind.BROWSER), ("api", TokenKind.SERVER)]
    assert intake.find_token("s-api").id == "api"
    assert intake.find_token("s-ap") is None and intake.find_token("") is None and intake.find_token(None) is None
    assert "s-web" not in repr(intake) and "s-web" not in repr(intake.tokens)


def test_demo_config_is_valid():
    intake = load_intake(DEFAULT_INTAKE, {"TIDEMARK_TOKEN_WEB": "a", "TIDEMARK_TOKEN_BACKEND": "b"})
    assert {t.kind for t in intake.tokens} == {TokenKind.BROWSER, TokenKind.SERVER}


def test_unset_secret_names_token_file_line_and_variable(tmp_path):
    p = write(tmp_path, GOOD)
    with pytest.raises(IntakeConfigError) as err:
        load_intake(p, {"T_WEB": "x"})
    assert err.value.problems == [f"{p}:11: token 'api': environment variable T_API is not set; export T_API=<the secret>"]
    with pytest.raises(IntakeConfigError, match="T_API is empty"):
        load_intake(p, {"T_WEB": "x", "T_API": ""})


def test_every_problem_with_its_line_and_field(tmp_path):
    p = write(tmp_path, GOOD.replace("port: 9000", "port: 99999\n  max_bodyy: 1").replace("max_body: 512KiB", "max_body: lots")
              .replace("id: api", "id: a.b").replace("kind: server", "kind: phone"))
    with pytest.raises(IntakeConfigError) as err:
        load_intake(p, {"T_WEB": "x", "T_API": "y"})
    problems = err.value.problems
    assert problems[0].startswith(f"{p}:2: field 'collector.port': ")
    assert problems[1].startswith(f"{p}:3: field 'collector.max_bodyy': unknown field") and "max_body" in problems[1]
    assert problems[2] == f"{p}:4: field 'collector.max_body': 'lots' is not a size (use e.g. 1048576, 512KiB, 1MiB, 64MB)"
    assert problems[3].startswith(f"{p}:10: field 'tokens.1.id': 'a.b' is not a token id")
    assert problems[4].startswith(f"{p}:11: field 'tokens.1.kind': ")
    assert len(problems) == 5


def test_duplicate_ids_secrets_yaml_and_missing_tokens(tmp_path):
    with pytest.raises(IntakeConfigError, match="token id 'web' is used twice"):
        load_intake(write(tmp_path, GOOD.replace("id: api", "id: web")), {"T_WEB": "x", "T_API": "y"})
    with pytest.raises(IntakeConfigError, match="same secret"):
        load_intake(write(tmp_path, GOOD), {"T_WEB": "x", "T_API": "x"})
    with pytest.raises(IntakeConfigError, match=r"intake.yaml:3:\d+: not valid YAML"):
        load_intake(write(tmp_path, "tokens:\n - id: [\n"), {})
    with pytest.raises(IntakeConfigError, match="field 'tokens': is required"):
        load_intake(write(tmp_path, "collector: {}\n"), {})
    with pytest.raises(IntakeConfigError, match="cannot read"):
        load_intake(tmp_path / "nope.yaml", {})


def test_sizes():
    assert parse_size("1MiB") == 1024**2 and parse_size("64MB") == 64_000_000 and parse_size(300) == 300
    assert parse_size("2 kb") == 2000
    for bad in ("1 parsec", True, 0, "-1"):
        with pytest.raises(ValueError):
            parse_size(bad)


# ------------------------------------------------------------------ bodies


def test_body_forms():
    assert parse_body(b'{"a": 1}') == [{"a": 1}]
    assert parse_body(b'[{"a": 1}, {"b": 2}]') == [{"a": 1}, {"b": 2}]
    assert parse_body(b'{"a": 1}\n\n{"b": 2}\n') == [{"a": 1}, {"b": 2}]
    assert parse_body(b'{"a": 1}', "application/x-ndjson") == [{"a": 1}]


@pytest.mark.parametrize(("body", "ctype", "status", "message"), [
    (b"", "", 400, "the body is empty"),
    (b"[]", "", 400, "holds no event"),
    (b'{"a": nope}', "", 400, "malformed JSON in the body: .* at line 1, column 7 \\(char 6 of the body\\)"),
    (b'{"a": 1}\n{"b": 2,}\n', "", 400, "on line 2 of the NDJSON body: .* at column 8 \\(char 16 of the body\\)"),
    (b'{"a": 1}\n[1]\n', "application/x-ndjson", 400, "line 2 of the NDJSON body is an array, not a JSON object"),
    (b'[{"a": 1}, "x"]', "", 400, "element 1 of the array is a string, not a JSON object"),
    (b"42", "", 400, "the body is a number"),
    (b"[" + b",".join([b"{}"] * 4) + b"]", "", 413, "more than 3 events"),
    (b"{}\n" * 4, "", 413, "more than 3 events"),
])
def test_bad_bodies_say_what_and_where(body, ctype, status, message):
    with pytest.raises(BadRequest) as err:
        parse_body(body, ctype, max_events=3)
    assert err.value.status == status
    assert re.search(message, err.value.message), err.value.message


def test_enrichment():
    stamp = utc_timestamp(dt.datetime(2026, 1, 31, 13, 0, 0, 5, tzinfo=dt.timezone(dt.timedelta(hours=1))))
    assert stamp == "2026-01-31T12:00:00.000005Z"
    browser = RequestContext(source_ip="10.0.0.1", token_id="web", browser=True, user_agent="UA/1")
    ev = enrich({"x": 1, "api_key": "forged", "eventn_ctx": {"event_id": "e1"}}, browser, stamp)
    assert ev == {"x": 1, "api_key": "web", "source_ip": "10.0.0.1", "_timestamp": stamp,
                  "eventn_ctx": {"event_id": "e1", "user_agent": "UA/1"}}
    server = RequestContext(source_ip="10.0.0.2", token_id="api", browser=False)
    ev = enrich({"x": 1}, server, stamp)
    assert ev["src"] == "api" and uuid.UUID(ev["eventn_ctx"]["event_id"]).version == 4 and "user_agent" not in ev["eventn_ctx"]
    assert enrich({"eventn_ctx": {"event_id": "mine"}}, server, stamp)["eventn_ctx"]["event_id"] == "mine"
    with pytest.raises(BadRequest, match="eventn_ctx is a string"):
        enrich({"eventn_ctx": "x"}, server, stamp)
