"""The docs name only what exists, and document every setting the code reads.

README.md and docs/*.md are read as text: every ``tidemark`` command (with its options) in code
blocks and inline code must parse with the CLI's own argparse parser (built in-process, no JVM);
every ``TIDEMARK_*`` variable must occur in the code; every script, bench or source path and every
relative link (with its ``#anchor``) must resolve. Fast: no Spark, no network.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from platform_assets.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 260

# Variables the code reads that the docs need not name, each with why.
UNDOCUMENTED_SETTINGS = {
    "TIDEMARK_CRASH_AT": "fault injection for the crash tests (platform_assets/core/faults.py)",
    "TIDEMARK_PAUSE_AT": "fault injection for the concurrency tests (platform_assets/core/faults.py)",
    "TIDEMARK_DEMO_CRM_DSN": "set by `tidemark demo` for its own throw-away PostgreSQL (demo/lineage/crm.yaml)",
}
# Where a documented variable may be read: the packages, the scripts, the benchmarks, and the tests
# (the test switches the docs name, e.g. TIDEMARK_TEST_CONNECT, TIDEMARK_MERGE_EXAMPLES).
SETTING_SOURCES = ("lineage", "resources", "platform_assets", "scripts", "bench", "tests")
# Where the variables users may set are read (the other direction: each must be documented).
SETTING_READERS = ("lineage", "resources", "platform_assets", "scripts")
# Top-level folders whose paths, named in code, must exist.
PATH_ROOTS = ("lineage", "resources", "platform_assets", "scripts", "bench", "tests", "demo")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Code:
    """A piece of code in a doc: one line of a fenced block, or one inline `span`."""

    path: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def split_doc(path: Path, text: str | None = None) -> tuple[list[Code], str]:
    """The code of a doc (fenced lines and inline spans), and its prose with fenced blocks blanked
    (line numbers kept), for links and headings."""
    text = path.read_text() if text is None else text
    codes: list[Code] = []
    prose: list[str] = []
    fence: str | None = None
    for n, line in enumerate(text.split("\n"), 1):
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            prose.append("")
        elif fence is not None:
            if stripped.startswith(fence):
                fence = None
            else:
                codes.append(Code(path, n, line))
            prose.append("")
        else:
            prose.append(line)
    body = "\n".join(prose)
    # inline spans may wrap onto the next line, never across a blank line
    for m in re.finditer(r"(`+)((?:[^`\n]|\n(?![ \t]*\n))+?)\1", body):
        span = re.sub(r"\s+", " ", m.group(2)).strip().replace("\\|", "|")
        codes.append(Code(path, body.count("\n", 0, m.start()) + 1, span))
    return codes, body


# ---------------------------------------------------------------- commands


def _sub_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not a.option_strings]  # positionals, in order


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


_COMMAND = re.compile(r"(?<![\w/.-])(?:\.venv/bin/)?tidemark(?![\w:/.-])")
_PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*|\.\.\.|…|'.*'|\".*\"|<.*>)$|[…<>]")


def _tokens(text: str) -> list[str]:
    """The words of one command: up to a comment, `;`, `&&` or a pipe between commands."""
    text = re.split(r"\s#|;|&&|\s\|\s", text, maxsplit=1)[0]
    return text.split()


def _clean(token: str) -> str:
    return token.strip("[](),.:")


def check_command(code: Code, start: int, root: argparse.ArgumentParser) -> list[str]:
    """Problems of the `tidemark ...` command that starts at ``start`` in ``code.text``."""
    words = _tokens(code.text[start:])
    shown = " ".join(["tidemark", *words])
    problems: list[str] = []
    parser = root
    path = ["tidemark"]
    positionals = _sub_actions(root)
    i = 0
    while i < len(words):
        word = _clean(words[i])
        i += 1
        if not word:
            continue
        if word.startswith("-"):
            name = word.split("=", 1)[0]
            action = parser._option_string_actions.get(name)
            if action is None:
                known = sorted(o for o in parser._option_string_actions if o.startswith("--"))
                problems.append(f"{code.where()}: `{shown}`: `{' '.join(path)}` has no option {name} "
                                f"(it has: {', '.join(known)})")
            elif parser is root and _takes_value(action) and "=" not in word and i < len(words):
                i += 1  # a global option's value, before the command
            continue
        if not positionals:
            continue  # values of options, or words after the command
        action = positionals[0]
        if isinstance(action, argparse._SubParsersAction):
            if word not in action.choices:
                if len(path) == 1 and not word[0].islower():
                    return []  # not a command: `tidemark` followed by prose or a placeholder
                problems.append(f"{code.where()}: `{shown}`: `{' '.join(path)} {word}` is not a command "
                                f"(there are: {', '.join(sorted(action.choices))})")
                return problems
            parser = action.choices[word]
            path.append(word)
            positionals = _sub_actions(parser)
            continue
        if action.nargs not in ("*", "+"):
            positionals = positionals[1:]
        if action.choices is not None and not _PLACEHOLDER.search(word):
            for choice in word.split("|"):
                if choice not in action.choices:
                    problems.append(f"{code.where()}: `{shown}`: `{' '.join(path)}` takes no {action.dest} "
                                    f"'{choice}' (it takes: {', '.join(map(str, action.choices))})")
    return problems


def command_problems(codes: list[Code], root: argparse.ArgumentParser) -> tuple[list[str], int]:
    problems: list[str] = []
    found = 0
    for code in codes:
        for m in _COMMAND.finditer(code.text):
            found += 1
            problems += check_command(code, m.end(), root)
    return problems, found


def test_every_tidemark_command_and_option_named_in_the_docs_exists() -> None:
    root = build_parser()
    problems: list[str] = []
    found = 0
    for path in doc_files():
        p, n = command_problems(split_doc(path)[0], root)
        problems += p
        found += n
    assert found > 50, f"only {found} `tidemark` commands found in the docs: is the parsing broken?"
    assert not problems, "commands the CLI does not have:\n" + "\n".join(problems)


# ---------------------------------------------------------------- settings

_SETTING = re.compile(r"\bTIDEMARK_[A-Z0-9_]*[A-Z0-9]\b(?!_|\*)")


def named_settings(path: Path, text: str | None = None) -> dict[str, int]:
    """Every TIDEMARK_* variable a doc names, with the first line naming it. A table cell may
    abbreviate: `TIDEMARK_S3_ENDPOINT`, `_ACCESS_KEY` names TIDEMARK_S3_ACCESS_KEY."""
    text = path.read_text() if text is None else text
    found: dict[str, int] = {}
    for n, line in enumerate(text.split("\n"), 1):
        names = _SETTING.findall(line)
        if names:
            prefix = names[0].rsplit("_", 1)[0]
            names += [prefix + s for s in re.findall(r"`(_[A-Z0-9_]*[A-Z0-9])`", line)]
        for name in names:
            found.setdefault(name, n)
    return found


def code_settings(folders: tuple[str, ...]) -> dict[str, str]:
    """Every TIDEMARK_* variable in the code under ``folders``, with the first file:line naming it."""
    found: dict[str, str] = {}
    for folder in folders:
        for f in sorted((ROOT / folder).rglob("*")):
            if f.suffix not in (".py", ".sh", ".yaml") or not f.is_file():
                continue
            for n, line in enumerate(f.read_text(errors="replace").split("\n"), 1):
                for name in _SETTING.findall(line):
                    found.setdefault(name, f"{f.relative_to(ROOT)}:{n}")
    return found


def test_every_setting_named_in_the_docs_exists_in_the_code() -> None:
    in_code = code_settings(SETTING_SOURCES)
    problems = [f"{path.relative_to(ROOT)}:{line}: {name} is not read anywhere in {', '.join(SETTING_SOURCES)}"
                for path in doc_files() for name, line in named_settings(path).items() if name not in in_code]
    assert not problems, "settings the docs name but the code does not know:\n" + "\n".join(problems)


def test_every_setting_the_code_reads_is_documented() -> None:
    documented = {name for path in doc_files() for name in named_settings(path)}
    stale = sorted(set(UNDOCUMENTED_SETTINGS) & documented)
    assert not stale, f"documented now, so take them off UNDOCUMENTED_SETTINGS: {stale}"
    problems = [f"{where}: {name} is read by the code but named in neither README.md nor docs/*.md "
                f"(document it, e.g. in docs/production.md's Settings)"
                for name, where in code_settings(SETTING_READERS).items()
                if name not in documented and name not in UNDOCUMENTED_SETTINGS]
    assert not problems, "undocumented settings:\n" + "\n".join(problems)


# ---------------------------------------------------------------- paths and links

_PATH = re.compile(r"(?<![\w./$~-])(?:\./)?(?:" + "|".join(PATH_ROOTS) + r")/[\w./-]*\w")


def path_problems(codes: list[Code]) -> list[str]:
    problems = []
    for code in codes:
        for m in _PATH.finditer(code.text):
            if not (ROOT / m.group()).exists():
                problems.append(f"{code.where()}: `{m.group()}` does not exist (in `{code.text.strip()[:80]}`)")
    return problems


def test_every_script_bench_and_source_path_named_in_the_docs_exists() -> None:
    problems: list[str] = []
    named = 0
    for path in doc_files():
        codes = split_doc(path)[0]
        named += sum(len(_PATH.findall(c.text)) for c in codes)
        problems += path_problems(codes)
    assert named > 20, f"only {named} paths found in the docs: is the parsing broken?"
    assert not problems, "paths that do not exist:\n" + "\n".join(problems)


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path, text: str | None = None) -> set[str]:
    """The anchors of a markdown file's headings (a repeated heading gets -1, -2, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in split_doc(path, text)[1].split("\n"):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            a = github_anchor(m.group(1))
            found.add(a if a not in seen else f"{a}-{seen[a]}")
            seen[a] = seen.get(a, 0) + 1
    return found


