"""Imports point one way: platform_assets -> resources -> lineage (DESIGN.md, Layout).

Every module of ``lineage/`` and ``resources/`` is parsed (not imported) and each import,
including those inside functions and ``TYPE_CHECKING`` blocks, is checked against the layer's
forbidden packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: package -> the top-level packages its modules may not import
FORBIDDEN = {
    "lineage": {"resources", "platform_assets", "dagster", "pyspark", "delta", "deltalake"},
    "resources": {"platform_assets"},
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted module)`` of every absolute import at ``path``; ``from a.b import c`` gives
    ``a.b.c`` (which names a module or a member of ``a.b``: the room, ``a.b``, is what counts)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level package)`` of every absolute import in the module at ``path`` (one per
    statement and package)."""
    out: list[tuple[int, str]] = []
    for line, dotted in imported_modules(path):
        if (line, dotted.split(".")[0]) not in out[-1:]:
            out.append((line, dotted.split(".")[0]))
    return out


def violations(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, imported in imported_packages(path):
            if imported in FORBIDDEN[package]:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    assert violations(package) == []


def test_the_check_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from platform_assets.engine.runner import Engine\n    import dagster as dg\n")
    assert imported_packages(module) == [(2, "platform_assets"), (3, "dagster")]


#: capability room -> the other rooms of its own top-level package it may import (docs/layout.md,
#: "What each package may import"); lower top-level packages stay open, as above
ALLOWED = {
    "lineage.core": set(),
    "lineage.cdc": {"core"},
    "lineage.intake": {"core"},
    "lineage.spec": {"core", "cdc"},
    "lineage.planning": {"core", "spec"},
    "lineage.views": {"core", "spec"},
    "resources.core": set(),
    "resources.storage": {"core"},
    "resources.state": {"core"},
    "resources.cdc": {"core"},
    "resources.spark": {"core", "storage"},
    "resources.intake": {"core", "storage"},
    "platform_assets.core": set(),
    "platform_assets.facts": {"core"},
    "platform_assets.views": {"core"},
    "platform_assets.cdc": {"core"},
    "platform_assets.intake": {"core"},
    "platform_assets.maintenance": {"core"},
    "platform_assets.engine": {"core", "facts", "views"},
    "platform_assets.follow": {"core", "engine", "cdc", "intake"},
    "platform_assets.dagster": {"core", "facts", "views", "cdc", "intake", "maintenance", "engine", "follow"},
    "platform_assets.demo": {"core", "facts", "views", "cdc", "intake", "maintenance", "engine", "dagster"},
    "platform_assets.cli": {"core", "facts", "views", "cdc", "intake", "maintenance", "engine", "dagster", "demo",
                            "follow"},
}

#: rooms that may import the Dagster library (besides these, a module that does is in the wrong room)
DAGSTER_ROOMS = {"platform_assets.dagster", "platform_assets.demo", "platform_assets.cli", "resources.spark"}


def room_violations(root: Path = ROOT) -> list[str]:
    found = []
    for top in ("lineage", "resources", "platform_assets"):
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).parts
            if parts[1:] == ("__init__.py",):
                continue
            if len(parts) < 3:
                found.append(f"{path.relative_to(root)}: a module outside every capability room")
                continue
            room = f"{parts[0]}.{parts[1]}"
            if room not in ALLOWED:
                found.append(f"{path.relative_to(root)}: room {room} is not in ALLOWED")
                continue
            for line, dotted in imported_modules(path):
                names = dotted.split(".")
                if names[0] == "dagster" and room not in DAGSTER_ROOMS:
                    found.append(f"{path.relative_to(root)}:{line} imports dagster outside {sorted(DAGSTER_ROOMS)}")
                if names[0] != parts[0] or len(names) < 2 or names[1] in (parts[1], "__init__"):
                    continue
                if names[1] not in ALLOWED[room]:
                    found.append(f"{path.relative_to(root)}:{line} imports {parts[0]}.{names[1]} ({room} may import "
                                 f"{sorted(ALLOWED[room]) or 'no other room'})")
    return found


def test_capability_rooms_import_only_the_rooms_they_may():
    assert room_violations() == []


def test_the_room_check_sees_a_room_importing_a_sibling(tmp_path):
    for room in ("platform_assets/cdc", "platform_assets/views", "lineage/core", "resources/core"):
        (tmp_path / room).mkdir(parents=True)
    (tmp_path / "platform_assets" / "cdc" / "a.py").write_text(
        "def f():\n    from platform_assets.views import merge\n    import dagster\n")
    (tmp_path / "platform_assets" / "stray.py").write_text("")
    assert room_violations(tmp_path) == [
        "platform_assets/cdc/a.py:2 imports platform_assets.views (platform_assets.cdc may import ['core'])",
        "platform_assets/cdc/a.py:3 imports dagster outside ['platform_assets.cli', 'platform_assets.dagster', "
        "'platform_assets.demo', 'resources.spark']",
        "platform_assets/stray.py: a module outside every capability room",
    ]
