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


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """``(line, top-level package)`` of every absolute import in the module at ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module.split(".")[0]))
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
    module.write_text("def f():\n    from platform_assets.engine import Engine\n    import dagster as dg\n")
    assert imported_packages(module) == [(2, "platform_assets"), (3, "dagster")]