_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def link_problems(path: Path, text: str | None = None) -> tuple[list[str], int]:
    """Relative links of a doc that point at no file, or at no heading of a markdown file. Links
    that leave the repository (../shared/DESIGN.md) are not checked: a clone need not hold them."""
    problems = []
    checked = 0
    body = split_doc(path, text)[1]
    for m in _LINK.finditer(body):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        line = body.count("\n", 0, m.start()) + 1
        where = f"{path.relative_to(ROOT)}:{line}"
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.is_relative_to(ROOT):
            continue
        checked += 1
        if file and not dest.exists():
            problems.append(f"{where}: link ({target}): {dest.relative_to(ROOT)} does not exist")
            continue
        if anchor and dest.suffix == ".md":
            known = anchors(dest, None if file else text)
            if anchor not in known:
                problems.append(f"{where}: link ({target}): {dest.relative_to(ROOT)} has no heading with anchor "
                                f"#{anchor} (it has: {', '.join(sorted(known))})")
    return problems, checked


def test_every_relative_link_and_anchor_resolves() -> None:
    problems: list[str] = []
    checked = 0
    for path in [*doc_files(), ROOT / "bench" / "README.md"]:
        p, n = link_problems(path)
        problems += p
        checked += n
    assert checked > 20, f"only {checked} links checked: is the parsing broken?"
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in doc_files()[1:] if f"](docs/{p.name})" not in readme]
    assert not missing, f"README.md's 'Where to go next' links no page {missing}"


