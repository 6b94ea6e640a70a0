"""The lineage loader and validator: YAML + .sql files in a temp dir -> Lineage, or a
LineageError naming the file (and line), the topic and the field of every problem."""

from __future__ import annotations

import datetime as dt
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lineage.core.errors import LineageError, UnknownTopicError
from lineage.spec.loader import load_lineage
from lineage.spec.model import DEFAULT_MAXSTEP, Lineage, Processor, TopicName, TopicSpec, split_sql

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "demo" / "lineage"


def write(path: Path, text: str) -> Path:
    """Write dedented ``text`` (a leading newline is dropped, so line 1 is the first line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


@pytest.fixture
def lin(tmp_path: Path) -> Path:
    """A lineage dir ``<tmp>/lineage`` next to ``<tmp>/sql`` holding a few transforms."""
    for name in ("a", "b", "c", "d", "orders", "items", "mart"):
        write(tmp_path / "sql" / f"{name}.sql", f"SELECT * FROM block -- {name}\n;\n")
    d = tmp_path / "lineage"
    d.mkdir()
    return d


def load_error(path: Path) -> LineageError:
    with pytest.raises(LineageError) as exc:
        load_lineage(path)
    return exc.value


def assert_before(lineage: Lineage, first: str, then: str) -> None:
    names = list(lineage.topics)
    assert names.index(first) < names.index(then), names


# --- valid lineages --------------------------------------------------------------------------------


def test_valid_multi_file_lineage_loads(lin: Path) -> None:
    src = write(
        lin / "sources.yaml",
        """
        sources:
          - table: stage.orders
            comment: from the shop
          - table: stage.items
            path: /data/stage/items
            owner: ops
        """,
    )
    facts = write(
        lin / "facts.yaml",
        """
        # consumers first, producers after: the loader sorts them
        topics:
          - table: fact.items
            depends_on: [stage.items, fact.orders]
            transforms: [../sql/items.sql]
            delay: 30s
            repeat: 5m
            maxstep: 500k
            comment: order lines

          - table: fact.orders
            depends_on: [stage.orders]
            processor: step
            transforms: [../sql/orders.sql, ../sql/a.sql]
        """,
    )
    marts = write(
        lin / "marts" / "mart.yml",
        """
        topics:
          - table: mart.revenue
            depends_on: fact.items
            processor: reload
            transforms: ../../sql/mart.sql
        """,
    )
    lineage = load_lineage(lin)

    assert set(lineage.topics) == {"fact.items", "fact.orders", "mart.revenue"}
    assert list(lineage.sources) == ["stage.orders", "stage.items"]
    assert lineage.files == tuple(sorted([src, facts, marts]))
    assert_before(lineage, "fact.orders", "fact.items")
    assert_before(lineage, "fact.items", "mart.revenue")

    items = lineage.topic("fact.items")
    assert items.file == facts
    assert items.line == 3
    assert items.where == f"{facts}:3"
    assert items.spec.depends_on == ["stage.items", "fact.orders"]
    assert items.spec.base == "stage.items"
    assert items.spec.processor is Processor.STEP
    assert items.spec.delay == dt.timedelta(seconds=30)
    assert items.spec.repeat == dt.timedelta(minutes=5)
    assert items.spec.maxstep == 500_000
    assert items.spec.comment == "order lines"
    assert [t.ref for t in items.transforms] == ["../sql/items.sql"]
    # the SQL is read, stripped and loses its trailing semicolon
    assert items.transforms[0].sql == "SELECT * FROM block -- items"
    assert items.transforms[0].path == (lin.parent / "sql" / "items.sql").resolve()
    assert items.transforms[0].python is None

    orders = lineage.topic("fact.orders")
    assert orders.line == 11
    assert orders.spec.delay == dt.timedelta(0)
    assert orders.spec.repeat == dt.timedelta(0)
    assert orders.spec.maxstep == DEFAULT_MAXSTEP == 1_000_000
    assert orders.spec.before == [] and orders.spec.after == []
    assert [t.sql for t in orders.transforms] == ["SELECT * FROM block -- orders", "SELECT * FROM block -- a"]

    mart = lineage.topic("mart.revenue")
    assert mart.file == marts
    assert mart.spec.processor is Processor.RELOAD
    assert mart.spec.depends_on == ["fact.items"]
    assert mart.spec.transforms == ["../../sql/mart.sql"]

    assert lineage.sources["stage.items"].spec.path == "/data/stage/items"
    assert lineage.sources["stage.items"].spec.owner == "ops"
    assert lineage.sources["stage.orders"].line == 2
    assert lineage.sources["stage.orders"].file == src
    assert lineage.producers("fact.items") == [items]
    assert lineage.producers("stage.items") == []
    assert lineage.tables() == ["stage.orders", "stage.items", "fact.orders", "fact.items", "mart.revenue"]


def test_unknown_topic_lookup_lists_known_topics(lin: Path) -> None:
    write(
        lin / "l.yaml",
        "sources: [{table: stage.a}]\ntopics: [{table: fact.a, depends_on: stage.a, transforms: ../sql/a.sql}]\n",
    )
    lineage = load_lineage(lin)
    with pytest.raises(UnknownTopicError, match=r"unknown topic 'fact.b' \(known topics: fact.a\)"):
        lineage.topic("fact.b")


def test_producer_first_even_when_declared_later_in_another_file(lin: Path) -> None:
    # "a.yaml" sorts first and holds the consumer; its topic name also sorts first
    write(
        lin / "a.yaml",
        """
        topics:
          - table: aaa.consumer
            depends_on: [zzz.producer]
            transforms: [../sql/a.sql]
        """,
    )
    write(
        lin / "z.yaml",
        """
        sources:
          - table: stage.raw
        topics:
          - table: zzz.producer
            depends_on: [mmm.middle]
            transforms: [../sql/b.sql]
          - table: mmm.middle
            depends_on: [stage.raw]
            transforms: [../sql/c.sql]
        """,
    )
    lineage = load_lineage(lin)
    assert list(lineage.topics) == ["mmm.middle", "zzz.producer", "aaa.consumer"]


def test_every_topic_comes_after_all_producers_of_its_dependencies(lin: Path) -> None:
    write(
        lin / "l.yaml",
        """
        sources: [{table: stage.a}, {table: stage.b}]
        topics:
          - {table: "x.out", depends_on: "x.left, x.right", transforms: ../sql/a.sql}
          - {table: "x.left#one", depends_on: stage.a, transforms: ../sql/a.sql}
          - {table: "x.right", depends_on: "stage.b, x.left", transforms: ../sql/b.sql}
          - {table: "x.left#two:1", depends_on: stage.b, transforms: ../sql/c.sql}
          - {table: "x.left#two:2", depends_on: stage.b, transforms: ../sql/c.sql}
        """,
    )
    lineage = load_lineage(lin)
    assert len(lineage.topics) == 5
    for topic in lineage.topics.values():
        for dep in topic.spec.depends_on:
            for producer in lineage.producers(dep):
                assert_before(lineage, producer.name, topic.name)


def test_comma_separated_strings_and_yaml_lists_are_equivalent(lin: Path) -> None:
    write(
        lin / "l.yaml",
        """
        sources:
          - table: stage.a
          - table: stage.b
        topics:
          - table: fact.strings
            depends_on: "stage.a, stage.b ,stage.c,"
            transforms: "../sql/a.sql,../sql/b.sql"
          - table: fact.lists
            depends_on: [stage.a, stage.b, stage.c]
            transforms:
              - ../sql/a.sql
              - ../sql/b.sql
          - table: stage.c
            depends_on: stage.a
            transforms: ../sql/c.sql
        """,
    )
    lineage = load_lineage(lin)
    strings, lists = lineage.topic("fact.strings").spec, lineage.topic("fact.lists").spec
    assert strings.depends_on == lists.depends_on == ["stage.a", "stage.b", "stage.c"]
    assert strings.transforms == lists.transforms == ["../sql/a.sql", "../sql/b.sql"]
    assert lineage.topic("stage.c").spec.depends_on == ["stage.a"]
    assert [t.sql for t in lineage.topic("fact.strings").transforms] == [
        "SELECT * FROM block -- a",
        "SELECT * FROM block -- b",
    ]


def test_before_and_after_split_on_semicolons_but_not_inside_quotes(lin: Path) -> None:
    write(
        lin / "l.yaml",
        """
        sources: [{table: stage.a}]
        topics:
          - table: fact.a
            depends_on: stage.a
            transforms: ../sql/a.sql
            before: "DELETE FROM t WHERE s = 'a;b'; SELECT \\"x;y\\" FROM `we;ird`;"
            after: |
              INSERT INTO log VALUES ('done;ok');  -- trailing; comment
              OPTIMIZE fact.a
          - table: fact.b
            depends_on: stage.a
            transforms: ../sql/b.sql
            before: [SELECT 1, "SELECT 2; SELECT 3"]
        """,
    )
    lineage = load_lineage(lin)
    a = lineage.topic("fact.a").spec
    assert a.before == ["DELETE FROM t WHERE s = 'a;b'", 'SELECT "x;y" FROM `we;ird`']
    assert a.after == ["INSERT INTO log VALUES ('done;ok')", "OPTIMIZE fact.a"]
    # a YAML list is taken as it is: one statement per item
    assert lineage.topic("fact.b").spec.before == ["SELECT 1", "SELECT 2; SELECT 3"]


def test_split_sql() -> None:
    assert split_sql("a; b ;; c") == ["a", "b", "c"]
    assert split_sql("select ';' ; x") == ["select ';'", "x"]
    assert split_sql("a -- b; c\nd") == ["a \nd"]
    assert split_sql("  ") == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("500k", 500_000),
        ("1m", 1_000_000),
        ("1.5k", 1_500),
        ("2M", 2_000_000),
        (2500, 2500),
        ("2500", 2500),
        ("10_000", 10_000),
    ],
)
def test_maxstep_forms(lin: Path, value: object, expected: int) -> None:
    text = f'"{value}"' if isinstance(value, str) else str(value)
    write(
        lin / "l.yaml",
        f"sources: [{{table: stage.a}}]\n"
        f"topics: [{{table: fact.a, depends_on: stage.a, transforms: ../sql/a.sql, maxstep: {text}}}]\n",
    )
    assert load_lineage(lin).topic("fact.a").spec.maxstep == expected


def test_maxstep_defaults_to_a_million(lin: Path) -> None:
    write(
        lin / "l.yaml",
        """
        sources: [{table: stage.a}]
        topics:
          - {table: fact.a, depends_on: stage.a, transforms: ../sql/a.sql}
          - {table: fact.b, depends_on: stage.a, transforms: ../sql/a.sql, maxstep: }
          - {table: fact.c, depends_on: stage.a, transforms: ../sql/a.sql, maxstep: ""}
        """,
    )
    lineage = load_lineage(lin)
    assert [t.spec.maxstep for t in lineage.topics.values()] == [1_000_000] * 3


@pytest.mark.parametrize("value", ['"2.5"', "yes"])
def test_maxstep_rejects_fractions_and_booleans(lin: Path, value: str) -> None:
    write(
        lin / "l.yaml",
        f"sources: [{{table: stage.a}}]\n"
        f"topics: [{{table: fact.a, depends_on: stage.a, transforms: ../sql/a.sql, maxstep: {value}}}]\n",
    )
    err = load_error(lin)
    assert "field 'maxstep'" in str(err)


def test_topic_names_with_tag_and_shard(lin: Path) -> None:
    write(
        lin / "l.yaml",
        """
        sources: [{table: stage.web}, {table: stage.app}]
        topics:
          - {table: "fact.orders#web", depends_on: stage.web, transforms: ../sql/a.sql}
          - {table: "fact.orders#app:eu-1", depends_on: stage.app, transforms: ../sql/b.sql}
          - {table: "fact.orders:2", depends_on: stage.app, transforms: ../sql/b.sql}
          - {table: "mart.orders", depends_on: fact.orders, transforms: ../sql/c.sql}
        """,
    )
    lineage = load_lineage(lin)
    web = lineage.topic("fact.orders#web").spec
    assert web.topic == TopicName("fact.orders", "web", None)
    assert web.destination == "fact.orders"
    app = lineage.topic("fact.orders#app:eu-1").spec
    assert app.topic == TopicName("fact.orders", "app", "eu-1")
    assert app.destination == "fact.orders"
    shard = lineage.topic("fact.orders:2").spec
    assert shard.topic == TopicName("fact.orders", None, "2")
    assert lineage.topic("mart.orders").spec.topic == TopicName("mart.orders", None, None)
    # several topics write one table; its consumer runs after all of them
    assert sorted(t.name for t in lineage.producers("fact.orders")) == [
        "fact.orders#app:eu-1",
        "fact.orders#web",
        "fact.orders:2",
    ]
    assert list(lineage.topics)[-1] == "mart.orders"
    assert lineage.tables() == ["stage.web", "stage.app", "fact.orders", "mart.orders"]
    # block keys: topic-qualified only where several topics build the table; block_of inverts
    assert lineage.block_key("fact.orders#web", 7) == "fact.orders#web@00000007"
    assert lineage.block_of("fact.orders", "fact.orders#web@00000007") == ("fact.orders#web", 7)
    assert lineage.block_key("mart.orders", 12) == "00000012"
    assert lineage.block_of("mart.orders", "00000012") == ("mart.orders", 12)


def test_single_file_path_and_empty_files(lin: Path) -> None:
    write(lin / "empty.yaml", "# nothing here yet\n")
    one = write(
        lin / "one.yaml",
        "sources: [{table: stage.a}]\ntopics: [{table: fact.a, depends_on: stage.a, transforms: ../sql/a.sql}]\n",
    )
    assert list(load_lineage(one).topics) == ["fact.a"]
    assert load_lineage(str(one)).files == (one,)
    assert list(load_lineage(lin).topics) == ["fact.a"]
    empty_only = write(lin.parent / "other" / "x.yaml", "")
    lineage = load_lineage(empty_only.parent)
    assert lineage.topics == {} and lineage.sources == {}


# --- python transforms -----------------------------------------------------------------------------


@pytest.fixture
def pymod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """Write a module with a unique name under ``<tmp>/py`` (on sys.path); returns its name."""
    root = tmp_path / "py"
    root.mkdir()
    names: list[str] = []

    def make(body: str, package: bool = False) -> str:
        name = f"tm_lineage_{uuid.uuid4().hex[:10]}"
        if package:
            write(root / name / "__init__.py", "")
            write(root / name / "mod.py", body)
            names.extend([name, f"{name}.mod"])
            importlib_invalidate()
            return f"{name}.mod"
        write(root / f"{name}.py", body)
        names.append(name)
        importlib_invalidate()
        return name

    monkeypatch.syspath_prepend(str(root))
    yield make
    for name in names:
        sys.modules.pop(name, None)


def importlib_invalidate() -> None:
    import importlib

    importlib.invalidate_caches()


PY_TOPIC = """
sources: [{{table: stage.a}}]
topics:
  - table: fact.py
    depends_on: stage.a
    transforms: ["{ref}"]
