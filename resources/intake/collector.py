"""The event collector (``tidemark collect``): a Starlette app on uvicorn (uvloop, httptools) with
Jitsu-compatible endpoints, answering 2xx only once the request's events are fsynced to the
incoming log (:mod:`resources.intake.incoming_log`).

| endpoint | token | events |
|---|---|---|
| ``POST /api/v1/event?token=T`` (or ``X-Auth-Token``) | a ``browser`` token | ``eventn_ctx.user_agent`` added |
| ``POST /api/v1/s2s/event`` with ``X-Auth-Token: T`` (or ``?token=``) | a ``server`` token | ``src: api``, ``eventn_ctx.event_id`` |
| ``GET /health`` | none | ``{"status": "ok"}`` |
| ``GET /metrics`` | none | JSON counters: events accepted, requests rejected by reason, fsyncs, bytes |

Answers: 200 ``{"status": "ok", "accepted": N}``; 401 missing, unknown or wrong-kind token; 413
body over ``max_body`` (refused from ``Content-Length`` before reading, or as soon as the read
passes the limit) or too many events; 400 malformed JSON (what and where) or a non-object event;
503 when the log cannot be written. A bad request never affects other requests.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lineage.intake.bodies import BadRequest, RequestContext, dumps_exact, enrich, parse_body, utc_timestamp
from lineage.intake.config import Intake, TokenKind
from resources.intake.incoming_log import IncomingLog


def _json(status: int, body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


class Collector:
    """The app's state: the intake config, the incoming log and the counters."""

    def __init__(self, intake: Intake, events_dir: Path) -> None:
        self.intake = intake
        c = intake.collector
        self.log = IncomingLog(events_dir, rotate_seconds=c.rotate_minutes * 60, rotate_bytes=c.rotate_bytes,
                               group_ms=c.fsync_group_ms)
        self.accepted = 0
        self.requests = 0
        self.rejected: Counter[str] = Counter()
        self.recovered: list[Path] = []

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            for t in self.intake.tokens:
                self.log.writer(t.id)  # starts the writer tasks on the server's loop
            try:
                yield
            finally:
                await self.log.close()
                print(f"collector stopped: {self.accepted} events accepted; open log files moved to {self.log.ready}",
                      flush=True)

        routes = [Route("/api/v1/event", self.browser, methods=["POST"]),
                  Route("/api/v1/s2s/event", self.server, methods=["POST"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        return Starlette(routes=routes, lifespan=lifespan)

    async def browser(self, request: Request) -> Response:
        return await self._events(request, TokenKind.BROWSER)

    async def server(self, request: Request) -> Response:
        return await self._events(request, TokenKind.SERVER)

    async def health(self, _: Request) -> Response:
        return _json(200, {"status": "ok"})

    async def metrics(self, _: Request) -> Response:
        m = self.log.metrics
        return _json(200, {"events_accepted": self.accepted, "requests_accepted": self.requests,
                           "rejected": dict(self.rejected), "fsyncs": m.fsyncs, "bytes_written": m.bytes_written,
                           "events_written": m.events_written, "files_rotated": m.files_rotated,
                           "files_recovered": m.files_recovered, "write_errors": m.write_errors})

    def _reject(self, status: int, message: str, reason: str) -> Response:
        self.rejected[reason] += 1
        return _json(status, {"status": "error", "error": message})

    async def _events(self, request: Request, kind: TokenKind) -> Response:
        c = self.intake.collector
        presented = request.headers.get("x-auth-token") or request.query_params.get("token")
        if not presented:
            return self._reject(401, "missing API token: pass ?token=<token> or the X-Auth-Token header", "no_token")
        token = self.intake.find_token(presented)
        if token is None:
            return self._reject(401, "unknown API token", "bad_token")
        if token.kind != kind:
            other = "/api/v1/s2s/event" if token.kind == TokenKind.SERVER else "/api/v1/event"
            return self._reject(401, f"token '{token.id}' is a {token.kind} token; send its events to {other}, or use a "
                                     f"{kind} token here", "wrong_token_kind")
        try:
            body = await self._body(request, c.max_body)
            events = parse_body(body, request.headers.get("content-type", ""), c.max_events_per_request)
            ctx = RequestContext(source_ip=self._source_ip(request), token_id=token.id, browser=kind == TokenKind.BROWSER,
                                 user_agent=request.headers.get("user-agent", "") if kind == TokenKind.BROWSER else None)
            stamp = utc_timestamp(dt.datetime.now(dt.UTC))
            data = b"".join([dumps_exact(enrich(e, ctx, stamp)) + b"\n" for e in events])
        except BadRequest as exc:
            return self._reject(exc.status, exc.message, exc.reason)
        try:
            await self.log.writer(token.id).append(data, len(events))
        except OSError as exc:
            return self._reject(503, f"the events could not be made durable ({exc}); nothing was acknowledged, "
                                     "send them again", "write_failed")
        self.accepted += len(events)
        self.requests += 1
        return _json(200, {"status": "ok", "accepted": len(events)})

    @staticmethod
    async def _body(request: Request, limit: int) -> bytes:
        too_big = BadRequest(413, f"the body is larger than {limit} bytes (collector.max_body); send smaller batches",
                             "too_large")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _source_ip(self, request: Request) -> str:
        if self.intake.collector.trust_proxy:
            forwarded = request.headers.get("x-forwarded-for", "")
            first = forwarded.split(",")[0].strip()
            if first:
                return first
        return request.client.host if request.client else ""


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound here so that port 0 gives a port we can print before serving)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(collector: Collector, sock: socket.socket) -> None:
    """Serve until SIGTERM/SIGINT; then uvicorn finishes the requests in flight and the log is
    flushed, fsynced and its open files moved to ready/."""
    import uvicorn

    config = uvicorn.Config(collector.app(), loop="uvloop", http="httptools", lifespan="on", log_level="warning",
                            access_log=False, timeout_graceful_shutdown=10, backlog=2048)
    uvicorn.Server(config).run(sockets=[sock])
