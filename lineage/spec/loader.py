"""Load ``*.yaml`` lineage files and validate them into a :class:`~lineage.spec.model.Lineage`.

Every problem found is reported at once, each naming the file (and line), the topic and the
field, before anything runs. A file holds ``topics:`` and/or ``sources:`` lists::

    sources:
      - table: stage.orders
    topics:
      - table: fact.orders            # topic: schema.table[#tag][:shard]
        depends_on: [stage.orders, dim.customers]
        transforms: [../sql/fact_orders.sql]
        delay: 30s
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lineage.cdc.replicas import ReplicatorSpec
from lineage.core.errors import LineageError
from lineage.core.yaml_lines import KEY_LINES, LINE, LineLoader, field_line, strip_lines, yaml_problem
from lineage.spec.model import (
    PYTHON_PREFIX,
    Lineage,
    Processor,
    Replicator,
    Source,
    SourceSpec,
    Topic,
    TopicSpec,
    Transform,
)


def lineage_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise LineageError(f"{path}: no such lineage file or directory (set TIDEMARK_LINEAGE or --lineage)")
    files = sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    if not files:
        raise LineageError(f"{path}: no *.yaml lineage files found")
    return files


def _where(file: Path, line: int | None, topic: str | None = None, field: str | None = None) -> str:
    out = f"{file}:{line}" if line else str(file)
    if topic:
        out += f": topic '{topic}'"
    if field:
        out += f": field '{field}'"
    return out


_KINDS = {"sources": "source", "cdc": "replicator"}


def _pydantic_problems(exc: ValidationError, file: Path, item: dict[str, Any], name: str | None,
                       model: type[TopicSpec] | type[SourceSpec] | type[ReplicatorSpec]) -> list[str]:
    problems = []
    for err in exc.errors():
        line = field_line(item, err["loc"])
        kind = "source" if model is SourceSpec else "replicator"
        where = _where(file, line, name) if model is TopicSpec else _where(file, line) + (f": {kind} '{name}'" if name else "")
        field = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; allowed: " + ", ".join(
                f.alias or n for n, f in model.model_fields.items()) + ")"
        elif err["type"] == "missing":
            msg = "is required"
        problems.append(f"{where}" + (f": field '{field}'" if field else "") + f": {msg}")
    return problems


def _resolve_transforms(spec: TopicSpec, file: Path, line: int | None, problems: list[str]) -> tuple[Transform, ...]:
    """``line``: the line of the ``transforms`` field."""
    out = []
    for ref in spec.transforms:
        if ref.startswith(PYTHON_PREFIX):
            module, _, func = ref.removeprefix(PYTHON_PREFIX).rpartition(":")
            where = _where(file, line, spec.name, "transforms")
            try:
                found = importlib.util.find_spec(module)
            except (ImportError, ValueError):
                found = None
            if found is None:
                problems.append(f"{where}: python module '{module}' of {ref!r} cannot be imported (is it on PYTHONPATH?)")
                continue
            try:
                fn = getattr(importlib.import_module(module), func, None)
            except Exception as exc:  # noqa: BLE001 - report any import failure as a config problem
                problems.append(f"{where}: importing '{module}' for {ref!r} failed: {exc}")
                continue
            if not callable(fn):
                problems.append(f"{where}: '{module}' has no function '{func}' ({ref!r})")
                continue
            out.append(Transform(ref=ref, python=(module, func)))
        else:
            path = (file.parent / ref).resolve()
            if not path.is_file():
                problems.append(f"{_where(file, line, spec.name, 'transforms')}: transform file '{ref}' not found (looked at {path})")
                continue
            sql = path.read_text(encoding="utf-8").strip().rstrip(";").strip()
            if not sql:
                problems.append(f"{_where(file, line, spec.name, 'transforms')}: transform file '{ref}' is empty")
                continue
            out.append(Transform(ref=ref, sql=sql, path=path))
    return tuple(out)


def _topological(topics: dict[str, Topic], problems: list[str]) -> list[str]:
    """Order topics so that producers come before consumers; report cycles between tables."""
    producers: dict[str, list[str]] = {}
    for t in topics.values():
        producers.setdefault(t.spec.destination, []).append(t.name)
    deps = {
        name: [p for d in t.spec.depends_on for p in producers.get(d, []) if p != name]
        for name, t in topics.items()
    }
    order: list[str] = []
    state: dict[str, int] = {}  # 1 visiting, 2 done
    reported: set[frozenset[str]] = set()

    def visit(name: str, stack: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = stack[stack.index(name):] + [name]
            key = frozenset(cycle)
            if key not in reported:
                reported.add(key)
                t = topics[name]
                tables = " -> ".join(topics[c].spec.destination for c in cycle)
                problems.append(f"{_where(t.file, t.line, name, 'depends_on')}: dependency cycle: {tables}")
            return
        state[name] = 1
        for d in deps[name]:
            visit(d, [*stack, name])
        state[name] = 2
        order.append(name)

    for name in sorted(topics):
        visit(name, [])
    return order


def load_lineage(path: str | Path) -> Lineage:
    """Load and validate every lineage file under ``path``; raise :class:`LineageError` listing
    every problem."""
    root = Path(path)
    files = lineage_files(root)
    problems: list[str] = []
    topics: dict[str, Topic] = {}
    sources: dict[str, Source] = {}
    replicators: dict[str, Replicator] = {}
    field_lines: dict[str, dict[str, Any]] = {}  # topic -> its YAML mapping (for the lines of its fields)
    for file in files:
        try:
            doc = yaml.load(file.read_text(encoding="utf-8"), Loader=LineLoader)  # noqa: S506 - SafeLoader subclass
        except yaml.YAMLError as exc:
            problems.append(yaml_problem(file, exc))
            continue
        if doc is None:
            continue
        if not isinstance(doc, dict):
            problems.append(f"{file}: expected a mapping with 'topics:' and/or 'sources:' lists")
            continue
        for key in doc:
            if key not in ("topics", "sources", "cdc", LINE, KEY_LINES):
                problems.append(f"{_where(file, field_line(doc, [key]))}: unknown top-level key '{key}' (allowed: topics, sources, cdc)")
        for kind in ("sources", "topics", "cdc"):
            items = doc.get(kind) or []
            if not isinstance(items, list):
                problems.append(f"{file}: '{kind}' must be a list")
                continue
            for item in items:
                line = item.get(LINE) if isinstance(item, dict) else None
                if not isinstance(item, dict):
                    problems.append(f"{file}: each entry of '{kind}' must be a mapping, got {item!r}")
                    continue
                label = "name" if kind == "cdc" else "table"
                name = item.get(label) if isinstance(item.get(label), str) else None
                model: type[TopicSpec] | type[SourceSpec] | type[ReplicatorSpec] = (
                    SourceSpec if kind == "sources" else ReplicatorSpec if kind == "cdc" else TopicSpec)
                try:
                    spec: Any = model.model_validate(strip_lines(item))
                except ValidationError as exc:
                    problems.extend(_pydantic_problems(exc, file, item, name, model))
                    continue
                if kind == "cdc":
                    if spec.name in replicators:
                        problems.append(f"{_where(file, line)}: replicator '{spec.name}' declared twice (also at "
                                        f"{replicators[spec.name].where})")
                        continue
                    replicators[spec.name] = Replicator(spec, file, line)
                elif kind == "sources":
                    if spec.table in sources:
                        first = sources[spec.table]
                        problems.append(f"{_where(file, line)}: source '{spec.table}' declared twice (also at {_where(first.file, first.line)})")
                        continue
                    sources[spec.table] = Source(spec, file, line)
                else:
                    if spec.name in topics:
                        problems.append(f"{_where(file, line, spec.name)}: duplicate topic (also at {topics[spec.name].where})")
                        continue
                    field_lines[spec.name] = item
                    topics[spec.name] = Topic(spec, file, line, _resolve_transforms(spec, file, field_line(item, ["transforms"]), problems))

    produced = {t.spec.destination for t in topics.values()}
    replica_schemas: dict[str, Replicator] = {}
    for r in replicators.values():
        other = replica_schemas.setdefault(r.spec.schema_.lower(), r)  # replica names are lower case
        if other is not r:
            problems.append(f"{_where(r.file, r.line)}: replicator '{r.name}': schema '{r.spec.schema_}' is also the "
                            f"replicas' schema of replicator '{other.name}' ({other.where}); give each its own schema")
        for table in produced | set(sources):
            if table.partition(".")[0].lower() == r.spec.schema_.lower():
                problems.append(f"{_where(r.file, r.line)}: replicator '{r.name}': schema '{r.spec.schema_}' holds its "
                                f"replicas, but '{table}' is also declared there by a topic or source")
    for t in topics.values():
        deps_line = field_line(field_lines.get(t.name, {}), ["depends_on"]) or t.line
        if t.spec.destination in t.spec.depends_on:
            problems.append(f"{_where(t.file, deps_line, t.name, 'depends_on')}: a topic cannot depend on its own table "
                            f"'{t.spec.destination}' (it would wait for itself)")
        for fname, problem in t.spec.merge_problems():
            item = field_lines.get(t.name, {})
            problems.append(f"{_where(t.file, field_line(item, [fname]) or t.line, t.name, fname)}: {problem}")
        for dep in t.spec.depends_on:
            if dep not in produced and dep not in sources and dep.partition(".")[0] not in replica_schemas:
                problems.append(
                    f"{_where(t.file, deps_line, t.name, 'depends_on')}: '{dep}' is produced by no topic and not declared "
                    f"as a source{' or a replica schema of a cdc: replicator' if replica_schemas else ''} (add it under "
                    f"'sources:' or fix the name)"
                )
    for table in produced & set(sources):
        s = sources[table]
        problems.append(f"{_where(s.file, s.line)}: '{table}' is declared as a source but topic(s) produce it")
    for table in produced:
        writers = [t for t in topics.values() if t.spec.destination == table]
        kinds = {t.spec.processor for t in writers}
        whole = kinds & {Processor.RELOAD, Processor.MERGE}
        if whole and len(writers) > 1:
            t = writers[0]
            names = ", ".join(w.name for w in writers)
            how = "rebuilt by a reload topic" if Processor.RELOAD in whole else "maintained by a merge topic (it deletes keys)"
            problems.append(
                f"{_where(t.file, t.line, t.name, 'processor')}: table '{table}' is {how}, so it "
                f"cannot have other topics ({names})"
            )
    order = _topological(topics, problems)
    if problems:
        raise LineageError(problems)
    return Lineage(topics={n: topics[n] for n in order}, sources=sources, files=tuple(files), replicators=replicators)