"""


def test_python_transform_resolves(lin: Path, pymod: Callable[..., str]) -> None:
    mod = pymod("def build(df):\n    return df\n")
    pkg_mod = pymod("def enrich(df):\n    return df\n", package=True)
    write(
        lin / "l.yaml",
        f"""
        sources: [{{table: stage.a}}]
        topics:
          - table: fact.py
            depends_on: stage.a
            transforms: ["python:{mod}:build", "../sql/a.sql", "python:{pkg_mod}:enrich"]
        """,
    )
    topic = load_lineage(lin).topic("fact.py")
    first, second, third = topic.transforms
    assert first.ref == f"python:{mod}:build"
    assert first.python == (mod, "build")
    assert first.sql is None and first.path is None
    assert second.sql == "SELECT * FROM block -- a"
    assert third.python == (pkg_mod, "enrich")


def test_python_transform_module_missing(lin: Path) -> None:
    missing = f"tm_lineage_missing_{uuid.uuid4().hex[:8]}"
    f = write(lin / "l.yaml", PY_TOPIC.format(ref=f"python:{missing}:build"))
    err = load_error(lin)
    assert len(err.problems) == 1
    msg = err.problems[0]
    assert msg.startswith(f"{f}:5: topic 'fact.py': field 'transforms': ")
    assert f"python module '{missing}' of 'python:{missing}:build' cannot be imported" in msg
    assert "PYTHONPATH" in msg


def test_python_transform_missing_parent_package(lin: Path) -> None:
    write(lin / "l.yaml", PY_TOPIC.format(ref="python:tm_no_such_pkg_zz.sub:build"))
    err = load_error(lin)
    assert "python module 'tm_no_such_pkg_zz.sub'" in str(err)
    assert "field 'transforms'" in str(err)


def test_python_transform_function_missing(lin: Path, pymod: Callable[..., str]) -> None:
    mod = pymod("def build(df):\n    return df\n\nNOT_A_FUNCTION = 3\n")
    f = write(lin / "l.yaml", PY_TOPIC.format(ref=f"python:{mod}:nope"))
    err = load_error(lin)
    assert err.problems == [
        f"{f}:5: topic 'fact.py': field 'transforms': '{mod}' has no function 'nope' ('python:{mod}:nope')"
    ]
    write(lin / "l.yaml", PY_TOPIC.format(ref=f"python:{mod}:NOT_A_FUNCTION"))
    assert f"'{mod}' has no function 'NOT_A_FUNCTION'" in str(load_error(lin))


def test_python_transform_module_that_fails_to_import(lin: Path, pymod: Callable[..., str]) -> None:
    mod = pymod("raise RuntimeError('boom at import')\n")
    write(lin / "l.yaml", PY_TOPIC.format(ref=f"python:{mod}:build"))
    err = load_error(lin)
    assert f"importing '{mod}' for 'python:{mod}:build' failed: boom at import" in str(err)
    assert "topic 'fact.py': field 'transforms'" in str(err)


@pytest.mark.parametrize(
    "ref", ["python:build", "python:1mod:f", "python:mod:f-g", "transform.py", "a.SQL.txt"]
)
def test_badly_written_transform_refs(lin: Path, ref: str) -> None:
    f = write(lin / "l.yaml", PY_TOPIC.format(ref=ref))
    err = load_error(lin)
    msg = str(err)
    assert f"{f}:5: topic 'fact.py': field 'transforms'" in msg
    assert repr(ref) in msg


# --- rejections: one problem each ---------------------------------------------------------------------


def one_topic(lin: Path, extra: str, name: str = "fact.x", file: str = "facts.yaml") -> Path:
    """A file with a source and one topic ``name`` (on line 3) plus ``extra`` fields."""
    body = f'sources:\n  - table: stage.a\n  - table: stage.b\ntopics:\n  - table: "{name}"\n'
    body += "    depends_on: [stage.a]\n    transforms: [../sql/a.sql]\n"
    body += textwrap.indent(textwrap.dedent(extra).strip("\n"), "    ") + "\n" if extra.strip() else ""
    return write(lin / file, body)


TOPIC_LINE = 5  # line of "- table:" in one_topic()
DEPS_LINE, TRANSFORMS_LINE = 6, 7  # lines of its depends_on and transforms
EXTRA_LINE = 8  # line of the first ``extra`` field


def test_one_topic_helper_is_valid(lin: Path) -> None:
    one_topic(lin, "delay: 1m")
    topic = load_lineage(lin).topic("fact.x")
    assert topic.line == TOPIC_LINE
    assert topic.spec.delay == dt.timedelta(minutes=1)


def test_misspelled_field(lin: Path) -> None:
    f = write(
        lin / "facts.yaml",
        """
        sources: [{table: stage.a}]
        topics:
          - table: fact.x
            dependson: [stage.a]
            transforms: [../sql/a.sql]
        """,
    )
    err = load_error(lin)
    msg = str(err)
    assert f"{f}:4: topic 'fact.x': field 'dependson': unknown field (check the spelling; allowed: " in msg
    assert "depends_on" in msg.split("field 'dependson'")[1]
    # the real field is then missing: also reported
    assert f"{f}:3: topic 'fact.x': field 'depends_on': is required" in msg
    assert len(err.problems) == 2
    assert msg.startswith("invalid lineage (2 problems):\n  - ")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("delay", "5x", "'5x' is not a duration (use e.g. 30s, 5m, 1h30m, 2d"),
        ("delay", '"-1"', "'-1' is not a duration"),
        ("repeat", "1h 30", "'1h 30' is not a duration"),
        ("repeat", "m5", "'m5' is not a duration"),
        ("delay", "-5", "-5 is negative; durations are >= 0"),
        ("delay", "yes", "True is not a duration"),
    ],
)
def test_bad_duration(lin: Path, field: str, value: str, expected: str) -> None:
    f = one_topic(lin, f"{field}: {value}")
    err = load_error(lin)
    assert len(err.problems) == 1
    msg = err.problems[0]
    assert msg.startswith(f"{f}:{EXTRA_LINE}: topic 'fact.x': field '{field}': ")
    assert expected in msg
    assert f.name in str(err)


@pytest.mark.parametrize("value", ["1000000000d", ".inf"])
def test_out_of_range_duration_is_a_lineage_error(lin: Path, value: str) -> None:
    one_topic(lin, f"delay: {value}")
    err = load_error(lin)
    assert "topic 'fact.x': field 'delay'" in str(err)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", "Input should be greater than 0"),
        ("-5", "Input should be greater than 0"),
        ('"-1k"', "Input should be greater than 0"),
        ("lots", "'lots' is not a row count (a whole number, e.g. 100000, 500k, 1m)"),
        ('"k"', "'k' is not a row count"),
        ("2.5", "fractional part"),
    ],
)
def test_bad_maxstep(lin: Path, value: str, expected: str) -> None:
    f = one_topic(lin, f"maxstep: {value}")
    err = load_error(lin)
    assert len(err.problems) == 1
    assert err.problems[0].startswith(f"{f}:{EXTRA_LINE}: topic 'fact.x': field 'maxstep': ")
    assert expected in err.problems[0]


@pytest.mark.parametrize("value", ["stream", "Step", "MERGE", "''"])
def test_bad_processor(lin: Path, value: str) -> None:
    f = one_topic(lin, f"processor: {value}")
    err = load_error(lin)
    assert len(err.problems) == 1
    assert err.problems[0].startswith(f"{f}:{EXTRA_LINE}: topic 'fact.x': field 'processor': ")
    assert "'step', 'reload' or 'merge'" in err.problems[0]


def test_merge_settings_are_checked_against_the_processor_and_depends_on(lin: Path) -> None:
    f = one_topic(lin, "processor: merge\njoin_keys: {stage.a: {customer_id: id}, dim.x: {a: b}}")
    problems = load_error(lin).problems
    assert any(p.startswith(f"{f}:") and "field 'key': a merge topic needs the unique key" in p for p in problems), problems
    assert any("field 'join_keys': stage.a is the base table" in p for p in problems), problems
    assert any("field 'join_keys': dim.x is not in depends_on" in p for p in problems), problems
    one_topic(lin, "key: [id]\nrefresh: incremental_strict")
    problems = load_error(lin).problems
    assert any("field 'key': only merge topics take 'key' (this is a step topic)" in p for p in problems), problems
    assert any("field 'refresh': only merge topics take 'refresh'" in p for p in problems), problems


def test_deletion_vectors_only_on_merge_views_that_no_block_reader_takes_as_its_base(lin: Path) -> None:
    one_topic(lin, "deletion_vectors: true")
    problems = load_error(lin).problems
    assert any("field 'deletion_vectors': only merge topics take 'deletion_vectors'" in p for p in problems), problems
    write(lin / "facts.yaml", """
        sources:
          - table: stage.a
        topics:
          - table: mart.v
            depends_on: [stage.a]
            processor: merge
            transforms: [../sql/a.sql]
            key: [id]
            deletion_vectors: true
          - table: fact.y
            depends_on: [mart.v]
            transforms: [../sql/b.sql]
          - table: fact.z
            depends_on: [mart.v]
            processor: reload
            transforms: [../sql/c.sql]
        """)
    # a view with deletion vectors is a base like any other: its rows are planned through deltalake's DataFusion reader
    loaded = load_lineage(lin)
    assert loaded.topic("fact.y").spec.base == "mart.v" and loaded.topic("mart.v").spec.deletion_vectors


@pytest.mark.parametrize(
    "name", ["orders", "fact orders", "fact.orders#", "fact.orders:", "fact.orders:a:b", "a.b.c", "1x.y"]
)
def test_bad_topic_name(lin: Path, name: str) -> None:
    f = one_topic(lin, "", name=name)
    err = load_error(lin)
    assert len(err.problems) == 1
    msg = err.problems[0]
    assert msg.startswith(f"{f}:{TOPIC_LINE}: topic '{name}': field 'table': ")
    assert (
        f"{name!r} is not a topic name: expected schema.table, optionally followed by #tag and :shard" in msg
    )


def test_bad_table_in_depends_on(lin: Path) -> None:
    f = write(lin / "l.yaml", "topics:\n  - {table: fact.x, depends_on: 'stage', transforms: ../sql/a.sql}\n")
    err = load_error(lin)
    assert err.problems == [
        f"{f}:2: topic 'fact.x': field 'depends_on': 'stage' is not a table name: expected schema.table"
    ]


def test_depends_on_listing_a_table_twice(lin: Path) -> None:
    write(
        lin / "facts.yaml",
        "sources: [{table: stage.a}]\ntopics:\n  - {table: fact.x, depends_on: 'stage.a, stage.a', transforms: ../sql/a.sql}\n",
    )
    err = load_error(lin)
    assert "topic 'fact.x': field 'depends_on': lists a table twice" in str(err)


def test_missing_required_fields(lin: Path) -> None:
    f = write(lin / "l.yaml", "topics:\n  - table: fact.x\n")
    err = load_error(lin)
    assert sorted(err.problems) == [
        f"{f}:2: topic 'fact.x': field 'depends_on': is required",
        f"{f}:2: topic 'fact.x': field 'transforms': is required",
    ]


def test_duplicate_topic_across_two_files(lin: Path) -> None:
    first = write(
        lin / "a.yaml",
        """
        sources: [{table: stage.a}]
        topics:
          - table: fact.x
            depends_on: stage.a
            transforms: ../sql/a.sql
        """,
    )
    second = write(
        lin / "b.yaml",
        """
        topics:
          - table: fact.y
            depends_on: stage.a
            transforms: ../sql/b.sql
          - table: fact.x
            depends_on: stage.a
            transforms: ../sql/c.sql
        """,
    )
    err = load_error(lin)
    assert err.problems == [f"{second}:5: topic 'fact.x': duplicate topic (also at {first}:3)"]


def test_dependency_cycle(lin: Path) -> None:
    f = write(
        lin / "l.yaml",
        """
        sources: [{table: stage.a}]
        topics:
          - table: fact.a
            depends_on: [fact.b]
            transforms: ../sql/a.sql
          - table: fact.b
            depends_on: [stage.a, fact.a]
            transforms: ../sql/b.sql
          - table: fact.ok
            depends_on: [stage.a]
            transforms: ../sql/c.sql
        """,
    )
    err = load_error(lin)
    assert len(err.problems) == 1
    msg = err.problems[0]
    assert msg.startswith(f"{f}:3: topic 'fact.a': field 'depends_on': dependency cycle: ")
    assert msg.endswith("fact.a -> fact.b -> fact.a")


def test_longer_cycle_through_tagged_topics_is_reported_once(lin: Path) -> None:
    write(
        lin / "l.yaml",
        """
        sources: [{table: stage.a}]
        topics:
          - {table: "x.a#t", depends_on: "stage.a, x.c", transforms: ../sql/a.sql}
          - {table: "x.b", depends_on: "x.a", transforms: ../sql/a.sql}
          - {table: "x.c:1", depends_on: "x.b", transforms: ../sql/a.sql}
        """,
    )
    err = load_error(lin)
    assert len(err.problems) == 1
    assert "dependency cycle: x.a -> x.c -> x.b -> x.a" in err.problems[0]
    assert "topic 'x.a#t'" in err.problems[0]


def test_cycle_reached_through_another_topic_shows_only_the_cycle(lin: Path) -> None:
    f = write(
        lin / "l.yaml",
        """
        sources: [{table: stage.a}]
        topics:
          - {table: a.entry, depends_on: "stage.a, c.one", transforms: ../sql/a.sql}
          - {table: c.one, depends_on: "stage.a, c.two", transforms: ../sql/a.sql}
          - {table: c.two, depends_on: "c.one", transforms: ../sql/a.sql}
        """,
    )
    err = load_error(lin)
    assert err.problems == [
        f"{f}:4: topic 'c.one': field 'depends_on': dependency cycle: c.one -> c.two -> c.one"
    ]


def test_topic_depending_on_its_own_table_is_rejected(lin: Path) -> None:
    write(
        lin / "facts.yaml",
        "sources: [{table: stage.a}]\ntopics:\n  - {table: fact.x, depends_on: 'stage.a, fact.x', transforms: ../sql/a.sql}\n",
    )
    err = load_error(lin)
    assert "topic 'fact.x': field 'depends_on'" in str(err)


def test_missing_transform_file(lin: Path) -> None:
    f = one_topic(lin, "")
    write(f, f.read_text().replace("[../sql/a.sql]", "[../sql/a.sql, ../sql/nope.sql]"))
    err = load_error(lin)
    assert len(err.problems) == 1
    msg = err.problems[0]
    expected_path = (lin.parent / "sql" / "nope.sql").resolve()
    assert msg == (
        f"{f}:{TRANSFORMS_LINE}: topic 'fact.x': field 'transforms': transform file '../sql/nope.sql' not found "
        f"(looked at {expected_path})"
    )


@pytest.mark.parametrize("content", ["", "   \n\n", ";\n", "  ;  \n"])
def test_empty_transform_file(lin: Path, content: str) -> None:
    (lin.parent / "sql" / "empty.sql").write_text(content)
    f = one_topic(lin, "")
    write(f, f.read_text().replace("[../sql/a.sql]", "[../sql/empty.sql]"))
    err = load_error(lin)
    assert err.problems == [
        f"{f}:{TRANSFORMS_LINE}: topic 'fact.x': field 'transforms': transform file '../sql/empty.sql' is empty"
    ]


def test_dependency_nobody_produces(lin: Path) -> None:
    f = one_topic(lin, "")
    write(f, f.read_text().replace("[stage.a]", "[stage.a, stage.nope]"))
    err = load_error(lin)
    assert err.problems == [
        f"{f}:{DEPS_LINE}: topic 'fact.x': field 'depends_on': 'stage.nope' is produced by no topic and not "
        "declared as a source (add it under 'sources:' or fix the name)"
    ]


def test_source_declared_twice(lin: Path) -> None:
    first = write(lin / "a.yaml", "sources:\n  - table: stage.a\n")
    second = write(
        lin / "b.yaml", "# again\nsources:\n  - table: stage.b\n  - table: stage.a\n    comment: dup\n"
    )
    err = load_error(lin)
    assert err.problems == [f"{second}:4: source 'stage.a' declared twice (also at {first}:2)"]


def test_table_declared_as_source_and_produced(lin: Path) -> None:
    f = write(
        lin / "l.yaml",
        """
        sources:
          - table: stage.a
          - table: fact.x
        topics:
          - {table: "fact.x#web", depends_on: stage.a, transforms: ../sql/a.sql}
        """,
    )
    err = load_error(lin)
    assert err.problems == [f"{f}:3: 'fact.x' is declared as a source but topic(s) produce it"]


@pytest.mark.parametrize("other", ["fact.r#extra", "fact.r:2"])
def test_reload_topic_sharing_its_table(lin: Path, other: str) -> None:
    f = write(
        lin / "l.yaml",
        f"""
        sources: [{{table: stage.a}}]
        topics:
          - {{table: fact.r, depends_on: stage.a, processor: reload, transforms: ../sql/a.sql}}
          - {{table: "{other}", depends_on: stage.a, transforms: ../sql/b.sql}}
        """,
    )
    err = load_error(lin)
    assert err.problems == [
        f"{f}:3: topic 'fact.r': field 'processor': table 'fact.r' is rebuilt by a reload topic, so it cannot "
        f"have other topics (fact.r, {other})"
    ]


def test_two_reload_topics_on_one_table(lin: Path) -> None:
    write(
        lin / "l.yaml",
        """
        sources: [{table: stage.a}]
        topics:
          - {table: "fact.r#a", depends_on: stage.a, processor: reload, transforms: ../sql/a.sql}
          - {table: "fact.r#b", depends_on: stage.a, processor: reload, transforms: ../sql/b.sql}
        """,
    )
    assert (
        "table 'fact.r' is rebuilt by a reload topic, so it cannot have other topics (fact.r#a, fact.r#b)"
        in str(load_error(lin))
    )


def test_unknown_top_level_key(lin: Path) -> None:
    f = write(lin / "l.yaml", "sources: [{table: stage.a}]\ntopic:\n  - table: fact.x\n")
    err = load_error(lin)
    assert err.problems == [f"{f}:2: unknown top-level key 'topic' (allowed: topics, sources, cdc)"]


def test_invalid_yaml(lin: Path) -> None:
    f = write(lin / "bad.yaml", "topics:\n  - table: fact.x\n   depends_on: [stage.a\n")
    err = load_error(lin)
    assert len(err.problems) == 1
    assert err.problems[0].startswith(f"{f}:3:")
    assert ": not valid YAML: " in err.problems[0]
    assert "<unicode string>" not in err.problems[0]


def test_yaml_syntax_error_names_the_file_line_and_column(lin: Path) -> None:
    f = write(lin / "bad.yaml", "sources:\n  - table: stage.a\ntopics:\n  - table: fact.x\n    depends_on: [stage.a]\n"
                                 "    transforms: [../sql/a.sql\n    delay: 5m\n")
    err = load_error(lin)
    assert err.problems == [
        f"{f}:7:10: not valid YAML: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence at line 6, column 17)"
    ]


def test_a_field_error_names_the_line_of_the_field(lin: Path) -> None:
    f = write(lin / "l.yaml", "sources: [{table: stage.a}]\ntopics:\n  - table: fact.x\n    depends_on: [stage.a]\n"
                               "    transforms: [../sql/a.sql]\n    checks:\n      severity: error\n      max_lag: soon\n")
    err = load_error(lin)
    assert len(err.problems) == 1 and err.problems[0].startswith(f"{f}:8: topic 'fact.x': field 'checks.max_lag': "), err.problems


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- table: fact.x\n", "expected a mapping with 'topics:' and/or 'sources:' lists"),
        ("just a string\n", "expected a mapping with 'topics:' and/or 'sources:' lists"),
        ("topics:\n  table: fact.x\n", "'topics' must be a list"),
        ("sources: stage.a\n", "'sources' must be a list"),
        ("topics:\n  - fact.x\n", "each entry of 'topics' must be a mapping, got 'fact.x'"),
    ],
)
def test_wrong_shapes(lin: Path, text: str, expected: str) -> None:
    f = write(lin / "l.yaml", text)
    err = load_error(lin)
    assert err.problems == [f"{f}: {expected}"]


def test_directory_without_yaml_files(tmp_path: Path) -> None:
    d = tmp_path / "lineage"
    write(d / "readme.txt", "no yaml here")
    write(d / "x.sql", "SELECT 1")
    err = load_error(d)
    assert err.problems == [f"{d}: no *.yaml lineage files found"]


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    err = load_error(missing)
    assert err.problems == [
        f"{missing}: no such lineage file or directory (set TIDEMARK_LINEAGE or --lineage)"
    ]
    assert (
        str(err)
        == f"invalid lineage:\n  - {missing}: no such lineage file or directory (set TIDEMARK_LINEAGE or --lineage)"
    )


def test_unknown_field_of_a_source_lists_source_fields(lin: Path) -> None:
    write(lin / "l.yaml", "sources:\n  - table: stage.a\n    paht: /data/a\n")
    msg = load_error(lin).problems[0]
    assert "field 'paht': unknown field" in msg
    assert "allowed: table, path, comment, owner" in msg
    assert "topic 'stage.a'" not in msg


def test_bad_source_table_name(lin: Path) -> None:
    f = write(lin / "l.yaml", "sources:\n  - table: stage\n  - comment: no table\n")
    err = load_error(lin)
    assert len(err.problems) == 2
    assert "'stage' is not a table name: expected schema.table" in err.problems[0]
    assert err.problems[0].startswith(f"{f}:2:")
    assert err.problems[1] == f"{f}:3: field 'table': is required"


# --- many problems at once -------------------------------------------------------------------------


def test_all_problems_are_reported_at_once(lin: Path) -> None:
    one = write(
        lin / "one.yaml",
        """
        sources:
          - table: stage.a
        topics:
          - table: fact.a
            depends_on: stage.a
            transforms: ../sql/a.sql
            delay: 5x
          - table: fact.b
            depends_on: stage.a
            transforms: ../sql/b.sql
            maxstep: 0
          - table: fact.c
            depends_on: stage.a
            transforms: ../sql/missing.sql
        """,
    )
    two = write(
        lin / "two.yaml",
        """
        sources:
          - table: stage.a
        topics:
          - table: fact.d
            depends_on: [stage.a, stage.nope]
            transforms: ../sql/d.sql
            procesor: reload
          - table: "bad name"
            depends_on: stage.a
            transforms: ../sql/d.sql
        """,
    )
    err = load_error(lin)
    expected = [
        f"{one}:7: topic 'fact.a': field 'delay': '5x' is not a duration",
        f"{one}:11: topic 'fact.b': field 'maxstep': Input should be greater than 0",
        f"{one}:14: topic 'fact.c': field 'transforms': transform file '../sql/missing.sql' not found",
        f"{two}:2: source 'stage.a' declared twice (also at {one}:2)",
        f"{two}:7: topic 'fact.d': field 'procesor': unknown field",
        f"{two}:8: topic 'bad name': field 'table': 'bad name' is not a topic name",
    ]
    assert len(err.problems) == len(expected), err.problems
    for want in expected:
        assert sum(p.startswith(want) for p in err.problems) == 1, (want, err.problems)
        assert want in str(err)
    assert str(err).startswith(f"invalid lineage ({len(expected)} problems):\n  - ")


def test_valid_topics_unaffected_by_unknown_dependency_check(lin: Path) -> None:
    """A dependency on a valid topic in another file is not reported as unknown."""
    write(
        lin / "a.yaml",
        "sources: [{table: stage.a}]\ntopics: [{table: fact.a, depends_on: stage.a, transforms: ../sql/a.sql}]\n",
    )
    f = write(
        lin / "b.yaml",
        "topics:\n  - {table: fact.b, depends_on: 'fact.a, fact.zz', transforms: ../sql/b.sql}\n",
    )
    err = load_error(lin)
    assert err.problems == [
        f"{f}:2: topic 'fact.b': field 'depends_on': 'fact.zz' is produced by no topic and not declared as a "
        "source (add it under 'sources:' or fix the name)"
    ]


# --- the demo --------------------------------------------------------------------------------------


def test_demo_lineage_loads() -> None:
    lineage = load_lineage(DEMO)
    assert set(lineage.topics) == {"dim.customers", "fact.orders", "fact.order_items", "mart.daily_revenue", "fact.page_views"}
    assert set(lineage.sources) == {"stage.customers", "stage.orders", "stage.order_items", "stage.events_page_view"}
    assert_before(lineage, "fact.orders", "fact.order_items")
    assert_before(lineage, "fact.order_items", "mart.daily_revenue")
    assert lineage.files == (DEMO / "crm.yaml", DEMO / "shop.yaml")
    assert lineage.replicators["crm"].spec.replica("public.customers") == "crm.customers"

    dim = lineage.topic("dim.customers").spec
    assert dim.processor is Processor.RELOAD
    assert dim.depends_on == ["stage.customers"]
    items = lineage.topic("fact.order_items").spec
    assert items.processor is Processor.STEP
    assert items.depends_on == ["stage.order_items", "fact.orders"]
    assert items.delay == dt.timedelta(seconds=5)
    assert items.maxstep == 4000
    assert items.after == ["SELECT count(*) FROM block"]
    assert lineage.topic("fact.orders").spec.maxstep == 1500
    assert lineage.topic("mart.daily_revenue").spec.processor is Processor.MERGE
    for topic in lineage.topics.values():
        assert len(topic.transforms) == 1
        t = topic.transforms[0]
        assert t.path is not None and t.path.is_file()
        assert t.path.parent == (ROOT / "demo" / "sql").resolve()
        assert t.sql and t.sql.strip() == t.sql


def test_topic_spec_model_validate_directly() -> None:
    spec = TopicSpec.model_validate(
        {
            "table": " fact.x#t:1 ",
            "depends_on": "stage.a,stage.b",
            "transforms": "x.sql",
            "delay": "1m",
            "repeat": 30,
        }
    )
    assert spec.name == "fact.x#t:1"  # whitespace stripped
    assert spec.base == "stage.a"
    assert spec.delay == dt.timedelta(minutes=1)
    assert spec.repeat == dt.timedelta(seconds=30)
    assert spec.maxstep == DEFAULT_MAXSTEP


def test_cdc_replicators_load_and_topics_may_read_their_replicas(lin: Path) -> None:
    f = lin / "cdc.yaml"
    write(f, """
