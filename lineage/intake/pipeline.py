"""The intake's pipeline steps as pure functions (seed 002, "Pipeline steps"): multiplexing with
``only_keys``, the table name template, LookupEnrichment, the Mapping step, flattening, implicit
types and promotion into a :class:`BatchHeader`, and the rows of a batch typed against the
columns of the table they go to (values that fit no column -> ``_unmapped_data`` or a failure).

Nothing here reads files or tables: the geo database is passed in as a lookup function.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from jinja2 import meta

from lineage.intake.bodies import dumps_exact, loads_exact
from lineage.intake.columns import CoercionError, SqlType, coerce, implicit_type, parse_timestamp, promote
from lineage.intake.destinations import (
    TEMPLATES,
    DestinationMode,
    DestinationSpec,
    MappingAction,
    UnmappedPolicy,
    compile_template,
)

UNMAPPED = "_unmapped_data"
RESERVED = ("pos", "id", UNMAPPED)  # the stage table's own columns; event fields of these names get a '_' suffix
#: seed: ``/_timestamp`` is a TIMESTAMP for every event, ``/eventn_ctx/utc_time`` for browser ones
IMPLICIT_CASTS = {"_timestamp": SqlType.TIMESTAMP, "eventn_ctx_utc_time": SqlType.TIMESTAMP}
_SPECIAL = re.compile(r"[^a-z0-9_]")

GeoLookup = Callable[[str], dict[str, Any] | None]
_MISSING = object()
#: the Python type a column of each type stores as it is (no conversion needed)
_NATIVE = {SqlType.STRING: str, SqlType.DOUBLE: float, SqlType.BOOLEAN: bool, SqlType.BIGINT: int}
_FAST_TYPES = {str: SqlType.STRING, float: SqlType.DOUBLE, bool: SqlType.BOOLEAN}


class EventFailure(Exception):  # noqa: N818 - an outcome of one event, not a failure of Tidemark
    """This event cannot go to this destination: it becomes an EventError in failed events."""


@functools.lru_cache(maxsize=65536)
def column_name(key: str) -> str:
    """A field name as a column name: lower-case, special characters and spaces -> ``_``."""
    return _SPECIAL.sub("_", key.strip().lower()) or "_"


def flatten(event: dict[str, Any]) -> dict[str, Any]:
    """Nested objects joined with ``_``; arrays as JSON strings; empty objects dropped; the
    stage table's own column names (``pos``, ``id``, ``_unmapped_data``) get a ``_`` suffix.

    Fields that flatten to the same column (``a.b``, ``a_b``, ``A-B``, ``{"a": {"b": ..}}``;
    ``pos`` next to ``pos_``): the one whose path is spelled exactly as the column wins, and
    among several such (or none) the first by JSON Pointer; each other value goes under
    ``UNMAPPED`` as ``{column: {pointer: {"value", "reason"}}}`` (:func:`type_batch` moves them
    to ``_unmapped_data``)."""
    out: dict[str, Any] = {}
    try:
        _walk(event, "", out)
    except _Collision:
        return _flatten_collided(event)
    for r in RESERVED:
        if r in out:
            if r + "_" in out:
                return _flatten_collided(event)
            out[r + "_"] = out.pop(r)
    return out


class _Collision(Exception):  # noqa: N818 - control flow: two fields of one event, one column
    pass


_SCALARS = frozenset({str, int, float, bool, type(None)})
_FLAT_NAMES: dict[tuple[str, str], str] = {}  # (prefix, key) -> column: the hot path of every event


def _walk(node: dict[str, Any], prefix: str, out: dict[str, Any]) -> None:
    names = _FLAT_NAMES
    for k, v in node.items():
        name = names.get((prefix, k))
        if name is None:
            name = prefix + column_name(k)
            if len(names) < 100_000:
                names[(prefix, k)] = name
        t = type(v)
        if t in _SCALARS:
            if name in out:  # the hot path's only cost of the collision rule
                raise _Collision
            out[name] = v
        elif t is dict or isinstance(v, dict):
            _walk(v, name + "_", out)
        elif name in out:
            raise _Collision
        elif t is list or isinstance(v, list):
            out[name] = dumps_exact(v).decode()
        else:
            out[name] = v


def pointer_segment(key: str) -> str:
    """``key`` as a JSON Pointer segment (RFC 6901): ``~`` -> ``~0``, ``/`` -> ``~1``."""
    return key.replace("~", "~0").replace("/", "~1")


def _leaves(node: dict[str, Any], prefix: str, pointer: str, exact: bool,
            out: dict[str, list[tuple[int, str, Any]]]) -> None:
    """Every leaf as ``column -> [(rank, JSON Pointer, value)]``; rank 0: every segment of the
    path is spelled as its column name."""
    for k, v in node.items():
        seg = column_name(k)
        name = prefix + seg
        ptr = pointer + "/" + pointer_segment(k)
        same = exact and seg == k
        if isinstance(v, dict):
            _leaves(v, name + "_", ptr, same, out)
            continue
        if isinstance(v, list):
            v = dumps_exact(v).decode()
        if name in RESERVED:
            name, same = name + "_", False
        out.setdefault(name, []).append((0 if same else 1, ptr, v))


def _flatten_collided(event: dict[str, Any]) -> dict[str, Any]:
    """:func:`flatten`'s slow path, taken only when two fields share a column."""
    leaves: dict[str, list[tuple[int, str, Any]]] = {}
    _leaves(event, "", "", True, leaves)
    out: dict[str, Any] = {}
    collided: dict[str, dict[str, dict[str, Any]]] = {}
    for name, found in leaves.items():
        if len(found) == 1:
            out[name] = found[0][2]
            continue
        found.sort(key=lambda f: (f[0], f[1]))
        winner = found[0][1]
        out[name] = found[0][2]
        collided[name] = {ptr: {"value": v, "reason": f"collides with {winner} in column {name}"}
                          for _, ptr, v in found[1:]}
    if collided:
        out[UNMAPPED] = collided
    return out


