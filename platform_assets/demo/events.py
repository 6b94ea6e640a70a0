"""The demo's events (issue 11): a real collector (``tidemark collect`` on a free loopback port),
page views and cart events posted to it over HTTP, the rotated files processed by the intake's
Dagster job, and one line that follows the events to ``fact.page_views``.

The feeder (``platform_assets/demo/feeder.py --collector URL``) posts the same kinds of events.
Token secrets come from ``TIDEMARK_TOKEN_WEB`` / ``TIDEMARK_TOKEN_BACKEND`` (demo/intake.yaml);
when unset, throw-away ones are generated for this process and its collector.
"""

from __future__ import annotations

import os
import random
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from resources.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
TOKEN_ENV = {"web": "TIDEMARK_TOKEN_WEB", "backend": "TIDEMARK_TOKEN_BACKEND"}
PAGES = ["/", "/search", "/cart", "/checkout"] + [f"/product/SKU-{n:04d}" for n in range(1, 40)]
AGENTS = ["Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/126.0 Safari/537.36",
          "Mozilla/5.0 (Macintosh; Intel Mac OS X 14_5) AppleWebKit/605.1.15 (KHTML, like Gecko) Version/17.5 Safari/605.1.15",
          "Mozilla/5.0 (Windows NT 10.0; Win64; x64; rv:127.0) Gecko/20100101 Firefox/127.0"]

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy


def ensure_tokens() -> dict[str, str]:
    """The demo tokens' secrets (token id -> secret), generated into the environment when unset."""
    out = {}
    for token, env in TOKEN_ENV.items():
        if not os.environ.get(env):
            os.environ[env] = "demo-" + secrets.token_urlsafe(18)
        out[token] = os.environ[env]
    return out


