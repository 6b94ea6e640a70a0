"""Alert notifications: one alert per incident, to a JSON-lines log file and an optional webhook.

Pure Python (no Dagster, no Spark); the Dagster resource and the sensor that finds incidents
live in ``platform_assets/dagster/alerts.py``.

Channels:

- **log file** (always): one JSON object per line, by default ``$TIDEMARK_HOME/alerts.log``.
  It is written first, so an alert is never lost because the webhook is down.
- **webhook** (when the environment variable named by ``webhook_env``, by default
  ``TIDEMARK_ALERT_WEBHOOK_URL``, holds an ``http(s)://`` URL): one JSON ``POST`` per alert.
  The payload carries ``text`` (the title), so Slack/Mattermost-style incoming webhooks show it
  as is. A failed delivery is logged (without the URL's path, which often holds a token) and
  retried on later calls for ``retry_for_s`` seconds; after the first failure in a call the
  remaining deliveries of that call wait for the next one, so a dead endpoint costs at most one
  timeout per call.

Dedup: an alert's ``key`` names its incident (a run id, a check evaluation). A key is alerted
once, across calls and process restarts: the sent keys are kept in a small sidecar state file
next to the log (``<log>.state.json``, the newest ``max_keys`` keys). The state also records how
far the log file was accounted for, so lines written just before a crash are recognised as sent
(and their webhook delivery is retried), and a lost state file is rebuilt from the log itself.
A process-wide and a file lock (``<log>.lock``) serialise concurrent notifiers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from resources.core.settings import Settings

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: the in-process lock still applies
    fcntl = None  # type: ignore[assignment]

DEFAULT_WEBHOOK_ENV = "TIDEMARK_ALERT_WEBHOOK_URL"
ALERT_KINDS = ("run_failure", "check_failure")
AlertKind = Literal["run_failure", "check_failure"]
WebhookStatus = Literal["sent", "failed", "deferred", "gave_up", "off"]

logger = logging.getLogger("tidemark.alerts")

_locks: dict[Path, threading.Lock] = {}
_locks_guard = threading.Lock()


def default_log_path(env: Mapping[str, str] | None = None) -> Path:
    """``$TIDEMARK_HOME/alerts.log`` (``TIDEMARK_HOME`` defaults to ``./.tidemark``)."""
    return Settings.from_env(env).home / "alerts.log"


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON: datetimes as ISO 8601, sets as sorted lists, NaN/inf and anything
    else JSON cannot hold as strings (strict JSON parsers reject NaN)."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return [_jsonable(v) for v in sorted(value, key=str)]
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)


@dataclass(frozen=True)
class Alert:
    """One incident. ``key`` identifies the incident (not the alert): the same key is sent once."""

    kind: AlertKind
    key: str
    title: str
    details: Mapping[str, Any] = field(default_factory=dict)
    at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def __post_init__(self) -> None:
        if self.kind not in ALERT_KINDS:
            raise ValueError(f"alert kind must be one of {', '.join(ALERT_KINDS)}, not {self.kind!r}")
        if not self.key:
            raise ValueError("an alert needs a non-empty key (the incident id used for dedup)")

    def payload(self) -> dict[str, Any]:
        """The JSON object sent to the webhook and written as one line of the log file."""
        at = self.at if self.at.tzinfo else self.at.replace(tzinfo=UTC)
        return {
            "source": "tidemark",
            "kind": self.kind,
            "key": self.key,
            "title": self.title,
            "text": f"[tidemark] {self.title}",
            "at": at.astimezone(UTC).isoformat(),
            "details": _jsonable(dict(self.details)),
        }


@dataclass(frozen=True)
class Delivery:
    """What happened to one alert in one :meth:`AlertNotifier.send_all` call.

    ``logged``: a line was appended to the log file by this call (False for duplicates and for
    retries of an earlier alert). ``webhook``: ``sent``, ``failed`` (will be retried),
    ``deferred`` (not tried: the webhook already failed in this call; will be retried),
    ``gave_up`` (retried for ``retry_for_s`` without success) or ``off`` (no webhook configured,
    or nothing to send).
    """

    key: str
    duplicate: bool
    logged: bool
    webhook: WebhookStatus
    error: str | None = None
    retry: bool = False


@dataclass(frozen=True)
class SendReport:
    deliveries: list[Delivery]

    @property
    def new(self) -> list[Delivery]:
        """Alerts of new incidents (written to the log file by this call)."""
        return [d for d in self.deliveries if d.logged]

    @property
    def duplicates(self) -> list[Delivery]:
        return [d for d in self.deliveries if d.duplicate]

    @property
    def failures(self) -> list[Delivery]:
        """Webhook deliveries that failed, were deferred or were given up in this call."""
        return [d for d in self.deliveries if d.webhook in ("failed", "deferred", "gave_up")]

    def summary(self) -> str:
        webhook_sent = sum(1 for d in self.deliveries if d.webhook == "sent")
        text = f"{len(self.new)} new alert(s), {len(self.duplicates)} duplicate(s) skipped, {webhook_sent} webhook post(s)"
        if self.failures:
            errors = sorted({d.error for d in self.failures if d.error})
            text += f", {len(self.failures)} webhook delivery(ies) not done: {'; '.join(errors)}"
        return text


@dataclass
class _State:
    sent: dict[str, None] = field(default_factory=dict)  # insertion-ordered set, oldest first
    pending: list[dict[str, Any]] = field(default_factory=list)  # webhook deliveries to retry
    log_offset: int = 0


class WebhookError(RuntimeError):
    pass


class AlertNotifier:
    """Sends alerts to the log file and the webhook, once per incident key (see the module doc)."""

    def __init__(
        self,
        log_path: str | os.PathLike[str] | None = None,
        *,
        webhook_env: str = DEFAULT_WEBHOOK_ENV,
        timeout_s: float = 10.0,
        retry_for_s: float = 3600.0,
        max_keys: int = 10_000,
        max_pending: int = 1_000,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if max_keys < 1 or max_pending < 1:
            raise ValueError("max_keys and max_pending must be >= 1")
        self._env = env
        self.log_path = Path(log_path).absolute() if log_path else default_log_path(env)
        self.state_path = self.log_path.with_name(self.log_path.name + ".state.json")
        self.lock_path = self.log_path.with_name(self.log_path.name + ".lock")
        self.webhook_env = webhook_env
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self.max_keys = max_keys
        self.max_pending = max_pending

    # -- configuration ------------------------------------------------------------------------

    @property
    def webhook_url(self) -> str | None:
        """The webhook URL, read from the environment at each call (``None``: channel off)."""
        env = os.environ if self._env is None else self._env
        return (env.get(self.webhook_env) or "").strip() or None

    def describe(self) -> str:
        url = self.webhook_url
        hook = f"webhook {_redact(url)} (from ${self.webhook_env})" if url else f"no webhook (${self.webhook_env} unset)"
        return f"alert log {self.log_path}, {hook}"

    # -- queries ------------------------------------------------------------------------------

    def already_sent(self, key: str) -> bool:
        with self._locked():
            return key in self._load().sent

    def pending_keys(self) -> list[str]:
        """Keys whose webhook delivery failed and will be retried."""
        with self._locked():
            return [p["payload"]["key"] for p in self._load().pending]

    # -- sending ------------------------------------------------------------------------------

    def send(self, alert: Alert) -> Delivery:
        """Send one alert (and retry earlier failed webhook deliveries)."""
        report = self.send_all([alert])
        return next(d for d in reversed(report.deliveries) if d.key == alert.key and not d.retry)

    def send_all(self, alerts: Iterable[Alert]) -> SendReport:
        """Retry pending webhook deliveries, then send each alert whose key was not sent before."""
        alerts = list(alerts)
        deliveries: list[Delivery] = []
        with self._locked():
            state = self._load()
            url = self.webhook_url
            url_error = _check_url(url, self.webhook_env) if url else None
            failed: str | None = None  # the webhook's first error in this call

            def post(payload: dict[str, Any]) -> tuple[WebhookStatus, str | None]:
                nonlocal failed
                if url is None:
                    return "off", None
                if failed is not None:
                    return "deferred", f"not tried after an earlier failure in this call ({failed})"
                try:
                    if url_error:
                        raise WebhookError(url_error)
                    self._post(url, payload)
                except Exception as exc:  # any failure: the alert stays in the log and is retried
                    failed = _describe_error(exc, self.timeout_s)
                    return "failed", failed
                return "sent", None

            # 1. earlier alerts whose webhook delivery failed
            if state.pending and url is None:
                logger.warning("dropping %d pending webhook deliveries: $%s is no longer set",
                               len(state.pending), self.webhook_env)
                state.pending.clear()
            now = time.time()
            for entry in list(state.pending):
                key = entry["payload"]["key"]
                if now - entry["first_failed_at"] > self.retry_for_s:
                    state.pending.remove(entry)
                    logger.error("alert webhook: giving up on %r after %d attempt(s) over %.0fs (last error: %s); "
                                 "it is in the alert log %s", key, entry["attempts"], now - entry["first_failed_at"],
                                 entry.get("error"), self.log_path)
                    deliveries.append(Delivery(key, False, False, "gave_up", entry.get("error"), retry=True))
                    continue
                status, error = post(entry["payload"])
                if status == "sent":
                    state.pending.remove(entry)
                    logger.info("alert webhook: delivered %r on retry %d", key, entry["attempts"])
                elif status == "failed":
                    entry["attempts"] += 1
                    entry["error"] = error
                    self._log_failure(key, url, error, entry)
                deliveries.append(Delivery(key, False, False, status, error, retry=True))
            self._save(state)

            # 2. new incidents: log file first (always), then the webhook
            for alert in alerts:
                if alert.key in state.sent:
                    deliveries.append(Delivery(alert.key, True, False, "off"))
                    continue
                payload = alert.payload()
                self._append_log(payload)
                self._remember(state, alert.key)
                entry = {"payload": payload, "attempts": 0, "first_failed_at": time.time(), "error": None}
                if url is not None:  # queued before the attempt: a crash during the POST retries it
                    state.pending.append(entry)
                state.log_offset = self._log_size()
                self._save(state)
                status, error = post(payload)
                if status == "sent":
                    state.pending.remove(entry)
                elif status == "failed":
                    entry["attempts"] += 1
                    entry["error"] = error
                    self._log_failure(alert.key, url, error, entry)
                elif status == "deferred":
                    entry["error"] = error
                self._trim_pending(state)
                self._save(state)
                deliveries.append(Delivery(alert.key, False, True, status, error))
        return SendReport(deliveries)

    # -- internals ----------------------------------------------------------------------------

    def _post(self, url: str, payload: Mapping[str, Any]) -> None:
        # imported on a post only: a run without alerts starts faster
        from urllib import request as urlrequest

        body = json.dumps(payload).encode("utf-8")
        req = urlrequest.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "User-Agent": "tidemark-alerts/1"})
        with urlrequest.urlopen(req, timeout=self.timeout_s) as resp:  # scheme checked by _check_url
            resp.read(65536)

    def _log_failure(self, key: str, url: str | None, error: str | None, entry: Mapping[str, Any]) -> None:
        logger.error("alert webhook failed: %r was not delivered to %s: %s. The alert is in the alert log %s; "
                     "retrying on later ticks (attempt %d, for up to %.0fs)",
                     key, _redact(url), error, self.log_path, entry["attempts"], self.retry_for_s)

    def _remember(self, state: _State, key: str) -> None:
        state.sent[key] = None
        while len(state.sent) > self.max_keys:
            del state.sent[next(iter(state.sent))]

    def _trim_pending(self, state: _State) -> None:
        while len(state.pending) > self.max_pending:
            dropped = state.pending.pop(0)
            logger.error("alert webhook: dropping the oldest pending delivery %r (more than %d pending); "
                         "it is in the alert log %s", dropped["payload"]["key"], self.max_pending, self.log_path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with _locks_guard:
            lock = _locks.setdefault(self.log_path, threading.Lock())
        with lock, open(self.lock_path, "a") as fh:
            if fcntl is not None:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def _append_log(self, payload: Mapping[str, Any]) -> None:
        line = json.dumps(payload, ensure_ascii=False) + "\n"
        with open(self.log_path, "ab+") as fh:
            if fh.seek(0, os.SEEK_END) > 0:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":  # a torn last line (crash mid-write): start a new one
                    line = "\n" + line
            fh.write(line.encode("utf-8"))
            fh.flush()
            os.fsync(fh.fileno())

    def _read_log_keys(self, offset: int) -> list[tuple[str, dict[str, Any]]]:
        """(key, payload) of the complete alert lines of the log file from byte ``offset`` on."""
        out: list[tuple[str, dict[str, Any]]] = []
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                for raw in fh:
                    try:
                        obj = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(obj, dict) and isinstance(obj.get("key"), str):
                        out.append((obj["key"], obj))
        except FileNotFoundError:
            pass
        return out

    def _load(self) -> _State:
        state = _State()
        size = self._log_size()
        try:
            raw = json.loads(self.state_path.read_text())
            state.sent = dict.fromkeys(raw["sent"])
            state.pending = list(raw["pending"])
            state.log_offset = int(raw["log_offset"])
        except FileNotFoundError:
            raw = None
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("alert state %s is unreadable (%s); rebuilding it from the alert log", self.state_path, exc)
            raw = None
            state = _State()
        if raw is None:
            # no state (first use, or lost): the log file is the record of what was sent
            for key, _ in self._read_log_keys(0):
                self._remember(state, key)
        elif size < state.log_offset:
            # the log was rotated or truncated: keep the remembered keys, add the new file's
            for key, _ in self._read_log_keys(0):
                self._remember(state, key)
        elif size > state.log_offset:
            # lines written after the last save (a crash in between): sent; webhook unknown, so retry it
            retry = self.webhook_url is not None
            for key, payload in self._read_log_keys(state.log_offset):
                if key not in state.sent:
                    self._remember(state, key)
                    if retry:
                        state.pending.append({"payload": payload, "attempts": 0, "first_failed_at": time.time(),
                                              "error": "interrupted before the webhook delivery was recorded"})
        state.log_offset = size
        return state

    def _save(self, state: _State) -> None:
        data = json.dumps({"version": 1, "log_offset": state.log_offset, "sent": list(state.sent),
                           "pending": state.pending})
        tmp = self.state_path.with_name(f"{self.state_path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.state_path)


def _redact(url: str | None) -> str:
    """``scheme://host:port/…``: webhook paths and queries often carry secrets."""
    if not url:
        return "(none)"
    parts = urlsplit(url)
    host = parts.hostname or "?"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}/…"


def _check_url(url: str, env_name: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"${env_name} is not an http(s):// URL (scheme {parts.scheme or 'missing'!r})"
    return None


def _describe_error(exc: BaseException, timeout_s: float) -> str:
    from urllib import error as urlerror

    if isinstance(exc, urlerror.HTTPError):
        return f"HTTP {exc.code} {exc.reason}"
    if isinstance(exc, urlerror.URLError):
        reason = exc.reason
        if isinstance(reason, TimeoutError):
            return f"timed out after {timeout_s:g}s"
        return f"cannot connect: {reason}"
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout_s:g}s"
    if isinstance(exc, WebhookError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