cdc:
  - name: shop
    dsn_env: SHOP_DSN
    tables: [public.customers, "sales.order_*"]
    change_feed: false
    deletion_vectors: true
    options:
      public.customers: {scd: 2, change_feed: true, deletion_vectors: false}
topics:
  - table: dim.customers
    depends_on: [replica.customers]
    processor: reload
    transforms: [x.sql]
""")
    write(lin / "x.sql", "SELECT * FROM replica.customers")
    lineage = load_lineage(lin)
    rep = lineage.replicators["shop"].spec
    assert rep.replica("public.customers") == "replica.customers" and rep.replica("sales.order_lines") == "replica.sales__order_lines"
    assert rep.selects("sales.order_x") and not rep.selects("sales.orders")
    assert rep.table_options("public.customers")[2] == 2 and rep.table_options("sales.order_1")[2] == 1
    assert rep.table_options("public.customers")[3] is True and rep.table_options("sales.order_1")[3] is False
    assert not rep.table_options("public.customers").deletion_vectors and rep.table_options("sales.order_1").deletion_vectors
    assert lineage.replicator_of("replica.customers") is lineage.replicators["shop"]


def test_cdc_replicator_problems_name_file_line_and_field(lin: Path) -> None:
    f = lin / "cdc.yaml"
    write(f, """
cdc:
  - name: Shop
    tables: [customers]
    colour: red
""")
    err = load_error(lin)
    text = "\n".join(err.problems)
    assert f"{f}:2: replicator 'Shop': field 'name'" in text and "lower-case" in text
    assert f"{f}:3: replicator 'Shop': field 'tables'" in text and "expected schema.table" in text
    assert f"{f}:4: replicator 'Shop': field 'colour': unknown field" in text


def test_two_replicators_may_not_share_a_replicas_schema_whatever_its_case(lin: Path) -> None:
    write(lin / "cdc.yaml", """
cdc:
  - name: a
    dsn_env: A_DSN
    tables: [public.x]
    schema: rep
  - name: b
    dsn_env: B_DSN
    tables: [public.y]
    schema: Rep
""")
    text = "\n".join(load_error(lin).problems)
    assert "replicator 'b': schema 'Rep' is also the replicas' schema of replicator 'a'" in text, text
