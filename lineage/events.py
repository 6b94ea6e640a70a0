"""Request bodies of the event collector and the seed's ContextEnrichment step, as pure functions
(no I/O): ``parse_body`` turns a body into event objects or a :class:`BadRequest` that says what is
wrong and where; ``enrich`` adds what the collector knows about the request.

Accepted bodies: one JSON object, a JSON array of objects, or NDJSON (one object per line; blank
lines are ignored). ``Content-Type: application/x-ndjson`` forces NDJSON.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

import orjson


class BadRequest(Exception):  # noqa: N818 - it is an HTTP answer, not a failure of Tidemark
    """A request the collector refuses: ``status`` (400, 413) and a message for the client."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason  # short counter name for /metrics


_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
          bool: "a boolean", type(None): "null"}


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


def _decode_error(exc: orjson.JSONDecodeError, what: str, offset: int = 0) -> BadRequest:
    return BadRequest(400, f"malformed JSON in {what}: {exc.msg} at line {exc.lineno}, column {exc.colno} "
                           f"(char {exc.pos + offset} of the body)", "malformed_json")


def _ndjson(body: bytes, max_events: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    offset = 0
    for n, line in enumerate(body.split(b"\n"), start=1):
        start = offset
        offset += len(line) + 1
        if not line.strip():
            continue
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(400, f"malformed JSON on line {n} of the NDJSON body: {exc.msg} at column {exc.colno} "
                                  f"(char {start + exc.pos} of the body)", "malformed_json") from None
        if not isinstance(value, dict):
            raise BadRequest(400, f"line {n} of the NDJSON body is {_kind(value)}, not a JSON object: every event "
                                  "must be an object", "not_an_object")
        events.append(value)
        if len(events) > max_events:
            raise _too_many(max_events)
    return events


def _too_many(max_events: int) -> BadRequest:
    return BadRequest(413, f"more than {max_events} events in one request (collector.max_events_per_request); "
                           "split the batch", "too_many_events")


def parse_body(body: bytes, content_type: str = "", max_events: int = 10_000) -> list[dict[str, Any]]:
    """The events of a request body; raises :class:`BadRequest` (400 or 413) naming what is wrong
    and where (line of an NDJSON body, index in an array, char offset)."""
    if not body.strip():
        raise BadRequest(400, "the body is empty: send a JSON object, a JSON array of objects or NDJSON", "empty")
    if "ndjson" in content_type.lower() or "jsonlines" in content_type.lower():
        events = _ndjson(body, max_events)
    else:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            # a second document after the first: NDJSON without its content type
            if exc.msg.startswith("unexpected content after document") and b"\n" in body.strip():
                events = _ndjson(body, max_events)
            else:
                raise _decode_error(exc, "the body") from None
        else:
            if isinstance(value, dict):
                events = [value]
            elif isinstance(value, list):
                if len(value) > max_events:
                    raise _too_many(max_events)
                for i, item in enumerate(value):
                    if not isinstance(item, dict):
                        raise BadRequest(400, f"element {i} of the array is {_kind(item)}, not a JSON object: every "
                                              "event must be an object", "not_an_object")
                events = value
            else:
                raise BadRequest(400, f"the body is {_kind(value)}: send a JSON object, a JSON array of objects or "
                                      "NDJSON", "not_an_object")
    if not events:
        raise BadRequest(400, "the body holds no event", "empty")
    return events


@dataclass(frozen=True)
class RequestContext:
    """What the collector knows about a request, added to each of its events."""

    source_ip: str
    token_id: str
    browser: bool
    user_agent: str | None = None
    received: dt.datetime | None = None


def utc_timestamp(when: dt.datetime) -> str:
    """ISO 8601 in UTC with microseconds and a ``Z``: ``2026-01-31T12:00:00.123456Z``."""
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def enrich(event: dict[str, Any], ctx: RequestContext, stamp: str) -> dict[str, Any]:
    """The seed's ContextEnrichment, in place: ``source_ip``, ``_timestamp`` (``stamp``),
    ``api_key`` (the token's id), and for browser events ``eventn_ctx.user_agent``, for server
    events ``src: api`` and ``eventn_ctx.event_id`` (a uuid4 unless the client sent one).
    Raises :class:`BadRequest` when ``eventn_ctx`` is not an object."""
    event["source_ip"] = ctx.source_ip
    event["_timestamp"] = stamp
    event["api_key"] = ctx.token_id
    needs_ctx = ctx.user_agent is not None if ctx.browser else True
    if not needs_ctx:
        return event
    ectx = event.get("eventn_ctx")
    if ectx is None:
        ectx = event["eventn_ctx"] = {}
    elif not isinstance(ectx, dict):
        raise BadRequest(400, f"eventn_ctx is {_kind(ectx)}; it must be an object", "bad_eventn_ctx")
    if ctx.browser:
        ectx["user_agent"] = ctx.user_agent
    else:
        event["src"] = "api"
        if not ectx.get("event_id"):
            ectx["event_id"] = str(uuid.uuid4())
    return event
