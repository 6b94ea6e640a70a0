#!/usr/bin/env python3
"""The import graph of Tidemark's three packages, drawn from the source (parsed, never imported).

Every import of one project module by another is an edge, tagged by where it stands:
``top`` (runs at import time), ``typing`` (inside ``if TYPE_CHECKING:``) or ``function`` (inside a
``def``: runs when called). Prints each import circle (a strongly connected component of more than
one module, over all edges) with every import between its members, then the circles left when only
``top`` edges count. ``--check`` exits 1 when there is a circle. ``--dot`` prints a graphviz graph of the edges between packages instead
(folders: ``platform_assets`` today, ``platform_assets.cdc.replicator`` once capability packages exist).

    .venv/bin/python scripts/import_graph.py
    .venv/bin/python scripts/import_graph.py --dot | dot -Tsvg > imports.svg

Stdlib only; docs/layout.md is drawn from its output.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lineage", "resources", "platform_assets")


@dataclass(frozen=True)
class Edge:
    src: str  # importing module, dotted
    dst: str  # imported module, dotted
    path: str  # file of the import, relative to the repository
    line: int
    kind: str  # "top", "typing" or "function"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of the three packages."""
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """``(node, kind)`` for every import statement of a module."""
    def walk(node: ast.AST, kind: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, kind
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(child, "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test) and kind == "top":
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "typing")
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), "top")
            else:
                yield from walk(child, kind)
    # a bare import statement at the top of the body is a direct child of the module
    yield from walk(tree, "top")


def edges(root: Path = ROOT) -> list[Edge]:
    known = modules(root)
    out: list[Edge] = []
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        rel = str(path.relative_to(root))
        for node, kind in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_package else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join([*pkg, base] if base else pkg)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in known else base)
            seen: set[str] = set()
            for target in targets:
                # `import a.b.c` of a module: the longest known prefix
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name and target not in seen:
                    seen.add(target)
                    out.append(Edge(name, target, rel, node.lineno, kind))
    return out


def sccs(nodes: list[str], adj: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), those of more than one node, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(adj.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(adj.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return sorted(found, key=lambda c: (-len(c), c))


def circles(all_edges: list[Edge], kinds: set[str]) -> list[tuple[list[str], list[Edge]]]:
    """Each circle over the edges of ``kinds``, with the edges inside it."""
    chosen = [e for e in all_edges if e.kind in kinds]
    adj: dict[str, set[str]] = defaultdict(set)
    for e in chosen:
        adj[e.src].add(e.dst)
    nodes = sorted({e.src for e in chosen} | {e.dst for e in chosen})
    out = []
    for comp in sccs(nodes, adj):
        members = set(comp)
        inside = sorted((e for e in chosen if e.src in members and e.dst in members),
                        key=lambda e: (e.path, e.line, e.dst))
        out.append((comp, inside))
    return out


def package_of(module: str, known: dict[str, Path]) -> str:
    """The folder a module lives in (a package stands for itself)."""
    if known[module].name == "__init__.py":
        return module
    return module.rpartition(".")[0] or module


def dot(all_edges: list[Edge], known: dict[str, Path]) -> str:
    weights: dict[tuple[str, str], int] = defaultdict(int)
    for e in all_edges:
        a, b = package_of(e.src, known), package_of(e.dst, known)
        if a != b:
            weights[(a, b)] += 1
    lines = ["digraph tidemark {", "  rankdir=LR;", "  node [shape=box, fontname=monospace];"]
    for pkg in sorted({package_of(m, known) for m in known}):
        lines.append(f'  "{pkg}";')
    for (a, b), n in sorted(weights.items()):
        lines.append(f'  "{a}" -> "{b}" [label="{n}"];')
    lines.append("}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dot", action="store_true", help="print a graphviz graph of package-level edges")
    parser.add_argument("--check", action="store_true", help="exit 1 when there is an import circle")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = parser.parse_args(argv)
    known = modules(args.root)
    all_edges = edges(args.root)
    if args.dot:
        print(dot(all_edges, known))
        return 0
    counts: dict[str, int] = defaultdict(int)
    for e in all_edges:
        counts[e.kind] += 1
    print(f"{len(known)} modules, {len(all_edges)} imports between them "
          f"({counts['top']} top, {counts['typing']} typing, {counts['function']} function)")
    found = circles(all_edges, {"top", "typing", "function"})
    print(f"\n{len(found)} import circles (all imports):")
    for n, (comp, inside) in enumerate(found, 1):
        print(f"\n{n}. {', '.join(comp)}")
        for e in inside:
            print(f"   {e.path}:{e.line} [{e.kind}] -> {e.dst}")
    runtime = circles(all_edges, {"top"})
    print(f"\n{len(runtime)} circles of top-level imports alone:")
    for comp, _ in runtime:
        print(f"   {', '.join(comp)}")
    return 1 if found and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
