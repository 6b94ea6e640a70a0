"""YAML with line numbers, for config errors that name the file and line: a loader that records
the line of every mapping and of each of its keys, and helpers that find a field's line, strip the
records again and word a syntax error. Used by the lineage loader and the intake config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

LINE = "__line__"
KEY_LINES = "__key_lines__"


class LineLoader(yaml.SafeLoader):
    """SafeLoader that records the line of every mapping under ``__line__`` and the line of each
    of its keys under ``__key_lines__``, so a problem with a field names the field's line."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        mapping = super().construct_mapping(node, deep=deep)
        mapping[LINE] = node.start_mark.line + 1
        mapping[KEY_LINES] = {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
        return mapping


def field_line(item: Any, loc: tuple[Any, ...] | list[Any]) -> int | None:
    """The line of the field at ``loc`` (pydantic's path into ``item``), else of the deepest
    mapping on that path that has one."""
    line = item.get(LINE) if isinstance(item, dict) else None
    for part in loc:
        if isinstance(item, dict):
            line = item.get(KEY_LINES, {}).get(part, line)
            item = item.get(part)
        elif isinstance(item, list) and isinstance(part, int) and 0 <= part < len(item):
            item = item[part]
            if isinstance(item, dict):
                line = item.get(LINE, line)
        else:
            break
    return line


def yaml_problem(file: Path, exc: yaml.YAMLError) -> str:
    """A YAML syntax error as ``file:line:column: not valid YAML: what`` (PyYAML's own text names
    ``<unicode string>`` instead of the file)."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return f"{file}: not valid YAML: {exc}"
    mark = exc.problem_mark
    what = exc.problem or "syntax error"
    if exc.context:
        ctx = exc.context_mark
        what += f" ({exc.context}" + (f" at line {ctx.line + 1}, column {ctx.column + 1}" if ctx else "") + ")"
    return f"{file}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {what}"


def strip_lines(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: strip_lines(v) for k, v in value.items() if k not in (LINE, KEY_LINES)}
    if isinstance(value, list):
        return [strip_lines(v) for v in value]
    return value
