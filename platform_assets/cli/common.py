"""What the ``tidemark`` commands share (:mod:`platform_assets.cli.main` and its sub-command modules
:mod:`platform_assets.cli.cdc`, :mod:`platform_assets.cli.events`): settings and an Engine from the
common arguments, and plain-text tables. It imports no command module (docs/layout.md, circle 1)."""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Sequence
from typing import Any

from lineage.core.positions import Position, format_ts
from resources.core.settings import Settings


def format_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[format_cell(v) for v in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)


def format_cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, Position):
        return "start" if v.is_zero() else f"{format_ts(v.pos).replace('T', ' ')[:23]} #{v.id}"
    if isinstance(v, dt.datetime):
        return format_ts(v.replace(tzinfo=None) if v.tzinfo else v).replace("T", " ")[:23]
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, dict):
        return ",".join(f"{k}={n}" for k, n in v.items()) or "{}"
    return str(v)


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings.from_env(home=args.home, warehouse=args.warehouse, offsets_url=args.offsets_url,
                             lineage=args.lineage, spark_master=args.spark_master)


_ENGINES: list[Any] = []  # opened by engine_from, closed by close_engines when the command ends


def engine_from(args: argparse.Namespace, settings: Settings | None = None):  # noqa: ANN202 - lazy import of the engine
    from lineage.spec.loader import load_lineage
    from platform_assets.engine.runner import Engine

    settings = settings or settings_from(args)
    eng = Engine(settings, load_lineage(settings.lineage))
    _ENGINES.append(eng)
    return eng


def close_engines() -> None:
    """Close every Engine the command opened."""
    for eng in _ENGINES:
        eng.close()
    _ENGINES.clear()
