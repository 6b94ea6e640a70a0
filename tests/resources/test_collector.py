"""The event collector as a real server (``tidemark collect`` in a subprocess on a free loopback
port), driven by an async HTTP client: refusals that never stop it, body forms, enrichment, the
incoming log's rotation, graceful stop, and SIGKILL mid-load without losing an acknowledged event."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from resources.intake.incoming_log import ReadStats, file_name, iter_ready_files, read_events

ROOT = Path(__file__).resolve().parents[2]
WEB, API = "web-secret-Zq81", "api-secret-Pw07"


def config(tmp_path: Path, **collector: Any) -> Path:
    lines = "".join(f"  {k}: {v}\n" for k, v in collector.items())
    p = tmp_path / "intake.yaml"
    p.write_text("collector:\n" + (lines or "  {}\n").replace("  {}\n", "") + "  fsync_group_ms: 1\n"
                 "tokens:\n  - {id: web, kind: browser, secret_env: T_WEB}\n  - {id: api, kind: server, secret_env: T_API}\n")
    return p


class Collector:
    """A ``tidemark collect`` subprocess; ``url`` once it answers /health."""

    def __init__(self, home: Path, cfg: Path, env: dict[str, str] | None = None) -> None:
        self.home, self.cfg = home, cfg
        self.out = home / f"collector-{time.monotonic_ns()}.out"
        home.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "T_WEB": WEB, "T_API": API, **(env or {})}
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "platform_assets.cli", "--home", str(home), "collect",
                                          "--config", str(cfg), "--port", "0"], cwd=ROOT, env=full_env,
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.url = self._wait()

    def _wait(self) -> str:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://\S+)", self.out.read_text())
            if m:
                try:
                    if httpx.get(m[1] + "/health", timeout=2).status_code == 200:
                        return m[1]
                except httpx.TransportError:
                    pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"the collector exited ({self.proc.returncode}):\n{self.out.read_text()}")
            time.sleep(0.05)
        raise RuntimeError(f"the collector did not answer within 30 s:\n{self.out.read_text()}")

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    c = Collector(tmp_path / "home", config(tmp_path))
    try:
        yield c
    finally:
        c.stop(signal.SIGKILL)


def ready_events(home: Path) -> list[dict[str, Any]]:
    return [e for f in iter_ready_files(home / "events") for _, e in read_events(f.path)]


def test_refusals_never_stop_the_server(collector):
    u = collector.url

    def post(path: str, **kw: Any) -> httpx.Response:
        return httpx.post(u + path, timeout=10, **kw)

    r = post("/api/v1/event", json={"a": 1})
    assert r.status_code == 401 and "missing API token" in r.json()["error"]
    assert post("/api/v1/event?token=nope", json={"a": 1}).status_code == 401
    r = post("/api/v1/s2s/event", headers={"X-Auth-Token": WEB}, json={"a": 1})
    assert r.status_code == 401 and "'web' is a browser token" in r.json()["error"]
    r = post(f"/api/v1/event?token={API}", json={"a": 1})
    assert r.status_code == 401 and "'api' is a server token" in r.json()["error"]
    big = b'{"a": "' + b"x" * (1024**2) + b'"}'
    r = post(f"/api/v1/event?token={WEB}", content=big)  # refused on Content-Length
    assert r.status_code == 413 and "max_body" in r.json()["error"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: refused once the read passes the limit
        for _ in range(40):
            yield b"x" * 65536

    r = post(f"/api/v1/event?token={WEB}", content=chunks())
    assert r.status_code == 413
    r = post("/api/v1/s2s/event", headers={"X-Auth-Token": API}, content=b'{"a": 1}\n{"b": 2,}\n')
    assert r.status_code == 400 and "line 2 of the NDJSON body" in r.json()["error"] and "char 16" in r.json()["error"]
    r = post("/api/v1/s2s/event", headers={"X-Auth-Token": API}, content=b'[{"a": 1}, 7]')
    assert r.status_code == 400 and "element 1 of the array is a number" in r.json()["error"]
    r = post(f"/api/v1/event?token={WEB}", json={"ok": 1})
    assert r.status_code == 200 and r.json() == {"status": "ok", "accepted": 1}
    m = httpx.get(u + "/metrics").json()
    assert m["events_accepted"] == 1 and m["fsyncs"] >= 1
    assert m["rejected"] == {"no_token": 1, "bad_token": 1, "wrong_token_kind": 2, "too_large": 2, "malformed_json": 1,
                             "not_an_object": 1}
    assert collector.stop() == -signal.SIGTERM
    assert [e["ok"] for e in ready_events(collector.home)] == [1]  # nothing of a refused request was logged


def test_batch_forms_enrichment_and_no_secret_in_the_log(collector):
    async def go() -> None:
        async with httpx.AsyncClient(base_url=collector.url, timeout=10) as c:
            h = {"X-Auth-Token": API}
            assert (await c.post("/api/v1/s2s/event", headers=h, json={"n": 1})).json()["accepted"] == 1
            assert (await c.post("/api/v1/s2s/event", headers=h, json=[{"n": 2}, {"n": 3, "eventn_ctx": {"event_id": "kept"}}])
                    ).json()["accepted"] == 2
            assert (await c.post("/api/v1/s2s/event", headers=h, content=b'{"n": 4}\n{"n": 5}\n')).json()["accepted"] == 2
            r = await c.post("/api/v1/event", headers={"X-Auth-Token": WEB, "User-Agent": "Mozilla/5.0 test"},
                             content=b'{"n": 6}', params={})
            assert r.json()["accepted"] == 1
            r = await c.post(f"/api/v1/event?token={WEB}", headers={"User-Agent": "UA2", "Content-Type": "application/x-ndjson"},
                             content=b'{"n": 7, "api_key": "' + WEB.encode() + b'"}')
            assert r.status_code == 200

    asyncio.run(go())
    collector.stop()
    files = iter_ready_files(collector.home / "events")
    assert sorted(f.token for f in files) == ["api", "web"]
    for f in files:
        raw = f.path.read_bytes()
        assert WEB.encode() not in raw and API.encode() not in raw
        assert [n for n, _ in read_events(f.path)] == list(range(1, raw.count(b"\n") + 1))
    by_n = {e["n"]: e for e in ready_events(collector.home)}
    assert sorted(by_n) == [1, 2, 3, 4, 5, 6, 7]
    for n in (1, 2, 3, 4, 5):
        e = by_n[n]
        assert e["api_key"] == "api" and e["src"] == "api" and e["source_ip"] == "127.0.0.1"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", e["_timestamp"])
        assert "user_agent" not in e["eventn_ctx"]
    ids = [by_n[n]["eventn_ctx"]["event_id"] for n in (1, 2, 4, 5)]
    assert len(set(ids)) == 4 and all(len(i) == 36 for i in ids) and by_n[3]["eventn_ctx"]["event_id"] == "kept"
    assert by_n[6]["eventn_ctx"] == {"user_agent": "Mozilla/5.0 test"} and by_n[6]["api_key"] == "web" and "src" not in by_n[6]
    assert by_n[7]["api_key"] == "web" and by_n[7]["eventn_ctx"]["user_agent"] == "UA2"


def test_integers_beyond_64_bits_stay_exact_and_a_number_beyond_a_double_is_refused(collector):
    h = {"X-Auth-Token": API}
    body = b'[{"k": 1, "n2": 18446744073709551616, "neg": -9223372036854775809, "l": [123456789012345678901234567890]}]'
    r = httpx.post(collector.url + "/api/v1/s2s/event", headers=h, content=body, timeout=10)
    assert r.status_code == 200 and r.json()["accepted"] == 1
    r = httpx.post(collector.url + "/api/v1/s2s/event", headers=h, content=b'{"k": 2}\n{"k": 3, "x": 1e400}\n', timeout=10)
    assert r.status_code == 400
    assert "1e400 on line 2 of the NDJSON body" in r.json()["error"] and "send it as a string" in r.json()["error"]
    r = httpx.post(collector.url + "/api/v1/s2s/event", headers=h, content=b'{"k": 4, "x": NaN}', timeout=10)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
    assert httpx.get(collector.url + "/metrics").json()["rejected"] == {"number_out_of_range": 1, "malformed_json": 1}
    collector.stop()
    [event] = ready_events(collector.home)  # nothing of a refused request was logged
    assert event["n2"] == 2**64 and event["neg"] == -(2**63) - 1 and event["l"] == [123456789012345678901234567890]
    assert type(event["n2"]) is int


def test_rotation_by_size_and_by_time(tmp_path):
    c = Collector(tmp_path / "home", config(tmp_path, rotate_bytes="2KB", rotate_minutes=0.05, trust_proxy="true"))
    try:
        events = tmp_path / "home" / "events"
        h = {"X-Auth-Token": API, "X-Forwarded-For": "203.0.113.9, 10.0.0.1"}
        for i in range(10):  # ~300 bytes each: a new file after every ~7 events
            assert httpx.post(c.url + "/api/v1/s2s/event", headers=h, json={"i": i, "pad": "p" * 150}).status_code == 200
        sized = iter_ready_files(events)
        assert len(sized) >= 1 and all(f.path.stat().st_size >= 2000 for f in sized)
        deadline = time.monotonic() + 15  # rotate_minutes 0.05 = 3 s after the file's first event
        while len(by_time := iter_ready_files(events)) == len(sized) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(by_time) == len(sized) + 1, "the open file was not closed by time"
        assert not list((events / "incoming").glob("*.log")), "a file is still open after its time"
        got = [e for f in by_time for _, e in read_events(f.path)]
        assert [e["i"] for e in got] == list(range(10)) and {e["source_ip"] for e in got} == {"203.0.113.9"}
        sizes = [f.path.stat().st_size for f in by_time]
        assert httpx.post(c.url + "/api/v1/s2s/event", headers=h, json={"i": 10}).status_code == 200
        time.sleep(0.3)
        assert [f.path.stat().st_size for f in by_time] == sizes, "a ready file was written to"
        assert [f.start for f in by_time] == sorted(f.start for f in by_time)
    finally:
        c.stop(signal.SIGKILL)


def test_a_second_collector_on_the_same_log_is_refused_and_a_bad_config_never_starts(collector, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "T_WEB": WEB, "T_API": API}
    cmd = [sys.executable, "-m", "platform_assets.cli", "--home", str(collector.home), "collect", "--config",
           str(collector.cfg), "--port", "0"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "another collector (pid" in r.stderr, r.stderr
    del env["T_API"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{collector.cfg}:5: token 'api': environment variable T_API is not set" in r.stderr
    assert httpx.get(collector.url + "/health").status_code == 200


def test_reader_drops_a_torn_tail_and_skips_corrupt_lines(tmp_path):
    import datetime as dt

    ready = tmp_path / "events" / "incoming" / "ready"
    ready.mkdir(parents=True)
    t0 = dt.datetime(2026, 1, 31, 12, tzinfo=dt.UTC)
    a = ready / file_name("web", t0 + dt.timedelta(seconds=1))
    a.write_bytes(b'{"n": 1}\n\x00\x00\x00\n{"n": 3}\n{"n": 4, "tor')
    b = ready / file_name("api", t0)
    b.write_bytes(b'{"n": 0}\n')
    (ready / "notes.txt").write_text("ignored")
    assert [(f.token, f.start) for f in iter_ready_files(tmp_path / "events")] == [("api", t0), ("web", t0 + dt.timedelta(seconds=1))]
    stats = ReadStats()
    assert list(read_events(a, stats)) == [(1, {"n": 1}), (3, {"n": 3})]
    assert stats == ReadStats(events=2, torn_tail_bytes=len(b'{"n": 4, "tor'), corrupt_lines=[2])


def test_sigkill_mid_load_loses_no_acknowledged_event(tmp_path):
    """Clients post concurrently; the collector is SIGKILLed mid-load and restarted on the same
    home: every acknowledged event is in the log exactly once, no event is there twice."""
    home = tmp_path / "home"
    cfg = config(tmp_path, rotate_bytes="256KB")
    acked: list[str] = []
    sent: list[str] = []

    async def client(url: str, n: int, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            i = 0
            while not stop.is_set():
                batch = [f"c{n}-{i + k}" for k in range(1 + i % 17)]
                i += len(batch)
                sent.extend(batch)
                try:
                    r = await c.post("/api/v1/s2s/event", headers={"X-Auth-Token": API},
                                     json=[{"uid": u, "pad": "x" * 200} for u in batch])
                except httpx.TransportError:
                    return  # the collector is gone: this batch was never acknowledged
                if r.status_code == 200:
                    acked.extend(batch)

    async def load(c: Collector) -> None:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(client(c.url, n, stop)) for n in range(12)]
        incoming = home / "events" / "incoming"
        while len(acked) < 3000 or not list(incoming.glob("*.log")):  # a file is open (not just rotated)
            await asyncio.sleep(0.002)
        c.proc.send_signal(signal.SIGKILL)  # mid-load: requests are in flight
        await asyncio.gather(*tasks)

    first = Collector(home, cfg)
    try:
        asyncio.run(load(first))
        first.proc.wait(timeout=10)
    finally:
        first.stop(signal.SIGKILL)
    assert len(sent) > len(acked) >= 3000
    left = list((home / "events" / "incoming").glob("*.log"))
    assert left, "the kill left no open file: the test did not kill mid-write"
    second = Collector(home, cfg)
    try:
        assert "moved to ready/" in second.out.read_text()
        assert httpx.post(second.url + "/api/v1/s2s/event", headers={"X-Auth-Token": API},
                          json={"uid": "after"}).status_code == 200
    finally:
        assert second.stop() == -signal.SIGTERM
    stats = ReadStats()
    uids = Counter(e["uid"] for f in iter_ready_files(home / "events") for _, e in read_events(f.path, stats))
    missing = [u for u in acked if uids[u] != 1]
    assert missing == [], f"{len(missing)} acknowledged events not exactly once: {missing[:5]}"
    assert max(uids.values()) == 1 and uids["after"] == 1
    assert set(uids) <= {*sent, "after"}
    assert stats.corrupt_lines == []


def test_print_config_names_where_it_listens_the_token_ids_and_the_log(tmp_path, monkeypatch, capsys):
    from platform_assets.cli.main import main

    monkeypatch.setenv("T_WEB", WEB)
    monkeypatch.setenv("T_API", API)
    monkeypatch.setenv("TIDEMARK_INTAKE", str(config(tmp_path, port=9123)))
    assert main(["--home", str(tmp_path / "h"), "collect", "--host", "0.0.0.0", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "listen http://0.0.0.0:9123" in out and "tokens web (browser), api (server)" in out
    assert f"log {tmp_path / 'h' / 'events' / 'incoming'}" in out and WEB not in out and API not in out
    monkeypatch.delenv("T_WEB")
    assert main(["--home", str(tmp_path / "h"), "collect", "--print-config"]) == 2
    assert "environment variable T_WEB is not set" in capsys.readouterr().err