# ---------------------------------------------------------------- the README itself


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().split("\n")
    n = len(lines) - (lines[-1] == "")
    assert n <= README_MAX_LINES, (f"README.md has {n} lines (at most {README_MAX_LINES}): move the detail "
                                   f"to a page under docs/ and link it")
    first_block = next(i for i, line in enumerate(lines) if line.startswith("```"))
    commands = [line.split()[0] for line in lines[first_block + 1:first_block + 3]]
    assert commands == ["./scripts/demo.sh", "./scripts/test.sh"], (
        f"README.md:{first_block + 2}: the first code block must hold ./scripts/demo.sh and ./scripts/test.sh, "
        f"in that order; it holds {commands}")


# ---------------------------------------------------------------- the checks themselves


@pytest.mark.parametrize(("snippet", "expected"), [
    ("`tidemark offsets show fact.orders --history`", None),
    ("`tidemark --lineage /tmp/x lineage validate`", None),
    ("`tidemark spark up\\|down\\|status`", None),
    ("`tidemark cdc resume\nREPLICA --resync`", None),
    ("the txn id `tidemark:<topic>` and the pool `tidemark/<table>`", None),
    ("`tidemark nosuch`", "`tidemark nosuch` is not a command"),
    ("`tidemark lineage check`", "`tidemark lineage check` is not a command"),
    ("`tidemark offsets rewind TOPIC`", "takes no action 'rewind'"),
    ("`tidemark spark up|sideways`", "takes no action 'sideways'"),
    ("`tidemark verify TOPIC --samples 5`", "`tidemark verify` has no option --samples"),
    ("```bash\ntidemark run --until-caught-up   # --not-checked in a comment\n"
     "tidemark events process --until-done\n```", "`tidemark events process` has no option --until-done"),
])
def test_the_command_check_finds_what_the_cli_lacks(snippet: str, expected: str | None) -> None:
    problems, found = command_problems(split_doc(ROOT / "docs" / "x.md", snippet)[0], build_parser())
    if expected is None:
        assert not problems, problems
    else:
        assert len(problems) == 1 and expected in problems[0] and "docs/x.md:" in problems[0], problems


def test_the_setting_path_and_link_checks_find_what_is_missing() -> None:
    doc = ROOT / "docs" / "x.md"
    text = ("# Top\n\n## Set it: `now`\n\n| `TIDEMARK_S3_ENDPOINT`, `_NO_SUCH` | x |\n\n"
            "See `bench/no_such.py` and `./scripts/demo.sh`, [a](../README.md#no-such-heading),\n"
            "[b](cli.md), [c](nowhere.md), [d](#set-it-now), [e](#top-1), [f](https://example.com/x.md).\n")
    assert named_settings(doc, text) == {"TIDEMARK_S3_ENDPOINT": 5, "TIDEMARK_S3_NO_SUCH": 5}
    problems = path_problems(split_doc(doc, text)[0])
    assert len(problems) == 1 and "docs/x.md:7: `bench/no_such.py` does not exist" in problems[0], problems
    problems, checked = link_problems(doc, text)
    assert checked == 5, checked
    assert [p.split(": link ")[1].split(")")[0] for p in problems] == [
        "(../README.md#no-such-heading", "(nowhere.md", "(#top-1"], problems
    assert problems[0].startswith("docs/x.md:7:"), problems
    assert github_anchor("When someone else cleans up (OPTIMIZE, VACUUM, log retention)") == (
        "when-someone-else-cleans-up-optimize-vacuum-log-retention")
    assert github_anchor("CDC replicas: `cdc:` replicators") == "cdc-replicas-cdc-replicators"