class CollectorProcess:
    """``tidemark collect --port 0`` in a subprocess; :attr:`url` once it answers ``/health``."""

    def __init__(self, settings: Settings, config: Path | None = None, timeout_s: float = 30.0) -> None:
        args = [sys.executable, "-m", "platform_assets.cli", "--home", str(settings.home), "collect", "--port", "0"]
        if config is not None:
            args += ["--config", str(config)]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self.url = self._wait(timeout_s)

    def _wait(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while self.proc.stdout is not None and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.output.append(line.rstrip())
            m = re.search(r"listening on (http://\S+)", line)
            if m:  # the socket is bound before uvicorn listens on it: wait for /health
                while time.monotonic() < deadline and self.proc.poll() is None:
                    try:
                        with _OPENER.open(m[1] + "/health", timeout=2):
                            return m[1]
                    except OSError:
                        time.sleep(0.05)
        self.stop()
        raise RuntimeError("the collector did not start:\n" + "\n".join(self.output))

    def stop(self, timeout_s: float = 15.0) -> str:
        """SIGTERM: the collector answers what is in flight, fsyncs and moves its files to ready/."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                out, _ = self.proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, _ = self.proc.communicate()
            self.output += (out or "").splitlines()
        return "\n".join(self.output)


def make_events(rng: random.Random, page_views: int, carts: int, customers: int = 200) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Browser page views and server-side cart events of the demo shop."""
    pv = [{"event_type": "page_view", "url": rng.choice(PAGES), "customer_id": rng.randint(1, customers),
           "referrer": rng.choice(["https://search.example/", "", "https://news.example/"]),
           "screen": {"w": rng.choice([1920, 1440, 390]), "h": rng.choice([1080, 900, 844])}}
          for _ in range(page_views)]
    cart = [{"event_type": "cart", "action": rng.choice(["add", "add", "remove"]), "customer_id": rng.randint(1, customers),
             "sku": f"SKU-{rng.randint(1, 300):04d}", "qty": rng.randint(1, 3), "price": round(rng.uniform(2, 120), 2)}
            for _ in range(carts)]
    return pv, cart


def _post(url: str, body: list[dict[str, Any]], headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=orjson.dumps(body), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with _OPENER.open(req, timeout=30) as resp:
            return int(orjson.loads(resp.read())["accepted"])
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"POST {url.split('?')[0]}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None


@dataclass
class Posted:
    page_views: int = 0
    carts: int = 0
    accepted: int = 0
    seconds: float = 0.0
    tables: dict[str, int] = field(default_factory=dict)

    @property
    def posted(self) -> int:
        return self.page_views + self.carts


def post_events(url: str, tokens: dict[str, str], *, page_views: int, carts: int, batch: int = 100,
                seed: int | None = None) -> Posted:
    """POST page views (browser endpoint, batches of ``batch``, a browser's user agent) and cart
    events (server endpoint); returns what was posted and acknowledged."""
    rng = random.Random(seed)
    pv, cart = make_events(rng, page_views, carts)
    out = Posted(page_views=page_views, carts=carts)
    t0 = time.monotonic()
    for i in range(0, len(pv), batch):
        out.accepted += _post(f"{url}/api/v1/event?token={tokens['web']}", pv[i:i + batch],
                              {"User-Agent": rng.choice(AGENTS)})
    for i in range(0, len(cart), batch):
        out.accepted += _post(f"{url}/api/v1/s2s/event", cart[i:i + batch], {"X-Auth-Token": tokens["backend"]})
    out.seconds = time.monotonic() - t0
    return out


def collect_demo_events(settings: Settings, *, page_views: int = 400, carts: int = 150) -> Posted:
    """Start a collector, post the demo's events, stop it (its files rotate to ready/)."""
    tokens = ensure_tokens()
    collector = CollectorProcess(settings)
    try:
        posted = post_events(collector.url, tokens, page_views=page_views, carts=carts, seed=11)
    finally:
        collector.stop()
    return posted


def process_with_dagster(settings: Settings, instance: Any, posted: Posted) -> bool:
    """One tick of the intake sensor and its run (the ``tidemark_intake`` job, in this process)."""
    from platform_assets.dagster.definitions import build_definitions
    from platform_assets.dagster.intake import SENSOR_NAME

    defs = build_definitions(settings)
    sensor = defs.resolve_sensor_def(SENSOR_NAME)
    import dagster as dg

    tick = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, definitions=defs))
    if not tick.run_requests:
        print(f"  intake: nothing to process ({tick.skip_message})", flush=True)
        return False
    req = tick.run_requests[0]
    job = defs.resolve_job_def(req.job_name or "tidemark_intake")
    result = job.execute_in_process(instance=instance, tags=dict(req.tags), raise_on_error=False,
                                    run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}})
    for e in result.get_asset_materialization_events():
        mat = e.step_materialization_data.materialization
        if mat.asset_key.path[0] == "intake":
            m = {k: v.value for k, v in mat.metadata.items()}
            posted.tables = dict(m.get("tables") or {})  # type: ignore[arg-type]
            print(f"  {'/'.join(mat.asset_key.path):<22} {m['files']} files, {m['events_in']} events in, {m['written']} "
                  f"rows written, {m['failed']} failed, +{m['columns_added']} columns, {m['promotions']} promotions "
                  f"[run {result.run_id[:8]}]", flush=True)
    checks = ", ".join(f"{c.check_name} {'ok' if c.passed else 'FAILED'}" for c in result.get_asset_check_evaluations())
    print(f"  intake checks: {checks or 'none'}", flush=True)
    return bool(result.success)


def report(settings: Settings, posted: Posted) -> bool:
    """The end-to-end line: posted -> accepted -> stage tables -> fact.page_views (read with deltalake)."""
    from resources.storage.delta_log import open_table

    def count(table: str) -> int:
        t = open_table(settings.table_path(table))
        return 0 if t is None else t.to_pyarrow_table(columns=["id"]).num_rows

    stage_pv, stage_cart = count("stage.events_page_view"), count("stage.events_cart")
    fact = count("fact.page_views")
    ok = posted.accepted == posted.posted == stage_pv + stage_cart and fact == stage_pv == posted.page_views
    print(f"\ncheck: events {posted.posted} posted -> {posted.accepted} accepted (fsynced) -> {stage_pv + stage_cart} in stage "
          f"tables (events_page_view {stage_pv}, events_cart {stage_cart}) -> fact.page_views {fact} rows "
          f"-> {'OK, every event exactly once' if ok else 'MISMATCH'}")
    return ok