def path_column(path: str) -> str:
    """The column a JSON path ends up in after flattening: ``/a/b c`` -> ``a_b_c``."""
    name = "_".join(column_name(p) for p in path.strip("/").split("/"))
    return name + "_" if name in RESERVED else name


def _parts(path: str) -> list[str]:
    return path.strip("/").split("/")


def _pop(event: dict[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = event
    parts = _parts(path)
    for p in parts[:-1]:
        node = node.get(p) if isinstance(node, dict) else None
        if node is None:
            return False, None
    if not isinstance(node, dict) or parts[-1] not in node:
        return False, None
    return True, node.pop(parts[-1])


def _get(event: dict[str, Any], path: str) -> tuple[bool, Any]:
    node: Any = event
    for p in _parts(path):
        if not isinstance(node, dict) or p not in node:
            return False, None
        node = node[p]
    return True, node


def _set(event: dict[str, Any], path: str, value: Any) -> None:
    node = event
    parts = _parts(path)
    for p in parts[:-1]:
        child = node.get(p)
        if not isinstance(child, dict):
            child = node[p] = {}
        node = child
    node[parts[-1]] = value


@dataclass
class Destination:
    """A destination ready to run: its spec, compiled template and the column types its rules fix."""

    spec: DestinationSpec
    template: Any = None
    explicit: dict[str, SqlType] = field(default_factory=dict)
    kept: set[str] = field(default_factory=set)  # columns named by rules (keep_unmapped: false keeps only these)
    _names: tuple[str, ...] = ()
    _cache: dict[tuple[Any, ...], str | None | EventFailure] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.template = compile_template(self.spec.table_name_template)
        # the template's result depends only on the top-level fields it names: render once per
        # distinct tuple of their (scalar) values
        self._names = tuple(sorted(meta.find_undeclared_variables(TEMPLATES.parse(self.spec.table_name_template))))
        self.explicit = dict(IMPLICIT_CASTS)
        for r in self.spec.mappings.rules:
            col = path_column(r.dst or r.src or "")
            if r.action is not MappingAction.REMOVE:
                self.kept.add(col)
            if r.type is not None and r.action is not MappingAction.REMOVE:
                self.explicit[col] = r.type  # configured mapping has priority over the implicit casts

    @property
    def id(self) -> str:
        return self.spec.id

    def table_name(self, event: dict[str, Any]) -> str | None:
        """The table (``schema.name``) of ``event``, ``None`` to skip it; :class:`EventFailure`
        when the template fails or gives no usable name."""
        key = tuple(event.get(n, _MISSING) for n in self._names)
        if all(v is _MISSING or v is None or isinstance(v, str | int | float) for v in key):
            hit = self._cache.get(key, _MISSING)
            if hit is _MISSING:
                try:
                    hit = self._table_name(event)
                except EventFailure as exc:
                    hit = exc
                if len(self._cache) < 100_000:
                    self._cache[key] = hit  # type: ignore[assignment]
            if isinstance(hit, EventFailure):
                raise EventFailure(str(hit))
            return hit  # type: ignore[return-value]
        return self._table_name(event)

    def _table_name(self, event: dict[str, Any]) -> str | None:
        try:
            raw = self.template.render(event)
        except Exception as exc:  # noqa: BLE001 - any template error is this event's failure
            raise EventFailure(f"table_name_template {self.spec.table_name_template!r} failed: "
                               f"{type(exc).__name__}: {exc}") from None
        raw = raw.strip()
        if not raw:
            return None
        name = column_name(raw)
        if not re.match(r"^[a-z_][a-z0-9_]*$", name) or len(name) > 128:
            raise EventFailure(f"table_name_template gave {raw!r}, not a usable table name")
        return f"{self.spec.schema_}.{name}"

    def map_event(self, event: dict[str, Any]) -> dict[str, Any]:
        """The Mapping step then flattening (``event`` is changed in place)."""
        for r in self.spec.mappings.rules:
            if r.action is MappingAction.MOVE:
                found, value = _pop(event, r.src or "")
                if found:
                    _set(event, r.dst or "", value)
            elif r.action is MappingAction.REMOVE:
                _pop(event, r.src or "")
            elif r.action is MappingAction.CONSTANT:
                _set(event, r.dst or "", r.value)
            elif r.action is MappingAction.CAST and r.type is SqlType.STRING:
                found, value = _get(event, r.src or "")
                if found and isinstance(value, dict | list):  # an object cast to string is kept whole, as JSON
                    _set(event, r.src or "", dumps_exact(value).decode())
        row = flatten(event)
        if not self.spec.mappings.keep_unmapped:
            collided = row.get(UNMAPPED)
            row = {k: v for k, v in row.items() if k in self.kept}
            if collided:
                kept = {c: e for c, e in collided.items() if c in self.kept}
                if kept:
                    row[UNMAPPED] = kept
        return row


def build_destinations(specs: Iterable[DestinationSpec],
                       modes: tuple[DestinationMode, ...] = (DestinationMode.BATCH,)) -> list[Destination]:
    return [Destination(s) for s in specs if s.mode in modes]


def route(event: dict[str, Any], destinations: list[Destination]) -> list[Destination]:
    """Multiplexing: the destinations whose ``only_keys`` admit the event's token (``api_key``)."""
    key = event.get("api_key")
    return [d for d in destinations if not d.spec.only_keys or key in d.spec.only_keys]


@functools.lru_cache(maxsize=4096)
def parse_user_agent(ua: str) -> dict[str, Any]:
    """A user agent string -> ``{ua_family, ua_version, os_family, os_version, device_family}``."""
    from ua_parser import parse

    r = parse(ua)
    out: dict[str, Any] = {}
    if r.user_agent:
        out["ua_family"] = r.user_agent.family
        out["ua_version"] = ".".join(p for p in (r.user_agent.major, r.user_agent.minor) if p)
    if r.os:
        out["os_family"] = r.os.family
        out["os_version"] = ".".join(p for p in (r.os.major, r.os.minor) if p)
    out["device_family"] = r.device.family if r.device else "Other"
    return out


def geo_fields(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The parts of a MaxMind City/Country record that go to ``eventn_ctx.location``."""
    if not record:
        return None
    out: dict[str, Any] = {
        "country": (record.get("country") or {}).get("iso_code"),
        "city": ((record.get("city") or {}).get("names") or {}).get("en"),
        "region": (((record.get("subdivisions") or [{}])[0]).get("names") or {}).get("en"),
        "zip": (record.get("postal") or {}).get("code"),
        "latitude": (record.get("location") or {}).get("latitude"),
        "longitude": (record.get("location") or {}).get("longitude"),
    }
    return {k: v for k, v in out.items() if v is not None} or None


def lookup_enrichment(event: dict[str, Any], *, user_agent: bool, geo: GeoLookup | None) -> None:
    """LookupEnrichment in place: ``/eventn_ctx/user_agent`` -> ``/eventn_ctx/parsed_ua`` and
    ``/source_ip`` -> ``/eventn_ctx/location`` (when a geo database is configured)."""
    ctx = event.get("eventn_ctx")
    if not isinstance(ctx, dict):
        ctx = None
    if user_agent and ctx is not None and isinstance(ctx.get("user_agent"), str) and ctx["user_agent"]:
        ctx["parsed_ua"] = parse_user_agent(ctx["user_agent"])
    ip = event.get("source_ip")
    if geo is not None and isinstance(ip, str) and ip:
        try:
            loc = geo_fields(geo(ip))
        except ValueError:  # not an IP address
            loc = None
        if loc:
            if ctx is None:
                ctx = event["eventn_ctx"] = {}
            ctx["location"] = loc


@dataclass
class BatchHeader:
    """The seed's BatchHeader: a table and the type of each field seen in the batch."""

    table: str
    fields: dict[str, SqlType] = field(default_factory=dict)
    promotions: int = 0  # how many times a field's type was promoted in this batch

    _seen: dict[str, type] = field(default_factory=dict, repr=False, compare=False)
    #: every Python type of a field's values (``object``: an int beyond 64 bits), and the rows
    #: added: :func:`type_batch` takes a column whose values all fit as it is
    pytypes: dict[str, set[type]] = field(default_factory=dict, repr=False, compare=False)
    rows: int = field(default=0, repr=False, compare=False)
    collided_rows: int = field(default=0, repr=False, compare=False)  # rows carrying collided values (``UNMAPPED``)

    def add(self, row: dict[str, Any], explicit: dict[str, SqlType]) -> None:
        fields = self.fields
        seen = self._seen  # field -> Python type of the last value merged: the same type again changes nothing
        self.rows += 1
        items: Iterable[tuple[str, Any]] = row.items()
        if UNMAPPED in row:  # collided values (see flatten), not a field
            self.collided_rows += 1
            items = [(k, v) for k, v in items if k != UNMAPPED]
        for k, v in items:
            tv = type(v)
            if seen.get(k) is tv and (tv is not int or -(2**63) <= v < 2**63):
                continue
            if v is not None:
                self.pytypes.setdefault(k, set()).add(object if tv is int and not -(2**63) <= v < 2**63 else tv)
            t = explicit.get(k) or _FAST_TYPES.get(tv)
            if t is None:
                t = implicit_type(v)
                if t is None:
                    continue  # a null says nothing about the type; a column of only nulls is not added
            cur = fields.get(k)
            if cur is None:
                fields[k] = t
            elif cur is not t:
                new = explicit.get(k) or promote(cur, t)
                if new is not cur:
                    fields[k] = new
                    self.promotions += 1
            seen[k] = tv


@dataclass(frozen=True)
class ColumnType:
    """A column of an existing table as the intake sees it: its type (``None``: one the intake
    does not write, every value goes to ``_unmapped_data``) and integer width."""

    type: SqlType | None
    int_bits: int = 64


@dataclass
class TypedBatch:
    """Rows of one (destination, table) pair as columns, ready to write."""

    columns: dict[str, tuple[ColumnType, list[Any]]]
    lines: list[int]  # the rows' line numbers (their order)
    added: list[str]  # columns the table does not have yet
    unmapped_values: int = 0
    failed: list[tuple[int, str]] = field(default_factory=list)  # (line, why): unmapped: fail
    collided_values: int = 0  # values of fields that collided in a column (see flatten), in _unmapped_data


def type_batch(header: BatchHeader, rows: list[tuple[int, dict[str, Any]]], table: dict[str, ColumnType],
               policy: UnmappedPolicy) -> TypedBatch:
    """Table patching and the rows' values: a header field the table lacks becomes a new column
    of the header's type; one it has keeps the table's type (Delta cannot widen it here), and a
    value that does not fit goes to ``_unmapped_data`` as ``{column: {value, reason}}`` -- or,
    with ``unmapped: fail``, the whole event fails. One value never fails the batch. The values
    of fields that collided in a column (``row[UNMAPPED]``, see :func:`flatten`) join them as
    ``{JSON Pointer: {value, reason}}``."""
    targets: dict[str, ColumnType] = {}
    added = []
    for name, t in header.fields.items():
        if name in table:
            targets[name] = table[name]
        else:
            targets[name] = ColumnType(t)
            added.append(name)
    n = len(rows)
    cols: dict[str, list[Any]] = {}
    # the Python type a column stores as it comes (no conversion)
    fast = {name: (_NATIVE.get(ct.type) if ct.type is not None and ct.int_bits == 64 else None)  # type: ignore[arg-type]
            for name, ct in targets.items()}
    unmapped_col: list[Any] = [None] * n
    dropped: list[int] = []
    out = TypedBatch({}, [], added)
    lo, hi = -(2**63), 2**63
    complete = header.rows == n  # the header saw exactly these rows: its pytypes cover them
    bad_rows: dict[int, dict[str, Any]] = {}
    for name, ct in targets.items():
        ft: Any = fast[name]
        seen = header.pytypes.get(name) if complete else None
        if ft is not None and seen is not None and seen <= {ft}:
            cols[name] = [row.get(name) for _, row in rows]  # the hot path: every value fits as it is
            continue
        col: list[Any] = [None] * n
        for i, (_, row) in enumerate(rows):
            v: Any = row.get(name)
            if v is None:
                continue
            if type(v) is ft and (ft is not int or lo <= v < hi):
                col[i] = v
                continue
            try:
                if ct.type is None:
                    raise CoercionError("the column's type is not one the intake writes")
                col[i] = coerce(v, ct.type, int_bits=ct.int_bits)
            except CoercionError as exc:
                bad_rows.setdefault(i, {})[name] = {"value": v, "reason": str(exc)}
        cols[name] = col
    collided: dict[int, int] = {}  # row -> how many of its values collided
    if header.collided_rows or not complete:
        for i, (_, row) in enumerate(rows):
            by_column = row.get(UNMAPPED)
            if by_column:
                bad = bad_rows.setdefault(i, {})
                for entries in by_column.values():
                    bad.update(entries)
                    collided[i] = collided.get(i, 0) + len(entries)
    for i in sorted(bad_rows):
        bad = bad_rows[i]
        if policy is UnmappedPolicy.FAIL:
            out.failed.append((rows[i][0], "values fit no column: " + "; ".join(f"{k}: {b['reason']}" for k, b in bad.items())))
            dropped.append(i)
            continue
        # stdlib json: rare, and it also writes integers beyond 64 bits
        unmapped_col[i] = json.dumps(bad, sort_keys=True, separators=(",", ":"), default=str)
        out.collided_values += collided.get(i, 0)
        out.unmapped_values += len(bad) - collided.get(i, 0)
    out.lines = [line for line, _ in rows]
    if dropped:
        gone = set(dropped)
        keep = [i for i in range(n) if i not in gone]
        cols = {name: [c[i] for i in keep] for name, c in cols.items()}
        unmapped_col = [unmapped_col[i] for i in keep]
        out.lines = [out.lines[i] for i in keep]
    out.columns = {n: (targets[n], c) for n, c in cols.items()}
    if out.unmapped_values or out.collided_values or UNMAPPED in table:
        out.columns[UNMAPPED] = (ColumnType(SqlType.STRING), unmapped_col)
        if UNMAPPED not in table:
            out.added.append(UNMAPPED)
    return out


# ------------------------------------------------------------------ a unit's events, prepared


@dataclass
class Pair:
    """The events of one unit for one (destination, table)."""

    dest: Destination
    table: str
    header: BatchHeader
    rows: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    received: list[dt.datetime | None] = field(default_factory=list)


@dataclass
class Prepared:
    pairs: dict[tuple[str, str], Pair] = field(default_factory=dict)
    failures: dict[str, list[tuple[int, str | None, str]]] = field(default_factory=dict)  # dest -> (line, table, error)
    events_in: int = 0
    skipped: int = 0


def received_at(event: dict[str, Any]) -> dt.datetime | None:
    """The event's ``_timestamp`` (when the collector received it), None if absent or unreadable."""
    ts = event.get("_timestamp")
    if isinstance(ts, str):
        try:
            return parse_timestamp(ts)
        except ValueError:
            return None
    return None


def prepare(events: Iterable[tuple[int, dict[str, Any]]], destinations: list[Destination],
            geo: dict[str, GeoLookup]) -> Prepared:
    """Multiplex, name, enrich and map every event: rows grouped by (destination, table) with
    their BatchHeader, and the events that failed (a template error)."""
    out = Prepared()
    for line, event in events:
        out.events_in += 1
        targets = route(event, destinations)
        received = received_at(event)
        for i, d in enumerate(targets):
            ev = event if i == len(targets) - 1 else loads_exact(dumps_exact(event))  # steps change it in place
            try:
                table = d.table_name(ev)
            except EventFailure as exc:
                out.failures.setdefault(d.id, []).append((line, None, str(exc)))
                continue
            if table is None:
                out.skipped += 1
                continue
            lookup_enrichment(ev, user_agent=d.spec.lookups.user_agent, geo=geo.get(d.id))
            row = d.map_event(ev)
            pair = out.pairs.get((d.id, table))
            if pair is None:
                pair = out.pairs[(d.id, table)] = Pair(d, table, BatchHeader(table))
            pair.header.add(row, d.explicit)
            pair.rows.append((line, row))
            pair.received.append(received)
    return out
