"""No new import circle (issue 17 part 2; docs/layout.md). The graph is drawn from the source by
``scripts/import_graph.py`` (parsed, never imported), over every import: top level, inside
functions and under ``TYPE_CHECKING``. The circles still open are listed here with how
docs/layout.md breaks them; one more fails, and so does a listed one that is gone (take it off the
list, so it cannot come back)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the circles still open (their modules), each with its way out in docs/layout.md: none since issue 17's
#: part 2 broke the last three (CLI, Engine, CDC DDL); a new one fails the test
KNOWN: set[frozenset[str]] = set()


def _graph():  # noqa: ANN202 - the script's module
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_no_import_circle_beyond_the_known_ones_and_none_of_them_closed_at_import_time():
    g = _graph()
    edges = g.edges(ROOT)
    assert len(edges) > 300, "the graph found too few imports to be the project's"
    found = {frozenset(comp): inside for comp, inside in g.circles(edges, {"top", "typing", "function"})}
    new = [f"{', '.join(sorted(c))}:\n" + "\n".join(f"  {e.path}:{e.line} [{e.kind}] -> {e.dst}" for e in inside)
           for c, inside in found.items() if c not in KNOWN]
    assert not new, "new import circle(s); break them (docs/layout.md says how):\n" + "\n".join(new)
    gone = [sorted(c) for c in KNOWN if c not in found]
    assert not gone, f"these circles are broken: take them off KNOWN so they cannot come back: {gone}"
    assert g.circles(edges, {"top"}) == [], "a circle of top-level imports: a module cannot load without the other"


def test_the_graph_sees_imports_inside_functions_and_type_checking(tmp_path):
    """The check above can fail: a circle made only of a function-level and a typing import is found."""
    for pkg in ("lineage", "resources", "platform_assets"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "platform_assets" / "a.py").write_text("def f():\n    from platform_assets import b\n")
    (tmp_path / "platform_assets" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from platform_assets.a import f\n")
    g = _graph()
    [(comp, inside)] = g.circles(g.edges(tmp_path), {"top", "typing", "function"})
    assert comp == ["platform_assets.a", "platform_assets.b"]
    assert sorted(e.kind for e in inside) == ["function", "typing"]
    assert g.circles(g.edges(tmp_path), {"top"}) == []
