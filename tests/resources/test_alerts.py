"""The alert notifier on its own, against a real local HTTP receiver (no Dagster here)."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from resources.core.alerts import DEFAULT_WEBHOOK_ENV, Alert, AlertNotifier, default_log_path

TOKEN = "T000/B000/s3cr3t-token"


@dataclass
class Post:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class Receiver:
    """A real HTTP server on 127.0.0.1 (free port) that records every POST's JSON body.

    ``status``: the HTTP status it answers with; ``delay_s``: how long it waits before answering.
    """

    def __init__(self, status: int = 200, delay_s: float = 0.0) -> None:
        self.posts: list[Post] = []
        self.status = status
        self.delay_s = delay_s
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver._lock:
                    receiver.posts.append(Post(self.path, dict(self.headers), json.loads(body)))
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                self.send_response(receiver.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.running = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/{TOKEN}"

    def bodies(self) -> list[dict[str, Any]]:
        with self._lock:
            return [p.body for p in self.posts]

    def stop(self) -> None:
        if self.running:
            self.running = False
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(timeout=10)


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Any:
    r = Receiver()
    monkeypatch.setenv(DEFAULT_WEBHOOK_ENV, r.url)
    yield r
    r.stop()


def log_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def alert(key: str = "run:r1", kind: str = "run_failure", **details: Any) -> Alert:
    return Alert(kind=kind, key=key, title=f"incident {key}", details=details or {"run_id": key},  # type: ignore[arg-type]
                 at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))


def test_an_alert_is_posted_as_json_and_written_to_the_log(receiver: Receiver, tmp_path: Path) -> None:
    notifier = AlertNotifier(tmp_path / "alerts.log")
    d = notifier.send(alert("check:fact/orders:rows_ok:-:r1", "check_failure", severity="WARN", metadata={"bad": 2}))
    assert (d.logged, d.duplicate, d.webhook, d.error) == (True, False, "sent", None)

    [post] = receiver.posts
    assert post.path == f"/hooks/{TOKEN}"
    assert post.headers["Content-Type"] == "application/json"
    assert post.body == {
        "source": "tidemark", "kind": "check_failure", "key": "check:fact/orders:rows_ok:-:r1",
        "title": "incident check:fact/orders:rows_ok:-:r1", "text": "[tidemark] incident check:fact/orders:rows_ok:-:r1",
        "at": "2026-01-02T03:04:05+00:00", "details": {"severity": "WARN", "metadata": {"bad": 2}},
    }
    assert log_lines(tmp_path / "alerts.log") == [post.body]


def test_one_alert_per_key_across_calls_restarts_and_a_lost_state_file(receiver: Receiver, tmp_path: Path) -> None:
    log = tmp_path / "alerts.log"
    first = AlertNotifier(log)
    report = first.send_all([alert("run:a"), alert("run:b"), alert("run:a")])  # a repeat inside one call too
    assert [d.key for d in report.new] == ["run:a", "run:b"] and [d.key for d in report.duplicates] == ["run:a"]
    assert first.send(alert("run:a")).duplicate

    restarted = AlertNotifier(log)  # a new process: only the files are shared
    assert restarted.send_all([alert("run:a"), alert("run:b")]).new == []
    (tmp_path / "alerts.log.state.json").unlink()  # the state is lost: the log itself is the record
    assert AlertNotifier(log).send_all([alert("run:a"), alert("run:c")]).new[0].key == "run:c"

    assert [b["key"] for b in receiver.bodies()] == ["run:a", "run:b", "run:c"]
    assert [x["key"] for x in log_lines(log)] == ["run:a", "run:b", "run:c"]


def test_webhook_down_keeps_the_alert_in_the_log_reports_it_and_retries_once(
        receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    log = tmp_path / "alerts.log"
    notifier = AlertNotifier(log)
    receiver.stop()
    with caplog.at_level(logging.ERROR, logger="tidemark.alerts"):
        report = notifier.send_all([alert("run:a"), alert("run:b"), alert("run:c")])
    assert [x["key"] for x in log_lines(log)] == ["run:a", "run:b", "run:c"]  # the log has every alert
    # one connection attempt per call: after the first failure the others wait for the next call
    assert [(d.key, d.webhook) for d in report.deliveries] == [("run:a", "failed"), ("run:b", "deferred"),
                                                                ("run:c", "deferred")]
    assert "cannot connect" in (report.deliveries[0].error or "") and "Connection refused" in report.summary()
    [record] = caplog.records
    text = record.getMessage()
    assert "alert webhook failed: 'run:a' was not delivered to http://127.0.0.1:" in text
    assert str(log) in text and "retrying" in text
    assert TOKEN not in text  # the secret part of the URL is not logged
    assert notifier.pending_keys() == ["run:a", "run:b", "run:c"]

    assert notifier.send_all([]).failures[0].webhook == "failed"  # still down: still pending
    back = Receiver()
    monkeypatch.setenv(DEFAULT_WEBHOOK_ENV, back.url)
    try:
        report = AlertNotifier(log).send_all([alert("run:a"), alert("run:d")])  # after a restart too
        assert [(d.key, d.webhook, d.retry) for d in report.deliveries] == [
            ("run:a", "sent", True), ("run:b", "sent", True), ("run:c", "sent", True), ("run:a", "off", False),
            ("run:d", "sent", False)]
        notifier.send_all([alert("run:b")])
        assert [b["key"] for b in back.bodies()] == ["run:a", "run:b", "run:c", "run:d"]
    finally:
        back.stop()
    assert [x["key"] for x in log_lines(log)] == ["run:a", "run:b", "run:c", "run:d"]
    assert notifier.pending_keys() == []


def test_http_error_status_and_timeout_are_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing, slow = Receiver(status=500), Receiver(delay_s=2.0)
    try:
        monkeypatch.setenv(DEFAULT_WEBHOOK_ENV, failing.url)
        d = AlertNotifier(tmp_path / "a.log").send(alert("run:a"))
        assert (d.webhook, d.error) == ("failed", "HTTP 500 Internal Server Error")

        monkeypatch.setenv(DEFAULT_WEBHOOK_ENV, slow.url)
        t0 = time.monotonic()
        d = AlertNotifier(tmp_path / "b.log", timeout_s=0.3).send(alert("run:b"))
        assert (d.webhook, d.error) == ("failed", "timed out after 0.3s")
        assert time.monotonic() - t0 < 1.5
        assert [x["key"] for x in log_lines(tmp_path / "b.log")] == ["run:b"]
    finally:
        failing.stop()
        slow.stop()


def test_retries_stop_after_the_retry_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    dead = Receiver()
    dead.stop()
    monkeypatch.setenv(DEFAULT_WEBHOOK_ENV, dead.url)
    notifier = AlertNotifier(tmp_path / "alerts.log", retry_for_s=0)
    assert notifier.send(alert("run:a")).webhook == "failed"
    time.sleep(0.01)
    with caplog.at_level(logging.ERROR, logger="tidemark.alerts"):
        [d] = notifier.send_all([]).deliveries
    assert (d.key, d.webhook) == ("run:a", "gave_up")
    assert "giving up on 'run:a'" in caplog.text
    assert notifier.pending_keys() == [] and notifier.already_sent("run:a")


def test_without_a_webhook_url_alerts_go_to_the_log_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEFAULT_WEBHOOK_ENV, raising=False)
    notifier = AlertNotifier(tmp_path / "alerts.log")
    assert "no webhook ($TIDEMARK_ALERT_WEBHOOK_URL unset)" in notifier.describe()
    d = notifier.send(alert("run:a"))
    assert (d.logged, d.webhook) == (True, "off")
    assert notifier.pending_keys() == []


def test_the_webhook_env_var_name_is_configurable_and_must_hold_an_http_url(
        receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_HOOK", receiver.url)
    assert AlertNotifier(tmp_path / "a.log", webhook_env="MY_HOOK").send(alert("run:a")).webhook == "sent"
    assert AlertNotifier(tmp_path / "b.log", env={"MY_HOOK": receiver.url}, webhook_env="MY_HOOK").webhook_url == receiver.url

    monkeypatch.setenv("MY_HOOK", "file:///etc/passwd")
    d = AlertNotifier(tmp_path / "c.log", webhook_env="MY_HOOK").send(alert("run:c"))
    assert (d.webhook, d.error) == ("failed", "$MY_HOOK is not an http(s):// URL (scheme 'file')")
    assert [x["key"] for x in log_lines(tmp_path / "c.log")] == ["run:c"]
    assert [b["key"] for b in receiver.bodies()] == ["run:a"]


def test_remembered_keys_are_bounded(receiver: Receiver, tmp_path: Path) -> None:
    notifier = AlertNotifier(tmp_path / "alerts.log", max_keys=3)
    notifier.send_all([alert(f"run:{i}") for i in range(5)])
    state = json.loads((tmp_path / "alerts.log.state.json").read_text())
    assert state["sent"] == ["run:2", "run:3", "run:4"] and state["pending"] == []
    assert notifier.send(alert("run:4")).duplicate


def test_a_crash_between_log_and_state_neither_loses_nor_duplicates(receiver: Receiver, tmp_path: Path) -> None:
    log = tmp_path / "alerts.log"
    AlertNotifier(log).send(alert("run:a"))
    # as if a process wrote the next line and died before saving its state (and before the POST),
    # then a torn half line from another crash
    with open(log, "a") as fh:
        fh.write(json.dumps(alert("run:b").payload()) + "\n" + '{"key": "run:c", "ti')
    report = AlertNotifier(log).send_all([alert("run:b"), alert("run:c")])
    assert [(d.key, d.webhook, d.retry, d.duplicate) for d in report.deliveries] == [
        ("run:b", "sent", True, False), ("run:b", "off", False, True), ("run:c", "sent", False, False)]
    assert [b["key"] for b in receiver.bodies()] == ["run:a", "run:b", "run:c"]
    lines = log.read_text().splitlines()
    assert lines[2] == '{"key": "run:c", "ti' and [json.loads(x)["key"] for x in (lines[0], lines[1], lines[3])] == [
        "run:a", "run:b", "run:c"]


def test_default_log_path_is_under_tidemark_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDEMARK_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(DEFAULT_WEBHOOK_ENV, raising=False)
    assert AlertNotifier().log_path == tmp_path / "home" / "alerts.log"
    AlertNotifier().send(alert("run:a"))
    assert [x["key"] for x in log_lines(tmp_path / "home" / "alerts.log")] == ["run:a"]
    assert default_log_path({}) == Path(".tidemark").absolute() / "alerts.log"


def test_alerts_are_validated_and_their_payload_is_strict_json() -> None:
    with pytest.raises(ValueError, match="kind must be one of run_failure, check_failure"):
        Alert(kind="oops", key="k", title="t")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty key"):
        Alert(kind="run_failure", key="", title="t")
    payload = Alert(kind="check_failure", key="k", title="t", at=datetime(2026, 1, 1),
                    details={"nan": math.nan, "when": datetime(2026, 1, 1, tzinfo=UTC), "set": {"b", "a"},
                             "path": Path("/x"), "nested": {1: (1.5, None)}}).payload()
    assert payload["at"] == "2026-01-01T00:00:00+00:00"
    assert payload["details"] == {"nan": "nan", "when": "2026-01-01T00:00:00+00:00", "set": ["a", "b"],
                                  "path": "/x", "nested": {"1": [1.5, None]}}
    json.dumps(payload, allow_nan=False)
