"""bench/view_scaling.py's verdicts on issue 56's targets, from results given by hand (no Spark): each
target is judged from the right row, and a size the run left out is "not measured"."""

from __future__ import annotations

import pytest

from bench import view_scaling as vs

KEYED, AGG = vs.KEYED.topic, vs.AGGREGATE.topic


def result(size: int, changed: int, view: str, tm: float, full: float, strategy: str = "incremental") -> vs.Result:
    event = f"{changed:,} changed customers" if changed else "10,000 appended orders"
    return vs.Result(size, event, changed, view, tm, full, strategy, "")


def lines(results: list[vs.Result], capsys: pytest.CaptureFixture[str]) -> list[str]:
    vs.print_targets_56(results)
    return [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_issue_56_verdicts_come_from_the_right_rows(capsys: pytest.CaptureFixture[str]) -> None:
    out = lines([
        result(1_000_000, 10, KEYED, 3.0, 2.0, "full"),         # the full path at 1.5x: a miss of both rules
        result(10_000_000, 10, KEYED, 1.4, 10.0),               # 0.14 <= 0.15
        result(50_000_000, 10, KEYED, 4.0, 50.0),               # 0.08 <= 0.10; growth 4.0 / 3.0
        result(10_000_000, 0, KEYED, 0.4, 10.0),                # 0.04
        result(50_000_000, 0, KEYED, 3.0, 50.0),                # 0.06: a miss
        result(10_000_000, 1_000, AGG, 1.0, 1.0, "full"),
    ], capsys)
    assert f"{KEYED}: 10 changed rows at 1,000,000 orders <= 1.00 x the full rebuild: 1.500 -> MISS" in out
    assert f"{KEYED}: 10 changed rows at 10,000,000 orders <= 0.15 x the full rebuild: 0.140 -> PASS" in out
    assert f"{KEYED}: 10 changed rows at 50,000,000 orders <= 0.10 x the full rebuild: 0.080 -> PASS" in out
    assert f"{KEYED}: 10 changed rows, refresh time 50,000,000 / 1,000,000 orders <= 1.5x: 1.33 -> PASS" in out
    assert (f"{KEYED}: every unit on the full path <= 1.1x the plain rebuild (1 unit(s)): worst 1.500 "
            f"(1,000,000 orders, 10 changed customers) -> MISS") in out
    assert f"{KEYED}: appended orders at 10,000,000 orders <= 5% of the full rebuild: 0.040 -> PASS" in out
    assert f"{KEYED}: appended orders at 50,000,000 orders <= 5% of the full rebuild: 0.060 -> MISS" in out
    assert (f"{AGG}: every unit on the full path <= 1.1x the plain rebuild (1 unit(s)): worst 1.000 "
            f"(10,000,000 orders, 1,000 changed customers) -> PASS") in out
    assert f"{AGG}: 10 changed rows at 10,000,000 orders <= 0.15 x the full rebuild: - -> not measured" in out
    assert f"{AGG}: 10 changed rows, refresh time 50,000,000 / 1,000,000 orders <= 1.5x: - -> not measured" in out
